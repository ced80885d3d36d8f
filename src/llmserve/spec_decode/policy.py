"""Draft length per request and step: fixed ``k``, or adaptive.

Adaptive (ours; no anchor engine does this): each request keeps a decayed count of
accepted (``S``) and first-rejected (``F``) draft positions, so ``alpha = (S + 0.5) /
(S + F + 1)`` estimates the chance that one more draft is accepted. The ``j``-th
draft is worth ``alpha ** j`` expected tokens (it counts only if all before it are
accepted, Leviathan et al. 2023, eq. 1) and costs one more verified token plus, for
a draft model, one draft forward. Its cost relative to a whole decode step grows
with the batch, since a large batch is compute bound::

    cost(B) = draft_cost + B / compute_bound_batch
    k = max { j <= k_max : alpha ** j >= cost(B) }     (0: no speculation)

Those two costs are measured, not assumed, once the engine has seen enough steps
(:class:`StepCostModel`, one fit per batch-size bucket): decode-only verification steps
give a least-squares fit of step time ``t = a + b * rows`` (``b``: one more verified row, which on a CPU whose
packed int4 kernel costs ~2x at 4 rows what it costs at 1 is far from free), and the
proposer's time per draft position gives ``t_draft``. Then, per request at batch ``B``::

    cost(B) = (b * B + t_draft) / (a + b * B)     (one more row + a share of the draft
                                                   forward, over one plain decode step)

so speculation turns itself off where verifying does not pay. The engine seeds the fits
of batch sizes up to 8 with timed dummy steps at start-up (``calibrate.py``); larger
buckets use the priors above until they have timed 8 of their own steps, floored at the
cost measured for the largest smaller batch (a draft costs more as the batch grows).

A request whose ``k`` fell to 0 for low acceptance still drafts one token every
``PROBE_EVERY`` steps so its estimate can recover (8 for n-gram lookup; 64 for a draft
model, whose probe first catches up on every token since its last draft: probing every
8 steps cost 0.87x at batch 4, and probing a new request at once, which makes the draft
catch up on its whole prompt, 0.91x). Over the marginal rule sits a guard on measured
goodput (``goodput.py``): at a batch size (2 and up) where steps with drafts measured
more seconds per emitted token than steps without, no request drafts (bar a probe step
now and then). ``disable_by_batch_size`` turns
drafting off for every request while more requests are scheduled (both policies).
"""

from __future__ import annotations

from llmserve.spec_decode.config import SpeculativeConfig
from llmserve.spec_decode.goodput import PROBE_EVERY as GUARD_PROBE_EVERY
from llmserve.spec_decode.goodput import GoodputGuard

DECAY = 0.8
# steps at k = 0 between two probes: a draft model's probe first catches up on the tokens
# since its last draft (CATCH_UP_AS_DECODE: one forward a token), n-gram lookup's is free
PROBE_EVERY = {"ngram": 8, "draft_model": 64}
# per-draft cost relative to one target decode step: one more verified token (the n-gram
# lookup itself is free), plus a draft forward of a model ~3x smaller for a draft model
DRAFT_COST = {"ngram": 0.1, "draft_model": 0.25}
COMPUTE_BOUND_BATCH = 48


class _Fit:
    """Exponentially weighted least squares of ``t = a + b * rows``, and the mean time of
    one draft position, for the steps of one batch-size bucket."""

    def __init__(self) -> None:
        self.w = self.x = self.y = self.xx = self.xy = 0.0
        self.num_steps = 0
        self.draft_s: float | None = None
        self.b: float | None = None  # the last slope fitted while rows varied


