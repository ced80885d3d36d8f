"""The memory ledger: parameters, weight bytes and KV cache bytes of a model (pure Python).

Everything here is arithmetic on a :class:`~llmserve.planner.model.PlannerModel`;
nothing imports torch. The engine sizes its paged KV cache with
:func:`kv_cache_bytes_per_token` and :func:`num_kv_cache_blocks`, so the
planner and the running engine cannot disagree.

KV cache per token and layer (``b`` = bytes per element)::

    MHA / GQA / MQA   2 (K and V) x kv_heads x head_dim x b
    MLA               (kv_lora_rank + qk_rope_head_dim) x b     one latent, all heads

Sources: vLLM (``vllm/v1/kv_cache_interface.py``: ``page_size_bytes`` and
``MLAAttentionSpec``), DeepSeek-V2 paper (arXiv:2405.04434, section 2.1: MLA
caches ``(d_c + d_h^R) * l`` elements per token).

Parallelism (vLLM's rules):

- tensor parallel ``tp``: each device holds ``max(1, kv_heads // tp)`` KV heads
  (when ``tp > kv_heads`` a head is replicated on ``tp // kv_heads`` devices);
  needs ``kv_heads % tp == 0`` or ``tp % kv_heads == 0``. MLA's latent is not
  split: every device holds all of it.
- pipeline parallel ``pp``: layers split into contiguous stages
  (:func:`pp_partition`); the largest stage sizes every device.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from llmserve.planner.formats import (
    GGUF_BLOCK_SIZES,
    WeightFormat,
    kv_dtype_bytes,
    kv_row_scale_bytes,
)
from llmserve.planner.model import PlannerModel, as_planner_model
from llmserve.utils import format_size

if TYPE_CHECKING:
    from llmserve.config import ModelConfig

#: parameter components, in report order
COMPONENTS = ("embeddings", "attention", "mlp", "moe_experts", "moe_shared_experts",
              "moe_router", "norms", "lm_head")
_EMBEDDING_COMPONENTS = ("embeddings", "lm_head")
_SMALL_COMPONENTS = ("norms", "moe_router")  # kept in the checkpoint dtype


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ---- parallel layout -------------------------------------------------------

def check_parallel(model: PlannerModel, tp: int = 1, pp: int = 1) -> None:
    """Validate a tp x pp layout for ``model`` (vLLM's constraints).

    Raises:
        ValueError: when tp or pp is not a positive integer, ``pp`` exceeds the
            layer count, ``num_attention_heads % tp != 0``, or (non-MLA) neither
            ``kv_heads % tp == 0`` nor ``tp % kv_heads == 0``.
    """
    for name, value in (("tp", tp), ("pp", pp)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if pp > model.num_hidden_layers:
        raise ValueError(f"pp={pp} exceeds the {model.num_hidden_layers} layers of {model.name}")
    if model.num_attention_heads % tp:
        raise ValueError(f"tp={tp} does not divide the {model.num_attention_heads} attention "
                         f"heads of {model.name}")
    kv = model.num_key_value_heads
    if not model.is_mla and kv % tp and tp % kv:
        raise ValueError(f"tp={tp} must divide or be a multiple of the {kv} KV heads of "
                         f"{model.name}")


def kv_heads_per_device(model: PlannerModel, tp: int = 1) -> int:
    """KV heads one device holds: ``max(1, kv_heads // tp)`` (replicated past kv_heads)."""
    return max(1, model.num_key_value_heads // tp)


def pp_partition(num_layers: int, pp: int) -> list[int]:
    """Layers per pipeline stage, as vLLM's ``get_pp_indices`` splits them.

    Each stage gets ``num_layers // pp``; the remainder goes one layer each to
    the stages before the last one (the last stage also holds the lm_head).
    The largest stage has ``ceil(num_layers / pp)`` layers. Example: 61 layers,
    pp=4 -> ``[15, 15, 16, 15]``.
    """
    parts = [num_layers // pp] * pp
    for i in range(2, num_layers % pp + 2):
        parts[-i] += 1
    return parts


def _stage_ranges(num_layers: int, pp: int) -> list[range]:
    ranges, start = [], 0
    for n in pp_partition(num_layers, pp):
        ranges.append(range(start, start + n))
        start += n
    return ranges


# ---- parameters --------------------------------------------------------------

@dataclass(frozen=True)
class ParamCounts:
    """Parameter counts by component (on one device when built for tp/pp > 1).

    ``active`` is what one token touches: everything except the embedding
    table (a lookup) and the routed experts it is not sent to.
    """

    by_component: dict[str, int] = field(default_factory=dict)
    active: int = 0

    @property
    def total(self) -> int:
        """Sum over components."""
        return sum(self.by_component.values())

    def __getitem__(self, component: str) -> int:
        return self.by_component.get(component, 0)


def _attention_params(m: PlannerModel, tp: int) -> int:
    """Attention parameters of one layer on one device (q, k, v, o and MLA norms)."""
    h, heads = m.hidden_size, m.num_attention_heads
    if m.is_mla:
        qk_dim = m.qk_nope_head_dim + m.qk_rope_head_dim
        replicated = h * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank  # kv_a + norm
        if m.q_lora_rank:
            replicated += h * m.q_lora_rank + m.q_lora_rank  # q_a + norm
            q = m.q_lora_rank * heads * qk_dim
        else:
            q = h * heads * qk_dim
        sharded = (q + m.kv_lora_rank * heads * (m.qk_nope_head_dim + m.v_head_dim)  # kv_b
                   + heads * m.v_head_dim * h)  # o_proj
        return replicated + sharded // tp
    q_dim = heads * m.head_dim
    kv_dim = kv_heads_per_device(m, tp) * m.head_dim
    bias = (q_dim // tp + 2 * kv_dim) if m.attention_bias else 0
    return 2 * h * q_dim // tp + 2 * h * kv_dim + bias


def _layer_params(m: PlannerModel, layer: int, tp: int) -> dict[str, int]:
    h = m.hidden_size
    out = {"attention": _attention_params(m, tp), "norms": 2 * h}
    if m.is_moe_layer(layer):
        out["moe_experts"] = m.num_experts * 3 * h * m.moe_intermediate_size // tp
        shared = m.shared_expert_intermediate_size or m.moe_intermediate_size
        out["moe_shared_experts"] = m.num_shared_experts * 3 * h * shared // tp
        out["moe_router"] = h * m.num_experts
    else:
        out["mlp"] = 3 * h * m.intermediate_size // tp  # gate, up, down (SwiGLU)
    return out


def _stage_params(m: PlannerModel, stage: int, pp: int, tp: int) -> dict[str, int]:
    counts = dict.fromkeys(COMPONENTS, 0)
    for layer in _stage_ranges(m.num_hidden_layers, pp)[stage]:
        for key, value in _layer_params(m, layer, tp).items():
            counts[key] += value
    vocab_shard = _cdiv(m.vocab_size, tp) * m.hidden_size
    if stage == 0:
        counts["embeddings"] = vocab_shard
    if stage == pp - 1:
        counts["norms"] += m.hidden_size  # final norm
        # a tied lm_head reuses the embedding, except on a separate last stage
        if not m.tie_word_embeddings or pp > 1:
            counts["lm_head"] = vocab_shard
    return counts


def count_parameters(model: ModelConfig | PlannerModel) -> ParamCounts:
    """Parameters of the whole model by component (tied embeddings counted once).

    Per layer: attention ``h*(H + 2*KV)*d + H*d*h`` (+ q/k/v biases), or for
    MLA the q_a/q_b, kv_a/kv_b, o projections and their norms; a dense MLP
    ``3*h*I``; an MoE layer ``E*3*h*I_moe`` routed + ``S*3*h*I_shared`` shared
    + ``h*E`` router; two RMSNorms ``2*h``. Plus embeddings ``V*h``, final norm
    ``h`` and an untied lm_head ``V*h``. Rotary tables and DeepSeek's
    multi-token-prediction layers (``num_nextn_predict_layers``) are not
    counted; those are not served.
    """
    m = as_planner_model(model)
    counts = _stage_params(m, 0, 1, 1)
    inactive = 0
    if m.is_moe and m.num_experts_per_tok:
        per_expert = 3 * m.hidden_size * m.moe_intermediate_size
        moe_layers = sum(m.is_moe_layer(i) for i in range(m.num_hidden_layers))
        inactive = moe_layers * (m.num_experts - m.num_experts_per_tok) * per_expert
    active = sum(counts.values()) - counts["embeddings"] - inactive
    if m.tie_word_embeddings:
        active += counts["embeddings"]  # the tied matrix is read as the lm_head
    return ParamCounts(counts, active)


# ---- weight bytes --------------------------------------------------------------

@dataclass(frozen=True)
class WeightBytes:
    """Weight bytes by component, for the whole model or one device."""

    format: WeightFormat
    by_component: dict[str, int]
    params: dict[str, int]
    stage: int = 0

    @property
    def total(self) -> int:
        """Sum over components, in bytes."""
        return sum(self.by_component.values())


def _component_bytes(fmt: WeightFormat, component: str, params: int) -> int:
    if component in _SMALL_COMPONENTS:
        bits = 32 if fmt.name == "fp32" or fmt.name in GGUF_BLOCK_SIZES else 16
        return params * bits // 8
    return fmt.bytes_for(params, embedding=component in _EMBEDDING_COMPONENTS)


def weight_bytes(model: ModelConfig | PlannerModel, fmt: WeightFormat,
                 tp: int = 1, pp: int = 1) -> WeightBytes:
    """Bytes of weights on the device of the largest pipeline stage.

    With ``tp = pp = 1`` this is the whole model. Linear layers are split
    over ``tp`` (column/row parallel, expert weights included); norms, the MoE
    router, MLA's down-projections and replicated KV heads are not. The first
    stage holds the embedding, the last the lm_head. Embeddings and lm_head
    use ``fmt.embedding_bits``, norms and router 16 bits (32 for fp32 and GGUF).

    Raises:
        ValueError: for an invalid tp x pp layout (:func:`check_parallel`).
    """
    m = as_planner_model(model)
    check_parallel(m, tp, pp)
    best: WeightBytes | None = None
    for stage in range(pp):
        params = _stage_params(m, stage, pp, tp)
        by_component = {c: _component_bytes(fmt, c, n) for c, n in params.items()}
        wb = WeightBytes(fmt, by_component, params, stage)
        if best is None or wb.total > best.total:
            best = wb
    assert best is not None
    return best


# ---- KV cache --------------------------------------------------------------------

def kv_bytes_per_token_per_layer(model: ModelConfig | PlannerModel,
                                 kv_cache_dtype: str = "bfloat16", tp: int = 1,
                                 kv_key_quant: str = "per-token",
                                 block_size: int = 16) -> int:
    """K+V bytes of one token in one layer on one device.

    ``2 * max(1, kv_heads // tp) * (head_dim * b + scale)`` (``scale``: 2 bytes for
    llmserve's ``int8`` / ``fp8_e4m3`` pages, else 0); MLA: ``(kv_lora_rank +
    qk_rope_head_dim) * b`` whatever ``tp``. ``kv_key_quant="per-channel"`` (int8):
    a block's keys carry ``2 * head_dim`` scale bytes per KV head instead of 2 per token,
    amortized over ``block_size`` tokens and rounded up:
    ``kv_heads * (ceil(((bs + 2) * head_dim) / bs) + head_dim + 2)``.

    Raises:
        ValueError: for an unknown dtype or an invalid ``tp``.
    """
    m = as_planner_model(model)
    check_parallel(m, tp, 1)
    b = kv_dtype_bytes(kv_cache_dtype, m.torch_dtype)
    if m.is_mla:
        return (m.kv_lora_rank + m.qk_rope_head_dim) * b
    if kv_key_quant == "per-channel":  # layers/attention/kv_quant_pc.py
        key = -(-(block_size + 2) * m.head_dim // block_size)
        return kv_heads_per_device(m, tp) * (key + m.head_dim + 2)
    # int8 / fp8_e4m3 pages: + one fp16 scale per token and KV head (formats.py)
    return 2 * kv_heads_per_device(m, tp) * (m.head_dim * b + kv_row_scale_bytes(kv_cache_dtype))


def kv_cache_bytes_per_token(model: ModelConfig | PlannerModel,
                             kv_cache_dtype: str = "bfloat16", tp: int = 1, pp: int = 1,
                             kv_key_quant: str = "per-token", block_size: int = 16) -> int:
    """Bytes of K+V for one token on one device: what each paged-cache slot costs.

    ``2 x layers x kv_heads x head_dim x b`` (MHA/GQA/MQA) or
    ``(kv_lora_rank + qk_rope_head_dim) x layers x b`` (MLA), where ``kv_heads``
    is ``max(1, kv_heads // tp)`` and ``layers`` the largest pipeline stage
    (``ceil(layers / pp)``). Every layer counts, sliding-window ones included,
    because a block of the paged cache holds its tokens for all layers; the
    window cap is in :func:`kv_cache_bytes_per_sequence`.

    ``kv_cache_dtype``: ``"float32"``, ``"bfloat16"``, ``"float16"``, ``"fp8"``, ...;
    ``"auto"`` means the model's ``torch_dtype`` (bfloat16 for a ``ModelConfig``,
    which carries no dtype), so the engine passes its resolved dtype.
    ``kv_key_quant``, ``block_size``: see :func:`kv_bytes_per_token_per_layer`.

    Examples: Llama-3.1-70B, bf16: ``2 x 80 x 8 x 128 x 2 = 327,680`` B;
    DeepSeek-V3, bf16: ``(512 + 64) x 61 x 2 = 70,272`` B.

    Raises:
        ValueError: for an unknown ``kv_cache_dtype`` or an invalid tp/pp.
    """
    m = as_planner_model(model)
    check_parallel(m, tp, pp)
    return max(pp_partition(m.num_hidden_layers, pp)) * kv_bytes_per_token_per_layer(
        m, kv_cache_dtype, tp, kv_key_quant, block_size)


def kv_cache_bytes_per_sequence(model: ModelConfig | PlannerModel, num_tokens: int,
                                kv_cache_dtype: str = "bfloat16", tp: int = 1,
                                pp: int = 1) -> int:
    """Bytes of K+V one sequence of ``num_tokens`` needs on the busiest device.

    ``sum over layers of per_layer x min(num_tokens, window)`` (``window`` =
    infinity for full-attention layers), taken over each pipeline stage, the
    largest stage reported. Token-exact: block rounding is not included.

    Raises:
        ValueError: for ``num_tokens < 0``, an unknown dtype or invalid tp/pp.
    """
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    m = as_planner_model(model)
    check_parallel(m, tp, pp)
    per_layer = kv_bytes_per_token_per_layer(m, kv_cache_dtype, tp)
    best = 0
    for stage in _stage_ranges(m.num_hidden_layers, pp):
        tokens = 0
        for layer in stage:
            window = m.layer_window(layer)
            tokens += num_tokens if window is None else min(num_tokens, window)
        best = max(best, tokens * per_layer)
    return best


def kv_cache_bytes_per_batch(model: ModelConfig | PlannerModel, num_tokens: int,
                             batch_size: int, kv_cache_dtype: str = "bfloat16", tp: int = 1,
                             pp: int = 1) -> int:
    """``batch_size`` sequences of ``num_tokens`` each: ``batch_size x per_sequence``.

    Raises:
        ValueError: for a negative ``batch_size`` (and as :func:`kv_cache_bytes_per_sequence`).
    """
    if batch_size < 0:
        raise ValueError(f"batch_size must be >= 0, got {batch_size}")
    return batch_size * kv_cache_bytes_per_sequence(model, num_tokens, kv_cache_dtype, tp, pp)


def num_kv_cache_blocks(memory_bytes: int, block_size: int, bytes_per_token: int) -> int:
    """Paged KV cache blocks that fit: ``floor(memory / (block_size x bytes_per_token))``.

    Raises:
        ValueError: when ``block_size`` or ``bytes_per_token`` is not positive,
            or ``memory_bytes`` is below one block (the message says how much
            one block needs).
    """
    if block_size <= 0 or bytes_per_token <= 0:
        raise ValueError(f"block_size ({block_size}) and bytes_per_token ({bytes_per_token}) "
                         f"must be positive")
    one_block = block_size * bytes_per_token
    if memory_bytes < one_block:
        raise ValueError(
            f"KV cache memory of {memory_bytes:,} B ({format_size(max(memory_bytes, 0))}) is "
            f"less than one block: {block_size} tokens x {bytes_per_token:,} B/token = "
            f"{one_block:,} B ({format_size(one_block)}); give the KV cache more memory or "
            f"use a smaller block_size")
    return memory_bytes // one_block
