"""Scheduler without a model: a fake runner samples token 7 whenever a request
reaches the end of its known tokens."""

import pytest

from llmserve.config import SchedulerConfig
from llmserve.kv_cache import KVCacheManager
from llmserve.sampling_params import SamplingParams
from llmserve.scheduler import ModelRunnerOutput, Request, RequestStatus, Scheduler

TOKEN = 7


def make_scheduler(num_blocks=64, block_size=4, max_num_seqs=8, budget=32, max_model_len=256,
                   chunked=True):
    cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                          max_model_len=max_model_len, enable_chunked_prefill=chunked)
    return Scheduler(cfg, KVCacheManager(num_blocks, block_size))


def make_request(rid, prompt_len, max_tokens=4, eos=(), **kw):
    params = SamplingParams(max_tokens=max_tokens, **kw)
    return Request(rid, list(range(100, 100 + prompt_len)), params, max_tokens, eos)


class FakeRunner:
    """Tracks tokens like the model runner and checks block tables cover the KV."""

    def __init__(self, block_size):
        self.block_size = block_size
        self.tokens = {}
        self.computed = {}
        self.steps = []

    def execute(self, out):
        for r in out.finished_req_ids:
            self.tokens.pop(r, None)
        for new in out.scheduled_new_reqs:
            self.tokens[new.req_id] = list(new.prompt_token_ids)
            self.computed[new.req_id] = (new.num_computed_tokens, new.block_ids)
        for c in out.scheduled_cached_reqs:
            self.computed[c.req_id] = (c.num_computed_tokens, c.block_ids)
        res = ModelRunnerOutput()
        for rid, n in out.num_scheduled_tokens.items():
            start, blocks = self.computed[rid]
            end = start + n
            assert len(blocks) * self.block_size >= end, "block table too short for the KV"
            assert 0 not in blocks
            if end == len(self.tokens[rid]):
                self.tokens[rid].append(TOKEN)
                res.sampled_token_ids[rid] = TOKEN
        self.steps.append(dict(out.num_scheduled_tokens))
        return res


def run_all(sched, max_steps=1000, runner=None):
    runner = runner or FakeRunner(sched.kv_cache_manager.block_size)
    finished = {}
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            break
        out = sched.schedule()
        assert out.total_num_scheduled_tokens <= sched.config.max_num_batched_tokens
        assert len(out.num_scheduled_tokens) <= sched.config.max_num_seqs
        for o in sched.update_from_output(out, runner.execute(out)):
            if o.finished:
                finished[o.req_id] = o.finish_reason
    else:
        raise AssertionError("scheduler did not finish (deadlock?)")
    return finished, runner


def test_chunked_prefill_mixes_with_decodes():
    s = make_scheduler(budget=16)
    runner = FakeRunner(4)
    s.add_request(make_request("a", 3, max_tokens=10))
    out = s.schedule()
    assert out.num_scheduled_tokens == {"a": 3}
    s.update_from_output(out, runner.execute(out))
    s.add_request(make_request("b", 40, max_tokens=2))
    finished, runner = run_all(s, runner=runner)
    assert finished == {"a": "length", "b": "length"}
    # the decode of a goes first, b's prompt is chunked into the rest of the budget
    assert runner.steps[1] == {"a": 1, "b": 15}
    b_chunks = [st["b"] for st in runner.steps if "b" in st]
    assert b_chunks == [15, 15, 10, 1]  # 40 prompt tokens in 3 chunks, then one decode
    assert s.kv_cache_manager.get_num_free_blocks() == s.kv_cache_manager.num_usable_blocks


def test_no_chunking_waits_for_budget():
    s = make_scheduler(budget=16, chunked=False, max_model_len=16)
    s.add_request(make_request("a", 10, max_tokens=2))
    s.add_request(make_request("b", 10, max_tokens=2))
    out = s.schedule()
    assert out.num_scheduled_tokens == {"a": 10}


