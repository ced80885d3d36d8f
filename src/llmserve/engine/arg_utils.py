"""EngineArgs: user-facing engine options (the LLM constructor and CLI flags)
resolved into a validated :class:`~llmserve.config.EngineConfig`."""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass, fields, replace

from llmserve.config import (
    SUPPORTED_DTYPES,
    CacheConfig,
    EngineConfig,
    LoRAConfig,
    ModelConfig,
    OffloadConfig,
    ParallelConfig,
    SchedulerConfig,
)
from llmserve.layers.quantization import QUANTIZATION_METHODS
from llmserve.spec_decode.config import SpeculativeConfig
from llmserve.utils import parse_size

logger = logging.getLogger(__name__)

DEFAULT_KV_CACHE_MEMORY_CAP = 2 * 1024**3  # 2 GiB
DEFAULT_KV_CACHE_RAM_FRACTION = 0.2


def cpu_has_native_bf16() -> bool:
    """True when the CPU has AVX512-BF16 or AMX (fast bf16 matmuls)."""
    import torch

    try:
        return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    except AttributeError:  # older torch
        return False


def resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {device!r}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available")
    return device


def resolve_dtype(dtype: str, device: str) -> str:
    """``auto`` -> bfloat16 where the device computes it natively, else float32.

    Raises:
        ValueError: for an unknown dtype.
    """
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype must be one of {list(SUPPORTED_DTYPES)}, got {dtype!r}")
    if dtype != "auto":
        return dtype
    if device.startswith("cuda"):
        import torch

        return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    return "bfloat16" if cpu_has_native_bf16() else "float32"


def default_kv_cache_memory(device: str) -> int:
    """Default KV budget: 20% of free memory, at most 2 GiB."""
    if device.startswith("cuda"):
        import torch

        free, _ = torch.cuda.mem_get_info()
        return int(min(free * 0.5, 16 * 1024**3))
    import psutil

    avail = psutil.virtual_memory().available
    return int(min(avail * DEFAULT_KV_CACHE_RAM_FRACTION, DEFAULT_KV_CACHE_MEMORY_CAP))


def check_deterministic_supported(device: str, dtype: str, attention_backend: str) -> None:
    """``--deterministic`` runs every token through the CPU decode kernels.

    Raises:
        ValueError: another device, dtype or attention backend, or no C kernels.
    """
    why = None
    if device != "cpu":
        why = f"device {device!r} (it needs the CPU kernels: --device cpu)"
    elif dtype not in ("float32", "bfloat16"):
        why = f"dtype {dtype!r} (use --dtype bfloat16 or float32)"
    elif attention_backend != "cpu":
        why = f"attention backend {attention_backend!r} (use --attention-backend cpu)"
    else:
        from llmserve.kernels import get_cpu_kernels

        if get_cpu_kernels() is None:
            why = "this machine: the C kernels could not be built (is a C compiler installed?)"
    if why is not None:
        raise ValueError(f"deterministic mode is not supported with {why}")


