"""Build the :class:`SpecDecoder` an engine's model runner delegates its steps to."""

from __future__ import annotations

from llmserve.config import EngineConfig
from llmserve.spec_decode.proposer import NgramProposer, Proposer
from llmserve.spec_decode.verifier import SpecDecoder


def build_spec_decoder(config: EngineConfig, runner, draft_model=None) -> SpecDecoder:
    """The n-gram or draft-model proposer behind one verifier; with the adaptive
    draft-length policy, its step costs timed first (``calibrate.py``).

    Raises:
        ValueError: method ``draft_model`` without a loaded draft model.
    """
    sc = config.speculative_config
    proposer: Proposer
    if sc.method == "ngram":
        proposer = NgramProposer(sc)
    else:
        if draft_model is None:
            raise ValueError("speculative_config: method 'draft_model' needs the draft model "
                             "loaded (speculative_config.model)")
        from llmserve.spec_decode.draft_model import DraftModelProposer

        proposer = DraftModelProposer(config, runner, draft_model)
    spec = SpecDecoder(sc, proposer)
    if sc.draft_length_policy == "adaptive":
        from llmserve.spec_decode.calibrate import calibrate_step_costs

        calibrate_step_costs(spec, runner, config.scheduler_config.max_num_seqs)
    return spec