def test_max_num_seqs_and_fcfs():
    s = make_scheduler(max_num_seqs=2, budget=100)
    for i in range(5):
        s.add_request(make_request(f"r{i}", 5, max_tokens=3))
    runner = FakeRunner(4)
    out = s.schedule()
    assert list(out.num_scheduled_tokens) == ["r0", "r1"]
    s.update_from_output(out, runner.execute(out))
    finished, _ = run_all(s, runner=runner)
    assert len(finished) == 5
    assert s.kv_cache_manager.usage == 0.0


def test_eos_and_stop_token_ids_finish():
    s = make_scheduler()
    s.add_request(make_request("eos", 4, max_tokens=50, eos=(TOKEN,)))
    s.add_request(make_request("ign", 4, max_tokens=5, eos=(TOKEN,), ignore_eos=True))
    s.add_request(make_request("stoptok", 4, max_tokens=50, stop_token_ids=[TOKEN]))
    s.add_request(make_request("min", 4, max_tokens=50, eos=(TOKEN,), min_tokens=3))
    finished, runner = run_all(s)
    assert finished == {"eos": "stop", "ign": "length", "stoptok": "stop", "min": "stop"}
    assert len(runner.tokens.get("min", [])) in (0, 7)  # 4 prompt + 3 tokens when not yet dropped


def test_preemption_by_recompute_no_deadlock_no_loss():
    # 8 usable blocks of 4 tokens = 32 token slots; three requests that grow to 20 tokens each
    s = make_scheduler(num_blocks=9, block_size=4, budget=64, max_model_len=32)
    for i in range(3):
        s.add_request(make_request(f"r{i}", 8, max_tokens=12))
    finished, runner = run_all(s)
    assert finished == {"r0": "length", "r1": "length", "r2": "length"}
    assert s.stats.num_preemptions_total > 0
    assert s.kv_cache_manager.get_num_free_blocks() == 8
    assert not s.requests


def test_preempts_most_recently_admitted_and_requeues_at_head():
    s = make_scheduler(num_blocks=5, block_size=4, budget=64, max_model_len=16)  # 4 blocks
    s.add_request(make_request("old", 4, max_tokens=8))
    s.add_request(make_request("new", 4, max_tokens=8))
    runner = FakeRunner(4)
    out = s.schedule()
    s.update_from_output(out, runner.execute(out))  # each holds 2 blocks (5 tokens)
    preempted = None
    for _ in range(20):
        out = s.schedule()
        if out.preempted_req_ids:
            preempted = out.preempted_req_ids
            break
        s.update_from_output(out, runner.execute(out))
    assert preempted == {"new"}
    assert s.waiting[0].request_id == "new"
    assert s.waiting[0].num_computed_tokens == 0
    assert s.waiting[0].status == RequestStatus.PREEMPTED


def test_request_that_outgrows_whole_cache_is_capped():
    s = make_scheduler(num_blocks=3, block_size=4, budget=64, max_model_len=64)  # 8 slots
    s.add_request(make_request("big", 6, max_tokens=30))
    finished, _ = run_all(s)
    assert finished == {"big": "length"} or not s.requests
    assert s.kv_cache_manager.get_num_free_blocks() == 2


def test_refuses_prompts_that_can_never_fit():
    s = make_scheduler(num_blocks=5, block_size=4, max_model_len=64)  # 16 slots
    with pytest.raises(ValueError, match="max_model_len is 64"):
        s.add_request(make_request("a", 64))
    with pytest.raises(ValueError, match="whole KV cache holds 16"):
        s.add_request(make_request("b", 20))
    s.add_request(make_request("ok", 4))
    with pytest.raises(ValueError, match="already in use"):
        s.add_request(make_request("ok", 4))


def test_abort_waiting_and_running_frees_blocks():
    s = make_scheduler(max_num_seqs=1)
    s.add_request(make_request("run", 10, max_tokens=100))
    s.add_request(make_request("wait", 10))
    runner = FakeRunner(4)
    out = s.schedule()
    s.update_from_output(out, runner.execute(out))
    assert s.kv_cache_manager.usage > 0
    assert s.abort_requests(["run", "wait", "nope"]) == ["run", "wait"]
    assert s.kv_cache_manager.usage == 0.0
    assert not s.has_unfinished_requests()
    assert s.schedule().finished_req_ids == {"run"}
