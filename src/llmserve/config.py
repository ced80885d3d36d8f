"""Validated, frozen configuration dataclasses (pure Python, no torch).

One dataclass per concern, each checked in ``__post_init__``, combined into
:class:`EngineConfig` and passed explicitly to every component.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from llmserve.model_config import (  # noqa: F401  (re-exported)
    DTYPE_BYTES,
    LAYER_TYPES,
    SUPPORTED_DTYPES,
    ModelConfig,
)
from llmserve.utils import parse_size

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


#: ``--kv-key-quant``: how int8 pages scale keys (layers/attention/kv_quant_pc.py)
KV_KEY_QUANTS = ("per-token", "per-channel")

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
    ``kv_key_quant``: ``per-token`` (default) or ``per-channel`` (``int8`` only: KIVI's
    per-channel keys, a fp16 scale per block, KV head and channel, values per token;
    ``layers/attention/kv_quant_pc.py``; not with h2o / snapkv, whose scoring reads
    per-token rows).
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
    kv_key_quant: str = "per-token"

    def __post_init__(self) -> None:
        object.__setattr__(self, "kv_cache_dtype", normalize_kv_cache_dtype(self.kv_cache_dtype))
        key_quant = self.kv_key_quant.strip().lower().replace("_", "-") \
            if isinstance(self.kv_key_quant, str) else self.kv_key_quant
        if key_quant not in KV_KEY_QUANTS:
            raise ValueError(f"kv_key_quant must be one of {', '.join(KV_KEY_QUANTS)}, "
                             f"got {self.kv_key_quant!r}")
        object.__setattr__(self, "kv_key_quant", key_quant)
        if key_quant == "per-channel" and self.kv_cache_dtype != "int8":
            raise ValueError(f"kv_key_quant per-channel needs kv_cache_dtype int8, got "
                             f"{self.kv_cache_dtype!r}")
        if key_quant == "per-channel" and self.kv_eviction_policy in ("h2o", "snapkv"):
            raise ValueError(f"kv_key_quant per-channel does not support kv_eviction_policy "
                             f"{self.kv_eviction_policy!r} (use none or streaming_llm)")
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


DISTRIBUTED_EXECUTOR_BACKENDS = ("mp", "ray")


@dataclass(frozen=True)
class ParallelConfig:
    """How one engine spreads over processes (vLLM's names).

    ``tensor_parallel_size`` (tp): ranks that split every layer (Megatron-LM column /
    row parallel linears, vocab-parallel embedding); ``pipeline_parallel_size`` (pp):
    stages of consecutive layers; ``data_parallel_size`` (dp): engine replicas;
    ``enable_expert_parallel``: shard MoE experts over the tp ranks (the ep group;
    dp replicas are separate engines) instead of refusing a MoE model at tp > 1.
    ``distributed_executor_backend``: ``"mp"`` (worker processes on this machine) or
    ``"ray"`` (Ray tasks in a placement group, on the cluster of ``RAY_ADDRESS`` or a
    local Ray; :mod:`llmserve.distributed.ray_executor`). ``startup_timeout_s``: seconds every rank has to join
    and load its shard before the engine gives up (naming the missing ranks).
    Validation against a model: :meth:`check_model`. tp > 1 (with expert parallelism
    on MoE models) and pp > 1 run in one engine; dp > 1 is run by ``llmserve serve`` as
    separate engine processes behind one API server
    (:mod:`llmserve.entrypoints.openai.data_parallel`).

    Raises:
        ValueError: a size that is not a positive integer, an unknown backend.
    """

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    enable_expert_parallel: bool = False
    distributed_executor_backend: str = "mp"
    startup_timeout_s: float = 300.0
    # layers per pipeline stage, "16,14" (vLLM's VLLM_PP_LAYER_PARTITION); None: the
    # LLMSERVE_PP_LAYER_PARTITION environment variable, else vLLM's even split
    pp_layer_partition: str | None = None

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
        pp = self.pipeline_parallel_size
        if pp > model.num_hidden_layers:
            raise ValueError(f"pipeline_parallel_size={pp} exceeds the {model.num_hidden_layers} "
                             f"layers of {model.architecture} (each stage needs a layer); "
                             f"sizes that work: 1 to {model.num_hidden_layers}")
        tp = self.tensor_parallel_size
        if tp == 1:
            return
        why = _tp_mismatch(model, tp)
        if why is not None:
            works = [n for n in range(1, model.num_attention_heads + 1)
                     if _tp_mismatch(model, n) is None]
            raise ValueError(f"tensor_parallel_size={tp} does not fit {model.architecture}: "
                             f"{why}; sizes that work: {', '.join(map(str, works))}")
        if model.num_experts and not self.enable_expert_parallel:
            raise ValueError("tensor_parallel_size > 1 on a mixture-of-experts model needs "
                             "--enable-expert-parallel (experts sharded over the tp ranks)")
        if model.num_experts and model.num_experts % tp:
            works = [n for n in range(1, model.num_experts + 1)
                     if model.num_experts % n == 0 and _tp_mismatch(model, n) is None]
            raise ValueError(f"enable_expert_parallel: tensor_parallel_size={tp} must divide "
                             f"num_experts {model.num_experts}; sizes that work: "
                             f"{', '.join(map(str, works))}")


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
class OffloadConfig:
    """Weights outside the compute device (``worker/offload.py``).

    ``cpu_offload_gb``: GiB of decoder-layer weights kept in host memory (pinned on CUDA)
    and streamed to the device just before each of their layers runs (vLLM's
    ``--cpu-offload-gb``); whole layers, from the first, while they fit; 0 = off.
    ``num_device_layers``: llama.cpp's ``--n-gpu-layers``: the first N decoder layers (and
    their KV cache) on the device, the rest on the CPU; None = all on the device. With a
    split, embeddings, final norm and LM head stay on the CPU (llama.cpp keeps the input
    layer on the CPU and puts the output layer on the GPU only when every layer is).

    Raises:
        ValueError: a negative or non-numeric size, a negative layer count;
            :meth:`check_model`: more layers than the model has.
    """

    cpu_offload_gb: float = 0.0
    num_device_layers: int | None = None

    def __post_init__(self) -> None:
        gb = self.cpu_offload_gb
        if isinstance(gb, bool) or not isinstance(gb, (int, float)) or not gb >= 0 \
                or gb == float("inf"):
            raise ValueError(f"cpu_offload_gb must be a number of GiB >= 0, got {gb!r}")
        n = self.num_device_layers
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 0):
            raise ValueError(f"num_device_layers (--n-gpu-layers) must be an integer >= 0 "
                             f"(or unset: all layers), got {n!r}")

    @property
    def cpu_offload_bytes(self) -> int:
        return int(self.cpu_offload_gb * 1024**3)

    @property
    def enabled(self) -> bool:
        return self.cpu_offload_gb > 0 or self.num_device_layers is not None

    def check_model(self, model: ModelConfig) -> None:
        """Raises ValueError when ``num_device_layers`` exceeds the model's layers."""
        n, total = self.num_device_layers, model.num_hidden_layers
        if n is not None and n > total:
            raise ValueError(f"num_device_layers (--n-gpu-layers) is {n} but the model has "
                             f"{total} decoder layers (0..{total} allowed)")


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
    # structured outputs: append the tokens a grammar forces after each sampled token
    # (jump-forward decoding) instead of decoding them one step each
    jump_forward: bool = True
    lora_config: LoRAConfig | None = None  # multi-LoRA (--enable-lora), None = off
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    offload_config: OffloadConfig = field(default_factory=OffloadConfig)

    @property
    def kv_cache_dtype(self) -> str:
        """The KV cache dtype, resolved (``auto`` -> ``dtype``)."""
        kv = self.cache_config.kv_cache_dtype
        return self.dtype if kv == "auto" else kv

    def __post_init__(self) -> None:
        self.parallel_config.check_model(self.model_config)
        self.offload_config.check_model(self.model_config)
        if self.offload_config.enabled and (self.parallel_config.world_size > 1
                                            or self.lora_config is not None):
            raise ValueError("cpu_offload_gb / num_device_layers do not support "
                             "tensor or pipeline parallelism (world size > 1) or LoRA adapters yet")
        if self.offload_config.num_device_layers is not None and (
                self.speculative_config is not None or self.cache_config.kv_store is not None
                or self.cache_config.kv_eviction_policy in ("h2o", "snapkv")):
            raise ValueError("num_device_layers (--n-gpu-layers) does not support speculative "
                             "decoding, the shared KV store or attention-scored KV eviction "
                             "(h2o, snapkv) yet")
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
