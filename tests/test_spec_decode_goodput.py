"""The adaptive policy's goodput guard (spec_decode/goodput.py): measured seconds per
emitted token with and without drafts, per batch size."""

import pytest

from llmserve.spec_decode import SpeculativeConfig


def measure_plain_steps(policy, batch_sizes):
    """The goodput guard's reference: plain steps at each batch size (goodput.py)."""
    from llmserve.spec_decode.goodput import MIN_STEPS

    for b in batch_sizes:
        for _ in range(MIN_STEPS):
            policy.guard.observe(b, 0.05, b, drafted=False)


def test_goodput_guard_keeps_speculation_off_where_it_measured_slower():
    from llmserve.spec_decode.goodput import MIN_STEPS, PROBE_EVERY, GoodputGuard
    from llmserve.spec_decode.policy import DraftLengthPolicy

    guard = GoodputGuard()
    assert guard.allows_drafts(1)  # batch 1: the marginal rule alone
    for _ in range(MIN_STEPS):
        guard.observe(1, 0.050, 1, drafted=False)
        guard.observe(1, 0.500, 2, drafted=True)
    assert guard.allows_drafts(1)
    assert not guard.allows_drafts(2)  # plain steps are measured first
    for _ in range(MIN_STEPS):
        guard.observe(4, 0.080, 4, drafted=False)  # 20 ms a token
    assert guard.allows_drafts(4)
    assert not guard.allows_drafts(3) and not guard.allows_drafts(5)  # sizes not pooled
    for _ in range(MIN_STEPS):
        guard.observe(40, 1.0, 40, drafted=False)
    assert guard.allows_drafts(33) and guard.allows_drafts(64)  # one bucket: 33-64
    for _ in range(MIN_STEPS):
        guard.observe(4, 0.160, 7, drafted=True)  # 23 ms a token: slower
    assert guard.seconds_per_token(4) == pytest.approx((0.020, 0.160 / 7))
    assert not guard.allows_drafts(4)
    assert guard.probe_every == PROBE_EVERY["ngram"] < PROBE_EVERY["draft_model"]
    for i in range(guard.probe_every):  # a probe after probe_every plain steps
        assert not guard.allows_drafts(4), i
        guard.observe(4, 0.080, 4, drafted=False)
    assert guard.allows_drafts(4)
    for _ in range(30):  # probes that now pay: drafting stays on
        guard.observe(4, 0.100, 8, drafted=True)
    assert guard.allows_drafts(4)
    guard.observe(4, 0.0, 0, drafted=True)  # no tokens: ignored
    assert guard.allows_drafts(4)
    # the policy asks the guard before the marginal rule
    pol = DraftLengthPolicy(SpeculativeConfig(method="ngram", num_speculative_tokens=4,
                                              draft_length_policy="adaptive"))
    for _ in range(10):
        pol.observe("r", 4, 4)
    assert pol.num_drafts("r", 2) == 0
    measure_plain_steps(pol, (2,))
    assert pol.num_drafts("r", 2) == 4
    for _ in range(MIN_STEPS):
        pol.guard.observe(2, 0.3, 3, drafted=True)  # 100 ms a token against 25
    assert pol.num_drafts("r", 2) == 0


def test_draft_model_probes_rarely():
    """A draft model's probe pays a catch-up forward per token since its last draft (a
    new request's: its whole prompt), so a request priced out (k = 0) probes every 64
    steps, not every 8 as with n-gram lookup, and not at once."""
    from llmserve.spec_decode.policy import PROBE_EVERY, DraftLengthPolicy

    for method, every in (("ngram", 8), ("draft_model", 64)):
        pol = DraftLengthPolicy(SpeculativeConfig(
            method=method, model=None if method == "ngram" else "draft.gguf",
            num_speculative_tokens=4, draft_length_policy="adaptive"))
        assert pol.probe_every == PROBE_EVERY[method] == every
        pol.draft_cost = 0.9  # priors: a draft costs 0.9 of a step at batch 1
        ks = [pol.num_drafts("new", 1) for _ in range(2 * every)]
        assert ks.count(1) == 2 and ks[every - 1] == ks[-1] == 1 and max(ks) == 1
        pol.observe("good", 1, 1)  # accepted: alpha 0.75 < 0.92, still priced out
        assert pol.num_drafts("good", 1) == 0
        for _ in range(10):
            pol.observe("good", 4, 4)
        assert pol.num_drafts("good", 1) >= 1
