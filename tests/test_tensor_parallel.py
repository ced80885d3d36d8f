"""Tensor parallelism with real processes: torch.distributed, gloo, loopback.

The oracle is the single-process engine on the same weights and settings (itself
checked against transformers elsewhere). fp32 greedy tokens must be identical; where a
row-parallel all-reduce sums in another order and flips a near-tie, vLLM's
``check_logprobs_close`` rule applies (the sequences may part only at a token that is
in the other's top-5 logprobs, and nothing is compared after it) and such cases are
counted and bounded. Logprobs of the tokens both engines chose agree within
``LOGPROB_ATOL``.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time

import pytest

from llmserve import LLM, SamplingParams
from llmserve.config import ModelConfig, ParallelConfig
from llmserve.distributed.multiproc import RankFailedError, WorkerProcesses
from tests import tp_targets
from tests.conftest import engine_variant

pytestmark = pytest.mark.model

LOGPROB_ATOL = 2e-3  # fp32: |logprob(TP) - logprob(single)| of the same token, in nats
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "1, 2, 3, 4,",
    "Translate to French: good morning, my friend.",
    "List three uses of a paperclip:\n1.",
    "<|im_start|>user\nWhat is 17 * 23?<|im_end|>\n<|im_start|>assistant\n",
    "The quick brown fox",
]
SCHED = {"max_num_batched_tokens": 24, "max_num_seqs": 6}  # chunked prefill, batched
NUM_BLOCKS = 8  # 7 usable blocks of 16 tokens for 6 running requests: forces preemption


def check_logprobs_close(ref, test, name_ref: str, name_test: str) -> int:
    """vLLM's rule over two lists of CompletionOutputs; returns how many sequences part
    (each time at a token in the other's top logprobs). Asserts the logprobs of the
    common prefix agree within LOGPROB_ATOL."""
    parted = 0
    for i, (a, b) in enumerate(zip(ref, test, strict=True)):
        for pos, (ta, tb) in enumerate(zip(a.token_ids, b.token_ids)):
            la, lb = a.logprobs[pos], b.logprobs[pos]
            if ta != tb:
                assert ta in lb and tb in la, (
                    f"prompt {i} parts at token {pos}: {name_ref} {ta} not in {name_test}'s "
                    f"top {sorted(lb)} or {tb} not in {sorted(la)}")
                parted += 1
                break
            assert abs(la[ta].logprob - lb[tb].logprob) <= LOGPROB_ATOL, (i, pos, la[ta], lb[tb])
        else:
            assert len(a.token_ids) == len(b.token_ids), i
    return parted


def _params(max_tokens: int = 10) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=5, ignore_eos=True)


def _outputs(llm: LLM, prompts=PROMPTS, max_tokens: int = 10):
    return [o.outputs[0] for o in llm.generate(prompts, _params(max_tokens), use_tqdm=False)]


# ------------------------------------------------------------------ validation
def _smollm_config(**kw) -> ModelConfig:
    base = dict(architecture="LlamaForCausalLM", vocab_size=49152, hidden_size=576,
                intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                num_key_value_heads=3)
    return ModelConfig(**{**base, **kw})


def test_tp_size_that_does_not_divide_names_the_sizes_that_work():
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 .*9 attention heads.*"
                                         r"sizes that work: 1, 3$"):
        ParallelConfig(tensor_parallel_size=2).check_model(_smollm_config())
    ParallelConfig(tensor_parallel_size=3).check_model(_smollm_config())
    qwen = _smollm_config(hidden_size=896, intermediate_size=4864, num_attention_heads=14,
                          num_key_value_heads=2)
    ParallelConfig(tensor_parallel_size=2).check_model(qwen)
    with pytest.raises(ValueError, match="sizes that work: 1, 2$"):
        ParallelConfig(tensor_parallel_size=4).check_model(qwen)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer"):
            ParallelConfig(tensor_parallel_size=bad)


def test_llm_with_tp2_on_the_default_model_fails_before_starting_ranks():
    import multiprocessing

    with pytest.raises(ValueError, match="sizes that work: 1, 3"):
        LLM(tensor_parallel_size=2)
    assert not [p for p in multiprocessing.active_children()
                if p.name.startswith("llmserve-rank")]


# ------------------------------------------------------------------ launcher
def test_launcher_names_the_rank_that_failed_to_start():
    workers = WorkerProcesses(tp_targets.raise_on_rank_1, "x.gguf", 3, timeout_s=120)
    with pytest.raises(RankFailedError, match=r"rank 1 failed to start: ValueError: "
                                              r"cannot load shard x.gguf") as e:
        workers.wait_for("ready")
    assert e.value.rank == 1
    assert not any(p.is_alive() for p in workers.procs.values())  # the others were stopped


def test_launcher_start_up_timeout_names_the_missing_ranks():
    workers = WorkerProcesses(tp_targets.never_ready, None, 2, timeout_s=120)
    workers.wait_for("joined")
    with pytest.raises(RankFailedError, match=r"rank 1 was not ready within the start-up "
                                              r"timeout of 1 s \(ranks not ready: \[1\]\)"):
        workers.wait_for("ready", timeout_s=1.0)
    assert not any(p.is_alive() for p in workers.procs.values())


# ------------------------------------------------------------------ numerics
@pytest.fixture(scope="module")
def reference(llm_fp32):
    """The single-process engine (fp32) with the TP engines' scheduler and cache."""
    return engine_variant(llm_fp32, scheduler=SCHED,
                          cache={"num_gpu_blocks_override": NUM_BLOCKS})


@pytest.fixture(scope="module")
def tp3():
    """The default model at tp=3 (9 query / 3 KV heads: 3 / 1 per rank), fp32; the
    kill test below ends it."""
    llm = LLM(dtype="float32", tensor_parallel_size=3, num_gpu_blocks_override=NUM_BLOCKS,
              **SCHED)
    yield llm
    llm.engine.shutdown()


def test_tp3_default_model_fp32_matches_single_process(reference, tp3):
    ref = _outputs(reference)
    ref_preempted = reference.engine.scheduler.stats.num_preemptions_total
    assert tp3.engine.runner.kv_caches[0][0].shape[2] == 1  # 3 KV heads / 3 ranks
    out = _outputs(tp3)
    assert tp3.engine.scheduler.stats.num_preemptions_total > 0 and ref_preempted > 0
    single = _outputs(tp3, PROMPTS[:1], 6)  # alone, unbatched
    parted = check_logprobs_close(ref, out, "tp=1", "tp=3")
    assert parted <= 1, f"{parted} of {len(PROMPTS)} sequences parted at a near-tie"
    assert single[0].token_ids == ref[0].token_ids[:6]
    print(f"tp=3 vs tp=1 fp32: {len(PROMPTS)} prompts, {parted} parted at a near-tie")


def test_rank_memory_agrees_with_the_planner(tp3):
    """What rank 0 allocated (measured on its tensors) = what ``llmserve plan`` computes."""
    from llmserve.planner.formats import parse_weight_format
    from llmserve.planner.ledger import kv_cache_bytes_per_token, weight_bytes

    mc = tp3.engine.config.model_config
    mem = tp3.engine.rank_memory
    assert mem["weights"] == weight_bytes(mc, parse_weight_format("fp32"), tp=3).total
    assert mem["kv_cache"] == NUM_BLOCKS * 16 * kv_cache_bytes_per_token(mc, "float32", tp=3)
    assert mem["weights"] < weight_bytes(mc, parse_weight_format("fp32")).total / 2


def test_killed_rank_ends_the_offline_engine_naming_it(tp3):
    pid = tp3.engine.executor.workers.pids[2]
    killer = threading.Timer(1.0, os.kill, (pid, signal.SIGKILL))
    killer.start()
    try:
        with pytest.raises(RankFailedError, match="rank 2 was killed by SIGKILL"):
            tp3.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=4000,
                                                              ignore_eos=True), use_tqdm=False)
        assert not any(p.is_alive() for p in tp3.engine.executor.workers.procs.values())
        with pytest.raises(RankFailedError, match="rank 2"):  # and stays dead
            tp3.generate(["Hello"], SamplingParams(max_tokens=2), use_tqdm=False)
    finally:
        killer.cancel()