class StepCostModel:
    """Online fit of a verification step's time, ``t = a + b * rows`` (seconds), by
    exponentially weighted least squares over decode-only steps, and the mean time of
    one draft position (a draft-model forward; ~0 for n-gram lookup); one fit per
    batch-size bucket (1, 2, 3-4, 5-8, ...): what one more row costs grows with the rows
    a step already has (the int8 kernels are bandwidth bound up to a few rows, compute
    bound beyond), so a fit made on batch-1 steps underrates a batch of 4.

    :meth:`coefficients` is None until the bucket's row counts vary enough to fit ``b``
    (weighted variance of rows >= ``MIN_ROWS_VAR``) over ``MIN_STEPS`` steps; once
    fitted, a bucket whose rows stop varying (speculation turned off) keeps its last
    ``b`` instead of falling back to the priors, which would turn speculation on again."""

    DECAY = 0.97
    MIN_STEPS = 8
    MIN_ROWS_VAR = 0.2

    def __init__(self) -> None:
        self._fits: dict[int, _Fit] = {}

    def _fit(self, batch_size: int) -> _Fit:
        return self._fits.setdefault((max(batch_size, 1) - 1).bit_length(), _Fit())

    def observe_step(self, rows: int, seconds: float, batch_size: int = 1) -> None:
        f, d = self._fit(batch_size), self.DECAY
        f.w, f.x, f.y = d * f.w + 1, d * f.x + rows, d * f.y + seconds
        f.xx, f.xy = d * f.xx + rows * rows, d * f.xy + rows * seconds
        f.num_steps += 1

    def observe_draft(self, positions: int, seconds: float, batch_size: int = 1) -> None:
        if positions > 0:
            f, per = self._fit(batch_size), seconds / positions
            f.draft_s = per if f.draft_s is None else 0.8 * f.draft_s + 0.2 * per

    def coefficients(self, batch_size: int = 1) -> tuple[float, float] | None:
        """``(a, b)`` in seconds for steps of ``batch_size`` requests, or None while the
        fit is not determined."""
        f = self._fit(batch_size)
        if f.num_steps < self.MIN_STEPS:
            return None
        var = f.xx / f.w - (f.x / f.w) ** 2
        if var >= self.MIN_ROWS_VAR:
            f.b = max((f.xy / f.w - f.x * f.y / f.w ** 2) / var, 0.0)
        elif f.b is None:
            return None
        # rows that stopped varying (speculation off: every step B rows) keep the last
        # slope; the mean step time still moves the intercept
        a = max(f.y / f.w - f.b * f.x / f.w, 1e-6)
        return a, f.b

    def smaller_batch_cost(self, batch_size: int) -> float | None:
        """The relative cost measured at the largest fitted bucket below ``batch_size``'s
        (at that bucket's largest batch), or None: a lower bound for ``batch_size``, since
        one more draft costs a larger share of a step as the batch grows."""
        key = (max(batch_size, 1) - 1).bit_length()
        for lower in range(key - 1, -1, -1):
            if lower in self._fits:
                cost = self.relative_cost(1 << lower)
                if cost is not None:
                    return cost
        return None

    def relative_cost(self, batch_size: int) -> float | None:
        """One more draft for every request, over one plain decode step at ``batch_size``."""
        fit, draft_s = self.coefficients(batch_size), self._fit(batch_size).draft_s
        if fit is None or draft_s is None:
            return None
        a, b = fit
        return (b * batch_size + draft_s) / (a + b * batch_size)


class DraftLengthPolicy:
    """How many drafts each request gets next step (see the module docstring)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.k_max = config.num_speculative_tokens
        self.adaptive = config.draft_length_policy == "adaptive"
        self.disable_by_batch_size = config.disable_by_batch_size
        self.draft_cost = DRAFT_COST[config.method]
        self.probe_every = PROBE_EVERY[config.method]
        self.cost_model = StepCostModel()
        self.guard = GoodputGuard(GUARD_PROBE_EVERY[config.method])
        self._counts: dict[str, list[float]] = {}  # req_id -> [S, F, steps since a draft]

    def alpha(self, req_id: str) -> float:
        s, f, _ = self._counts.get(req_id, (0.0, 0.0, 0))
        return (s + 0.5) / (s + f + 1.0)

    def num_drafts(self, req_id: str, batch_size: int) -> int:
        """Drafts for ``req_id`` when ``batch_size`` requests run this step."""
        if self.disable_by_batch_size is not None and batch_size > self.disable_by_batch_size:
            return 0
        if not self.adaptive:
            return self.k_max
        if not self.guard.allows_drafts(batch_size):
            return 0
        cost = self.cost_model.relative_cost(batch_size)
        if cost is None:  # priors until the engine has measured its own steps, but never
            # below what a smaller batch measured (buckets above the start-up timing's 8)
            cost = max(self.draft_cost + batch_size / COMPUTE_BOUND_BATCH,
                       self.cost_model.smaller_batch_cost(batch_size) or 0.0)
        if cost >= 1.0:
            return 0  # compute bound: a verified token costs as much as a decode step
        alpha = self.alpha(req_id)
        k, value = 0, 1.0
        while k < self.k_max:
            value *= alpha
            if value < cost:
                break
            k += 1
        counts = self._counts.setdefault(req_id, [0.0, 0.0, 0])
        if k == 0:
            counts[2] += 1
            if counts[2] >= self.probe_every:
                counts[2] = 0
                return 1
        return k

    def observe(self, req_id: str, num_drafts: int, num_accepted: int) -> None:
        """Record one verification: ``num_accepted`` leading drafts of ``num_drafts``."""
        if num_drafts <= 0 or not self.adaptive:
            return
        counts = self._counts.setdefault(req_id, [0.0, 0.0, 0])
        counts[0] = DECAY * counts[0] + num_accepted
        counts[1] = DECAY * counts[1] + (1.0 if num_accepted < num_drafts else 0.0)
        counts[2] = 0

    def drop(self, req_id: str) -> None:
        self._counts.pop(req_id, None)
