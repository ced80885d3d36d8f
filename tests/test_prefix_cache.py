"""Prefix caching, copy-on-write forks, priority and swap in the KV cache manager
and scheduler, without a model (a fake runner samples token 7)."""

import pytest

from llmserve.config import SchedulerConfig
from llmserve.kv_cache import KVCacheManager, hash_block_tokens
from llmserve.sampling_params import SamplingParams
from llmserve.scheduler import Request, Scheduler
from tests.test_scheduler import FakeRunner, run_all

BS = 4


def make_sched(num_blocks=64, budget=64, max_model_len=256, policy="fcfs", mode="recompute",
               host_blocks=0, max_num_seqs=8, caching=True):
    cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                          max_model_len=max_model_len, scheduling_policy=policy,
                          preemption_mode=mode)
    return Scheduler(cfg, KVCacheManager(num_blocks, BS, enable_caching=caching), host_blocks)


def req(rid, tokens, max_tokens=3, **kw):
    params = SamplingParams(max_tokens=max_tokens)
    return Request(rid, list(tokens), params, max_tokens, (), **kw)


def test_block_hash_chains_and_salts():
    h1 = hash_block_tokens(None, [1, 2, 3, 4])
    assert h1 == hash_block_tokens(None, (1, 2, 3, 4))
    assert h1 != hash_block_tokens(None, [1, 2, 3, 5])
    assert h1 != hash_block_tokens(None, [1, 2, 3, 4], b"salt:a")
    assert hash_block_tokens(h1, [5, 6, 7, 8]) != hash_block_tokens(None, [5, 6, 7, 8])
    assert len(h1) == 32


def test_hit_stops_one_token_short_and_survives_free_until_evicted():
    m = KVCacheManager(num_blocks=7, block_size=BS, enable_caching=True)  # 6 usable
    tokens = list(range(12))  # exactly 3 full blocks
    assert m.allocate_slots("a", 0, 12) == []
    m.cache_blocks("a", tokens, 12)
    a_blocks = m.get_block_ids("a")
    # the whole prompt is cached, but the last token must be computed: 2 blocks hit
    hits = m.get_computed_blocks("b", tokens)
    assert [b.block_id for b in hits] == a_blocks[:2]
    # a longer prompt with the same prefix hits all 3
    hits = m.get_computed_blocks("c", tokens + [99, 98])
    assert [b.block_id for b in hits] == a_blocks
    m.free("a")
    assert m.get_num_free_blocks() == 6  # cached blocks are free (evictable)
    hits = m.get_computed_blocks("c", tokens + [99])
    assert len(hits) == 3
    assert m.allocate_slots("c", 12, 1, hits) == []
    assert m.get_block_ids("c")[:3] == a_blocks
    m.free("c")
    # filling the pool with other content evicts a's blocks, the last block first
    assert m.allocate_slots("d", 0, 4 * BS) == []
    assert [b.block_id for b in m.get_computed_blocks("e", tokens + [1])] == a_blocks[:2]
    assert m.allocate_slots("f", 0, 2 * BS) == []
    assert m.get_computed_blocks("e", tokens + [1]) == []
    assert m.block_pool.num_evictions == 3


def test_fork_shares_blocks_and_copies_on_write():
    m = KVCacheManager(num_blocks=9, block_size=BS, enable_caching=False)
    assert m.allocate_slots("p", 0, 6) == []  # blocks for 6 tokens: one full + one partial
    m.fork("p", "c", 6)
    assert m.get_block_ids("c") == m.get_block_ids("p")
    shared = m.get_block_ids("p")
    # the child recomputes token 5 (in the shared partial block): copy-on-write
    copies = m.allocate_slots("c", 5, 1)
    assert len(copies) == 1 and copies[0][0] == shared[1]
    assert m.get_block_ids("c") == [shared[0], copies[0][1]]
    # now the parent owns block shared[1] alone and writes without a copy
    assert m.allocate_slots("p", 6, 1) == []
    m.free("p")
    m.free("c")
    assert m.get_num_free_blocks() == 8


