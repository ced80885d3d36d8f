"""llmserve.planner: the memory ledger and capacity planner (pure Python, never imports torch).

The engine sizes its KV cache with :func:`kv_cache_bytes_per_token` and
:func:`num_kv_cache_blocks`; ``llmserve plan`` prints the same arithmetic.
See docs/memory.md.
"""

from llmserve.planner.capacity import (
    CapacityPlan,
    DoesNotFitError,
    candidate_layouts,
    estimate_activation_bytes,
    parse_memory,
    plan_capacity,
    smallest_parallelism,
)
from llmserve.planner.formats import (
    GGUF_BLOCK_SIZES,
    KV_CACHE_DTYPE_BYTES,
    WeightFormat,
    gguf_type_bits,
    kv_dtype_bytes,
    parse_weight_format,
)
from llmserve.planner.ledger import (
    COMPONENTS,
    ParamCounts,
    WeightBytes,
    check_parallel,
    count_parameters,
    kv_bytes_per_token_per_layer,
    kv_cache_bytes_per_batch,
    kv_cache_bytes_per_sequence,
    kv_cache_bytes_per_token,
    kv_heads_per_device,
    num_kv_cache_blocks,
    pp_partition,
    weight_bytes,
)
from llmserve.planner.model import PlannerModel, as_planner_model
from llmserve.planner.sources import (
    DEFAULT_PRESET,
    ResolvedModel,
    list_presets,
    load_config_json,
    load_gguf,
    load_preset,
    resolve_model,
)

__all__ = [
    "COMPONENTS", "DEFAULT_PRESET", "GGUF_BLOCK_SIZES", "KV_CACHE_DTYPE_BYTES", "CapacityPlan",
    "DoesNotFitError", "ParamCounts", "PlannerModel", "ResolvedModel", "WeightBytes",
    "WeightFormat", "as_planner_model", "candidate_layouts", "check_parallel",
    "count_parameters", "estimate_activation_bytes", "gguf_type_bits",
    "kv_bytes_per_token_per_layer", "kv_cache_bytes_per_batch", "kv_cache_bytes_per_sequence",
    "kv_cache_bytes_per_token", "kv_dtype_bytes", "kv_heads_per_device", "list_presets",
    "load_config_json", "load_gguf", "load_preset", "num_kv_cache_blocks", "parse_memory",
    "parse_weight_format", "plan_capacity", "pp_partition", "resolve_model",
    "smallest_parallelism", "weight_bytes",
]
