"""The `llmserve plan` report: every figure with its formula and numbers substituted.

:func:`build_report` returns a JSON-ready dict whose ``rows`` list holds
``(section, label, formula, value)``; :func:`render_table` prints them.
"""

from __future__ import annotations

from typing import Any

from llmserve.planner.capacity import CapacityPlan, estimate_activation_bytes, ffn_width
from llmserve.planner.formats import WeightFormat, kv_dtype_bytes
from llmserve.planner.ledger import (
    count_parameters,
    kv_bytes_per_token_per_layer,
    kv_cache_bytes_per_sequence,
    kv_cache_bytes_per_token,
    kv_heads_per_device,
    pp_partition,
    weight_bytes,
)
from llmserve.planner.model import PlannerModel
from llmserve.planner.sources import ResolvedModel
from llmserve.utils import format_size

Row = tuple[str, str, str, str]


def _n(x: int) -> str:
    return f"{x:,}"


def _b(x: int) -> str:
    """Bytes as ``327,680 B (320.00 KiB)``, or just a binary size when large."""
    return f"{x:,} B" if x < 1024 else (f"{x:,} B ({format_size(x)})" if x < 1 << 30
                                        else format_size(x))


def _model_rows(m: PlannerModel) -> list[Row]:
    p = count_parameters(m)
    h, L = m.hidden_size, m.num_hidden_layers
    moe = sum(m.is_moe_layer(i) for i in range(L))
    dense = L - moe
    if m.is_mla:
        attn = f"{L} layers x MLA (q_a, q_b, kv_a, kv_b, o projections + norms)"
    else:
        attn = (f"{L} layers x (2 x {_n(h)} x {m.num_attention_heads} x {m.head_dim}"
                f" + 2 x {_n(h)} x {m.num_key_value_heads} x {m.head_dim})")
        attn += " + biases" if m.attention_bias else ""
    rows: list[Row] = [
        ("Parameters", "embeddings", f"vocab {_n(m.vocab_size)} x hidden {_n(h)}",
         _n(p["embeddings"])),
        ("Parameters", "attention", attn, _n(p["attention"])),
    ]
    if dense:
        rows.append(("Parameters", "mlp", f"{dense} dense layers x 3 x {_n(h)} x "
                     f"{_n(m.intermediate_size)}", _n(p["mlp"])))
    if moe:
        rows.append(("Parameters", "moe experts", f"{moe} MoE layers x {m.num_experts} experts "
                     f"x 3 x {_n(h)} x {_n(m.moe_intermediate_size)}", _n(p["moe_experts"])))
        if m.num_shared_experts:
            width = m.shared_expert_intermediate_size or m.moe_intermediate_size
            rows.append(("Parameters", "shared experts", f"{moe} x {m.num_shared_experts} "
                         f"shared x 3 x {_n(h)} x {_n(width)}", _n(p["moe_shared_experts"])))
        rows.append(("Parameters", "router", f"{moe} x {_n(h)} x {m.num_experts}",
                     _n(p["moe_router"])))
    rows += [
        ("Parameters", "norms", f"(2 x {L} + 1) x {_n(h)}", _n(p["norms"])),
        ("Parameters", "lm_head", "tied to the embeddings" if m.tie_word_embeddings
         else f"{_n(m.vocab_size)} x {_n(h)}", _n(p["lm_head"])),
        ("Parameters", "total", "sum of the above", f"{_n(p.total)} ({p.total / 1e9:.2f} B)"),
    ]
    if m.is_moe:
        rows.append(("Parameters", "active per token", f"total - embeddings - {moe} x "
                     f"{m.num_experts - m.num_experts_per_tok} unused experts",
                     f"{_n(p.active)} ({p.active / 1e9:.2f} B)"))
    return rows