def test_scheduler_prefix_hit_skips_computed_tokens():
    s = make_sched()
    runner = FakeRunner(BS)
    prefix = list(range(200, 220))  # 5 full blocks
    s.add_request(req("a", prefix + [1, 2]))
    run_all(s, runner=runner)
    s.add_request(req("b", prefix + [3, 4, 5]))
    out = s.schedule()
    assert out.num_scheduled_tokens == {"b": 3}  # 20 of 23 tokens came from the cache
    assert out.scheduled_new_reqs[0].num_computed_tokens == 20
    s.update_from_output(out, runner.execute(out))
    s.add_request(req("salted", prefix + [3, 4, 5], cache_salt="tenant-2"))
    out = s.schedule()
    assert out.num_scheduled_tokens["salted"] == 23
    assert s.stats.prefix_cache_hits_total == 20
    s.update_from_output(out, runner.execute(out))
    run_all(s, runner=runner)
    assert s.kv_cache_manager.get_num_free_blocks() == s.kv_cache_manager.num_usable_blocks


def test_n_siblings_fork_after_the_leader_prompt():
    s = make_sched(caching=False)
    runner = FakeRunner(BS)
    prompt = list(range(300, 310))
    s.add_request(req("x#0", prompt, max_tokens=4))
    for i in (1, 2, 3):
        s.add_request(req(f"x#{i}", prompt, max_tokens=4, fork_from="x#0"))
    out = s.schedule()
    assert out.num_scheduled_tokens == {"x#0": 10}
    s.update_from_output(out, runner.execute(out))
    finished, runner = run_all(s, runner=runner)
    assert len(finished) == 4
    total = sum(sum(step.values()) for step in runner.steps)
    # prompt once, each sibling recomputes only the last prompt token, 3 decodes each
    assert total == 10 + 3 * 1 + 4 * 3
    assert s.kv_cache_manager.get_num_free_blocks() == s.kv_cache_manager.num_usable_blocks


def test_priority_admission_preempts_lower_priority():
    s = make_sched(num_blocks=9, policy="priority", max_model_len=32)  # 8 blocks
    runner = FakeRunner(BS)
    s.add_request(req("low1", range(100, 112), max_tokens=8, priority=5))
    s.add_request(req("low2", range(120, 132), max_tokens=8, priority=5))
    out = s.schedule()
    s.update_from_output(out, runner.execute(out))
    s.add_request(req("vip", range(140, 152), max_tokens=8, priority=0))
    out = s.schedule()
    assert "vip" in out.num_scheduled_tokens
    assert out.preempted_req_ids == {"low2"}
    finished = {}
    order = []
    for _ in range(200):
        if not s.has_unfinished_requests():
            break
        s.update_from_output(out, runner.execute(out))
        for rid in ("vip", "low1", "low2"):
            if rid not in s.requests and rid not in order:
                order.append(rid)
        out = s.schedule()
    finished = set(order)
    assert finished == {"vip", "low1", "low2"}
    assert order.index("vip") < order.index("low2")
    assert s.kv_cache_manager.get_num_free_blocks() == 8


def test_swap_preemption_keeps_computed_tokens_and_empties_host_pool():
    s = make_sched(num_blocks=9, budget=64, max_model_len=32, mode="swap", host_blocks=16)
    for i in range(3):
        s.add_request(req(f"r{i}", range(100 + 20 * i, 108 + 20 * i), max_tokens=12))
    runner = FakeRunner(BS)
    swapped = []
    for _ in range(300):
        if not s.has_unfinished_requests():
            break
        out = s.schedule()
        outs = [op for op in out.kv_cache_ops if op[0] == "swap_out"]
        swapped += outs
        for c in out.scheduled_cached_reqs:
            if c.resumed_from_preemption:
                assert c.num_computed_tokens > 0  # resumed where it stopped
        s.update_from_output(out, runner.execute(out))
    assert swapped and s.stats.num_swapped_out_total > 0
    assert not s.has_unfinished_requests()
    assert s.host_pool.get_num_free_blocks() == 16
    assert s.kv_cache_manager.get_num_free_blocks() == 8


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_policies_finish_everything(policy):
    s = make_sched(num_blocks=12, policy=policy, max_model_len=40)
    for i in range(6):
        s.add_request(req(f"r{i}", range(100, 110 + i), max_tokens=10, priority=i % 3))
    finished, _ = run_all(s)
    assert len(finished) == 6
    assert s.kv_cache_manager.get_num_free_blocks() == 11
