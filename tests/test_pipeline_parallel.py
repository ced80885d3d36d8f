"""Pipeline parallelism (and tp x pp) with real processes: torch.distributed, gloo,
loopback; the oracle is the single-process engine on the same weights and settings.

A pipeline stage runs whole layers, so nothing is summed in another order: fp32
greedy tokens must be identical and the logprobs of the chosen tokens agree within
``LOGPROB_ATOL`` (tests/test_tensor_parallel.py). Under tp x pp the tensor-parallel
all-reduces may flip a near-tie; vLLM's ``check_logprobs_close`` rule applies there
and the partings are counted (at most one of the eight prompts).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading

import pytest

from llmserve import LLM, SamplingParams
from llmserve.config import ParallelConfig
from llmserve.distributed.multiproc import RankFailedError
from llmserve.models.pipeline_parallel import PARTITION_ENV, pp_layer_ranges
from tests.conftest import engine_variant
from tests.test_tensor_parallel import (
    NUM_BLOCKS,
    PROMPTS,
    SCHED,
    _outputs,
    _smollm_config,
    check_logprobs_close,
)

pytestmark = pytest.mark.model


# ------------------------------------------------------------------ layout
def test_stage_split_follows_vllm_get_pp_indices_and_the_override(monkeypatch):
    monkeypatch.delenv(PARTITION_ENV, raising=False)
    assert [len(r) for r in pp_layer_ranges(30, 2)] == [15, 15]
    assert [len(r) for r in pp_layer_ranges(30, 4)] == [7, 8, 8, 7]  # vLLM: remainder
    assert pp_layer_ranges(30, 4)[3] == range(23, 30)                # before the last
    assert [len(r) for r in pp_layer_ranges(24, 5)] == [5, 5, 5, 5, 4]
    assert pp_layer_ranges(30, 2, "20,10") == [range(0, 20), range(20, 30)]
    monkeypatch.setenv(PARTITION_ENV, "12, 18")
    assert pp_layer_ranges(30, 2) == [range(0, 12), range(12, 30)]
    for bad in ("15,14", "30,0", "10,10,10", "a,b"):
        with pytest.raises(ValueError, match="pp_layer_partition"):
            pp_layer_ranges(30, 2, bad)


def test_pp_larger_than_the_layers_is_a_clear_error_before_ranks_start():
    with pytest.raises(ValueError, match=r"pipeline_parallel_size=31 exceeds the 30 layers"):
        ParallelConfig(pipeline_parallel_size=31).check_model(_smollm_config())
    ParallelConfig(pipeline_parallel_size=30).check_model(_smollm_config())
    with pytest.raises(ValueError, match=r"pipeline_parallel_size=31 exceeds the 30 layers"):
        LLM(pipeline_parallel_size=31)
    with pytest.raises(ValueError, match="pipeline_parallel_size must be a positive integer"):
        ParallelConfig(pipeline_parallel_size=0)
    assert not [p for p in multiprocessing.active_children()
                if p.name.startswith("llmserve-rank")]


# ------------------------------------------------------------------ numerics
@pytest.fixture(scope="module")
def reference(llm_fp32):
    """The single-process engine's outputs for PROMPTS, with the pipelines' settings."""
    llm = engine_variant(llm_fp32, scheduler=SCHED,
                         cache={"num_gpu_blocks_override": NUM_BLOCKS})
    out = _outputs(llm)
    assert llm.engine.scheduler.stats.num_preemptions_total > 0
    return out


def test_pp2_default_model_fp32_identical_to_single_process(reference):
    """Batched, chunked prefill (24-token budget), preemption (7 usable blocks), two
    micro-batches in flight."""
    ref = reference
    llm = LLM(dtype="float32", pipeline_parallel_size=2, num_gpu_blocks_override=NUM_BLOCKS,
              **SCHED)
    try:
        engine = llm.engine
        assert len(engine.runner.kv_caches) == 15  # stage 0's layers only
        assert engine.runner.model.model.layers[20].__class__.__name__ == "PPMissingLayer"
        assert engine.runner.model.model.norm.__class__.__name__ == "PPMissingLayer"
        out = _outputs(llm)
        assert engine.batch_queue.max_depth == 2  # stage 0 ran a batch while stage 1 ran one
        assert engine.scheduler.stats.num_preemptions_total > 0
        assert [o.token_ids for o in out] == [o.token_ids for o in ref]
        assert check_logprobs_close(ref, out, "pp=1", "pp=2") == 0
        engine.batch_queue.max_in_flight = 1  # the synchronous pipeline: same tokens
        assert [o.token_ids for o in _outputs(llm, PROMPTS[:3], 6)] == \
            [o.token_ids[:6] for o in ref[:3]]
    finally:
        llm.engine.shutdown()


@pytest.fixture(scope="module")
def tp3_pp2():
    """tp=3 x pp=2 = 6 ranks (the default model's 9 / 3 heads), an uneven 18 + 12 split."""
    os.environ[PARTITION_ENV] = "18,12"
    try:
        llm = LLM(dtype="float32", tensor_parallel_size=3, pipeline_parallel_size=2,
                  num_gpu_blocks_override=NUM_BLOCKS, **SCHED)
    finally:
        del os.environ[PARTITION_ENV]
    yield llm
    llm.engine.shutdown()


def test_tp3_pp2_matches_single_process(reference, tp3_pp2):
    ref = reference[:4]
    groups = tp3_pp2.engine.executor.groups
    assert (groups.tp.ranks, groups.pp.ranks) == ([0, 1, 2], [0, 3])  # tp fastest-varying
    assert len(tp3_pp2.engine.runner.kv_caches) == 18
    assert tp3_pp2.engine.runner.kv_caches[0][0].shape[2] == 1  # 3 KV heads / 3 ranks
    out = _outputs(tp3_pp2, PROMPTS[:4])
    parted = check_logprobs_close(ref, out, "tp=1 pp=1", "tp=3 pp=2")
    assert parted <= 1, f"{parted} of 4 sequences parted at a near-tie"
    print(f"tp=3 x pp=2 vs single fp32: 4 prompts, {parted} parted at a near-tie")


def test_killed_last_stage_rank_ends_the_engine_naming_it(tp3_pp2):
    pid = tp3_pp2.engine.executor.workers.pids[4]  # stage 1, tp rank 1
    killer = threading.Timer(1.0, os.kill, (pid, signal.SIGKILL))
    killer.start()
    try:
        with pytest.raises(RankFailedError, match="rank 4 was killed by SIGKILL"):
            tp3_pp2.generate(["Once upon a time"], SamplingParams(
                temperature=0, max_tokens=4000, ignore_eos=True), use_tqdm=False)
        assert not any(p.is_alive() for p in tp3_pp2.engine.executor.workers.procs.values())
    finally:
        killer.cancel()


@pytest.mark.real_model
def test_tp2_pp2_qwen05_matches_single_process(qwen05_gguf):
    """The issue's tp x pp = 2 x 2 on Qwen2.5-Coder-0.5B (14 / 2 heads, 24 layers: 12 + 12),
    fp32, against the single-process engine on the same GGUF and settings."""
    from tests.test_tensor_parallel import parallel_vs_single

    def check(llm):
        groups = llm.engine.executor.groups
        assert (groups.tp.ranks, groups.pp.ranks) == ([0, 1], [0, 2])
        assert len(llm.engine.runner.kv_caches) == 12  # stage 0's layers
        assert llm.engine.runner.kv_caches[0][0].shape[2] == 1  # 2 KV heads / 2 ranks

    parted = parallel_vs_single(qwen05_gguf, check, tensor_parallel_size=2,
                                pipeline_parallel_size=2)
    assert parted <= 1, parted
    print(f"Qwen2.5-0.5B tp=2 x pp=2 vs single fp32: {parted} of 3 parted")