def _weight_rows(r: ResolvedModel, fmt: WeightFormat, plan: CapacityPlan) -> list[Row]:
    m = r.model
    sec = "Weights"
    if r.file_weight_bytes is not None and plan.weight_format == "gguf file":
        return [(sec, "total", f"tensors in the GGUF file ({r.file_type or 'mixed types'})",
                 _b(r.file_weight_bytes)),
                (sec, "per device", f"file size x this device's share (tp {plan.tp}, "
                 f"pp {plan.pp})", _b(plan.weight_bytes))]
    total = weight_bytes(m, fmt)
    emb = "" if fmt.quantize_embeddings else "; embeddings, lm_head at 16 bits"
    rows = [(sec, "format", f"{fmt.name}: {fmt.describe()} per weight{emb}", ""),
            (sec, "total", f"{_n(count_parameters(m).total)} params x bits / 8",
             _b(total.total))]
    dev = weight_bytes(m, fmt, plan.tp, plan.pp)
    layers = pp_partition(m.num_hidden_layers, plan.pp)[dev.stage]
    rows.append((sec, "per device", f"stage {dev.stage + 1}/{plan.pp} ({layers} layers), "
                 f"sharded / tp {plan.tp}", _b(dev.total)))
    return rows


def _kv_rows(m: PlannerModel, plan: CapacityPlan) -> list[Row]:
    sec = "KV cache"
    b = kv_dtype_bytes(plan.kv_cache_dtype, m.torch_dtype)
    L, tp, pp = m.num_hidden_layers, plan.tp, plan.pp
    full = kv_cache_bytes_per_token(m, plan.kv_cache_dtype)
    stage_layers = max(pp_partition(L, pp))
    layers_txt = f"{L} layers" if pp == 1 else f"{stage_layers} layers (ceil({L} / pp {pp}))"
    if m.is_mla:
        one = f"({m.kv_lora_rank} kv_lora_rank + {m.qk_rope_head_dim} qk_rope_head_dim) x"
        rows = [(sec, "KV/token", f"{one} {L} layers x {b} B", _b(full))]
        dev = f"{one} {layers_txt} x {b} B (latent not split by tp)"
    else:
        kv, hd = m.num_key_value_heads, m.head_dim
        rows = [(sec, "KV/token", f"2 x {L} layers x {kv} kv_heads x {hd} head_dim x {b} B",
                 _b(full))]
        kvd = kv_heads_per_device(m, tp)
        heads_txt = f"{kvd} kv_heads" if tp == 1 else f"{kvd} kv_heads (max(1, {kv} // tp {tp}))"
        dev = f"2 x {layers_txt} x {heads_txt} x {hd} head_dim x {b} B"
        if kv < m.num_attention_heads:
            naive = 2 * L * m.hidden_size * b
            rows.append((sec, "rule of thumb", f"2 x {L} layers x {_n(m.hidden_size)} hidden x "
                         f"{b} B (assumes MHA: {naive / full:g}x too much)", _b(naive)))
    per_dev = plan.kv_bytes_per_token
    if tp > 1 or pp > 1:
        rows.append((sec, "KV/token/device", dev, _b(per_dev)))
    ctx = plan.max_model_len
    seq = per_dev * ctx
    rows.append((sec, "KV/sequence", f"{_n(per_dev)} B x {_n(ctx)} tokens", _b(seq)))
    if m.sliding_window is not None:
        capped = kv_cache_bytes_per_sequence(m, ctx, plan.kv_cache_dtype, tp, pp)
        rows.append((sec, "  window-capped", f"{m.num_sliding_layers} of {L} layers keep "
                     f"min({_n(ctx)}, window {_n(m.sliding_window)}) tokens", _b(capped)))
    if plan.window_pool_bytes:
        rows.append((sec, "  window pool", f"local layers: {plan.concurrency} sequences' "
                     "windows (prefix caching off); KV/token counts the global layers",
                     _b(plan.window_pool_bytes)))
    rows.append((sec, "KV/batch", f"{format_size(seq)} x {plan.concurrency} sequences",
                 _b(seq * plan.concurrency)))
    return rows


