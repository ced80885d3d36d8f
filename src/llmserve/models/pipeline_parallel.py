"""Cut a Llama-family model into pipeline stages, outside the model code.

Layers are split into contiguous stages as vLLM's ``get_pp_indices`` does
(``vllm/distributed/utils.py``: ``num_layers // pp`` each, the remainder one layer
each to the stages before the last; :func:`~llmserve.planner.ledger.pp_partition`),
or as ``pp_layer_partition`` / ``LLMSERVE_PP_LAYER_PARTITION="16,14"`` says
(vLLM's ``VLLM_PP_LAYER_PARTITION``)::

    30 layers, pp=2:   stage 0: embed_tokens, layers 0..14
                       stage 1: layers 15..29, norm, lm_head (tied: embed_tokens too)

A stage keeps only its own layers (the others become :class:`PPMissingLayer`, as
vLLM's ``PPMissingLayer``: no parameters, no KV cache), loads only their weights
(:func:`stage_weights`), and allocates KV pages for its layers only
(``model.num_layers``). Tensor parallelism applies inside each stage.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from llmserve.config import ModelConfig

PARTITION_ENV = "LLMSERVE_PP_LAYER_PARTITION"


class PPMissingLayer(nn.Identity):
    """A placeholder for a module another pipeline stage owns (no parameters)."""


def pp_layer_ranges(num_layers: int, pp: int, partition: str | None = None) -> list[range]:
    """The layer range of every stage.

    Args:
        num_layers: decoder layers of the model.
        pp: pipeline stages.
        partition: ``"a,b,..."`` layers per stage (they must sum to ``num_layers``, each
            >= 1); None: ``$LLMSERVE_PP_LAYER_PARTITION`` if set, else vLLM's rule.

    Raises:
        ValueError: ``pp`` larger than ``num_layers``, or a bad partition (the message
            names the sizes and the layers).
    """
    if pp > num_layers:
        raise ValueError(f"pipeline_parallel_size={pp} exceeds the model's {num_layers} "
                         f"layers (each stage needs at least one layer)")
    partition = partition if partition is not None else os.environ.get(PARTITION_ENV)
    if partition:
        if not re.fullmatch(r"\s*\d+(\s*,\s*\d+)*\s*", partition):
            raise ValueError(f"pp_layer_partition {partition!r} must be comma-separated "
                             f"layer counts")
        sizes = [int(x) for x in partition.split(",")]
        if len(sizes) != pp or sum(sizes) != num_layers or min(sizes) < 1:
            raise ValueError(f"pp_layer_partition {partition!r} must give {pp} stages of at "
                             f"least one layer summing to the model's {num_layers} layers")
    else:
        from llmserve.planner.ledger import pp_partition

        sizes = pp_partition(num_layers, pp)
    ranges, start = [], 0
    for n in sizes:
        ranges.append(range(start, start + n))
        start += n
    return ranges


def check_pipeline_model(model: nn.Module) -> None:
    """Raise ValueError unless ``model`` runs through ``LlamaModel.forward`` (the stage-aware
    forward); other families (Gemma 3) have their own forward and no stages yet."""
    from llmserve.models.llama import LlamaModel

    inner = getattr(model, "model", None)
    if not isinstance(inner, LlamaModel) or type(inner).forward is not LlamaModel.forward:
        raise ValueError(f"pipeline parallelism does not support {type(model).__name__} "
                         f"yet (Llama-family models: Llama, Mistral, Qwen2, Qwen3, Phi-3)")


def make_pipeline_stage(model: nn.Module, config: ModelConfig, pp_rank: int, pp: int,
                        partition: str | None = None) -> nn.Module:
    """Turn ``model`` (built whole, weights not loaded) into stage ``pp_rank`` of ``pp``, in
    place; returns it. ``model.num_layers`` becomes the stage's layer count (the runner
    allocates that many KV caches); ``model.pp_layers`` its range.

    Raises:
        ValueError: see :func:`pp_layer_ranges` and :func:`check_pipeline_model`.
    """
    if pp == 1:
        return model
    check_pipeline_model(model)
    layers = pp_layer_ranges(config.num_hidden_layers, pp, partition)[pp_rank]
    inner = model.model
    first, last = pp_rank == 0, pp_rank == pp - 1
    for i in range(config.num_hidden_layers):
        if i not in layers:
            inner.layers[i] = PPMissingLayer()
    inner.start_layer, inner.end_layer, inner.is_last_stage = layers.start, layers.stop, last
    if not first and not (last and model.tie_word_embeddings):
        inner.embed_tokens = PPMissingLayer()
    if not last:
        inner.norm = PPMissingLayer()
        if model.lm_head is not None:
            model.lm_head = PPMissingLayer()
    model.num_layers = len(layers)
    model.pp_layers = layers
    model.pp_rank, model.pp_size = pp_rank, pp
    return model


_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def stage_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]
                  ) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint tensors this stage owns (names as Hugging Face writes them)."""
    layers = getattr(model, "pp_layers", None)
    if layers is None:
        yield from weights
        return
    inner = model.model
    for name, tensor in weights:
        m = _LAYER.match(name)
        if m is not None:
            if int(m.group(1)) in layers:
                yield name, tensor
            continue
        if name.startswith("model.embed_tokens.") and isinstance(inner.embed_tokens,
                                                                   PPMissingLayer):
            continue
        if name.startswith("model.norm.") and isinstance(inner.norm, PPMissingLayer):
            continue
        if name.startswith("lm_head.") and isinstance(model.lm_head, PPMissingLayer):
            continue
        yield name, tensor


def stage_kv_bytes_per_token(bytes_all_layers: int, config: ModelConfig,
                             model: nn.Module) -> int:
    """KV bytes per token of this stage's layers, from the whole model's figure."""
    num_layers = getattr(model, "num_layers", config.num_hidden_layers)
    return bytes_all_layers // config.num_hidden_layers * num_layers