def test_tp3_native_int4_matches_tp1_native():
    """Q4_1 shards through the int4 kernel (bfloat16 activations): row-parallel layers cut
    the Q4_1 blocks along the input dimension, on block boundaries."""
    kw = dict(dtype="bfloat16", quantization="gguf-native", kv_cache_memory="32MiB", **SCHED)
    single = LLM(**kw)
    ref = _outputs(single, PROMPTS[:4], 8)
    del single
    llm = LLM(tensor_parallel_size=3, **kw)
    try:
        layer = llm.engine.runner.model.model.layers[0]
        assert type(layer.mlp.down_proj.quant_method).__name__ == "GGUFNativeLinearMethod"
        assert layer.mlp.down_proj.quant_method.packed is not None  # int4 shard, not dense
        out = _outputs(llm, PROMPTS[:4], 8)
    finally:
        llm.engine.shutdown()
    parted = 0
    for a, b in zip(ref, out, strict=True):  # bf16: the rule only, no logprob tolerance
        for pos, (ta, tb) in enumerate(zip(a.token_ids, b.token_ids)):
            if ta != tb:
                assert ta in b.logprobs[pos] and tb in a.logprobs[pos]
                parted += 1
                break
    assert parted <= 1, parted
    print(f"tp=3 vs tp=1 gguf-native bf16: {parted} of 4 parted at a near-tie")