def _capacity_rows(m: PlannerModel, plan: CapacityPlan, reserve_given: bool) -> list[Row]:
    sec = "Capacity per device"
    if reserve_given:
        act = "--activation-reserve"
    else:
        act = (f"2,048 x (4 x {_n(m.hidden_size)} + 2 x {_n(ffn_width(m))} / {plan.tp}) x 2 B"
               f" + 256 x {_n(m.vocab_size)} x 4 B + 1 GiB (estimate)")
        assert plan.activation_bytes == estimate_activation_bytes(m, plan.tp)
    bs = plan.block_size
    rows = [
        (sec, "usable", f"{format_size(plan.gpu_memory)} x {plan.gpu_memory_utilization:g} "
         f"gpu_memory_utilization", _b(plan.usable_bytes)),
        (sec, "weights", f"{plan.weight_format}, tp {plan.tp} x pp {plan.pp}"
         + (" (device part, below)" if plan.num_device_layers is not None else ""),
         _b(plan.weight_bytes)),
        (sec, "activations", act, _b(plan.activation_bytes)),
        (sec, "KV budget", f"{format_size(plan.usable_bytes)} - {format_size(plan.weight_bytes)}"
         f" - {format_size(plan.activation_bytes)}",
         _b(plan.kv_budget_bytes) if plan.kv_budget_bytes >= 0
         else f"-{format_size(-plan.kv_budget_bytes)}"),
        (sec, "KV blocks", (f"floor(({_n(max(plan.kv_budget_bytes, 0))} B - "
                            f"{_n(plan.window_pool_bytes)} B window pool)"
                            if plan.window_pool_bytes else
                            f"floor({_n(max(plan.kv_budget_bytes, 0))} B")
         + f" / ({bs} tokens x "
         f"{_n(plan.kv_bytes_per_token)} B))", _n(plan.num_blocks)),
        (sec, "tokens", f"({_n(plan.num_blocks)} - 1 null block) x {bs}", _n(plan.num_tokens)),
        (sec, "sequences", f"floor({_n(plan.usable_blocks)} / ceil({_n(plan.max_model_len)} / "
         f"{bs})) at {_n(plan.max_model_len)} tokens" if plan.max_blocks_per_sequence is None
         else f"floor({_n(plan.usable_blocks)} / {_n(plan.blocks_per_sequence)} blocks, the "
         f"per-sequence cap) at {_n(plan.max_model_len)} tokens", _n(plan.max_num_seqs)),
        (sec, "longest context", f"all {_n(plan.usable_blocks)} blocks to one sequence (model "
         f"max {_n(m.max_position_embeddings)})", _n(plan.max_single_context)),
    ]
    if plan.num_device_layers is not None:  # --cpu-offload-gb / --num-device-layers
        rows += [
            (sec, "device layers", f"{plan.num_device_layers} of {m.num_hidden_layers} "
             f"decoder layers (their KV) on the device, {plan.offloaded_layers} of them "
             f"offloaded", _n(plan.num_device_layers)),
            (sec, "host weights", "CPU layers, offloaded layers (and embeddings / LM head "
             "under a split)", _b(plan.host_weight_bytes)),
            (sec, "host KV", "the CPU layers' KV for the same blocks", _b(plan.host_kv_bytes)),
            (sec, "streamed", "host -> device weight bytes per forward pass",
             _b(plan.offload_bytes_per_forward)),
        ]
    sec = "Deployment"
    group = plan.tp * plan.pp
    rows += [
        (sec, "layout", f"tp {plan.tp} x pp {plan.pp}", f"{group} GPU{'s' * (group > 1)}"),
        (sec, "replicas", f"{plan.num_gpus} GPU{'s' * (plan.num_gpus > 1)} // {group}",
         _n(plan.replicas)),
        (sec, "concurrency", f"{plan.replicas} x {_n(plan.max_num_seqs)} sequences of "
         f"{_n(plan.max_model_len)} tokens", _n(plan.total_max_num_seqs)),
        (sec, "verdict", f"{plan.concurrency} x {_n(plan.max_model_len)} tokens per replica",
         "fits" if plan.fits else "DOES NOT FIT"),
    ]
    return rows


