"""The adaptive policy's guard: speculation stays off where it measured slower.

The marginal rule of ``policy.py`` weighs one more draft against a fitted model of
what rows and draft forwards cost. What that model leaves out (rejection sampling,
the draft's catch-up rows, Python per drafted token, kernels whose cost is not linear
in rows) decides the sign where speculation is close to break-even, as at batch 4 on
a CPU (0.87-0.98x measured with the model alone). So the policy also keeps, per
batch size (each size up to 16, then 17-32, 33-64, ...: a plain step of 3 requests
costs more a token than one of 4, so sizes are not pooled), what it matters for: the
measured seconds per emitted token of decode-only steps that verified drafts and of
steps that did not, each an exponentially weighted ratio of sums::

    spec   = sum(step time + the proposal that made its drafts) / sum(tokens emitted)
    plain  = sum(step time) / sum(tokens emitted)

    plain not measured yet (MIN_STEPS)     -> no drafts (plain steps measure it)
    spec not measured yet                  -> drafts allowed (the marginal rule decides)
    spec > plain                           -> no drafts, except one probe step every
                                              ``probe_every`` plain steps (spec re-measured)

Batch 1 is left to the marginal rule: there the per-request acceptance it tracks is the
whole story (no batch shares the step), while the guard pools every request of a batch
size, so one request that copies nothing (a new docstring) would switch drafting off
for the next one that copies everything (a rename): n-gram adaptive on the edit
prompts read 1.14x with the guard at batch 1, 1.23-1.26x without.

A draft model's probe is dear: the draft has fallen behind by ``probe_every`` tokens
a request and catches up through its prompt path. So it probes every 256 steps,
n-gram lookup (free to resume) every 32.

Ours; no anchor engine adapts to measured goodput. Only real steps count (the
start-up timing of ``calibrate.py`` leaves out the engine's work around a forward,
which would make plain steps look cheaper than they are), so each bucket's first
MIN_STEPS decode-only steps run without drafts.
"""

from __future__ import annotations

DECAY = 0.9
MIN_STEPS = 3
PROBE_EVERY = {"ngram": 32, "draft_model": 256}
EXACT_UP_TO = 16  # batch sizes with a measurement of their own
MIN_BATCH = 2  # batch 1: the marginal rule alone (module doc)


class _Bucket:
    def __init__(self) -> None:
        self.seconds = [0.0, 0.0]  # [plain, spec], decayed sums
        self.tokens = [0.0, 0.0]
        self.steps = [0, 0]
        self.plain_since_spec = 0


class GoodputGuard:
    """Measured seconds per emitted token with and without drafts (module doc)."""

    def __init__(self, probe_every: int = PROBE_EVERY["ngram"]) -> None:
        self.probe_every = probe_every
        self._buckets: dict[int, _Bucket] = {}

    def _bucket(self, batch_size: int) -> _Bucket:
        b = max(batch_size, 1)
        key = b if b <= EXACT_UP_TO else EXACT_UP_TO + (b - 1).bit_length()
        return self._buckets.setdefault(key, _Bucket())

    def observe(self, batch_size: int, seconds: float, tokens: int, drafted: bool) -> None:
        """One decode-only step of ``batch_size`` requests: ``seconds`` (with the proposal
        that made its drafts, if ``drafted``) for ``tokens`` emitted tokens."""
        if tokens <= 0:
            return
        b, i = self._bucket(batch_size), int(drafted)
        b.seconds[i] = DECAY * b.seconds[i] + seconds
        b.tokens[i] = DECAY * b.tokens[i] + tokens
        b.steps[i] += 1
        b.plain_since_spec = 0 if drafted else b.plain_since_spec + 1

    def seconds_per_token(self, batch_size: int) -> tuple[float | None, float | None]:
        """``(plain, spec)`` seconds per emitted token, None where not yet measured."""
        b = self._bucket(batch_size)
        return tuple(b.seconds[i] / b.tokens[i] if b.steps[i] >= MIN_STEPS else None
                     for i in (0, 1))

    def allows_drafts(self, batch_size: int) -> bool:
        """Whether a step of ``batch_size`` requests may verify drafts (module doc)."""
        if batch_size < MIN_BATCH:
            return True
        plain, spec = self.seconds_per_token(batch_size)
        if plain is None:
            return False
        if spec is None or spec <= plain:
            return True
        return self._bucket(batch_size).plain_since_spec >= self.probe_every
