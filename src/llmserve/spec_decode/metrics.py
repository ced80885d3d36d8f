"""Speculative-decoding counters with vLLM's names (``vllm:spec_decode_*``).

``num_drafts``: verification steps that had at least one draft token;
``num_draft_tokens``: drafted tokens verified; ``num_accepted_tokens``: of those,
accepted; ``num_accepted_tokens_per_pos[i]``: accepted at draft position ``i``
(0-based). Acceptance rate = accepted / draft tokens; mean acceptance length =
1 + accepted / drafts (tokens emitted per verification step, the bonus included),
as vLLM's ``SpecDecodingLogging``. Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodingStats:
    """Cumulative counters since the engine started."""

    num_spec_tokens: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def observe(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """Count one request's verification: ``num_accepted_tokens`` leading drafts of
        ``num_draft_tokens`` were accepted (0 drafts: nothing counted)."""
        if num_draft_tokens <= 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        if len(self.num_accepted_tokens_per_pos) < num_draft_tokens:
            self.num_accepted_tokens_per_pos.extend(
                [0] * (num_draft_tokens - len(self.num_accepted_tokens_per_pos)))
        for i in range(num_accepted_tokens):
            self.num_accepted_tokens_per_pos[i] += 1

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted tokens (0 when nothing was drafted)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verification step: ``1 + accepted / drafts``."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def log_line(self) -> str:
        """vLLM's ``SpecDecoding metrics`` log line."""
        per_pos = ", ".join(f"{a / self.num_drafts:.3f}" if self.num_drafts else "0"
                            for a in self.num_accepted_tokens_per_pos)
        return (f"SpecDecoding metrics: Draft acceptance rate: {100 * self.acceptance_rate:.1f}%, "
                f"Mean acceptance length: {self.mean_acceptance_length:.2f}, "
                f"Accepted: {self.num_accepted_tokens} tokens, "
                f"Drafted: {self.num_draft_tokens} tokens, "
                f"Per-position acceptance rate: {per_pos}")

    def as_dict(self) -> dict:
        return {"num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens,
                "num_accepted_tokens_per_pos": list(self.num_accepted_tokens_per_pos),
                "acceptance_rate": self.acceptance_rate,
                "mean_acceptance_length": self.mean_acceptance_length}
