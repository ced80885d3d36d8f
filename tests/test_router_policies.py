"""Router logic alone (no processes but one torch-import check): the engine's block
hashes, each routing policy on fake worker state, the circuit breaker, the pool."""

from __future__ import annotations

import subprocess
import sys

import pytest

from llmserve.kv_cache.manager import KVCacheManager
from llmserve.router.health import parse_load
from llmserve.router.policies import RouteRequest, create_policy, policy_names
from llmserve.router.prefix import prompt_block_hashes, salt_extra_keys
from llmserve.router.state import WorkerPool
from llmserve.router.worker import CircuitBreaker, Worker
from llmserve.sampling_params import SamplingParams
from llmserve.scheduler.request import Request

BS = 16


def workers(*loads: int) -> list[Worker]:
    return [Worker(f"w{i}", f"http://127.0.0.1:{9000 + i}", in_flight=n)
            for i, n in enumerate(loads)]


def rr(tokens: list[int]) -> RouteRequest:
    return RouteRequest(prompt_block_hashes(tokens, BS), len(tokens), BS)


@pytest.mark.parametrize("salt", [None, "tenant-a"])
def test_router_hashes_equal_engine_prefix_cache(salt):
    ids = [(i * 7919) % 49152 for i in range(100)]  # 6 full blocks + 4 tokens
    req = Request("r", ids, SamplingParams(max_tokens=1), max_tokens=1, cache_salt=salt)
    assert req.extra_keys == salt_extra_keys(salt)
    m = KVCacheManager(num_blocks=64, block_size=BS, enable_caching=True)
    m.get_computed_blocks("r", ids, req.extra_keys)
    engine_hashes = m.req_to_hashes["r"]
    assert len(engine_hashes) == 6
    assert prompt_block_hashes(ids, BS, salt) == engine_hashes
    other = prompt_block_hashes(ids, BS, None if salt else "x")
    assert other[0] != engine_hashes[0]  # the salt enters the first block


