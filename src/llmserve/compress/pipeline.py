"""The layer-by-layer quantization loop (the GPTQ / llm-compressor "sequential" pipeline).

::

    calibration windows [S, L] -> embeddings -> hidden [S, L, H]   (captured at layer 0)
    for each decoder layer (tqdm bar):
        run the float layer on hidden, hooks record each linear group's inputs
            (GPTQ: Hessian; AWQ: inputs; SmoothQuant: per-channel max |x|)
        choose scales (AWQ / SmoothQuant; folded into the producing norm / linear),
        quantize the layer's linears, write their dequantized weights back
        hidden = the quantized layer's output on hidden             (input of the next)

Memory stays at one layer's activations for the calibration batch. The float model is a
transformers ``AutoModelForCausalLM`` in float32 (a GGUF is dequantized by transformers'
GGUF reader first, so quality is then relative to that dequantized source).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from llmserve.compress import awq, smoothquant
from llmserve.compress.gptq import GPTQ
from llmserve.compress.quantizer import check_bits, quantize_rtn

METHODS = ("rtn", "gptq", "awq", "smoothquant")
METHOD_BITS = {"rtn": (4, 8), "gptq": (4, 8), "awq": (4,), "smoothquant": (8,)}
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                           "Qwen3ForCausalLM")
# linears that read one input, and the module that produces it (scales fold into it)
GROUPS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "input_layernorm"),
    (("self_attn.o_proj",), "self_attn.v_proj"),
    (("mlp.gate_proj", "mlp.up_proj"), "post_attention_layernorm"),
    (("mlp.down_proj",), "mlp.up_proj"),
)
NO_CLIP = ("self_attn.q_proj", "self_attn.k_proj")
# AWQ scores a group's scales on this parent module's output (AutoAWQ's module2inspect)
AWQ_PARENTS = {"self_attn.q_proj": "self_attn", "mlp.gate_proj": "mlp"}


@dataclass
class QuantizeOptions:
    """``llmserve quantize`` settings (validated by :func:`check_options`)."""

    method: str
    bits: int
    group_size: int = 128
    act_order: bool = False
    symmetric: bool = False
    alpha: float = 0.5  # SmoothQuant strength
    percdamp: float = 0.01  # GPTQ damping


@dataclass
class QuantizedModel:
    """The result: ``model`` (float, with AWQ/SmoothQuant scales folded and quantized
    weights dequantized in place), ``weights`` HF module name -> :class:`QuantizedLinear`
    (weight-only) or ``(int8 codes [N, K], float32 scales [N])`` (W8A8)."""

    model: nn.Module
    options: QuantizeOptions
    weights: dict[str, Any] = field(default_factory=dict)


def check_options(opts: QuantizeOptions) -> None:
    """Raises ValueError for an unknown method or bits the method does not support."""
    if opts.method not in METHODS:
        raise ValueError(f"--method must be one of {list(METHODS)}, got {opts.method!r}")
    check_bits(opts.bits, METHOD_BITS[opts.method], opts.method)
    if opts.act_order and opts.method != "gptq":
        raise ValueError("--act-order applies to --method gptq only")


class _Captured(Exception):
    pass


def capture_layer_inputs(model: nn.Module, input_ids: torch.Tensor,
                         ) -> tuple[torch.Tensor, dict[str, Any]]:
    """Run the embeddings on ``input_ids [S, L]``; return layer 0's hidden states
    ``[S, L, H]`` and keyword arguments (rotary embeddings, mask), stopping there."""
    store: dict[str, Any] = {}

    def hook(_module, args, kwargs):
        store["hidden"] = args[0] if args else kwargs.pop("hidden_states")
        store["kwargs"] = {k: v for k, v in kwargs.items() if k != "hidden_states"}
        raise _Captured

    handle = model.model.layers[0].register_forward_pre_hook(hook, with_kwargs=True)
    try:
        model(input_ids=input_ids, use_cache=False)
    except _Captured:
        pass
    finally:
        handle.remove()
    kwargs = {k: (None if "cache" in type(v).__name__.lower() else v)
              for k, v in store["kwargs"].items()}
    return store["hidden"], kwargs


def run_layer(layer: nn.Module, hidden: torch.Tensor, kwargs: dict[str, Any]) -> torch.Tensor:
    out = layer(hidden, **kwargs)
    return out[0] if isinstance(out, tuple) else out


def _fold(producer: nn.Module, s: torch.Tensor) -> bool:
    """Divide the producer's output channels by ``s``: an RMSNorm weight or a linear's
    rows (and bias). False when its output size differs (GQA v_proj -> o_proj)."""
    w = producer.weight
    if w.shape[0] != s.numel():
        return False
    with torch.no_grad():
        if w.dim() == 1:
            w.div_(s)
        else:
            w.div_(s[:, None])
        if getattr(producer, "bias", None) is not None:
            producer.bias.div_(s)
    return True


def record_inputs(layer: nn.Module, method: str) -> tuple[dict[str, Any], list[Any]]:
    """Hooks on each group's first linear: its inputs (``awq``), Hessian (``gptq``, also
    SparseGPT's), ``sum x_j^2`` over tokens (``sqsum``, Wanda's) or max ``|x|``
    (``smoothquant``); returns the stats dict the hooks fill and their handles."""
    stats: dict[str, Any] = {}
    handles = []
    if method == "awq":  # the attention block's call, to rerun it in the scale search
        def attn_hook(_m, args, kwargs):
            hidden = args[0] if args else kwargs["hidden_states"]
            stats["shape"] = tuple(hidden.shape[:-1])
            stats["self_attn.kwargs"] = {k: v for k, v in kwargs.items()
                                         if k != "hidden_states"}

        handles.append(layer.get_submodule("self_attn").register_forward_pre_hook(
            attn_hook, with_kwargs=True))
    for names, _ in GROUPS:
        first = layer.get_submodule(names[0])

        def hook(_m, args, _out, key=names[0], k=first.in_features):
            x = args[0].detach().reshape(-1, k).float()
            if method == "gptq":
                stats.setdefault(key, GPTQ(k)).add_batch(x)
            elif method == "awq":
                stats.setdefault(key, []).append(x)
            elif method == "sqsum":
                sq = (x.double() ** 2).sum(0)
                stats[key] = stats[key] + sq if key in stats else sq
            else:
                amax = x.abs().amax(0)
                stats[key] = torch.maximum(stats[key], amax) if key in stats else amax

        handles.append(first.register_forward_hook(hook))
    return stats, handles


@contextmanager
def _holding(mods: list[nn.Module], weights: list[torch.Tensor]):
    """The linears ``mods`` hold ``weights`` inside the block, their own ones after."""
    saved = [m.weight.data for m in mods]
    try:
        for m, w in zip(mods, weights):
            m.weight.data = w
        yield
    finally:
        for m, w in zip(mods, saved):
            m.weight.data = w


def _awq_objective(layer: nn.Module, first: str, mods: list[nn.Module], x: torch.Tensor,
                   stats: dict[str, Any]):
    """The parent module's output on ``x [M, K]`` as a function of the group's weights
    (None for a group scored on its own outputs)."""
    parent = AWQ_PARENTS.get(first)
    if parent is None or "shape" not in stats:
        return None
    module = layer.get_submodule(parent)
    hidden = x.reshape(*stats["shape"], x.shape[-1])  # [S, L, K]
    kwargs = stats.get(f"{parent}.kwargs", {})

    def objective(weights: list[torch.Tensor]) -> torch.Tensor:
        with _holding(mods, weights):
            out = module(hidden, **kwargs)
        return out[0] if isinstance(out, tuple) else out

    return objective


def _awq_scale_layer(layer: nn.Module, stats: dict[str, Any],
                     opts: QuantizeOptions) -> dict[str, torch.Tensor]:
    """Search and fold every group's AWQ scales before any weight is quantized; returns
    each group's input ``[M, K]`` as the scaled linears see it (``x / s``, for the clip
    search).

    All folds come first because a producer can be a linear of an earlier group
    (``v_proj`` for ``o_proj``, ``up_proj`` for ``down_proj``): dividing its rows by
    ``s`` after it was rounded would leave the checkpoint's codes without the ``1/s``
    (AutoAWQ's ``auto_scale`` -> ``apply_scale`` for all groups, then ``auto_clip``,
    then quantization). q/k/v and gate/up are scored on their parent module's output
    (:data:`AWQ_PARENTS`), searched before any fold changes that module.
    """
    inputs: dict[str, torch.Tensor] = {}
    for names, producer in GROUPS:
        mods = [layer.get_submodule(n) for n in names]
        x = torch.cat(stats[names[0]])
        s = awq.search_scales(x, [m.weight for m in mods], opts.bits, opts.group_size,
                              objective=_awq_objective(layer, names[0], mods, x, stats))
        if _fold(layer.get_submodule(producer), s):
            with torch.no_grad():
                for m in mods:
                    m.weight.mul_(s)
            x = x / s
        inputs[names[0]] = x
    return inputs


def quantize_layer(layer: nn.Module, stats: dict[str, Any], opts: QuantizeOptions,
                   prefix: str) -> dict[str, Any]:
    """Quantize one decoder layer's linears in place (see the module doc); returns
    ``{f"{prefix}.{name}": QuantizedLinear | (codes, scales)}``."""
    out: dict[str, Any] = {}
    if opts.method == "awq":
        stats = _awq_scale_layer(layer, stats, opts)
    for names, producer in GROUPS:
        mods = [layer.get_submodule(n) for n in names]
        x = stats.get(names[0])
        if opts.method == "smoothquant":
            s = smoothquant.smoothing_scales(x, [m.weight for m in mods], opts.alpha)
            if producer.endswith("layernorm") and _fold(layer.get_submodule(producer), s):
                with torch.no_grad():
                    for m in mods:
                        m.weight.mul_(s)
        joint = None
        if opts.method == "gptq":  # rows are independent given H: one solve per group
            joint = x.quantize(torch.cat([m.weight.detach().float() for m in mods]),
                               opts.bits, opts.group_size, opts.symmetric, opts.act_order,
                               opts.percdamp)
        row = 0
        for name, m in zip(names, mods):
            w = m.weight.detach().float()
            if joint is not None:
                q = joint.rows(row, row + w.shape[0])
                row += w.shape[0]
                out[f"{prefix}.{name}"] = q
                deq = q.dequantize()
            elif opts.method == "smoothquant":
                codes, scales = smoothquant.quantize_int8_per_channel(w)
                out[f"{prefix}.{name}"] = (codes, scales)
                deq = codes.float() * scales[:, None]
            else:
                if opts.method == "awq" and name not in NO_CLIP:
                    w = awq.apply_clip(w, awq.search_clip(x, w, opts.bits, opts.group_size))
                q = quantize_rtn(w, opts.bits, opts.group_size, opts.symmetric)
                out[f"{prefix}.{name}"] = q
                deq = q.dequantize()
            with torch.no_grad():
                m.weight.copy_(deq)
    return out


def check_architecture(model: nn.Module, tool: str) -> None:
    """Raises ValueError unless ``model`` is one of :data:`SUPPORTED_ARCHITECTURES`."""
    arch = (getattr(model.config, "architectures", None) or [type(model).__name__])[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"llmserve {tool} supports {list(SUPPORTED_ARCHITECTURES)}, "
                         f"got {arch!r}")


def sequential_layers(model: nn.Module, calib: torch.Tensor | None, record: str | None,
                      apply, desc: str, progress: bool = True) -> None:
    """The sequential pass over the decoder layers (module docstring): with ``record``
    (a :func:`record_inputs` stat) each layer's inputs are recorded on the float layer,
    then ``apply(index, layer, stats)`` changes it, and its output feeds the next layer;
    without, ``apply`` runs on each layer with empty stats and no forward pass."""
    from tqdm import tqdm

    model.eval()
    hidden = kwargs = None
    if record is not None:
        hidden, kwargs = capture_layer_inputs(model, calib)
    for i, layer in enumerate(tqdm(model.model.layers, desc=desc, unit="layer",
                                   disable=not progress)):
        stats: dict[str, Any] = {}
        if hidden is not None:
            stats, handles = record_inputs(layer, record)
            try:
                run_layer(layer, hidden, kwargs)
            finally:
                for h in handles:
                    h.remove()
        apply(i, layer, stats)
        del stats
        if hidden is not None:
            hidden = run_layer(layer, hidden, kwargs)


@torch.no_grad()
def quantize_model(model: nn.Module, opts: QuantizeOptions,
                   calib: torch.Tensor | None, progress: bool = True) -> QuantizedModel:
    """Quantize every decoder linear of a transformers causal LM (float32) in place.

    Args:
        model: e.g. ``LlamaForCausalLM`` (architectures in :data:`SUPPORTED_ARCHITECTURES`).
        opts: the method, bits and group size.
        calib: int64 ``[S, L]`` calibration windows (None only for ``rtn``).
        progress: show a tqdm bar (one step per decoder layer).

    Raises:
        ValueError: bad options, an unsupported architecture, or no calibration data.
    """
    check_options(opts)
    check_architecture(model, "quantize")
    if calib is None and opts.method != "rtn":
        raise ValueError(f"--method {opts.method} needs calibration data")
    result = QuantizedModel(model, opts)

    def apply(i: int, layer: nn.Module, stats: dict[str, Any]) -> None:
        result.weights.update(quantize_layer(layer, stats, opts, f"model.layers.{i}"))

    sequential_layers(model, calib, None if opts.method == "rtn" else opts.method, apply,
                      f"quantize {opts.method} w{opts.bits}", progress)
    return result
