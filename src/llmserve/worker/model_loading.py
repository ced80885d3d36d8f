"""Build and load one rank's model: the same steps on the driver and on every worker."""

from __future__ import annotations

from typing import Any

import torch

from llmserve.config import EngineConfig
from llmserve.distributed.parallel_state import GroupCoordinator
from llmserve.layers.batch_invariant import make_batch_invariant
from llmserve.layers.quantization import resolve_quantization
from llmserve.loader import ModelSource, checkpoint_quantization, iter_weights
from llmserve.loader.gguf_loader import gguf_tensor_types
from llmserve.models import get_model_class
from llmserve.models.pipeline_parallel import make_pipeline_stage, stage_weights
from llmserve.models.tensor_parallel import build_model_shard
from llmserve.worker.model_runner import TORCH_DTYPES


def load_model(config: EngineConfig, source: ModelSource, quantization: str,
               tp: GroupCoordinator | None = None, pp_rank: int = 0):
    """``(model, quantization config or None)``: this rank's shard (the whole model when
    ``tp`` is None or has one rank) of pipeline stage ``pp_rank`` (its layers only, when
    ``pipeline_parallel_size > 1``), weights loaded, quantization processed, eval mode.

    Raises:
        ValueError: an unsupported format or architecture, a bad weight.
    """
    mc = config.model_config
    quant = resolve_quantization(
        quantization, model_kind=source.kind, dtype=config.dtype, device=config.device,
        checkpoint=checkpoint_quantization(source),
        gguf_types=set(gguf_tensor_types(source.path).values()) if source.kind == "gguf"
        else None,
        deterministic=config.deterministic)
    if config.seed is not None:
        torch.manual_seed(config.seed)
    model_cls = get_model_class(mc.architecture)
    dtype = TORCH_DTYPES[config.dtype]
    oc = getattr(config, "offload_config", None)
    offload = oc is not None and oc.enabled
    # offload / layer split: build and load in host memory, then place (layer_split.py)
    with torch.device("cpu" if offload else config.device):
        if tp is None or tp.world_size == 1:
            model = model_cls(mc, dtype, config.attention_backend)
        else:
            model = build_model_shard(model_cls, mc, dtype, config.attention_backend, tp,
                                      config.parallel_config.enable_expert_parallel)
    pc = config.parallel_config
    make_pipeline_stage(model, mc, pp_rank, pc.pipeline_parallel_size,
                        getattr(pc, "pp_layer_partition", None))
    # a quantization method replaces the layers' matmuls; the model code is unchanged
    model.load_weights(stage_weights(model, iter_weights(source, mc, quantization=quant)))
    if quant is not None:
        quant.process_model(model)
    if config.deterministic:  # dense layers: fixed-shape row chunks (batch_invariant.py)
        make_batch_invariant(model)
    model.eval()
    if offload:
        from llmserve.worker.layer_split import install_offload

        install_offload(model, config)
    elif quant is not None:
        quant.fix_layouts(model)
    return model, quant


def model_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the weights as the engine holds them: every parameter, and every tensor
    held by a layer's ``quant_method`` (packed kernels of GGUF and checkpoint layers,
    int8 codes, scales) or hung off a parameter (``p.packed``), each storage counted
    once (tied embeddings, shared packed LM heads). Buffers (RoPE tables) are not
    weights and are left out, as the planner's ledger leaves them out."""
    seen: set[int] = set()
    total = 0

    def add(t: torch.Tensor) -> None:
        nonlocal total
        if t.device.type == "meta":
            return
        if t.is_mkldnn:  # oneDNN's packed layout (dense_prefill.py): no storage to share
            total += t.numel() * t.element_size()
            return
        st = t.untyped_storage()
        if st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            total += st.nbytes()

    def walk(obj: Any, depth: int) -> None:
        if isinstance(obj, torch.Tensor):
            add(obj)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                walk(v, depth)
        elif depth > 0 and hasattr(obj, "__dict__") and not isinstance(obj, torch.nn.Module):
            for v in vars(obj).values():
                walk(v, depth - 1)

    for t in model.parameters():
        add(t)
        walk(getattr(t, "packed", None), 3)
    for m in model.modules():
        walk(getattr(m, "quant_method", None), 3)
    return total
