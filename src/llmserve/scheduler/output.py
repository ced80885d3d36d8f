"""What the scheduler hands the model runner each step: plain lists, no tensors."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from llmserve.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the runner has not seen yet (first schedule)."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    lora_request: Any = None  # a llmserve.lora.LoRARequest, None = the base model
    # tokens whose blocks were evicted or slid out (whole blocks before the kept ones):
    # position p lives in block_ids[(p - num_evicted_tokens) // block_size]
    num_evicted_tokens: int = 0
    # a mixed model's local layers (kv_cache/window_blocks.py): (first logical block,
    # window-pool block ids); position p lives in ids[p // block_size - first]
    window_blocks: tuple[int, list[int]] | None = None


@dataclass
class CachedRequestData:
    """A request the runner already holds; its full block table is resent.

    ``resumed_from_preemption``: its KV was dropped and is being recomputed
    (``num_computed_tokens`` restarted from 0).
    """

    req_id: str
    block_ids: list[int]
    num_computed_tokens: int
    resumed_from_preemption: bool = False
    num_evicted_tokens: int = 0  # as NewRequestData's
    window_blocks: tuple[int, list[int]] | None = None  # as NewRequestData's


@dataclass
class SchedulerOutput:
    """One step's plan.

    ``num_scheduled_tokens[req_id]`` tokens of each scheduled request are
    computed, starting at its ``num_computed_tokens``.
    ``finished_req_ids``: requests that ended since the previous step (the
    runner drops their state).
    ``kv_cache_ops``: block moves the runner performs, in order, before the
    forward pass: ``("copy", src, dst)`` (copy-on-write, device to device),
    ``("swap_out", device_block, host_block)``, ``("swap_in", host_block, device_block)``,
    ``("load", body, device_block)`` (fill a block from the shared KV store's bytes,
    ``worker/kv_transfer.py``).
    """

    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: list[CachedRequestData] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] = field(default_factory=set)
    kv_cache_ops: list[tuple[str, Any, int]] = field(default_factory=list)
    # speculative decoding: the drafts scheduled after a decode's last token; they are
    # the last len(drafts) of its num_scheduled_tokens (vLLM's name)
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # KV eviction (H2O, SnapKV): request -> the first query position whose attention
    # the runner sums per kept block this step (ModelRunnerOutput.kv_block_scores)
    kv_score_from: dict[str, int] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass
class ModelRunnerOutput:
    """What the runner returns: one sampled token per request that reached the
    end of its known tokens this step (partial prefill chunks sample nothing).

    ``logprobs[req_id]`` = (token ids, logprobs, rank of the sampled token):
    column 0 is the sampled token, then the top-n.
    """

    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, tuple[list[int], list[float], int]] = field(default_factory=dict)
    # every token a request emits this step where it is more than the sampled one:
    # speculative decoding's accepted drafts, then the recovered or bonus token; or a
    # sampled token, then the tokens its grammar forces (jump-forward). The tokens after
    # the first are not computed yet (their KV is written by the next step) except for
    # accepted drafts. sampled_token_ids holds the last token.
    emitted_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # speculative decoding: the drafts proposed for each request's next step
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # with the first sampled token: per prompt token 1..P-1 (ids, logprobs, rank), or None
    # when they could not be computed (see worker/prompt_logprobs.py)
    prompt_logprobs: dict[str, list | None] = field(default_factory=dict)
    # KV eviction: per request of SchedulerOutput.kv_score_from, the attention mass its
    # scored query rows put on each block of its block table (summed over layers and
    # query heads), aligned with the table it ran with
    kv_block_scores: dict[str, list[float]] = field(default_factory=dict)

    def new_token_ids(self, req_id: str) -> list[int]:
        """Every token ``req_id`` emitted this step (none for a partial prefill chunk)."""
        token = self.sampled_token_ids.get(req_id)
        return self.emitted_token_ids.get(req_id) or ([] if token is None else [token])


@dataclass
class EngineCoreOutput:
    """Per-request result of a step, handed to the output processor."""

    req_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    new_logprobs: tuple[list[int], list[float], int] | None = None
    num_cached_tokens: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
