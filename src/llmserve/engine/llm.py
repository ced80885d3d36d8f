"""The offline API, as vLLM's::

    from llmserve import LLM, SamplingParams
    llm = LLM()                                   # the embedded SmolLM2-135M-Instruct
    outs = llm.generate(["Hello, my name is"], SamplingParams(temperature=0, max_tokens=32))
    print(outs[0].outputs[0].text)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from llmserve.engine.arg_utils import EngineArgs
from llmserve.engine.llm_engine import LLMEngine, PromptType
from llmserve.engine.output_processor import RequestOutputKind
from llmserve.lora import LoRARequest
from llmserve.outputs import RequestOutput
from llmserve.sampling_params import SamplingParams
from llmserve.tokenizer import apply_chat_template

Message = dict[str, Any]


class LLM:
    """Offline batched generation through the paged-KV, continuously batched engine.

    Args:
        model: ``"smollm2-135m-instruct"`` (default), a GGUF file or a HF model directory.
        dtype: ``auto`` | ``float32`` | ``bfloat16`` | ``float16``.
        kv_cache_memory: KV budget in bytes or a string like ``"4GiB"``.
        block_size, max_num_seqs, max_num_batched_tokens, max_model_len:
            see :class:`~llmserve.engine.arg_utils.EngineArgs`.
        **kwargs: any other :class:`EngineArgs` field.

    Raises:
        ValueError: for a bad option or a model that cannot be loaded.
    """

    def __init__(self, model: str | None = None, dtype: str = "auto",
                 kv_cache_memory: int | str | None = None, block_size: int = 16,
                 max_num_seqs: int = 256, max_num_batched_tokens: int = 2048,
                 max_model_len: int | None = None, **kwargs: Any) -> None:
        args = EngineArgs(model=model, dtype=dtype, kv_cache_memory=kv_cache_memory,
                          block_size=block_size, max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=max_num_batched_tokens,
                          max_model_len=max_model_len, **kwargs)
        self.engine = LLMEngine.from_engine_args(args)
        self._next_id = 0

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> LLM:
        """Wrap an already built :class:`LLMEngine` (e.g. one sharing loaded weights)."""
        llm = cls.__new__(cls)
        llm.engine = engine
        llm._next_id = 0
        return llm

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                 ) -> list[RequestOutput]:
        """Generate for every prompt, batched; outputs in input order.

        Args:
            prompts: a string, ``{"prompt_token_ids": [...]}``, or a list of them.
            sampling_params: one for all prompts, or a list with one per prompt.
            lora_request: a LoRA adapter for all prompts, or one (or None) per prompt
                (needs ``enable_lora=True``); adapters and the base run in one batch.

        Raises:
            ValueError: for a bad prompt or parameter (no request is left queued).
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(
                    f"sampling_params: got {len(params_list)} for {len(prompts)} prompts")
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * len(prompts)
        else:
            loras = list(lora_request)
            if len(loras) != len(prompts):
                raise ValueError(f"lora_request: got {len(loras)} for {len(prompts)} prompts")
        ids: list[str] = []
        try:
            for prompt, params, lora in zip(prompts, params_list, loras):
                ids.append(self.engine.add_request(f"gen-{self._next_id}", prompt, params,
                                                   RequestOutputKind.FINAL_ONLY,
                                                   lora_request=lora))
                self._next_id += 1
        except ValueError:
            self.engine.abort_request(ids)
            raise
        return self._run(ids, use_tqdm)

    def chat(self, messages: list[Message] | list[list[Message]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Apply the model's chat template to a conversation (or a list of them), then generate.

        Raises:
            ValueError: for malformed messages or a model without a chat template.
        """
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list")
        conversations = messages if isinstance(messages[0], list) else [messages]
        prompts = [{"prompt_token_ids": apply_chat_template(
            self.engine.tokenizer, conv, add_generation_prompt=add_generation_prompt)}
            for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def beam_search(self, prompts: PromptType | Sequence[PromptType], params):
        """Beam search (see :mod:`llmserve.beam_search`): for each prompt, the
        ``params.beam_width`` best sequences, best first.

        Args:
            prompts: a string, ``{"prompt_token_ids": [...]}``, or a list of them.
            params: a :class:`~llmserve.beam_search.BeamSearchParams`.

        Returns:
            ``list[BeamSearchOutput]`` in prompt order.

        Raises:
            ValueError: for a bad prompt or parameter.
        """
        return _beam_search(self, prompts, params)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm or len(ids) < 2,
                   dynamic_ncols=True)
        wanted = set(ids)
        try:
            while len(finished) < len(ids):
                if not self.engine.has_unfinished_requests():
                    break
                for out in self.engine.step():
                    if out.finished and out.request_id in wanted:
                        finished[out.request_id] = out
                        bar.update(1)
        finally:
            bar.close()
            leftover = [i for i in ids if i not in finished]
            if leftover:
                self.engine.abort_request(leftover)
        return [finished[i] for i in ids if i in finished]


def _beam_search(llm: LLM, prompts, params):
    """See :meth:`LLM.beam_search`."""
    from llmserve.beam_search import BeamSearchOutput, BeamSearchSequence, beam_search_score

    engine = llm.engine
    eos = engine.eos_token_ids
    if isinstance(prompts, (str, dict)):
        prompts = [prompts]
    prompt_ids = [engine.tokenize_prompt(p)[1] for p in prompts]
    step_params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=2 * params.beam_width,
                                 ignore_eos=True)

    def key(beam):
        return beam_search_score(beam.tokens, beam.cum_logprob, eos, params.length_penalty)

    live = [[BeamSearchSequence(tokens=list(ids))] for ids in prompt_ids]
    done: list[list[BeamSearchSequence]] = [[] for _ in prompt_ids]
    for _ in range(params.max_tokens):
        flat = [(i, beam) for i, beams in enumerate(live) for beam in beams
                if len(beam.tokens) < engine.max_model_len]
        if not flat:
            break
        outs = llm.generate([{"prompt_token_ids": b.tokens} for _, b in flat], step_params,
                            use_tqdm=False)
        candidates: list[list[BeamSearchSequence]] = [[] for _ in prompt_ids]
        for (i, beam), out in zip(flat, outs):
            for token_id, lp in out.outputs[0].logprobs[0].items():
                new = BeamSearchSequence(beam.tokens + [token_id], beam.logprobs + [lp.logprob],
                                         beam.cum_logprob + lp.logprob)
                if token_id in eos and not params.ignore_eos:
                    new.finished = True
                    done[i].append(new)
                else:
                    candidates[i].append(new)
        live = [sorted(c, key=key, reverse=True)[:params.beam_width] for c in candidates]
    results = []
    tok = engine.tokenizer
    for i, ids in enumerate(prompt_ids):
        best = sorted(done[i] + live[i], key=key, reverse=True)[:params.beam_width]
        for beam in best:
            beam.text = tok.decode(beam.tokens[len(ids):], skip_special_tokens=True)
        results.append(BeamSearchOutput(best))
    return results
