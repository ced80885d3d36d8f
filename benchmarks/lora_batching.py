"""Multi-LoRA batching cost: tokens/s of one batch whose requests use 0, 1, 2 or 4
different adapters, against the same engine without ``enable_lora``.

Default model (SmolLM2-135M GGUF, the engine's default format), random PEFT adapters
(rank ``--rank`` on all seven projections, written in PEFT's file format), ``--num-prompts``
random prompts of ``--input-len`` tokens, ``--output-len`` greedy tokens each
(``ignore_eos``), all added at once; requests are spread round-robin over the adapters.
Each mode runs ``--repeats`` times after a warm-up; the best run is reported, with the
ratio to the engine without LoRA. Run on a quiet machine::

    python benchmarks/lora_batching.py --num-prompts 16 --input-len 64 --output-len 32
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time


def write_adapter(path: str, config, rank: int, seed: int) -> None:
    """A random PEFT LoRA directory for the model ``config`` (our ModelConfig)."""
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    h, i = config.hidden_size, config.intermediate_size
    q, kv = config.num_attention_heads * config.head_dim, \
        config.num_key_value_heads * config.head_dim
    shapes = {"self_attn.q_proj": (h, q), "self_attn.k_proj": (h, kv),
              "self_attn.v_proj": (h, kv), "self_attn.o_proj": (q, h),
              "mlp.gate_proj": (h, i), "mlp.up_proj": (h, i), "mlp.down_proj": (i, h)}
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for name, (fan_in, fan_out) in shapes.items():
            key = f"base_model.model.model.layers.{layer}.{name}"
            tensors[f"{key}.lora_A.weight"] = 0.01 * torch.randn(rank, fan_in, generator=g)
            tensors[f"{key}.lora_B.weight"] = 0.01 * torch.randn(fan_out, rank, generator=g)
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                   "target_modules": [n.split(".")[1] for n in shapes], "bias": "none"}, f)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()

    import random

    from llmserve import LLM, SamplingParams
    from llmserve.lora import LoRARequest

    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(args.input_len)]}
               for _ in range(args.num_prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    common = dict(dtype=args.dtype, kv_cache_memory="512MiB", enable_prefix_caching=False,
                  seed=0)

    def best(llm, loras) -> float:
        llm.generate(prompts[:2], params, use_tqdm=False,
                     lora_request=loras[:2] if isinstance(loras, list) else None)  # warm-up
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
            times.append(time.perf_counter() - t0)
        return min(times)

    tokens = args.num_prompts * (args.input_len + args.output_len)
    out_tokens = args.num_prompts * args.output_len
    results = {}
    plain = LLM(**common)
    results["no enable_lora"] = best(plain, None)
    print(f"no enable_lora: {results['no enable_lora']:.2f} s", flush=True)
    config = plain.engine.config.model_config
    fmt = plain.engine.config.dtype
    del plain
    with tempfile.TemporaryDirectory() as tmp:
        adapters = []
        for k in range(4):
            write_adapter(os.path.join(tmp, f"a{k}"), config, args.rank, k)
            adapters.append(LoRARequest(f"a{k}", k + 1, os.path.join(tmp, f"a{k}")))
        llm = LLM(enable_lora=True, max_loras=4, max_lora_rank=args.rank, **common)
        results["enable_lora, base only"] = best(llm, None)
        print(f"enable_lora, base only: {results['enable_lora, base only']:.2f} s", flush=True)
        for n in (1, 2, 4):
            loras = [adapters[i % n] for i in range(args.num_prompts)]
            results[f"{n} adapter{'s' if n > 1 else ''}"] = best(llm, loras)
            print(f"{n} adapters: {results[f'{n} adapter' + ('s' if n > 1 else '')]:.2f} s",
                  flush=True)
    ref = results["no enable_lora"]
    print(f"SmolLM2-135M ({fmt}), {args.num_prompts} requests x ({args.input_len} in + "
          f"{args.output_len} out), rank {args.rank} on 7 projections x "
          f"{config.num_hidden_layers} layers, best of {args.repeats}")
    print(f"{'mode':<24} {'s':>7} {'out tok/s':>10} {'total tok/s':>12} {'vs no LoRA':>11}")
    for mode, t in results.items():
        print(f"{mode:<24} {t:7.2f} {out_tokens / t:10.1f} {tokens / t:12.1f} {ref / t:10.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