def parallel_vs_single(model: str, check=None, prompts=PROMPTS[:3], **parallel) -> int:
    """Greedy fp32 tokens of ``model`` on one process, then with ``parallel`` (e.g.
    ``tensor_parallel_size=2``); ``check(llm)`` inspects the parallel engine before it
    shuts down. Returns the near-tie partings (check_logprobs_close)."""
    kw = dict(model=model, dtype="float32", kv_cache_memory="48MiB",
              max_model_len=512, max_num_batched_tokens=24)
    kw.update({k: parallel.pop(k) for k in ("device", "kv_cache_memory") if k in parallel})
    single = LLM(**kw)
    ref = _outputs(single, prompts, 6)
    del single
    llm = LLM(**parallel, **kw)
    try:
        if check is not None:
            check(llm)
        out = _outputs(llm, prompts, 6)
    finally:
        llm.engine.shutdown()
    return check_logprobs_close(ref, out, "single", f"{parallel}")


@pytest.mark.real_model
def test_tp2_qwen05_fp32_matches_single_process(qwen05_gguf):
    """14 query heads / 2 KV heads: 7 + 1 per rank; a tied 151936-row vocabulary."""
    def check(llm):
        assert llm.engine.runner.kv_caches[0][0].shape[2] == 1

    parted = parallel_vs_single(qwen05_gguf, check, tensor_parallel_size=2)
    assert parted <= 1, parted
    print(f"Qwen2.5-0.5B tp=2 vs tp=1 fp32: {parted} of 3 parted at a near-tie")


# ------------------------------------------------------------------ faults: server
def test_killed_rank_makes_the_server_answer_503_and_exit_nonzero():
    httpx = pytest.importorskip("httpx")
    psutil = pytest.importorskip("psutil")
    from tests.test_server import MODEL, start_server

    server = start_server("--tensor-parallel-size", "3", "--kv-cache-memory", "64MiB")
    try:
        ranks = [c for c in psutil.Process(server.proc.pid).children()
                 if "resource_tracker" not in " ".join(c.cmdline())]
        assert len(ranks) == 2, [c.cmdline() for c in ranks]
        result: dict = {}

        def complete() -> None:  # a long request, in flight when the rank dies
            result["r"] = httpx.post(server.url + "/v1/completions", timeout=300, json={
                "model": MODEL, "prompt": "Once upon a time", "max_tokens": 4000,
                "temperature": 0, "ignore_eos": True})
        caller = threading.Thread(target=complete)
        caller.start()
        deadline = time.monotonic() + 120
        while "num_requests_running" not in _running(httpx, server.url) and \
                time.monotonic() < deadline:
            time.sleep(0.05)
        ranks[0].send_signal(signal.SIGKILL)
        caller.join(300)
        assert not caller.is_alive(), "the request hung after a rank died"
        r = result["r"]
        assert r.status_code == 503, r.text
        assert re.search(r"the engine died: tensor-parallel rank [12] was killed by SIGKILL",
                         r.json()["error"]["message"]), r.text
        assert server.proc.wait(timeout=120) != 0
        assert re.search(r"llmserve serve: error: the engine died: tensor-parallel rank [12] "
                         r"was killed by SIGKILL", server.log()), server.log()[-3000:]
    finally:
        if server.proc.poll() is None:
            server.proc.kill()


def _running(httpx, url: str) -> str:
    """'num_requests_running' when /metrics shows a running request (else '')."""
    try:
        text = httpx.get(url + "/metrics", timeout=10).text
    except httpx.TransportError:
        return ""
    running = re.search(r"^llmserve:num_requests_running\{[^}]*\} (\S+)", text, re.M)
    return "num_requests_running" if running and float(running.group(1)) >= 1 else ""