def test_router_imports_no_torch():
    code = ("import sys\nfrom llmserve.entrypoints.cli import build_parser\n"
            "a = build_parser().parse_args(['router', '--worker', 'http://127.0.0.1:1'])\n"
            "import llmserve.router.app, llmserve.router.policies\n"
            "from llmserve.router.state import WorkerPool\n"
            "from llmserve.router.policies import create_policy\n"
            "llmserve.router.app.build_app(WorkerPool(create_policy('cache_aware')))\n"
            "bad = [m for m in sys.modules if m == 'torch' or m.startswith('torch.')\n"
            "       or m.startswith('llmserve.engine.') and m != 'llmserve.engine.arg_utils']\n"
            "print(bad)\nassert not bad, bad\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr + out.stdout


def test_policy_registry():
    assert policy_names() == ["cache_aware", "least_load", "prefix_hash", "round_robin"]
    with pytest.raises(ValueError, match="unknown routing policy 'nope'"):
        create_policy("nope")
    with pytest.raises(ValueError, match="balance_rel_threshold"):
        create_policy("cache_aware", balance_rel_threshold=0.5)


def test_cache_aware_prefers_worker_that_holds_prefix():
    p = create_policy("cache_aware")
    ws = workers(0, 0)
    prefix = list(range(1000, 1160))  # 10 blocks
    first = p.select(rr(prefix + [1, 2, 3]), ws)
    assert first.reason == "miss" and first.worker.id == "w0"  # tie: by id
    p.on_routed(rr(prefix + [1, 2, 3]), first.worker)
    ws[0].in_flight = 5  # busier, but within the balance thresholds
    d = p.select(rr(prefix + list(range(5000, 5040))), ws)
    assert (d.worker.id, d.reason, d.matched_tokens) == ("w0", "cache_hit", 160)
    # a prompt sharing under cache_threshold of its blocks is a miss -> least loaded
    d = p.select(rr(prefix[:16] + list(range(7000, 7200))), ws)
    assert (d.worker.id, d.reason) == ("w1", "miss")


def test_cache_aware_digest_replaces_what_it_assumed():
    """A worker's published digest is the truth as of when it was asked for: prompts
    routed before then and not in it are forgotten (evicted), later ones still
    assumed, and a prefix never routed there but published is a hit."""
    p = create_policy("cache_aware", cache_threshold=0.5, digest_grace_s=0.0)
    clock = [100.0]
    p.clock = lambda: clock[0]
    ws = workers(0, 0)
    a, b = rr(list(range(64))), rr(list(range(1000, 1064)))
    p.on_routed(a, ws[0])
    assert p.select(a, ws).reason == "cache_hit"
    clock[0] = 101.0
    p.on_routed(b, ws[0])  # routed after the digest below was asked for
    p.on_digest("w0", [], asked_at=100.5)  # w0 evicted a, b not yet seen
    assert p.matched_blocks("w0", a.block_hashes) == 0
    assert p.matched_blocks("w0", b.block_hashes) == 4
    p.on_digest("w1", a.block_hashes[:3], asked_at=102.0)  # computed there by others
    d = p.select(a, ws)
    assert (d.worker.id, d.reason, d.matched_tokens) == ("w1", "cache_hit", 3 * BS)
    p.on_remove("w1")
    assert p.matched_blocks("w1", a.block_hashes) == 0


def test_cache_aware_digest_keeps_prompts_routed_within_the_grace():
    """A prompt routed 5 s before a digest was asked for may still be prefilling: the
    digest (which lacks it) does not erase it; one routed 40 s before is erased."""
    p = create_policy("cache_aware", cache_threshold=0.5)  # digest_grace_s 30
    clock = [100.0]
    p.clock = lambda: clock[0]
    ws = workers(0, 0)
    old, recent = rr(list(range(64))), rr(list(range(1000, 1064)))
    p.on_routed(old, ws[0])
    clock[0] = 135.0
    p.on_routed(recent, ws[0])
    p.on_digest("w0", [], asked_at=140.0)
    assert p.matched_blocks("w0", old.block_hashes) == 0
    assert p.matched_blocks("w0", recent.block_hashes) == 4
    with pytest.raises(ValueError, match="digest_grace_s"):
        create_policy("cache_aware", digest_grace_s=-1)


def test_block_pool_cache_version_follows_the_cached_set():
    m = KVCacheManager(num_blocks=3, block_size=BS, enable_caching=True)
    v0, hashes = m.prefix_cache_digest()
    assert hashes == []
    ids = list(range(2 * BS))
    assert m.get_computed_blocks("r", ids, b"") == []
    assert m.allocate_slots("r", 0, len(ids)) is not None
    m.cache_blocks("r", ids, len(ids))
    v1, hashes = m.prefix_cache_digest()
    assert v1 > v0 and hashes == prompt_block_hashes(ids, BS)
    m.free("r")
    assert m.prefix_cache_digest() == (v1, hashes)  # freed blocks stay cached
    assert m.reset_prefix_cache() and m.prefix_cache_digest()[0] > v1
    assert m.prefix_cache_digest()[1] == []


def test_cache_aware_balances_past_both_thresholds():
    p = create_policy("cache_aware")  # abs 32, rel 1.1
    prefix = rr(list(range(320)))
    ws = workers(0, 0)
    p.on_routed(prefix, ws[0])
    ws[0].in_flight, ws[1].in_flight = 40, 8  # gap 32: not > 32 -> still cache
    assert p.select(prefix, ws).reason == "cache_hit"
    ws[0].in_flight = 41  # gap 33 > 32 and 41 > 8 * 1.1
    d = p.select(prefix, ws)
    assert (d.worker.id, d.reason) == ("w1", "balance")
    ws[0].in_flight, ws[1].in_flight = 400, 370  # gap 30: balanced again
    assert p.select(prefix, ws).reason == "cache_hit"
    p2 = create_policy("cache_aware", balance_abs_threshold=10, balance_rel_threshold=2.0)
    p2.on_routed(prefix, ws[0])
    ws[0].in_flight, ws[1].in_flight = 100, 60  # gap 40 > 10 but 100 < 2 * 60
    assert p2.select(prefix, ws).reason == "cache_hit"


def test_cache_aware_miss_goes_to_least_loaded_not_smallest_tree():
    p = create_policy("cache_aware")
    ws = workers(3, 9)  # w1 has the smallest (empty) tree but the most load
    p.on_routed(rr(list(range(500, 820))), ws[0])
    d = p.select(rr(list(range(9000, 9100))), ws)
    assert (d.worker.id, d.reason) == ("w0", "miss")


def test_cache_aware_lru_bound_and_removal():
    p = create_policy("cache_aware", max_blocks_per_worker=4)
    w = workers(0)[0]
    a = rr(list(range(160)))
    p.on_routed(a, w)
    assert p.matched_blocks("w0", a.block_hashes) == 0  # first blocks evicted
    p.on_remove("w0")
    assert p.matched_blocks("w0", a.block_hashes) == 0


def test_prefix_hash_consistent_bounded_and_rebuilt():
    p = create_policy("prefix_hash")
    ws = workers(0, 0, 0)
    reqs = [rr([k] * 64 + list(range(64))) for k in range(60)]
    owner = {i: p.select(r, ws).worker.id for i, r in enumerate(reqs)}
    assert len(set(owner.values())) == 3  # keys spread over the ring
    assert all(p.select(r, ws).worker.id == owner[i] for i, r in enumerate(reqs))
    # a shared first-4-block prefix maps to one worker whatever follows
    base = list(range(2000, 2064))
    assert len({p.select(rr(base + [s] * 40), ws).worker.id for s in range(10)}) == 1
    # membership change: w2 leaves; keys it did not own stay put, its keys move
    p.on_remove("w2")
    live = ws[:2]
    for i, r in enumerate(reqs):
        now = p.select(r, live).worker.id
        assert now != "w2"
        if owner[i] != "w2":
            assert now == owner[i]
    # bounded load: the owner at capacity passes the key on clockwise
    r = reqs[0]
    home = p.select(r, live)
    home.worker.in_flight = 10  # cap = ceil(1.25 * 11 / 2) = 7
    d = p.select(r, live)
    assert d.worker.id != home.worker.id and d.reason == "balance"
    assert p.select(rr([1, 2, 3]), live).reason == "miss"  # under one block: no key


def test_least_load_uses_scraped_metrics_and_in_flight():
    p = create_policy("least_load")
    ws = workers(0, 0)
    ws[0].load = parse_load("llmserve:num_requests_running{model_name=\"m\"} 3.0\n"
                            "llmserve:num_requests_waiting{model_name=\"m\"} 2.0\n"
                            "llmserve:kv_cache_usage_perc{model_name=\"m\"} 0.5\n")
    assert ws[0].load.scraped and ws[0].load.num_requests_waiting == 2.0
    assert p.select(RouteRequest(), ws).worker.id == "w1"
    ws[1].in_flight = 6  # the router knows of more outstanding on w1 than w0 reports
    assert p.select(RouteRequest(), ws).worker.id == "w0"
    ws[1].in_flight = 5  # tie on queue (5 vs 5): lower KV usage wins
    assert p.select(RouteRequest(), ws).worker.id == "w1"
    assert not parse_load("other_metric 1\n").scraped


def test_round_robin_cycles():
    p = create_policy("round_robin")
    ws = workers(0, 0, 0)
    assert [p.select(RouteRequest(), ws).worker.id for _ in range(6)] == \
        ["w0", "w1", "w2", "w0", "w1", "w2"]


def test_circuit_breaker_states():
    now = [0.0]
    b = CircuitBreaker(failure_threshold=2, cooldown_s=5.0, clock=lambda: now[0])
    b.record_failure()
    assert b.state == "closed" and b.allows()
    b.record_failure()
    assert b.state == "open" and not b.allows()
    now[0] = 5.0
    assert b.state == "half_open" and b.allows()
    b.on_send()
    assert not b.allows()  # one trial at a time
    b.record_failure()
    assert b.state == "open"
    now[0] = 10.0
    b.on_send()
    b.record_success()
    assert b.state == "closed" and b.failures == 0


def test_pool_session_affinity_exclusion_and_drain():
    pool = WorkerPool(create_policy("round_robin"))
    a, b = pool.add("http://127.0.0.1:9000/"), pool.add("http://127.0.0.1:9001")
    assert a.url == "http://127.0.0.1:9000" and (a.id, b.id) == ("w0", "w1")
    with pytest.raises(ValueError, match="already in the pool"):
        pool.add("http://127.0.0.1:9000")
    with pytest.raises(ValueError, match="not an http"):
        pool.add("127.0.0.1:9002")
    d = pool.pick(RouteRequest(), "alice")
    pool.routed(RouteRequest(), d.worker, "alice")
    again = [pool.pick(RouteRequest(), "alice") for _ in range(3)]
    assert all(x.worker is d.worker and x.reason == "session" for x in again)
    assert pool.pick(RouteRequest(), "alice", exclude={d.worker.id}).worker is not d.worker
    d.worker.healthy = False  # session falls back to the policy
    assert pool.pick(RouteRequest(), "alice").worker is not d.worker
    d.worker.healthy = True
    b.in_flight = 1
    pool.drain("w1")
    assert "w1" in pool.workers and pool.eligible() == [a]
    b.in_flight = 0
    pool.maybe_remove(b)
    assert "w1" not in pool.workers
    with pytest.raises(KeyError):
        pool.drain("w1")


def test_lora_request_hashes_as_each_workers_engine_salts_it():
    """A request naming a LoRA adapter is hashed, per worker, with the ``lora_int_id``
    that worker's ``/v1/models`` card publishes: exactly the engine's block hashes for
    a Request with that adapter; cache_aware matches and records those per worker."""
    from llmserve.lora import LoRARequest

    ids = [(i * 104729) % 49152 for i in range(70)]  # 4 full blocks
    ws = workers(0, 0)
    for w, lid in zip(ws, (3, 7), strict=True):
        w.models = [{"id": "base"}, {"id": "sql", "parent": "base", "lora_int_id": lid}]
    req = RouteRequest(prompt_block_hashes(ids, BS), len(ids), BS, token_ids=ids,
                       lora_name="sql")
    for w, lid in zip(ws, (3, 7), strict=True):
        eng = Request("r", ids, SamplingParams(max_tokens=1), max_tokens=1,
                      lora_request=LoRARequest("sql", lid, "/adapters/sql"))
        m = KVCacheManager(num_blocks=64, block_size=BS, enable_caching=True)
        m.get_computed_blocks("r", ids, eng.extra_keys)
        assert req.hashes_for(w) == m.req_to_hashes["r"]
    assert req.hashes_for(ws[0])[0] not in (req.hashes_for(ws[1])[0], req.block_hashes[0])
    p = create_policy("cache_aware")
    p.on_routed(req, ws[1])
    assert p.matched_blocks("w1", req.hashes_for(ws[1])) == 4
    assert p.matched_blocks("w1", prompt_block_hashes(ids, BS)) == 0  # base != adapter
    assert p.select(req, ws).worker is ws[1]
    plain = Worker("w2", "http://127.0.0.1:9002")  # no adapter id published
    assert req.hashes_for(plain) == req.block_hashes
