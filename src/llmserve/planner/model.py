"""`PlannerModel`: the architecture numbers the memory ledger needs (pure Python).

:class:`llmserve.config.ModelConfig` describes what the engine runs (dense
Llama-family models). The planner also has to describe models the engine
cannot run yet, so it keeps its own, wider description: mixture of experts
(Mixtral, DeepSeek, Qwen-MoE) and multi-head latent attention (DeepSeek-V2/V3).

Build one from a Hugging Face ``config.json`` dict (:meth:`PlannerModel.from_hf_config`),
from a :class:`~llmserve.config.ModelConfig` (:meth:`PlannerModel.from_model_config`)
or from GGUF metadata (:func:`llmserve.planner.sources.load_gguf`).
Field names follow Hugging Face ``transformers``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from llmserve.config import ModelConfig


@dataclass(frozen=True)
class PlannerModel:
    """Architecture hyper-parameters relevant to memory (Hugging Face names).

    Attention is one of three kinds:

    - MHA / GQA / MQA: ``num_key_value_heads`` K and V heads of ``head_dim``
      (MHA: equal to ``num_attention_heads``; MQA: 1).
    - MLA (DeepSeek-V2/V3, ``kv_lora_rank > 0``): one compressed latent of
      ``kv_lora_rank`` plus a decoupled RoPE key of ``qk_rope_head_dim`` per
      token and layer, shared by all heads.

    Mixture of experts (``num_experts > 0``): layer ``i`` is an MoE layer when
    ``i >= first_k_dense_replace and i % moe_layer_freq == 0`` (DeepSeek's
    rule; Mixtral and Qwen-MoE have every layer MoE). Each MoE layer has
    ``num_experts`` routed experts of width ``moe_intermediate_size``, a
    router, and ``num_shared_experts`` always-on experts of width
    ``shared_expert_intermediate_size`` (0 means ``moe_intermediate_size``).

    Sliding window: when ``sliding_window`` is set, the layers in
    ``sliding_window_layers`` (``None``: every layer) attend to at most
    ``sliding_window`` past tokens.

    ``torch_dtype`` is the checkpoint's dtype, used when a dtype is ``"auto"``;
    ``quantization`` is a weight-format hint from the checkpoint (``"fp8"``,
    ``"int4-g128"``, a GGUF type) or ``""``.
    """

    name: str
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int = 0
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    sliding_window: int | None = None
    sliding_window_layers: tuple[int, ...] | None = None
    # mixture of experts
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    num_shared_experts: int = 0
    shared_expert_intermediate_size: int = 0
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    # multi-head latent attention
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    torch_dtype: str = "bfloat16"
    quantization: str = ""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"model {self.name!r}: {name} must be a positive integer, "
                                 f"got {value!r}")
        for name in ("head_dim", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                     "num_shared_experts", "shared_expert_intermediate_size",
                     "first_k_dense_replace", "kv_lora_rank", "q_lora_rank",
                     "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"model {self.name!r}: {name} must be an integer >= 0, "
                                 f"got {value!r}")
        if self.moe_layer_freq < 1:
            raise ValueError(f"model {self.name!r}: moe_layer_freq must be >= 1")
        if self.head_dim == 0:
            if self.is_mla:
                object.__setattr__(self, "head_dim", self.qk_nope_head_dim + self.qk_rope_head_dim)
            else:
                if self.hidden_size % self.num_attention_heads:
                    raise ValueError(f"model {self.name!r}: hidden_size {self.hidden_size} is "
                                     f"not divisible by num_attention_heads "
                                     f"{self.num_attention_heads}; give head_dim")
                object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if not self.is_mla and self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"model {self.name!r}: num_attention_heads ({self.num_attention_heads}) must be "
                f"a multiple of num_key_value_heads ({self.num_key_value_heads})")
        if self.is_mla and not self.qk_rope_head_dim:
            raise ValueError(f"model {self.name!r}: MLA (kv_lora_rank > 0) needs qk_rope_head_dim")
        if self.num_experts and not self.moe_intermediate_size:
            object.__setattr__(self, "moe_intermediate_size", self.intermediate_size)
        if self.sliding_window is not None and self.sliding_window <= 0:
            object.__setattr__(self, "sliding_window", None)
        if self.sliding_window_layers is not None:
            object.__setattr__(self, "sliding_window_layers",
                               tuple(sorted(int(i) for i in self.sliding_window_layers)))

    # ---- derived facts -------------------------------------------------

    @property
    def is_mla(self) -> bool:
        """True for multi-head latent attention (DeepSeek-V2/V3)."""
        return self.kv_lora_rank > 0

    @property
    def is_moe(self) -> bool:
        """True when the model has routed experts."""
        return self.num_experts > 0

    @property
    def attention_kind(self) -> str:
        """``"MLA"``, ``"MHA"``, ``"MQA"`` or ``"GQA"``."""
        if self.is_mla:
            return "MLA"
        if self.num_key_value_heads == self.num_attention_heads:
            return "MHA"
        return "MQA" if self.num_key_value_heads == 1 else "GQA"

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` (0-based) has routed experts."""
        return (self.is_moe and layer >= self.first_k_dense_replace
                and layer % self.moe_layer_freq == 0)

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of decoder layer ``layer``, ``None`` for full attention."""
        if self.sliding_window is None:
            return None
        if self.sliding_window_layers is None or layer in self.sliding_window_layers:
            return self.sliding_window
        return None

    @property
    def num_sliding_layers(self) -> int:
        """How many decoder layers use the sliding window."""
        return sum(self.layer_window(i) is not None for i in range(self.num_hidden_layers))

    # ---- constructors --------------------------------------------------

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], name: str = "") -> PlannerModel:
        """Build from a Hugging Face ``config.json`` dict.

        Reads the dense fields, MoE fields (``num_local_experts`` /
        ``n_routed_experts`` / ``num_experts``, ``num_experts_per_tok``,
        ``n_shared_experts``, ``shared_expert_intermediate_size``,
        ``moe_intermediate_size``, ``first_k_dense_replace``, ``moe_layer_freq``),
        MLA fields (``kv_lora_rank``, ``q_lora_rank``, ``qk_rope_head_dim``,
        ``qk_nope_head_dim``, ``v_head_dim``) and the sliding-window layout
        (``layer_types``; Qwen2's ``use_sliding_window`` / ``max_window_layers``;
        Gemma's alternation). A nested ``text_config`` (multimodal models) is used
        when present.

        Raises:
            ValueError: when a required field is missing or a value is invalid.
        """
        if not isinstance(cfg, dict):
            raise ValueError(f"a model config must be a JSON object, got {type(cfg).__name__}")
        if isinstance(cfg.get("text_config"), dict):
            cfg = {**cfg, **cfg["text_config"]}
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else str(cfg.get("model_type", "unknown"))
        try:
            num_heads = int(cfg["num_attention_heads"])
            num_layers = int(cfg["num_hidden_layers"])
            kwargs: dict[str, Any] = dict(
                name=name or str(cfg.get("_name_or_path") or arch),
                architecture=arch,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=int(cfg["hidden_size"]),
                intermediate_size=int(cfg["intermediate_size"]),
                num_hidden_layers=num_layers,
                num_attention_heads=num_heads,
                num_key_value_heads=int(cfg.get("num_key_value_heads") or num_heads),
            )
        except KeyError as e:
            raise ValueError(f"model config is missing the field {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            raise ValueError(f"model config has a non-integer size field: {e}") from None
        num_experts = (cfg.get("num_local_experts") or cfg.get("n_routed_experts")
                       or cfg.get("num_experts") or 0)
        shared_width = int(cfg.get("shared_expert_intermediate_size") or 0)
        num_shared = int(cfg.get("n_shared_experts") or (1 if shared_width else 0))
        window, window_layers = _sliding_window_layout(cfg, num_layers)
        quant = cfg.get("quantization_config") or {}
        kwargs.update(
            head_dim=int(cfg.get("head_dim") or 0),
            max_position_embeddings=int(cfg.get("max_position_embeddings") or 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)
                                or cfg.get("model_type") in ("qwen2", "qwen2_moe")),
            sliding_window=window,
            sliding_window_layers=window_layers,
            num_experts=int(num_experts),
            num_experts_per_tok=int(cfg.get("num_experts_per_tok") or 0) if num_experts else 0,
            moe_intermediate_size=int(cfg.get("moe_intermediate_size") or 0) if num_experts else 0,
            num_shared_experts=num_shared if num_experts else 0,
            shared_expert_intermediate_size=shared_width if num_experts else 0,
            first_k_dense_replace=int(cfg.get("first_k_dense_replace") or 0),
            moe_layer_freq=int(cfg.get("moe_layer_freq") or 1),
            kv_lora_rank=int(cfg.get("kv_lora_rank") or 0),
            q_lora_rank=int(cfg.get("q_lora_rank") or 0),
            qk_rope_head_dim=int(cfg.get("qk_rope_head_dim") or 0),
            qk_nope_head_dim=int(cfg.get("qk_nope_head_dim") or 0),
            v_head_dim=int(cfg.get("v_head_dim") or 0),
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"),
            quantization=_quantization_hint(quant) if isinstance(quant, dict) else "",
        )
        if kwargs["kv_lora_rank"]:
            kwargs["head_dim"] = 0  # derived from the MLA dims
        return cls(**kwargs)

    @classmethod
    def from_model_config(cls, mc: ModelConfig, name: str = "") -> PlannerModel:
        """Build from an llmserve :class:`~llmserve.config.ModelConfig` (dense or MoE).

        A ``sliding_window`` there applies to every layer.
        """
        return cls(
            name=name or mc.architecture,
            architecture=mc.architecture,
            vocab_size=mc.vocab_size,
            hidden_size=mc.hidden_size,
            intermediate_size=mc.intermediate_size,
            num_hidden_layers=mc.num_hidden_layers,
            num_attention_heads=mc.num_attention_heads,
            num_key_value_heads=mc.num_key_value_heads,
            head_dim=mc.head_dim,
            max_position_embeddings=mc.max_position_embeddings,
            tie_word_embeddings=mc.tie_word_embeddings,
            attention_bias=mc.attention_bias,
            sliding_window=mc.sliding_window,
            # MoE (every layer sparse; Qwen's decoder_sparse_step / mlp_only_layers not modelled)
            num_experts=mc.num_experts,
            num_experts_per_tok=mc.num_experts_per_tok,
            moe_intermediate_size=mc.moe_intermediate_size,
            num_shared_experts=1 if mc.num_experts and mc.shared_expert_intermediate_size else 0,
            shared_expert_intermediate_size=mc.shared_expert_intermediate_size,
        )


def as_planner_model(model: ModelConfig | PlannerModel) -> PlannerModel:
    """Return ``model`` as a :class:`PlannerModel` (converting a ``ModelConfig``).

    Raises:
        TypeError: for anything else.
    """
    if isinstance(model, PlannerModel):
        return model
    from llmserve.config import ModelConfig  # pure Python, no torch

    if isinstance(model, ModelConfig):
        return PlannerModel.from_model_config(model)
    raise TypeError(f"expected a ModelConfig or PlannerModel, got {type(model).__name__}")


def _sliding_window_layout(cfg: dict[str, Any], num_layers: int
                           ) -> tuple[int | None, tuple[int, ...] | None]:
    """``(window, layers)`` from a HF config; ``layers=None`` means every layer."""
    window = cfg.get("sliding_window")
    if not window or cfg.get("use_sliding_window") is False:
        return None, None
    window = int(window)
    layer_types = cfg.get("layer_types")
    if isinstance(layer_types, list) and layer_types:
        return window, tuple(i for i, t in enumerate(layer_types) if t == "sliding_attention")
    if cfg.get("use_sliding_window") and cfg.get("max_window_layers") is not None:
        # Qwen2: layers from max_window_layers on use the window
        first = int(cfg["max_window_layers"])
        return window, tuple(range(first, num_layers))
    pattern = cfg.get("sliding_window_pattern")
    if isinstance(pattern, int) and pattern > 1:  # Gemma3: every pattern-th layer is global
        return window, tuple(i for i in range(num_layers) if (i + 1) % pattern)
    if cfg.get("model_type") == "gemma2":  # even layers slide, odd layers are global
        return window, tuple(range(0, num_layers, 2))
    return window, None


def _quantization_hint(quant: dict[str, Any]) -> str:
    """A weight-format name from a HF ``quantization_config`` (``""`` if unknown)."""
    method = str(quant.get("quant_method") or "").lower()
    if method == "fp8":
        return "fp8"
    if method in ("awq", "gptq"):
        bits = int(quant.get("bits") or quant.get("w_bit") or 4)
        group = int(quant.get("group_size") or quant.get("q_group_size") or 128)
        return f"int{bits}-g{max(group, 0)}"
    return ""
