"""The model's architecture, parsed from a Hugging Face ``config.json`` or a GGUF
header (pure Python, no torch): :class:`ModelConfig`. Re-exported by
:mod:`llmserve.config` with the engine's other configuration dataclasses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SUPPORTED_DTYPES = ("auto", "float32", "bfloat16", "float16")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass(frozen=True)
class ModelConfig:
    """Architecture hyper-parameters of a decoder-only model (Hugging Face names).

    ``head_dim`` defaults to ``hidden_size // num_attention_heads``.
    ``eos_token_ids`` gathers every id that ends generation (config and
    ``generation_config.json``).

    Per-layer attention (Gemma 3, Qwen2/Qwen3 ``max_window_layers``):
    ``layer_types`` holds ``"sliding_attention"`` or ``"full_attention"`` per layer
    (None: every layer uses ``sliding_window``); :meth:`layer_sliding_window` gives
    a layer's window. ``rope_local_theta`` / ``rope_local_scaling``: the RoPE of the
    sliding layers when it differs (Gemma 3 ``rope_local_base_freq``).
    ``partial_rotary_factor``: the rotated fraction of a head. ``query_pre_attn_scalar``:
    attention scale ``query_pre_attn_scalar ** -0.5`` instead of ``head_dim ** -0.5``.
    ``final_logit_softcapping``: ``cap * tanh(logits / cap)``.

    Mixture of experts (``num_experts > 0``; Mixtral's ``num_local_experts``): each
    token runs ``num_experts_per_tok`` of ``num_experts`` experts of width
    ``moe_intermediate_size`` (0: ``intermediate_size``), plus a gated shared expert
    of width ``shared_expert_intermediate_size`` when that is > 0 (Qwen2-MoE).
    ``norm_topk_prob`` renormalizes the top-k weights (always on for Mixtral). Layer
    ``i`` is sparse unless ``i in mlp_only_layers`` or ``(i + 1) % decoder_sparse_step``
    (Qwen-MoE; :meth:`is_moe_layer`); dense layers use ``intermediate_size``.
    ``max_model_len``: the context the engine serves (``EngineArgs`` sets it); it sizes
    the RoPE table and picks "longrope"'s factor set (None: :attr:`max_context_len`).
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int = 0
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    sliding_window: int | None = None
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    model_type: str = "llama"
    layer_types: tuple[str, ...] | None = None
    partial_rotary_factor: float = 1.0
    rope_local_theta: float | None = None
    rope_local_scaling: dict[str, Any] | None = None
    query_pre_attn_scalar: float | None = None
    final_logit_softcapping: float | None = None
    # mixture of experts (see the class docstring)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    max_model_len: int | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"ModelConfig.{name} must be positive, got {getattr(self, name)!r}")
        if self.head_dim == 0:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError("ModelConfig: hidden_size must be divisible by num_attention_heads")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"ModelConfig: num_attention_heads ({self.num_attention_heads}) must be a multiple "
                f"of num_key_value_heads ({self.num_key_value_heads})")
        if self.sliding_window is not None and self.sliding_window <= 0:
            object.__setattr__(self, "sliding_window", None)
        object.__setattr__(self, "eos_token_ids", tuple(int(t) for t in self.eos_token_ids))
        self._check_arch_fields()
        self._check_moe()

    def _check_arch_fields(self) -> None:
        if self.layer_types is not None:
            types = tuple(str(t) for t in self.layer_types)
            bad = sorted(set(types) - set(LAYER_TYPES))
            if bad or len(types) != self.num_hidden_layers:
                raise ValueError(f"ModelConfig.layer_types must list one of {list(LAYER_TYPES)} "
                                 f"per layer ({self.num_hidden_layers}), got {list(types)}")
            object.__setattr__(self, "layer_types", types)
        rotary_dim = int(self.head_dim * self.partial_rotary_factor)
        if not 0 < self.partial_rotary_factor <= 1 or rotary_dim % 2 or rotary_dim < 2:
            raise ValueError(f"ModelConfig.partial_rotary_factor must be in (0, 1] and give an "
                             f"even rotary width, got {self.partial_rotary_factor!r} "
                             f"(head_dim {self.head_dim})")
        for name in ("query_pre_attn_scalar", "final_logit_softcapping"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"ModelConfig.{name} must be positive, got {value!r}")

    def _check_moe(self) -> None:
        object.__setattr__(self, "mlp_only_layers", tuple(int(i) for i in self.mlp_only_layers))
        if not self.num_experts:
            return
        if self.num_experts < 0 or not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"ModelConfig: num_experts_per_tok must be in 1..num_experts "
                             f"({self.num_experts}), got {self.num_experts_per_tok}")
        if self.decoder_sparse_step < 1:
            raise ValueError(f"ModelConfig.decoder_sparse_step must be >= 1, "
                             f"got {self.decoder_sparse_step}")
        if self.moe_intermediate_size < 0 or self.shared_expert_intermediate_size < 0:
            raise ValueError("ModelConfig: expert sizes must be >= 0")
        if not self.moe_intermediate_size:
            object.__setattr__(self, "moe_intermediate_size", self.intermediate_size)

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` (0-based) has routed experts (Qwen-MoE's rule;
        every layer for Mixtral)."""
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    @property
    def rotary_dim(self) -> int:
        """The rotated width of a head: ``int(head_dim * partial_rotary_factor)``."""
        return int(self.head_dim * self.partial_rotary_factor)

    def layer_sliding_window(self, layer_idx: int) -> int | None:
        """The sliding window of layer ``layer_idx`` (None: full attention)."""
        if self.layer_types is None or self.layer_types[layer_idx] == "sliding_attention":
            return self.sliding_window
        return None

    @property
    def rope_max_position(self) -> int:
        """Rows of the RoPE table: ``max_model_len``, else :attr:`max_context_len`."""
        return self.max_model_len or self.max_context_len

    @property
    def max_context_len(self) -> int:
        """The longest context the model serves: ``max_position_embeddings``, extended by
        "linear", "dynamic" and "yarn" RoPE scaling (vLLM's derived ``max_model_len``)."""
        rs = self.rope_scaling or {}
        rope_type = rs.get("rope_type", rs.get("type", "default"))
        if rope_type not in ("linear", "dynamic", "yarn") or rs.get("factor") is None:
            return self.max_position_embeddings  # "llama3"/"longrope" state the long length
        base_len = self.max_position_embeddings
        if rope_type == "yarn":
            base_len = int(rs.get("original_max_position_embeddings") or base_len)
        return max(self.max_position_embeddings, int(base_len * float(rs["factor"])))

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], extra_eos: list[int] | tuple[int, ...] = ()) -> ModelConfig:
        """Build from a Hugging Face ``config.json`` dict.

        Raises:
            ValueError: when a required field is missing.
        """
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else cfg.get("model_type", "unknown")
        eos = cfg.get("eos_token_id")
        eos_list = list(eos) if isinstance(eos, (list, tuple)) else ([eos] if eos is not None else [])
        for e in extra_eos:
            if e not in eos_list:
                eos_list.append(e)
        try:
            num_heads = cfg["num_attention_heads"]
            return cls(
                architecture=arch,
                model_type=cfg.get("model_type", "llama"),
                vocab_size=cfg["vocab_size"],
                hidden_size=cfg["hidden_size"],
                intermediate_size=cfg["intermediate_size"],
                num_hidden_layers=cfg["num_hidden_layers"],
                num_attention_heads=num_heads,
                num_key_value_heads=cfg.get("num_key_value_heads") or num_heads,
                head_dim=cfg.get("head_dim") or 0,
                rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
                max_position_embeddings=cfg.get("max_position_embeddings", 2048),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                attention_bias=bool(cfg.get("attention_bias", False)
                                    or cfg.get("model_type") == "qwen2"
                                    or (cfg.get("model_type") == "qwen2_moe"
                                        and cfg.get("qkv_bias", True))),
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=tuple(eos_list),
                **_hf_rope_fields(cfg),
                **_hf_attention_fields(cfg),
                **_moe_fields(cfg),
            )
        except KeyError as e:
            raise ValueError(f"model config is missing the field {e.args[0]!r}") from None


def _moe_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """The MoE fields of a HF config (Mixtral: ``num_local_experts``; Qwen: ``num_experts``)."""
    num_experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0)
    if not num_experts:
        return {}
    return dict(
        num_experts=num_experts,
        num_experts_per_tok=int(cfg.get("num_experts_per_tok") or 0),
        moe_intermediate_size=int(cfg.get("moe_intermediate_size") or 0),
        shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0),
        norm_topk_prob=cfg.get("model_type") == "mixtral" or bool(cfg.get("norm_topk_prob")),
        decoder_sparse_step=int(cfg.get("decoder_sparse_step") or 1),
        mlp_only_layers=tuple(cfg.get("mlp_only_layers") or ()),
    )


_QWEN_TYPES = ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe")
_GEMMA3_TYPES = ("gemma3", "gemma3_text")
_ORIGINAL_LEN_TYPES = ("llama3", "yarn", "longrope")


def _rope_scaling_dict(params: dict[str, Any] | None, cfg: dict[str, Any]) -> dict[str, Any] | None:
    """A non-default rope dict with ``original_max_position_embeddings`` filled in as
    ``transformers`` standardizes it (a top-level field wins, e.g. Phi-3's)."""
    if not params:
        return None
    rs = dict(params)
    rope_type = rs.get("rope_type", rs.get("type", "default"))
    if cfg.get("model_type") == "phi3" and rope_type in ("su", "yarn"):
        rope_type = "longrope"  # Phi3Config's legacy names
    if rope_type == "default":
        return None
    rs["rope_type"] = rope_type
    if rope_type in _ORIGINAL_LEN_TYPES:
        if cfg.get("original_max_position_embeddings") is not None:
            rs["original_max_position_embeddings"] = cfg["original_max_position_embeddings"]
        rs.setdefault("original_max_position_embeddings", cfg.get("max_position_embeddings", 2048))
    return rs


def _hf_rope_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """RoPE fields from a ``config.json``: legacy ``rope_theta`` / ``rope_scaling``, the
    flat ``rope_parameters`` of transformers >= 5, or its per-layer-type nesting (Gemma 3
    ``{"full_attention": {...}, "sliding_attention": {...}}``)."""
    rp = cfg.get("rope_parameters") or {}
    gemma3 = cfg.get("model_type") in _GEMMA3_TYPES
    nested = isinstance(rp.get("full_attention"), dict) or isinstance(
        rp.get("sliding_attention"), dict)
    local: dict[str, Any] | None = None
    if nested:
        glob = dict(rp.get("full_attention") or {})
        local = dict(rp.get("sliding_attention") or {})
    else:
        glob = dict(cfg.get("rope_scaling") or rp)
        if gemma3:  # legacy Gemma 3: rope_local_base_freq, no scaling on sliding layers
            local = {"rope_theta": cfg.get("rope_local_base_freq", 10000.0)}
    default_theta = 1_000_000.0 if gemma3 else 10000.0
    theta = glob.get("rope_theta", cfg.get("rope_theta", rp.get("rope_theta", default_theta)))
    prf = cfg.get("partial_rotary_factor") or glob.get("partial_rotary_factor") or 1.0
    fields: dict[str, Any] = {"rope_theta": float(theta), "partial_rotary_factor": float(prf),
                              "rope_scaling": _rope_scaling_dict(glob, cfg)}
    if local is not None:
        fields["rope_local_theta"] = float(local.get("rope_theta", 10000.0))
        fields["rope_local_scaling"] = _rope_scaling_dict(local, cfg)
    return fields


def _hf_attention_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """Sliding windows per layer, activation, attention scale and logit soft-capping.

    Layer types as ``transformers`` derives them when ``layer_types`` is absent: Qwen2/3
    slide on layers ``i >= max_window_layers`` (only with ``use_sliding_window``), Qwen2-MoE
    on the even layers ``i < max_window_layers``, Gemma 3 on all but every
    ``sliding_window_pattern``-th layer; Mistral, Mixtral and Qwen3-MoE slide everywhere.

    Raises:
        ValueError: Gemma 3 ``use_bidirectional_attention`` (not supported).
    """
    model_type = cfg.get("model_type")
    n = int(cfg["num_hidden_layers"])
    sw = cfg.get("sliding_window")
    if cfg.get("use_sliding_window") is False or \
            (model_type in _QWEN_TYPES and not cfg.get("use_sliding_window", False)):
        sw = None
    layer_types = None if model_type == "mistral" else cfg.get("layer_types")
    if layer_types is None and sw is not None:
        if model_type == "qwen2_moe":  # Qwen2MoeConfig: even layers below max_window_layers
            below = int(cfg.get("max_window_layers", 28))
            layer_types = ["sliding_attention" if (i + 1) % 2 and i < below else
                           "full_attention" for i in range(n)]
        elif model_type in _QWEN_TYPES and model_type != "qwen3_moe" and \
                cfg.get("max_window_layers") is not None:
            layer_types = ["sliding_attention" if i >= cfg["max_window_layers"] else
                           "full_attention" for i in range(n)]
        elif model_type in _GEMMA3_TYPES:
            pattern = int(cfg.get("sliding_window_pattern") or
                          cfg.get("_sliding_window_pattern") or 6)
            layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                           for i in range(n)]
    if layer_types is not None:
        layer_types = tuple(layer_types)
        if sw is None or all(t == "full_attention" for t in layer_types):
            sw, layer_types = None, None
        elif all(t == "sliding_attention" for t in layer_types):
            layer_types = None
    if model_type in _GEMMA3_TYPES and cfg.get("use_bidirectional_attention"):
        raise ValueError("Gemma 3 use_bidirectional_attention is not supported (causal only)")
    scalar = cfg.get("query_pre_attn_scalar")
    if scalar is None and model_type in _GEMMA3_TYPES:
        scalar = 256
    return {
        "sliding_window": sw,
        "layer_types": layer_types,
        "hidden_act": cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu",
        "query_pre_attn_scalar": None if scalar is None else float(scalar),
        "final_logit_softcapping": cfg.get("final_logit_softcapping"),
    }
