"""Tiered routing's pure parts: the heuristic complexity classifier, the tiers config
and model-aware worker selection (no processes; the end-to-end test is in
test_router.py)."""

from __future__ import annotations

import pytest

from llmserve.router.config import load_router_config
from llmserve.router.policies import RouteRequest, create_policy
from llmserve.router.state import WorkerPool
from llmserve.router.tiers import ComplexityClassifier, HeuristicClassifier, parse_tiers

LEVELS = [{"model": "small", "max_score": 0.35}, {"model": "large"}]


class LongIsHard(ComplexityClassifier):
    """A user-supplied classifier, loaded by its import path."""

    def score(self, body):
        return 1.0 if len(body.get("prompt", "")) > 10 else 0.0


def test_heuristic_scores_follow_the_features():
    c = HeuristicClassifier()
    easy = c.score({"messages": [{"role": "user", "content": "Capital of France?"}]})
    code = c.score({"prompt": "Implement a function that parses JSON:\n```python\n"
                              "def parse(s):\n    return None\n```\nThen write unit tests."})
    math_ = c.score({"prompt": "Prove the theorem: the integral of 2*x is x^2."})
    deep = c.score({"messages": [{"role": "user", "content": "ok"}] * 11})
    assert 0 <= easy < 0.1 < min(code, math_, deep) <= 1
    assert code > math_  # code markers weigh more than math markers
    f = c.features({"prompt": "x" * 6200})
    assert f["length"] == pytest.approx(1.0, abs=0.01) and f["code"] == 0
    assert c.score({"prompt": [1, 2, 3]}) == 0  # token ids: no text to read


def test_tier_choice_by_threshold_and_custom_classifier():
    t = parse_tiers({"auto": {"levels": LEVELS}})["auto"]
    assert t.choose({"prompt": "hi"})[0] == 0
    assert t.choose({"prompt": "```python\ndef f():\n    return 1\n```\nrefactor and debug "
                               "this, explain step by step, compare designs" * 20})[0] == 1
    t = parse_tiers({"a": {"classifier": "tests.test_router_tiers:LongIsHard",
                           "levels": LEVELS}})["a"]
    assert [t.choose({"prompt": p})[0] for p in ("short", "a much longer one")] == [0, 1]


@pytest.mark.parametrize("spec, field", [
    ({"levels": [{"model": "s"}]}, "levels"),
    ({"levels": [{"model": "s"}, {"model": "l"}]}, "levels[0].max_score"),
    ({"levels": [{"model": "s", "max_score": 0.5}, {"model": "l", "max_score": 0.9}]},
     "levels[1].max_score"),
    ({"levels": [{"model": "s", "max_score": 0.5}, {"model": "m", "max_score": 0.4},
                 {"model": "l"}]}, "levels[1].max_score"),
    ({"levels": [{"model": "s", "max_score": 1.5}, {"model": "l"}]}, "levels[0].max_score"),
    ({"levels": LEVELS, "classifier": "nope"}, "classifier"),
    ({"levels": LEVELS, "classifier": "os:path"}, "classifier"),
    ({"levels": LEVELS, "escalate_on": "length"}, "escalate_on"),
    ({"levels": LEVELS, "extra": 1}, "unknown"),
])
def test_bad_tiers_name_the_field(spec, field):
    with pytest.raises(ValueError, match=rf"tiers\.auto.*{field}".replace("[", r"\[")):
        parse_tiers({"auto": spec})


def test_router_config_file(tmp_path):
    p = tmp_path / "router.yaml"
    p.write_text("workers: [http://127.0.0.1:9]\ntiers:\n  auto:\n    levels:\n"
                 "      - {model: s, max_score: 0.2}\n      - {model: l}\n")
    cfg = load_router_config(str(p))
    assert cfg.workers == ("http://127.0.0.1:9",) and list(cfg.tiers) == ["auto"]
    p.write_text("policy: x\n")
    with pytest.raises(ValueError, match="unknown section"):
        load_router_config(str(p))
    p.write_text("tiers: [1]\n")
    with pytest.raises(ValueError, match=str(p)):
        load_router_config(str(p))


def test_pool_routes_only_to_workers_serving_the_model():
    pool = WorkerPool(create_policy("round_robin"))
    a, b, c = (pool.add(f"http://127.0.0.1:{9000 + i}") for i in range(3))
    a.models, b.models = [{"id": "small"}], [{"id": "large"}]  # c: not known yet
    picks = {pool.pick(RouteRequest(), model="small").worker.id for _ in range(4)}
    assert picks == {a.id, c.id}
    assert pool.known_model("anything")  # c might serve it
    c.models = [{"id": "small"}]
    assert not pool.known_model("anything") and pool.known_model("large")
    assert pool.pick(RouteRequest(), model="large").worker is b
    b.healthy = False
    assert pool.pick(RouteRequest(), model="large") is None
