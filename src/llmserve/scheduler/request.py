"""The token-centric request the scheduler works on (pure Python)."""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING

from llmserve.kv_cache.prefix_cache import request_extra_keys

if TYPE_CHECKING:
    from llmserve.lora import LoRARequest
    from llmserve.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    """Life cycle of a request. Values above ``PREEMPTED`` are finished states."""

    WAITING = enum.auto()
    WAITING_FOR_FORK = enum.auto()  # n > 1: waits for its leader's prompt KV
    RUNNING = enum.auto()
    SWAPPED = enum.auto()  # preempted by swap: KV in the host pool
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def get_finished_reason(status: RequestStatus) -> str | None:
        """OpenAI ``finish_reason``: ``"stop"``, ``"length"``, ``"abort"`` or None."""
        return _FINISHED_REASONS.get(status)


_FINISHED_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class Request:
    """One generation request, tracked by token counts.

    ``num_tokens = len(prompt_token_ids) + len(output_token_ids)``; the KV of
    the first ``num_computed_tokens`` tokens is in the cache. A step gives the
    request ``num_tokens - num_computed_tokens`` tokens to compute (the rest
    of its prompt, possibly chunked, or its last sampled token), or fewer.

    Args:
        max_tokens: output tokens allowed, already capped at the context length.
        eos_token_ids: ids that finish the request unless ``ignore_eos``.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        max_tokens: int,
        eos_token_ids: tuple[int, ...] | set[int] = (),
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        fork_from: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.max_tokens = max_tokens
        self.eos_token_ids = frozenset(eos_token_ids)
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.priority = priority
        self.cache_salt = cache_salt
        self.lora_request = lora_request  # its LoRA adapter (None: the base model)
        # prefix-cache extra keys of the first block: different salts or adapters never share
        self.extra_keys = request_extra_keys(
            cache_salt, None if lora_request is None else lora_request.lora_int_id)
        # n > 1: the id of the request whose prompt KV this one shares once computed
        self.fork_from = fork_from
        self.status = RequestStatus.WAITING_FOR_FORK if fork_from else RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_preemptions = 0
        self.num_cached_tokens = -1  # prompt tokens found in the prefix cache (-1: not yet)
        self.first_scheduled_time: float | None = None
        self.host_block_ids: list[int] = []  # while SWAPPED
        self.spec_token_ids: list[int] = []  # drafts to verify in the next step
        self.eviction = None  # kv_cache.eviction.EvictionState when a KV budget applies

    def sort_key(self) -> tuple[int, float]:
        """Priority order: lower ``priority`` first, then earlier arrival (vLLM)."""
        return (self.priority, self.arrival_time)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def get_finished_reason(self) -> str | None:
        return RequestStatus.get_finished_reason(self.status)

    def check_stop(self, max_model_len: int) -> bool:
        """Token-level stop check after a token was appended; sets ``status``.

        Stop strings are matched on text by the detokenizer, not here.
        Order: min_tokens, EOS (unless ignore_eos), stop_token_ids, max_tokens,
        max_model_len.
        """
        params = self.sampling_params
        if self.num_output_tokens < params.min_tokens:
            return False
        last = self.output_token_ids[-1]
        if not params.ignore_eos and last in self.eos_token_ids:
            self.status = RequestStatus.FINISHED_STOPPED
            return True
        if params.stop_token_ids and last in params.stop_token_ids:
            self.status = RequestStatus.FINISHED_STOPPED
            self.stop_reason = last
            return True
        if self.num_output_tokens >= self.max_tokens or self.num_tokens >= max_model_len:
            self.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        return False

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.name}, "
                f"computed={self.num_computed_tokens}/{self.num_tokens})")
