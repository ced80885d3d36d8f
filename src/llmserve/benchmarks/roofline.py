"""Machine ceilings for the benchmark tables: memory bandwidth and peak matmul rate.

Decode at small batch reads every weight once per step, so
``tokens/s <= read bandwidth / weight bytes per token``; large batches are
compute bound, ``tokens/s <= peak FLOP/s / (2 * matmul parameters)``
(DESIGN.md section 6). Best of ``reps`` runs, since a shared machine only ever
makes a run slower.
"""

from __future__ import annotations

import time

import torch


def _best(fn, reps: int) -> float:
    fn()  # warm up (page faults, thread pool)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def memory_bandwidth(nbytes: int = 512 * 2**20, reps: int = 5) -> dict:
    """GB/s (1e9 bytes/s): ``read`` from a float32 sum over ``nbytes`` (reads only),
    ``copy`` from ``dst.copy_(src)`` (counts the read and the write)."""
    n = nbytes // 4
    src = torch.ones(n)
    dst = torch.empty(n)
    t_read = _best(lambda: src.sum(), reps)
    t_copy = _best(lambda: dst.copy_(src), reps)
    return {"read_GBps": nbytes / t_read / 1e9, "copy_GBps": 2 * nbytes / t_copy / 1e9,
            "bytes": nbytes}


def peak_matmul(size: int = 2048, reps: int = 3) -> dict:
    """GFLOP/s of a ``size``-cubed matmul in float32 and bfloat16 (2 n^3 flops)."""
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        a = torch.randn(size, size).to(dtype)
        b = torch.randn(size, size).to(dtype)
        out[f"{str(dtype).split('.')[-1]}_GFLOPs"] = 2 * size**3 / _best(lambda a=a, b=b: a @ b, reps) / 1e9
    return out


def roofline_tokens_per_s(bandwidth_GBps: float, bytes_per_token: int) -> float:
    """Weight-bound decode ceiling: tokens/s = bandwidth / bytes read per token."""
    return bandwidth_GBps * 1e9 / bytes_per_token
