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


@dataclass(frozen=True)
class ModelConfig:
    """Architecture hyper-parameters of a decoder-only model (Hugging Face names).

    ``head_dim`` defaults to ``hidden_size // num_attention_heads``.
    ``eos_token_ids`` gathers every id that ends generation (config and
    ``generation_config.json``).
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
        # transformers >= 5 nests RoPE settings under "rope_parameters"
        rp = cfg.get("rope_parameters") or {}
        rope_theta = cfg.get("rope_theta", rp.get("rope_theta", 10000.0))
        rope_scaling = cfg.get("rope_scaling") or (
            rp if rp.get("rope_type", rp.get("type", "default")) != "default" else None)
        try:
            num_heads = cfg["num_attention_heads"]
            sw = cfg.get("sliding_window")
            if cfg.get("use_sliding_window") is False:
                sw = None
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
                rope_theta=rope_theta,
                rope_scaling=rope_scaling,
                max_position_embeddings=cfg.get("max_position_embeddings", 2048),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                attention_bias=bool(cfg.get("attention_bias", False)
                                    or cfg.get("model_type") == "qwen2"),
                sliding_window=sw,
                hidden_act=cfg.get("hidden_act", "silu"),
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=tuple(eos_list),
            )
        except KeyError as e:
            raise ValueError(f"model config is missing the field {e.args[0]!r}") from None


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache settings.

    ``kv_cache_memory``: bytes (int) or a string like ``"4GiB"``; ``None``
    means a default chosen from free RAM at start-up.
    ``num_gpu_blocks_override``: force a block count (tests).
    ``enable_prefix_caching``: automatic prefix caching (on by default).
    ``swap_space``: bytes of host memory for swapped-out KV blocks (used with
    ``preemption_mode="swap"``); ``num_cpu_blocks_override`` forces its block count.
    """

    block_size: int = 16
    kv_cache_memory: int | str | None = None
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool = True
    swap_space: int | str = 4 * 1024**3
    num_cpu_blocks_override: int | None = None

    def __post_init__(self) -> None:
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

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {self.dtype!r}")
        if self.scheduler_config.max_model_len <= 0:
            raise ValueError("EngineConfig needs a resolved max_model_len (> 0)")
