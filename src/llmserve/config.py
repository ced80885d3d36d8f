"""Validated, frozen configuration dataclasses (pure Python, no torch).

One dataclass per concern, each checked in ``__post_init__``, combined into
:class:`EngineConfig` and passed explicitly to every component.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from llmserve.utils import parse_size

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


#: ``--kv-cache-dtype`` values (vLLM's names); ``auto`` = the model dtype
KV_CACHE_DTYPES = ("auto", "bfloat16", "float32", "int8", "fp8_e4m3")
#: accepted aliases (vLLM: ``fp8`` means e4m3)
KV_CACHE_DTYPE_ALIASES = {"fp8": "fp8_e4m3", "fp8_e4m3fn": "fp8_e4m3", "bf16": "bfloat16",
                          "fp32": "float32"}


def normalize_kv_cache_dtype(value: Any) -> str:
    """The canonical ``kv_cache_dtype`` name (aliases resolved).

    Raises:
        ValueError: anything else, naming the allowed values.
    """
    name = value.strip().lower() if isinstance(value, str) else value
    name = KV_CACHE_DTYPE_ALIASES.get(name, name)
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)} (or fp8, "
                         f"an alias of fp8_e4m3), got {value!r}")
    return name


# the registered names of kv_cache/eviction (tests/test_kv_eviction.py checks they agree)
KV_EVICTION_POLICIES = ("none", "streaming_llm", "h2o", "snapkv")


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache settings.

    ``kv_cache_memory``: bytes (int) or a string like ``"4GiB"``; ``None``
    means a default chosen from free RAM at start-up.
    ``num_gpu_blocks_override``: force a block count (tests).
    ``enable_prefix_caching``: automatic prefix caching (on by default).
    ``swap_space``: bytes of host memory for swapped-out KV blocks (used with
    ``preemption_mode="swap"``); ``num_cpu_blocks_override`` forces its block count.
    ``kv_store``: a ``redis://HOST:PORT/DB`` URL of a KV cache store shared by workers
    (``kv_cache/kv_store.py``; needs prefix caching); ``kv_store_ttl``: seconds until a
    stored block expires (None: never, Redis's maxmemory policy evicts).
    ``kv_cache_dtype``: one of :data:`KV_CACHE_DTYPES` (``fp8`` accepted for
    ``fp8_e4m3``): ``auto`` keeps K/V in the model dtype; ``int8`` / ``fp8_e4m3`` store
    one byte per element plus a per-token, per-head fp16 scale
    (``layers/attention/kv_quant.py``).
    ``kv_eviction_policy``: ``none``, ``streaming_llm``, ``h2o`` or ``snapkv``
    (``kv_cache/eviction``), capping each sequence at ``kv_budget_tokens`` of KV
    (whole blocks; ``num_sink_tokens`` attention sinks for StreamingLLM); requests may
    override the three through their SamplingParams.
    """

    block_size: int = 16
    kv_cache_memory: int | str | None = None
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool = True
    swap_space: int | str = 4 * 1024**3
    kv_eviction_policy: str = "none"
    kv_budget_tokens: int | None = None
    num_sink_tokens: int = 4
    num_cpu_blocks_override: int | None = None
    kv_store: str | None = None
    kv_store_ttl: int | None = None
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        object.__setattr__(self, "kv_cache_dtype", normalize_kv_cache_dtype(self.kv_cache_dtype))
        if self.kv_store is not None and (
                not isinstance(self.kv_store, str)
                or not self.kv_store.startswith(("redis://", "rediss://", "unix://"))):
            raise ValueError(f"kv_store must be a redis://HOST:PORT/DB URL, got {self.kv_store!r}")
        if self.kv_store_ttl is not None and (isinstance(self.kv_store_ttl, bool) or not
                                              isinstance(self.kv_store_ttl, int)
                                              or self.kv_store_ttl <= 0):
            raise ValueError(f"kv_store_ttl must be a positive number of seconds, "
                             f"got {self.kv_store_ttl!r}")
        if self.kv_eviction_policy not in KV_EVICTION_POLICIES:
            raise ValueError(f"kv_eviction_policy must be one of {list(KV_EVICTION_POLICIES)}, "
                             f"got {self.kv_eviction_policy!r}")
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.kv_cache_memory is not None:
            object.__setattr__(self, "kv_cache_memory",
                               parse_size(self.kv_cache_memory, "kv_cache_memory"))
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override <= 0:
            raise ValueError("num_gpu_blocks_override must be positive")
        object.__setattr__(self, "swap_space", parse_size(self.swap_space, "swap_space"))
        if self.num_cpu_blocks_override is not None and self.num_cpu_blocks_override <= 0:
            raise ValueError("num_cpu_blocks_override must be positive")


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous-batching limits.

    ``max_num_seqs``: running requests per step. ``max_num_batched_tokens``:
    token budget per step (prefill chunks + decodes). ``max_model_len``:
    prompt + output tokens per request (0 = the model's context length).
    ``scheduling_policy``: ``fcfs`` or ``priority`` (lower value first, ties by
    arrival). ``preemption_mode``: ``recompute`` (drop the KV) or ``swap`` (copy
    it to the host pool and back).
    """

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 0
    enable_chunked_prefill: bool = True
    scheduling_policy: str = "fcfs"
    preemption_mode: str = "recompute"

    def __post_init__(self) -> None:
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', "
                             f"got {self.scheduling_policy!r}")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', "
                             f"got {self.preemption_mode!r}")
        if self.max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.max_num_batched_tokens <= 0:
            raise ValueError(
                f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}")
        if self.max_model_len < 0:
            raise ValueError(f"max_model_len must be >= 0, got {self.max_model_len}")
        if not self.enable_chunked_prefill and self.max_model_len and \
                self.max_num_batched_tokens < self.max_model_len:
            raise ValueError("without chunked prefill, max_num_batched_tokens must be >= max_model_len")


DISTRIBUTED_EXECUTOR_BACKENDS = ("mp",)


@dataclass(frozen=True)
class ParallelConfig:
    """How one engine spreads over processes (vLLM's names).

    ``tensor_parallel_size`` (tp): ranks that split every layer (Megatron-LM column /
    row parallel linears, vocab-parallel embedding); ``pipeline_parallel_size`` (pp):
    stages of consecutive layers; ``data_parallel_size`` (dp): engine replicas;
    ``enable_expert_parallel``: shard MoE experts over ``tp x dp`` ranks instead of
    splitting each expert. ``distributed_executor_backend``: ``"mp"`` (worker
    processes on this machine). ``startup_timeout_s``: seconds every rank has to join
    and load its shard before the engine gives up (naming the missing ranks).
    Validation against a model: :meth:`check_model`. Only tp > 1 runs today.

    Raises:
        ValueError: a size that is not a positive integer, an unknown backend.
    """

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    enable_expert_parallel: bool = False
    distributed_executor_backend: str = "mp"
    startup_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.distributed_executor_backend not in DISTRIBUTED_EXECUTOR_BACKENDS:
            raise ValueError(f"distributed_executor_backend must be one of "
                             f"{list(DISTRIBUTED_EXECUTOR_BACKENDS)}, "
                             f"got {self.distributed_executor_backend!r}")
        if not self.startup_timeout_s > 0:
            raise ValueError(f"startup_timeout_s must be positive, got {self.startup_timeout_s!r}")
        if self.pipeline_parallel_size > 1 or self.data_parallel_size > 1:
            raise ValueError("pipeline_parallel_size and data_parallel_size > 1 are not "
                             "supported yet (tensor_parallel_size is)")

    @property
    def world_size(self) -> int:
        """Processes of one engine: ``tp x pp`` (dp replicas are separate engines)."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def check_model(self, model: ModelConfig) -> None:
        """Validate ``tensor_parallel_size`` against ``model`` (vLLM's rules, the planner's
        :func:`~llmserve.planner.ledger.check_parallel`): it divides the query heads, and
        divides the KV heads or is a multiple of them (then each KV head is replicated on
        ``tp / num_kv_heads`` ranks); it divides ``intermediate_size``. MoE models are not
        split yet.

        Raises:
            ValueError: naming the sizes that work for this model.
        """
        tp = self.tensor_parallel_size
        if tp == 1:
            return
        why = _tp_mismatch(model, tp)
        if why is not None:
            works = [n for n in range(1, model.num_attention_heads + 1)
                     if _tp_mismatch(model, n) is None]
            raise ValueError(f"tensor_parallel_size={tp} does not fit {model.architecture}: "
                             f"{why}; sizes that work: {', '.join(map(str, works))}")
        if model.num_experts:
            raise ValueError("tensor_parallel_size > 1 is not supported for mixture-of-experts "
                             "models yet")


def _tp_mismatch(model: ModelConfig, tp: int) -> str | None:
    """Why ``tp`` cannot split ``model`` (None when it can): the planner's rules, plus
    ``intermediate_size % tp == 0`` for the column-parallel MLP."""
    from llmserve.planner.ledger import check_parallel
    from llmserve.planner.model import as_planner_model

    try:
        check_parallel(as_planner_model(model), tp, 1)
    except ValueError as e:
        return str(e)
    if model.intermediate_size % tp:
        return f"tp={tp} does not divide intermediate_size {model.intermediate_size}"
    return None


@dataclass(frozen=True)
class LoRAConfig:
    """Multi-LoRA limits (vLLM's ``--enable-lora`` options).

    ``max_loras``: distinct adapters in one batch (adapter slots); ``max_lora_rank``:
    the largest adapter rank accepted; ``max_cpu_loras``: adapters kept in memory
    (None = ``max_loras``; more are reloaded from their directories when needed).

    Raises:
        ValueError: a limit below 1, or ``max_cpu_loras < max_loras``.
    """

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        c = self.max_cpu_loras
        if c is not None and (isinstance(c, bool) or not isinstance(c, int)
                              or c < self.max_loras):
            raise ValueError(f"max_cpu_loras must be an integer >= max_loras "
                             f"({self.max_loras}), got {c!r}")


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs, resolved (``dtype`` is never ``auto`` here)."""

    model: str
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    dtype: str = "float32"
    device: str = "cpu"
    attention_backend: str = "cpu"
    seed: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
    # batch-invariant mode (--deterministic): every token computed as a one-token decode
    # through one kernel path, so batching, chunking and prefix-cache hits change no bits
    deterministic: bool = False
    speculative_config: Any = None  # a spec_decode.config.SpeculativeConfig, None = off
    lora_config: LoRAConfig | None = None  # multi-LoRA (--enable-lora), None = off
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)

    @property
    def kv_cache_dtype(self) -> str:
        """The KV cache dtype, resolved (``auto`` -> ``dtype``)."""
        kv = self.cache_config.kv_cache_dtype
        return self.dtype if kv == "auto" else kv

    def __post_init__(self) -> None:
        self.parallel_config.check_model(self.model_config)
        if self.parallel_config.world_size > 1 and (
                self.speculative_config is not None or self.cache_config.kv_store is not None):
            raise ValueError("tensor_parallel_size > 1 does not support speculative decoding "
                             "or the shared KV store (--kv-store) yet")
        if self.parallel_config.world_size > 1 and self.lora_config is not None:
            raise ValueError("tensor_parallel_size > 1 does not support LoRA adapters "
                             "(--enable-lora) yet")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {self.dtype!r}")
        if self.scheduler_config.max_model_len <= 0:
            raise ValueError("EngineConfig needs a resolved max_model_len (> 0)")
