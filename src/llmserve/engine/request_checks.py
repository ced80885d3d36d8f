"""Checks of a request's sampling parameters against what the engine was started with
(``LLMEngine.add_request`` runs them before anything is queued)."""

from __future__ import annotations

from typing import Any

from llmserve.config import EngineConfig
from llmserve.sampling_params import SamplingParams


def check_params_for_engine(config: EngineConfig, params: SamplingParams,
                            structured_output: Any) -> None:
    """Raises ValueError naming the field when ``params`` asks for what this engine cannot
    do: structured outputs or prompt logprobs under speculative decoding, structured
    outputs under pipeline parallelism, a grammar that does not compile
    (``structured_output.compile``, cached), or a stop token id outside the vocabulary."""
    if config.speculative_config is not None:  # the verifier runs neither yet
        if params.structured_outputs is not None:
            raise ValueError("structured outputs (response_format / guided_*) are not "
                             "supported with speculative decoding yet; serve without "
                             "--speculative-config")
        if params.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs are not supported with speculative "
                             "decoding yet; serve without --speculative-config")
    if params.structured_outputs is not None and \
            config.parallel_config.pipeline_parallel_size > 1:
        raise ValueError("structured outputs (response_format / guided_*) are not "
                         "supported with pipeline parallelism yet")
    if params.structured_outputs is not None:
        structured_output.compile(params.structured_outputs)  # cached; ValueError
    vocab = config.model_config.vocab_size
    bad = [t for t in params.stop_token_ids if t >= vocab]
    if bad:
        raise ValueError(f"stop_token_ids: {bad[0]} is not a token id in [0, {vocab})")
