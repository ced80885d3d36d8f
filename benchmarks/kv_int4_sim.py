"""Would int4 KV pages hold quality? A quantize-dequantize simulation (issue 15 item 1).

Before any int4 kernel: each variant runs the ``llmserve eval --kv-cache-dtype`` harness
(``llmserve.engine.kv_quality``: same text, split, reference and metrics) on float32 KV
pages, with the K/V write replaced by a PyTorch quantize-dequantize to 4 bits (the fused
decode path is turned off, so every write goes through it):

    int4-token      keys and values: symmetric per token and head, s = fp16(absmax / 7),
                    c in [-7, 7] (our int8 pages' scheme at 4 bits, group = head_dim)
    int4-token-asym keys and values: asymmetric per token and head (KIVI's value scheme):
                    s = (max - min) / 15, c = rint((x - min) / s) in [0, 15]
    int4-kivi       keys per channel, symmetric, a running absmax per 16-token block with
                    in-place re-rounding (kv_quant_pc.py's rule at qmax 7); values as
                    int4-token-asym

    PYTHONPATH=src nice -n 10 .venv/bin/python benchmarks/kv_int4_sim.py \\
        --text FILE --num-tokens 4096 --prompt-tokens 2048

The prompt chunk is written whole before it attends (as a float cache would be), so in
int4-kivi a prompt token may see its block's later growth; the scored rows are decode
steps, which write then attend one token at a time, as the real pages would.
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def _sym(x: torch.Tensor) -> torch.Tensor:
    s = (x.abs().amax(-1, keepdim=True) / 7).to(torch.float16).float()
    safe = torch.where(s == 0, torch.ones_like(s), s)
    return torch.round(x / safe).clamp(-7, 7) * s


def _asym(x: torch.Tensor) -> torch.Tensor:
    mn, mx = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    s = ((mx - mn) / 15).to(torch.float16).float()
    mn = mn.to(torch.float16).float()
    safe = torch.where(s == 0, torch.ones_like(s), s)
    return torch.round((x - mn) / safe).clamp(0, 15) * s + mn


class KiviKeys:
    """Running per-channel absmax int4 keys per block, per layer cache (side state)."""

    def __init__(self) -> None:
        self.state: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def write(self, key: torch.Tensor, key_cache: torch.Tensor, slots: list[int]) -> None:
        nb, bs, hkv, d = key_cache.shape
        st = self.state.get(key_cache.data_ptr())
        if st is None:
            st = self.state[key_cache.data_ptr()] = (torch.zeros(nb, bs, hkv, d),
                                                     torch.zeros(nb, hkv, d))
        codes, scales = st
        for t, slot in enumerate(slots):
            if slot < 0:
                continue
            blk, off = divmod(slot, bs)
            x = key[t].float()
            new = (x.abs() / 7).to(torch.float16).float()
            s_old = scales[blk]
            if off == 0:
                s = new
            else:
                grow = new > s_old
                s = torch.where(grow, new, s_old)
                safe = torch.where(grow, s, torch.ones_like(s))
                codes[blk, :off] = torch.where(
                    grow, torch.round(codes[blk, :off] * s_old / safe), codes[blk, :off])
            safe = torch.where(s == 0, torch.ones_like(s), s)
            codes[blk, off] = torch.round(x / safe).clamp(-7, 7)
            scales[blk] = s
            key_cache[blk, :off + 1] = codes[blk, :off + 1] * s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--text", required=True)
    ap.add_argument("--num-tokens", type=int, default=4096)
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--variants", default="int4-token,int4-token-asym,int4-kivi")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from llmserve.engine.kv_quality import (
        KVVariant,
        build_engines,
        reference_logprobs,
        score_variant,
    )
    from llmserve.layers.attention.cpu import CpuAttentionBackend
    from llmserve.tokenizer import encode_text

    engine = build_engines(None, [], args.num_tokens)["auto"]
    tok = engine.tokenizer
    with open(args.text, encoding="utf-8") as f:
        ids = encode_text(tok, f.read(), "text", add_special_tokens=False)
    ids = ([tok.bos_token_id] if tok.bos_token_id is not None else []) + ids
    ids = ids[:args.num_tokens]
    ref = reference_logprobs(engine, ids, args.prompt_tokens)
    model = getattr(engine.runner.model, "model", engine.runner.model)  # the LlamaModel
    original = CpuAttentionBackend.write_kv
    results = []
    for name in args.variants.split(","):
        kivi = KiviKeys()

        def write(key, value, key_cache, value_cache, slot_mapping, name=name, kivi=kivi):
            if name == "int4-kivi":
                kivi.write(key, key_cache, slot_mapping.tolist())
                original(key, _asym(value.float()), key_cache.clone(), value_cache,
                         slot_mapping)
                return
            q = _sym if name == "int4-token" else _asym
            original(q(key.float()), q(value.float()), key_cache, value_cache, slot_mapping)

        CpuAttentionBackend.write_kv = staticmethod(write)
        model.use_cpu_decode_path = False
        t0 = time.perf_counter()
        try:
            r = score_variant(engine, ids, args.prompt_tokens, KVVariant(), ref)
        finally:
            CpuAttentionBackend.write_kv = original
            model.use_cpu_decode_path = True
        d = {**r.as_dict(), "variant": name, "seconds": round(time.perf_counter() - t0, 1)}
        results.append(d)
        print(f"{name:>16}  ppl {d['perplexity']:.4f} (full {d['reference_perplexity']:.4f})"
              f"  KL mean {d['kl_mean']:.5f} max {d['kl_max']:.3f}  top-1 "
              f"{d['top1_agreement']:.3f}  ({d['seconds']} s)", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
