"""The CUDA path of the parallel engine (issue 13 item 8): NCCL groups, one GPU per rank.

On CPU this file checks what can be checked without a GPU: which backend and which GPU
each rank gets, the start-up error when ranks outnumber GPUs, and that a coordinator
with a separate ``cpu_group`` (the NCCL layout) sends tensors over its device group and
pickled objects over its gloo group, with real gloo collectives between two threads.
The tests marked ``cuda`` run the engine itself on GPUs and are skipped here; on a
machine with CUDA they compare against the single-process engine (the tensor-parallel
rule of tests/test_tensor_parallel.py).
"""

from __future__ import annotations

import datetime
import threading

import pytest
import torch
import torch.distributed as dist

from llmserve.distributed.parallel_state import (
    GroupCoordinator,
    backend_for_device,
    check_devices_for_ranks,
    rank_device,
)

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


def test_backend_and_device_per_rank():
    assert backend_for_device("cpu") == "gloo"
    assert backend_for_device("cuda") == backend_for_device("cuda:1") == "nccl"
    assert rank_device("cpu", 3, 0) == "cpu"
    assert [rank_device("cuda", r, 4) for r in range(4)] == [f"cuda:{r}" for r in range(4)]
    assert [rank_device("cuda:2", r, 4) for r in range(3)] == ["cuda:2", "cuda:3", "cuda:0"]
    assert rank_device("cuda", 5, 1) == "cuda:0"  # a Ray task sees only its own GPU
    with pytest.raises(ValueError, match="no CUDA device"):
        rank_device("cuda", 0, 0)


def test_more_ranks_than_gpus_is_a_start_up_error_naming_both():
    check_devices_for_ranks("cuda", 2, 2)
    check_devices_for_ranks("cpu", 8, 0)
    with pytest.raises(ValueError, match=r"4 ranks need 4 CUDA devices.*has 2"):
        check_devices_for_ranks("cuda", 4, 2)


class _Recording:
    """A real gloo group that notes which collectives ran on it."""

    def __init__(self, group) -> None:
        self.group, self.calls = group, []

    def __getattr__(self, name):
        def call(*args, **kwargs):
            self.calls.append(name)
            return getattr(self.group, name)(*args, **kwargs)
        return call


def test_nccl_layout_sends_tensors_on_the_device_group_and_objects_on_the_cpu_group():
    store = dist.HashStore()
    timeout = datetime.timedelta(seconds=30)
    results, errors = {}, []

    def rank(r: int) -> None:
        try:
            device = _Recording(dist.ProcessGroupGloo(dist.PrefixStore("dev/", store), r, 2,
                                                      timeout))
            cpu = _Recording(dist.ProcessGroupGloo(dist.PrefixStore("cpu/", store), r, 2,
                                                   timeout))
            g = GroupCoordinator(device, [0, 1], r, cpu_group=cpu)
            summed = g.all_reduce(torch.full((3,), float(r + 1), dtype=torch.bfloat16))
            gathered = g.all_gather(torch.tensor([r]), dim=0)
            obj = g.broadcast_object({"step": 7} if r == 0 else None)
            low = g.all_reduce_min(10 + r)
            if r == 0:
                g.send_object(["to", 1], 1, tag=3)
                g.send(torch.arange(4.0), 1, tag=4)
                got = None
            else:
                got = (g.recv_object(0, tag=3), g.recv(torch.empty(4), 0, tag=4))
            results[r] = (summed, gathered, obj, low, got, device.calls, cpu.calls)
        except BaseException as e:  # noqa: BLE001 - reported by the test thread
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    for r in range(2):
        summed, gathered, obj, low, got, device_calls, cpu_calls = results[r]
        assert summed.dtype == torch.bfloat16 and summed.tolist() == [3.0] * 3
        assert gathered.tolist() == [0, 1]
        assert obj == {"step": 7} and low == 10
        assert set(device_calls) == {"allreduce", "allgather", "send" if r == 0 else "recv"}
        assert "allreduce" in cpu_calls and "broadcast" in cpu_calls
        assert ("send" if r == 0 else "recv") in cpu_calls
    assert results[1][4][0] == ["to", 1] and results[1][4][1].tolist() == [0, 1, 2, 3]


@pytest.mark.skipif(GPUS < 1, reason="needs a CUDA GPU")
def test_cuda_engine_matches_the_cpu_engine(llm_fp32):
    """The whole engine on one GPU (fp32) against the CPU engine on the same weights."""
    from llmserve import LLM
    from tests.test_tensor_parallel import PROMPTS, _outputs, check_logprobs_close

    ref = _outputs(llm_fp32, PROMPTS[:4], 8)
    gpu = LLM(dtype="float32", device="cuda", kv_cache_memory="256MiB")
    parted = check_logprobs_close(ref, _outputs(gpu, PROMPTS[:4], 8), "cpu", "cuda")
    assert parted <= 1, parted


@pytest.mark.real_model
@pytest.mark.skipif(GPUS < 2, reason="NCCL needs one GPU per rank: two GPUs")
def test_tp2_over_nccl_matches_one_gpu(qwen05_gguf):
    from tests.test_tensor_parallel import parallel_vs_single

    def check(llm):
        assert llm.engine.runner.kv_caches[0][0].device.type == "cuda"

    assert parallel_vs_single(qwen05_gguf, check, tensor_parallel_size=2, device="cuda",
                              kv_cache_memory="256MiB") <= 1
