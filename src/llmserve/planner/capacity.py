"""Capacity planning: how much KV cache, how many sequences, on how many GPUs (pure Python).

Per device (every device of a tp x pp group is sized by the largest stage)::

    usable     = gpu_memory x gpu_memory_utilization
    kv_budget  = usable - weights_per_device - activation_reserve
    num_blocks = floor(kv_budget / (block_size x kv_bytes_per_token_per_device))
    tokens     = (num_blocks - 1) x block_size          block 0 is the reserved null block
    max_seqs   = floor((num_blocks - 1) / ceil(max_model_len / block_size))

This is vLLM's accounting (``gpu_memory_utilization`` bounds everything the
process uses; what weights and the profiled activation peak leave over
becomes KV blocks). The activation reserve here is an estimate
(:func:`estimate_activation_bytes`); pass a measured one when you have it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from llmserve.planner.formats import WeightFormat, parse_weight_format
from llmserve.planner.ledger import (
    check_parallel,
    kv_cache_bytes_per_token,
    num_kv_cache_blocks,
    weight_bytes,
)
from llmserve.planner.model import PlannerModel, as_planner_model
from llmserve.utils import format_size, parse_size

if TYPE_CHECKING:
    from llmserve.config import ModelConfig

DEFAULT_BLOCK_SIZE = 16
#: CUDA context, cuBLAS workspaces, CUDA graphs and NCCL buffers (a rough, typical figure)
RUNTIME_OVERHEAD_BYTES = 1 << 30


class DoesNotFitError(ValueError):
    """No tp x pp layout holds the requested context and concurrency."""


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def ffn_width(model: PlannerModel) -> int:
    """Widest per-token feed-forward: ``I`` (dense) or ``k x I_moe + S x I_shared`` (MoE)."""
    width = model.intermediate_size if model.first_k_dense_replace or not model.is_moe else 0
    if model.is_moe:
        shared = model.shared_expert_intermediate_size or model.moe_intermediate_size
        width = max(width, model.num_experts_per_tok * model.moe_intermediate_size
                    + model.num_shared_experts * shared)
    return width


def estimate_activation_bytes(model: ModelConfig | PlannerModel, tp: int = 1,
                              max_num_batched_tokens: int = 2048, max_num_seqs: int = 256,
                              act_bytes: int = 2) -> int:
    """A rough peak of activations and runtime buffers on one device, in bytes.

    ``T x (4 x hidden + 2 x ffn / tp) x act_bytes + S x vocab x 4 B + 1 GiB`` with
    ``T = max_num_batched_tokens`` (one forward pass: residual, normed input,
    attention in/out, and the gate and up projections), ``S = max_num_seqs``
    rows of fp32 logits, and :data:`RUNTIME_OVERHEAD_BYTES`. vLLM measures the
    real peak by profiling a forward pass; this estimate stands in for it.
    """
    m = as_planner_model(model)
    per_token = 4 * m.hidden_size + 2 * ffn_width(m) // tp
    return (max_num_batched_tokens * per_token * act_bytes
            + max_num_seqs * m.vocab_size * 4 + RUNTIME_OVERHEAD_BYTES)


@dataclass(frozen=True)
class CapacityPlan:
    """What one tp x pp group of devices can hold (all byte figures per device)."""

    model: str
    tp: int
    pp: int
    num_gpus: int
    replicas: int
    block_size: int
    max_model_len: int
    concurrency: int
    gpu_memory: int
    gpu_memory_utilization: float
    usable_bytes: int
    weight_bytes: int
    activation_bytes: int
    kv_budget_bytes: int
    kv_bytes_per_token: int
    num_blocks: int
    weight_format: str
    kv_cache_dtype: str
    # blocks one sequence holds at most whatever its length (llmserve's cap: a sliding
    # window on every layer, or --kv-budget-tokens; scheduler/kv_limits.py), or None
    max_blocks_per_sequence: int | None = None
    # a mixed model's local layers in a window pool (prefix caching off;
    # kv_cache/window_blocks.py): its bytes, taken from the KV budget before the paged
    # pool, which then holds the global layers' kv_bytes_per_token only
    window_pool_bytes: int = 0
    # CPU offload / layer split (llmserve --cpu-offload-gb, --num-device-layers); host
    # memory holds host_weight_bytes of weights and host_kv_bytes of KV (the CPU layers')
    num_device_layers: int | None = None
    offloaded_layers: int = 0
    host_weight_bytes: int = 0
    host_kv_bytes: int = 0
    offload_bytes_per_forward: int = 0

    @property
    def usable_blocks(self) -> int:
        """Blocks sequences can use: ``num_blocks - 1`` (block 0 is the reserved null block,
        as in vLLM and llmserve's ``BlockPool``)."""
        return max(self.num_blocks - 1, 0)

    @property
    def num_tokens(self) -> int:
        """KV slots sequences can use on each device: ``usable_blocks x block_size``."""
        return self.usable_blocks * self.block_size

    @property
    def blocks_per_sequence(self) -> int:
        """``ceil(max_model_len / block_size)``, at most ``max_blocks_per_sequence``."""
        blocks = _cdiv(self.max_model_len, self.block_size)
        cap = self.max_blocks_per_sequence
        return blocks if cap is None else min(blocks, cap)

    @property
    def max_num_seqs(self) -> int:
        """Sequences of ``max_model_len`` tokens one replica holds at once."""
        return self.usable_blocks // self.blocks_per_sequence

    @property
    def max_single_context(self) -> int:
        """The longest one sequence can grow, in tokens (all usable blocks to it)."""
        return self.num_tokens

    @property
    def total_max_num_seqs(self) -> int:
        """``replicas x max_num_seqs`` (data parallel over ``num_gpus``)."""
        return self.replicas * self.max_num_seqs

    @property
    def fits(self) -> bool:
        """Whether ``concurrency`` sequences of ``max_model_len`` fit in one replica."""
        return self.max_num_seqs >= self.concurrency

    def shortfall(self) -> str:
        """Why the plan does not fit (``""`` when it does)."""
        if self.fits:
            return ""
        if self.kv_budget_bytes <= 0 or self.usable_blocks == 0:
            return (f"weights {format_size(self.weight_bytes)} + activations "
                    f"{format_size(self.activation_bytes)} per device leave "
                    f"{format_size(max(self.kv_budget_bytes, 0))} of the usable "
                    f"{format_size(self.usable_bytes)}, less than one KV block "
                    f"({format_size(self.block_size * self.kv_bytes_per_token)})")
        need = self.concurrency * self.blocks_per_sequence
        return (f"the KV budget of {format_size(self.kv_budget_bytes)} per device holds "
                f"{self.usable_blocks:,} usable blocks ({self.num_tokens:,} tokens), but "
                f"{self.concurrency} x {self.blocks_per_sequence:,} = {need:,} blocks are needed")

    def as_dict(self) -> dict[str, object]:
        """All fields and derived figures, JSON-ready."""
        out: dict[str, object] = asdict(self)
        for name in ("usable_blocks", "num_tokens", "blocks_per_sequence", "max_num_seqs", "max_single_context",
                     "total_max_num_seqs", "fits"):
            out[name] = getattr(self, name)
        return out


def _positive_int(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def parse_memory(value: int | str, name: str) -> int:
    """Bytes from an int or a size string (``"80GiB"``), via :func:`llmserve.utils.parse_size`.

    Raises:
        ValueError: naming ``name`` for zero, negative or malformed sizes.
    """
    negative = (value.strip().startswith("-") if isinstance(value, str)
                else not isinstance(value, bool) and value <= 0)
    if negative:
        raise ValueError(f"{name} must be a positive size such as 80GiB, got {value!r}")
    return parse_size(value, name)


def plan_capacity(model: ModelConfig | PlannerModel, *, gpu_memory: int | str, tp: int = 1,
                  pp: int = 1, num_gpus: int | None = None, gpu_memory_utilization: float = 0.9,
                  activation_reserve: int | str | None = None,
                  weight_format: str | WeightFormat = "auto", kv_cache_dtype: str = "auto",
                  block_size: int = DEFAULT_BLOCK_SIZE, max_model_len: int | None = None,
                  concurrency: int = 1, file_weight_bytes: int | None = None,
                  kv_budget_tokens: int | None = None,
                  max_num_batched_tokens: int = 2048, cpu_offload_gb: float = 0.0,
                  num_device_layers: int | None = None,
                  window_pool: bool = False) -> CapacityPlan:
    """Size the KV cache of one tp x pp group of devices with ``gpu_memory`` bytes each.

    ``gpu_memory``: bytes or a size string (``"80GiB"``). ``num_gpus``: devices
    available (default ``tp x pp``); the spare ones make data-parallel
    replicas. ``activation_reserve``: bytes per device (default
    :func:`estimate_activation_bytes`). ``max_model_len``: context per
    sequence (default the model's ``max_position_embeddings``).
    ``file_weight_bytes``: the real size of all weights (a GGUF file), split
    over devices in the ledger's proportions instead of ``weight_format``.
    ``kv_budget_tokens``: llmserve's per-sequence KV eviction budget. It, or a sliding
    window on every layer (Mistral), caps the blocks of a sequence at
    ``budget // block_size + ceil(chunk / block_size) + 1`` or
    ``ceil((window + chunk) / block_size) + 1`` with ``chunk = max_num_batched_tokens``
    (a prefill chunk's blocks come before the old ones are freed).
    ``cpu_offload_gb`` / ``num_device_layers``: llmserve's weight offload and layer split
    (:func:`llmserve.planner.offload.split_weights`): device weights are the device layers'
    less the offloaded ones plus their staging slots, the KV per token on the device is
    the device layers' share, and the rest is host memory (``host_*`` fields).
    ``window_pool``: llmserve with prefix caching off, where a mixed model (local and
    global layers, Gemma 3) keeps its local layers' KV in a window pool sized for
    ``concurrency`` sequences (at most half the KV budget) and its paged pool pays the
    global layers' bytes per token only (``pp = 1``, no offload or KV budget).
    Never raises for a model that does not fit: see :attr:`CapacityPlan.fits`.

    Raises:
        ValueError: for non-positive sizes or counts, a utilization outside
            (0, 1], ``num_gpus < tp x pp``, an invalid tp/pp, unknown formats, offload
            options with tp or pp > 1 or out of range.
    """
    m = as_planner_model(model)
    memory = parse_memory(gpu_memory, "gpu_memory")
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    _positive_int("block_size", block_size)
    _positive_int("concurrency", concurrency)
    context = _positive_int("max_model_len", max_model_len or m.max_position_embeddings)
    check_parallel(m, tp, pp)
    gpus = _positive_int("num_gpus", num_gpus if num_gpus is not None else tp * pp)
    if gpus < tp * pp:
        raise ValueError(f"tp={tp} x pp={pp} needs {tp * pp} GPUs, but only {gpus} are given")
    fmt = (weight_format if isinstance(weight_format, WeightFormat)
           else parse_weight_format(weight_format, m.quantization or m.torch_dtype))
    if file_weight_bytes is not None:
        bf16 = parse_weight_format("bf16")
        share = weight_bytes(m, bf16, tp, pp).total / weight_bytes(m, bf16).total
        weights = int(file_weight_bytes * share)
    else:
        weights = weight_bytes(m, fmt, tp, pp).total
    if activation_reserve is None:
        activations = estimate_activation_bytes(m, tp)
    elif activation_reserve in (0, "0"):
        activations = 0
    else:
        activations = parse_memory(activation_reserve, "activation_reserve")
    usable = int(memory * gpu_memory_utilization)
    per_token = kv_cache_bytes_per_token(m, kv_cache_dtype, tp, pp)
    split = None
    if cpu_offload_gb or num_device_layers is not None:
        from llmserve.planner.offload import split_weights

        if tp * pp > 1:
            raise ValueError("cpu_offload_gb / num_device_layers are planned for tp = pp = 1")
        split = split_weights(m, weights, fmt, cpu_offload_gb, num_device_layers)
        weights = split.device_weight_bytes
        per_token = per_token * split.num_device_layers // m.num_hidden_layers
    budget = usable - weights - activations
    window_bytes = 0
    if window_pool and pp == 1 and split is None and kv_budget_tokens is None:
        per_token, window_bytes = _window_pool(m, kv_cache_dtype, tp, block_size, concurrency,
                                               max_num_batched_tokens, budget, per_token)
    blocks = num_kv_cache_blocks(budget - window_bytes, block_size, per_token) \
        if budget - window_bytes >= block_size * per_token else 0
    chunk = _cdiv(_positive_int("max_num_batched_tokens", max_num_batched_tokens), block_size)
    cap = None
    if kv_budget_tokens is not None:
        cap = _positive_int("kv_budget_tokens", kv_budget_tokens) // block_size + chunk + 1
    elif m.sliding_window is not None and all(m.layer_window(i) is not None
                                              for i in range(m.num_hidden_layers)):
        cap = _cdiv(m.sliding_window + max_num_batched_tokens, block_size) + 1
    offload = {} if split is None else dict(
        num_device_layers=split.num_device_layers, offloaded_layers=split.offloaded_layers,
        host_weight_bytes=split.host_weight_bytes,
        offload_bytes_per_forward=split.bytes_per_forward,
        host_kv_bytes=blocks * block_size * split.host_kv_bytes_per_token(
            kv_cache_bytes_per_token(m, kv_cache_dtype)))
    return CapacityPlan(
        **offload, max_blocks_per_sequence=cap, window_pool_bytes=window_bytes, model=m.name, tp=tp, pp=pp, num_gpus=gpus, replicas=gpus // (tp * pp),
        block_size=block_size, max_model_len=context, concurrency=concurrency,
        gpu_memory=memory, gpu_memory_utilization=gpu_memory_utilization, usable_bytes=usable,
        weight_bytes=weights, activation_bytes=activations, kv_budget_bytes=budget,
        kv_bytes_per_token=per_token, num_blocks=blocks,
        weight_format="gguf file" if file_weight_bytes is not None else fmt.name,
        kv_cache_dtype=m.torch_dtype if kv_cache_dtype == "auto" else kv_cache_dtype)


def _window_pool(m: PlannerModel, kv_cache_dtype: str, tp: int, block_size: int,
                 max_num_seqs: int, max_num_batched_tokens: int, budget: int,
                 per_token: int) -> tuple[int, int]:
    """``(paged pool bytes per token, window pool bytes)``, as the engine splits them
    (``worker/window_kv.py``); ``(per_token, 0)`` for a model that is not mixed."""
    from llmserve.kv_cache.window_blocks import cap_window_pool, window_kv_layout

    layout, _ = window_kv_layout([m.layer_window(i) for i in range(m.num_hidden_layers)],
                                 block_size, max_num_seqs, max_num_batched_tokens, [])
    if layout is None:
        return per_token, 0
    per_layer = per_token // m.num_hidden_layers
    per_block = block_size * per_layer * len(layout.layers)
    layout = cap_window_pool(layout, per_block, budget)
    return per_layer * (m.num_hidden_layers - len(layout.layers)), layout.num_blocks * per_block


def candidate_layouts(model: PlannerModel, gpus_per_node: int = 8,
                      num_gpus: int | None = None) -> list[tuple[int, int]]:
    """Valid (tp, pp) pairs in search order: fewest GPUs first.

    ``tp`` is a power of two up to ``gpus_per_node`` (tensor parallelism stays
    inside a node); ``pp > 1`` only with the largest valid ``tp`` (pipeline
    stages span nodes). Bounded by ``num_gpus`` and the layer count.
    """
    _positive_int("gpus_per_node", gpus_per_node)
    limit = num_gpus if num_gpus is not None else gpus_per_node * model.num_hidden_layers
    tps = []
    tp = 1
    while tp <= gpus_per_node:
        try:
            check_parallel(model, tp, 1)
            tps.append(tp)
        except ValueError:
            pass
        tp *= 2
    layouts = [(t, 1) for t in tps if t <= limit]
    if tps:
        top = tps[-1]
        layouts += [(top, p) for p in range(2, model.num_hidden_layers + 1) if top * p <= limit]
    return layouts


def smallest_parallelism(model: ModelConfig | PlannerModel, *, gpu_memory: int | str,
                         max_model_len: int | None = None, concurrency: int = 1,
                         gpus_per_node: int = 8, num_gpus: int | None = None,
                         **kwargs: object) -> CapacityPlan:
    """The smallest tp x pp whose one replica holds ``concurrency`` x ``max_model_len``.

    Tries :func:`candidate_layouts` in order (fewest GPUs first, so tp within a
    node before pp across nodes) and returns the first that fits; the other
    keyword arguments go to :func:`plan_capacity`. With ``num_gpus``, the
    result counts the data-parallel replicas that fit on them.

    Raises:
        DoesNotFitError: (a ValueError) when nothing fits, saying why the largest
            layout tried failed.
        ValueError: for invalid arguments (as :func:`plan_capacity`).
    """
    m = as_planner_model(model)
    layouts = candidate_layouts(m, gpus_per_node, num_gpus)
    if not layouts:
        raise DoesNotFitError(f"no valid tp x pp for {m.name} within {num_gpus} GPUs "
                         f"({gpus_per_node} per node)")
    plan = None
    for tp, pp in layouts:
        plan = plan_capacity(m, gpu_memory=gpu_memory, tp=tp, pp=pp,
                             num_gpus=num_gpus if num_gpus is not None else tp * pp,
                             max_model_len=max_model_len, concurrency=concurrency,
                             **kwargs)  # type: ignore[arg-type]
        if plan.fits:
            return plan
    assert plan is not None
    bound = f"--gpus {num_gpus}" if num_gpus is not None else f"{m.num_hidden_layers} layers"
    raise DoesNotFitError(
        f"{m.name} does not fit {concurrency} x {plan.max_model_len:,}-token sequences on any "
        f"tp x pp up to tp={plan.tp} x pp={plan.pp} ({plan.tp * plan.pp} GPUs of "
        f"{format_size(plan.gpu_memory)}, limited by {bound}): at that size "
        f"{plan.shortfall()}")