def build_report(resolved: ResolvedModel, plan: CapacityPlan, fmt: WeightFormat,
                 reserve_given: bool = False) -> dict[str, Any]:
    """The plan as a JSON-ready dict: model facts, parameters, weights, KV, capacity, rows."""
    m = resolved.model
    p = count_parameters(m)
    per_seq = plan.kv_bytes_per_token * plan.max_model_len
    from_file = plan.weight_format == "gguf file" and resolved.file_weight_bytes is not None
    total_weights = resolved.file_weight_bytes if from_file else weight_bytes(m, fmt).total
    bits = 8 * total_weights / p.total if from_file else fmt.bits_per_weight
    rows = (_model_rows(m) + _weight_rows(resolved, fmt, plan) + _kv_rows(m, plan)
            + _capacity_rows(m, plan, reserve_given))
    return {
        "model": {"name": m.name, "source": resolved.source, "kind": resolved.kind,
                  "architecture": m.architecture, "attention": m.attention_kind,
                  "num_hidden_layers": m.num_hidden_layers, "hidden_size": m.hidden_size,
                  "num_attention_heads": m.num_attention_heads,
                  "num_key_value_heads": m.num_key_value_heads, "head_dim": m.head_dim,
                  "vocab_size": m.vocab_size,
                  "max_position_embeddings": m.max_position_embeddings,
                  "sliding_window": m.sliding_window, "num_experts": m.num_experts,
                  "kv_lora_rank": m.kv_lora_rank},
        "parameters": {**p.by_component, "total": p.total, "active": p.active},
        "weights": {"format": plan.weight_format, "bits_per_weight": bits,
                    "total_bytes": total_weights, "per_device_bytes": plan.weight_bytes},
        "kv_cache": {"dtype": plan.kv_cache_dtype,
                     "bytes_per_element": kv_dtype_bytes(plan.kv_cache_dtype, m.torch_dtype),
                     "bytes_per_token_per_layer": kv_bytes_per_token_per_layer(
                         m, plan.kv_cache_dtype, plan.tp),
                     "bytes_per_token": kv_cache_bytes_per_token(m, plan.kv_cache_dtype),
                     "bytes_per_token_per_device": plan.kv_bytes_per_token,
                     "bytes_per_sequence_per_device": per_seq,
                     "bytes_per_sequence_window_capped": kv_cache_bytes_per_sequence(
                         m, plan.max_model_len, plan.kv_cache_dtype, plan.tp, plan.pp),
                     "bytes_per_batch_per_device": per_seq * plan.concurrency},
        "capacity": plan.as_dict(),
        "rows": [dict(zip(("section", "label", "formula", "value"), r, strict=True))
                 for r in rows],
    }


def render_table(report: dict[str, Any]) -> str:
    """Text table: a header, then ``label  formula  = value`` rows grouped by section."""
    m = report["model"]
    head = (f"llmserve plan: {m['name']} ({m['kind']}: {m['source']})\n"
            f"  {m['architecture']}: {m['num_hidden_layers']} layers, hidden {m['hidden_size']:,},"
            f" {m['num_attention_heads']} heads, {m['num_key_value_heads']} kv_heads "
            f"({m['attention']}), head_dim {m['head_dim']}, vocab {m['vocab_size']:,}")
    rows = report["rows"]
    lw = max(len(r["label"]) for r in rows)
    fw = max(len(r["formula"]) for r in rows)
    lines, section = [head], None
    for r in rows:
        if r["section"] != section:
            section = r["section"]
            lines.append(f"\n{section}")
        value = f"= {r['value']}" if r["value"] else ""
        lines.append(f"  {r['label']:<{lw}}  {r['formula']:<{fw}}  {value}".rstrip())
    return "\n".join(lines) + "\n"