@dataclass
class EngineArgs:
    """Engine options with vLLM's names. See ``llmserve generate --help``."""

    model: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    kv_cache_memory: int | str | None = None
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_chunked_prefill: bool = True
    attention_backend: str = "cpu"
    seed: int = 0
    num_gpu_blocks_override: int | None = None
    quantization: str = "auto"
    enable_prefix_caching: bool = True
    scheduling_policy: str = "fcfs"
    preemption_mode: str = "recompute"
    swap_space: float = 4.0
    num_cpu_blocks_override: int | None = None
    deterministic: bool = False
    jump_forward: bool = True
    kv_eviction_policy: str = "none"  # none | streaming_llm | h2o | snapkv
    kv_budget_tokens: int | None = None
    num_sink_tokens: int = 4
    # a SpeculativeConfig, its dict, or its JSON (--speculative-config); None = off
    speculative_config: object = None
    kv_store: str | None = None  # redis://HOST:PORT/DB: the shared KV cache store
    kv_store_ttl: int | None = None
    enable_lora: bool = False  # multi-LoRA: LoRARequest per request (llmserve.lora)
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    enable_expert_parallel: bool = False
    distributed_executor_backend: str = "mp"
    kv_cache_dtype: str = "auto"  # auto | bfloat16 | float32 | int8 | fp8_e4m3 (fp8)
    kv_key_quant: str = "per-token"  # per-token | per-channel (int8 keys, KIVI)
    cpu_offload_gb: float = 0.0  # GiB of layer weights in host memory (worker/offload.py)
    num_device_layers: int | None = None  # llama.cpp's --n-gpu-layers; None = all

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        g = parser.add_argument_group("engine")
        g.add_argument("--model", default=None,
                       help="'smollm2-135m-instruct' (default), a GGUF file, or a Hugging Face "
                            "model directory")
        g.add_argument("--dtype", default="auto", choices=list(SUPPORTED_DTYPES),
                       help="weights/activations dtype; auto = bfloat16 on CPUs with native bf16")
        g.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
        g.add_argument("--kv-cache-memory", default=None,
                       help="KV cache budget: bytes or e.g. '4GiB' (default: 20%% of free RAM, "
                            "at most 2GiB)")
        g.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block")
        g.add_argument("--kv-cache-dtype", default="auto",
                       help="KV cache storage: auto (= --dtype), bfloat16, float32, int8 or "
                            "fp8_e4m3 (alias fp8); int8/fp8 keep one byte per element plus a "
                            "per-token, per-head scale (about 2x the tokens per GiB)")
        g.add_argument("--kv-key-quant", default="per-token",
                       choices=["per-token", "per-channel"],
                       help="int8 KV: scale keys per token and head (default) or per block "
                            "and channel (KIVI's per-channel keys; values stay per token)")
        g.add_argument("--max-num-seqs", type=int, default=256, help="max running requests")
        g.add_argument("--max-num-batched-tokens", type=int, default=2048,
                       help="token budget per engine step")
        g.add_argument("--max-model-len", type=int, default=None,
                       help="max prompt + output tokens (default: the model's context length)")
        g.add_argument("--no-enable-chunked-prefill", dest="enable_chunked_prefill",
                       action="store_false", help="do not split long prompts across steps")
        g.add_argument("--attention-backend", default="cpu", help="cpu (fast) or reference")
        g.add_argument("--seed", type=int, default=0, help="global random seed")
        g.add_argument("--quantization", default="auto", choices=list(QUANTIZATION_METHODS),
                       help="weight format: none = dequantize to --dtype; gguf-native = GGUF "
                            "Q4_0/Q4_1/Q8_0 through the int4 CPU kernel; gguf-hybrid = that for "
                            "small steps plus a dense copy for large ones; auto = gguf-hybrid for "
                            "GGUF on CPU with bfloat16, else none")
        g.add_argument("--enable-prefix-caching", dest="enable_prefix_caching",
                       action="store_true", default=True,
                       help="reuse the KV of shared prompt prefixes (default: on)")
        g.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching",
                       action="store_false", help="turn automatic prefix caching off")
        g.add_argument("--scheduling-policy", choices=["fcfs", "priority"], default="fcfs",
                       help="fcfs, or priority (lower value first, ties by arrival)")
        g.add_argument("--preemption-mode", choices=["recompute", "swap"], default="recompute",
                       help="when KV blocks run out: recompute the preempted request's KV "
                            "later, or swap it to host memory and back")
        g.add_argument("--swap-space", type=float, default=4.0,
                       help="host memory for swapped KV, GiB (with --preemption-mode swap)")
        g.add_argument("--deterministic", action="store_true", default=False,
                       help="batch-invariant mode: greedy outputs and logprobs do not depend on "
                            "batching, prefill chunking or prefix-cache hits (every token runs "
                            "through one kernel path; slower prefill, see docs/benchmarks.md)")
        g.add_argument("--no-jump-forward", dest="jump_forward", action="store_false",
                       default=True,
                       help="structured outputs: decode grammar-forced tokens one step each "
                            "instead of appending them after each sampled token")
        g.add_argument("--kv-eviction-policy", default="none",
                       choices=["none", "streaming_llm", "h2o", "snapkv"],
                       help="evict whole KV blocks of a sequence past --kv-budget-tokens: "
                            "StreamingLLM (sinks + recent), H2O (accumulated attention + "
                            "recent) or SnapKV (the prompt's last queries vote)")
        g.add_argument("--kv-budget-tokens", type=int, default=None,
                       help="KV tokens kept per sequence under --kv-eviction-policy")
        g.add_argument("--num-sink-tokens", type=int, default=4,
                       help="StreamingLLM's attention sinks (rounded up to whole blocks)")
        g.add_argument("--speculative-config", default=None,
                       help='speculative decoding as JSON, e.g. \'{"method": "ngram", '
                            '"num_speculative_tokens": 4}\' or \'{"method": "draft_model", '
                            '"model": PATH, "num_speculative_tokens": 4}\' (vLLM names; plus '
                            '"draft_length_policy": "fixed"|"adaptive")')
        g.add_argument("--kv-store", default=None, metavar="redis://HOST:PORT/DB",
                       help="share computed prefix-cache blocks with other workers through "
                            "this Redis (size it with maxmemory + maxmemory-policy "
                            "allkeys-lru)")
        g.add_argument("--kv-store-ttl", type=int, default=None, metavar="SECONDS",
                       help="expire blocks in the KV store after this many seconds "
                            "(default: never; Redis's maxmemory policy evicts)")
        g.add_argument("--enable-lora", action="store_true", default=False,
                       help="serve PEFT LoRA adapters (batched with the base model in one step)")
        g.add_argument("--max-loras", type=int, default=1,
                       help="distinct LoRA adapters in one batch")
        g.add_argument("--max-lora-rank", type=int, default=16, help="largest adapter rank")
        g.add_argument("--max-cpu-loras", type=int, default=None,
                       help="adapters kept in memory (default: --max-loras)")
        g.add_argument("--cpu-offload-gb", type=float, default=0.0,
                       help="GiB of decoder-layer weights kept in host memory (pinned) and "
                            "streamed to the device just before each layer runs (vLLM's "
                            "option; whole layers, from the first)")
        g.add_argument("--num-device-layers", "--n-gpu-layers", dest="num_device_layers",
                       type=int, default=None, metavar="N",
                       help="llama.cpp's --n-gpu-layers: the first N decoder layers and their "
                            "KV cache on the device, the rest (and embeddings, LM head) on "
                            "the CPU (default: all on the device)")
        p = parser.add_argument_group("parallelism")
        p.add_argument("--tensor-parallel-size", type=int, default=1,
                       help="split every layer over this many processes (torch.distributed, "
                            "gloo on CPU); must divide the query heads")
        p.add_argument("--pipeline-parallel-size", type=int, default=1,
                       help="pipeline stages (only 1 today)")
        p.add_argument("--data-parallel-size", type=int, default=1,
                       help="serve: engine replicas, each its own process(es), behind one "
                            "API server that routes by load and cached prefix")
        p.add_argument("--enable-expert-parallel", action="store_true", default=False,
                       help="MoE models: shard the experts over the tensor-parallel ranks")
        p.add_argument("--distributed-executor-backend", choices=["mp", "ray"], default="mp",
                       help="how the ranks are started: mp = processes on this machine; "
                            "ray = Ray tasks on the cluster of RAY_ADDRESS (or a local Ray)")
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in vars(args).items() if k in names})

    def _swap_bytes(self) -> int:
        if isinstance(self.swap_space, bool) or not isinstance(self.swap_space, (int, float)) \
                or self.swap_space <= 0:
            raise ValueError(f"swap_space must be a positive number of GiB, got {self.swap_space!r}")
        return int(self.swap_space * 1024**3)

    def _lora_config(self) -> LoRAConfig | None:
        if not self.enable_lora:
            return None
        if self.speculative_config is not None:
            raise ValueError("enable_lora: LoRA adapters with speculative decoding are not "
                             "supported yet; drop --speculative-config")
        return LoRAConfig(self.max_loras, self.max_lora_rank, self.max_cpu_loras)

    def create_engine_config(self, model_config: ModelConfig, model_name: str) -> EngineConfig:
        """Resolve ``auto`` values against the model and the machine.

        Raises:
            ValueError: naming the field, for any invalid option.
        """
        device = resolve_device(self.device)
        dtype = resolve_dtype(self.dtype, device)
        model_max = model_config.max_context_len  # extended by linear/dynamic/yarn RoPE
        max_model_len = self.max_model_len if self.max_model_len is not None else model_max
        if max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {max_model_len}")
        if max_model_len > model_max:
            raise ValueError(
                f"max_model_len ({max_model_len}) is larger than the model's context length "
                f"({model_max})")
        if self.quantization not in QUANTIZATION_METHODS:
            raise ValueError(f"quantization must be one of {list(QUANTIZATION_METHODS)}, "
                             f"got {self.quantization!r}")
        if self.deterministic:
            check_deterministic_supported(device, dtype, self.attention_backend)
        kv_mem = (parse_size(self.kv_cache_memory, "kv_cache_memory")
                  if self.kv_cache_memory is not None else default_kv_cache_memory(device))
        return EngineConfig(
            model=model_name,
            model_config=replace(model_config, max_model_len=max_model_len),
            cache_config=CacheConfig(block_size=self.block_size, kv_cache_memory=kv_mem,
                                     num_gpu_blocks_override=self.num_gpu_blocks_override,
                                     enable_prefix_caching=self.enable_prefix_caching,
                                     swap_space=self._swap_bytes(),
                                     num_cpu_blocks_override=self.num_cpu_blocks_override,
                                     kv_eviction_policy=self.kv_eviction_policy,
                                     kv_budget_tokens=self.kv_budget_tokens,
                                     num_sink_tokens=self.num_sink_tokens,
                                     kv_store=self.kv_store, kv_store_ttl=self.kv_store_ttl,
                                     kv_cache_dtype=self.kv_cache_dtype,
                                     kv_key_quant=self.kv_key_quant),
            scheduler_config=SchedulerConfig(
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=self.max_num_batched_tokens,
                max_model_len=max_model_len,
                enable_chunked_prefill=self.enable_chunked_prefill,
                scheduling_policy=self.scheduling_policy,
                preemption_mode=self.preemption_mode),
            dtype=dtype, device=device, attention_backend=self.attention_backend, seed=self.seed,
            extra={"quantization": self.quantization}, deterministic=bool(self.deterministic),
            jump_forward=bool(self.jump_forward),
            speculative_config=SpeculativeConfig.from_value(self.speculative_config),
            lora_config=self._lora_config(),
            offload_config=OffloadConfig(cpu_offload_gb=self.cpu_offload_gb,
                                         num_device_layers=self.num_device_layers),
            parallel_config=ParallelConfig(
                tensor_parallel_size=self.tensor_parallel_size,
                pipeline_parallel_size=self.pipeline_parallel_size,
                data_parallel_size=self.data_parallel_size,
                enable_expert_parallel=bool(self.enable_expert_parallel),
                distributed_executor_backend=self.distributed_executor_backend))
