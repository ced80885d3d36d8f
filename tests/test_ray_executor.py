"""``distributed_executor_backend="ray"`` on a real two-node Ray cluster on loopback
(``ray.cluster_utils.Cluster``: a head and a second raylet, one CPU each), ranks placed
``STRICT_SPREAD`` so tensor-parallel ranks 1 and 2 run on different nodes. The oracle is
the single-process engine on the same weights (tests/test_tensor_parallel.py's rule:
fp32 greedy tokens, a near-tie parting only at a top-5 token, logprobs within its
``LOGPROB_ATOL``). Failures must be errors naming the rank, never hangs: a rank that
raises while loading, a rank's process killed, a placement group that cannot fit.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

ray = pytest.importorskip("ray")

from llmserve import LLM  # noqa: E402
from llmserve.distributed.multiproc import RankFailedError  # noqa: E402
from tests import tp_targets  # noqa: E402
from tests.conftest import engine_variant  # noqa: E402
from tests.test_tensor_parallel import (  # noqa: E402
    NUM_BLOCKS,
    PROMPTS,
    SCHED,
    _outputs,
    check_logprobs_close,
)

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def cluster(ray_cluster):
    """The two-node cluster, found by RAY_ADDRESS, ranks placed one per node."""
    saved = {k: os.environ.get(k) for k in ("RAY_ADDRESS", "LLMSERVE_RAY_PLACEMENT_STRATEGY")}
    os.environ.update(RAY_ADDRESS=ray_cluster.address,
                      LLMSERVE_RAY_PLACEMENT_STRATEGY="STRICT_SPREAD")
    try:
        yield ray_cluster
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def test_tp3_over_two_ray_nodes_matches_single_process_then_a_killed_rank_fails(
        cluster, llm_fp32):
    reference = engine_variant(llm_fp32, scheduler=SCHED,
                               cache={"num_gpu_blocks_override": NUM_BLOCKS})
    ref = _outputs(reference, PROMPTS[:4], max_tokens=8)
    llm = LLM(dtype="float32", tensor_parallel_size=3, distributed_executor_backend="ray",
              num_gpu_blocks_override=NUM_BLOCKS, **SCHED)
    try:
        workers = llm.engine.executor.workers
        assert sorted(workers.nodes) == [1, 2]
        assert len(set(workers.nodes.values())) == 2  # STRICT_SPREAD: one rank per node
        assert {n["NodeID"] for n in ray.nodes() if n["Alive"]} == set(workers.nodes.values())
        parted = check_logprobs_close(ref, _outputs(llm, PROMPTS[:4], max_tokens=8),
                                      "single", "ray tp3")
        assert parted <= 1
        os.kill(workers.pids[2], signal.SIGKILL)  # the nodes share this machine
        t0 = time.monotonic()
        with pytest.raises(RankFailedError, match=r"rank [12] ") as e:
            _outputs(llm, PROMPTS[:1], max_tokens=4)
        assert time.monotonic() - t0 < 60, "a dead rank must fail the step, not hang it"
        assert e.value.rank in (1, 2)
    finally:
        llm.engine.shutdown()
    assert all(
        pg["state"] == "REMOVED" for pg in ray.util.placement_group_table().values())


def test_a_rank_that_raises_while_loading_is_named(cluster):
    from llmserve.distributed.ray_executor import RayWorkers

    workers = RayWorkers(tp_targets.raise_on_rank_1, "x.gguf", 3, timeout_s=120)
    with pytest.raises(RankFailedError, match=r"rank 1 failed to start: ValueError: "
                                              r"cannot load shard x.gguf") as e:
        workers.wait_for("ready")
    assert e.value.rank == 1


def test_a_placement_group_that_cannot_fit_fails_in_the_timeout(cluster):
    from llmserve.distributed.ray_executor import RayWorkers
    from llmserve.entrypoints.cli import build_parser

    t0 = time.monotonic()
    with pytest.raises(RankFailedError, match=r"rank 1 could not be placed: the placement "
                                              r"group needs 4 x \{'CPU': 1\} \(STRICT_SPREAD\)"):
        RayWorkers(tp_targets.never_ready, None, 5, timeout_s=3)
    assert time.monotonic() - t0 < 30
    args = build_parser().parse_args(["serve", "--distributed-executor-backend", "ray",
                                      "--tensor-parallel-size", "3"])
    assert args.distributed_executor_backend == "ray"


def test_serve_on_ray_answers_and_stops_cleanly_on_sigterm(cluster):
    """``llmserve serve --distributed-executor-backend ray`` joins the cluster from its
    main thread (so Ray can set its SIGTERM handler, and uvicorn's handlers replace Ray's
    C++ failure handler): it answers as the single process does, and a SIGTERM is a
    clean exit 0, with neither Ray's "not the main thread" warning nor a stack trace."""
    import httpx

    from tests.test_server import MODEL, start_server, stop_server

    server = start_server("--tensor-parallel-size", "3", "--kv-cache-memory", "64MiB",
                          "--distributed-executor-backend", "ray")
    try:
        r = httpx.post(server.url + "/v1/completions", timeout=120, json={
            "model": MODEL, "prompt": "The capital of France is", "max_tokens": 3,
            "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"].startswith(" Paris"), r.text
    finally:
        code = stop_server(server)
    log = server.log()
    assert code == 0, log[-3000:]
    assert "not the main thread" not in log and "SIGTERM received" not in log, log[-3000:]
    assert "started 2 Ray worker tasks" in log
