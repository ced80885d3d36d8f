"""``llmserve eval``: perplexity, and KL divergence / top-1 agreement against a reference.

Each model runs through llmserve's own model classes and weight loader (the same
weights, quantization methods and kernels the engine runs), one window of tokens at a
time as a single prefill into a fresh paged KV cache. For a window ``t_0 .. t_{L-1}``
the model's next-token distributions ``p_i = softmax(logits_i)`` predict ``t_{i+1}``::

    NLL        = -sum_i log p_i(t_{i+1})   over all windows, i = 0 .. L-2
    perplexity = exp(NLL / number of predicted tokens)
    KL_i       = sum_v P_i(v) (log P_i(v) - log p_i(v))      P = reference, p = candidate
    top-1      = fraction of positions with argmax P_i == argmax p_i

KL is in nats, mean and max over positions (the metric llama.cpp's
``llama-perplexity --kl-divergence`` reports). The reference sees exactly the
candidate's token windows; the two models must share a tokenizer (same vocabulary size).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch

from llmserve.compress.texts import builtin_text, token_windows

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
BLOCK_SIZE = 16


@dataclass
class LoadedModel:
    """A model loaded as the engine loads it: ``model`` (an llmserve ``nn.Module``),
    its ``tokenizer``, ``config`` (``ModelConfig``) and the weights' method name."""

    model: torch.nn.Module
    tokenizer: Any
    config: Any
    name: str
    weights: str


def _activation_quantized(ckpt: Any) -> bool:
    """True for checkpoints whose activations are quantized at run time (W8A8)."""
    return any(getattr(s, "act_dynamic", None) is not None for s in getattr(ckpt, "schemes", ()))


def load_model(model: str, dtype: str = "float32", quantization: str = "auto") -> LoadedModel:
    """Load ``model`` (a name, GGUF file or HF directory) through ``llmserve.loader``.

    ``quantization``: ``auto`` runs W8A8 checkpoints natively (their int8 activations
    change the numbers) and dequantizes weight-only ones at load (exactly the weights
    the engine runs, in dense matmuls: torch's int4 CPU kernel is slow for float32
    prompts); ``native`` runs every checkpoint's own method; else as the engine's
    ``--quantization`` (``none``: dequantize everything).

    Raises:
        ValueError: an unknown model, bad dtype or unsupported format.
    """
    from llmserve.layers.quantization import resolve_quantization
    from llmserve.loader import (
        checkpoint_quantization,
        iter_weights,
        load_model_config,
        resolve_model,
    )
    from llmserve.loader.gguf_loader import gguf_tensor_types
    from llmserve.models.registry import get_model_class
    from llmserve.tokenizer import load_tokenizer

    if dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {list(DTYPES)}, got {dtype!r}")
    source = resolve_model(model)
    config = load_model_config(source)
    ckpt = checkpoint_quantization(source)
    if quantization == "auto" and ckpt is not None and not _activation_quantized(ckpt):
        quantization = "none"
    elif quantization == "native":
        quantization = "auto"
    quant = resolve_quantization(
        quantization, model_kind=source.kind, dtype=dtype, device="cpu",
        checkpoint=ckpt,
        gguf_types=set(gguf_tensor_types(source.path).values()) if source.kind == "gguf"
        else None)
    net = get_model_class(config.architecture)(config, DTYPES[dtype], "cpu")
    net.load_weights(iter_weights(source, config, quantization=quant))
    if quant is not None:
        quant.process_model(net)
        quant.fix_layouts(net)
    net.eval()
    return LoadedModel(net, load_tokenizer(source), config, source.name,
                       quant.name if quant is not None else "dense")


@torch.inference_mode()
def window_logits(model: torch.nn.Module, token_ids: list[int]) -> torch.Tensor:
    """float32 logits ``[L, vocab_size]`` of one sequence ``token_ids`` (length L), run
    as one prefill into a fresh KV cache of ``ceil(L / 16)`` blocks."""
    from llmserve.layers.attention import CommonAttentionMetadata

    n = len(token_ids)
    num_blocks = -(-n // BLOCK_SIZE)
    shape = model.get_kv_cache_shape(num_blocks, BLOCK_SIZE)
    kv_caches = [(torch.zeros(shape, dtype=model.dtype), torch.zeros(shape, dtype=model.dtype))
                 for _ in range(model.num_layers)]
    positions = torch.arange(n, dtype=torch.long)
    common = CommonAttentionMetadata(
        query_start_loc=torch.tensor([0, n], dtype=torch.long),
        seq_lens=torch.tensor([n], dtype=torch.long),
        block_table=torch.arange(num_blocks, dtype=torch.long)[None],
        slot_mapping=positions.clone(), query_lens=[n], seq_lens_list=[n], num_decodes=0,
        max_query_len=n, max_seq_len=n, block_size=BLOCK_SIZE,
        sliding_window=getattr(model, "sliding_window", None))
    metadata = model.attn_backend_cls.build_metadata(common)
    hidden = model(torch.tensor(token_ids, dtype=torch.long), positions, kv_caches, metadata)
    return model.compute_logits(hidden)  # [L, vocab_size] float32


@dataclass
class EvalResult:
    """Metrics over ``num_tokens`` predicted tokens in ``num_windows`` windows."""

    model: str
    num_tokens: int
    num_windows: int
    seq_len: int
    perplexity: float
    reference: str | None = None
    reference_perplexity: float | None = None
    kl_mean: float | None = None
    kl_max: float | None = None
    top1_agreement: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def eval_windows(windows: list[list[int]], candidate: torch.nn.Module,
                 reference: torch.nn.Module | None = None) -> dict[str, float]:
    """Perplexity (and, with ``reference``, KL and top-1 agreement) over token windows.

    Returns:
        ``{"num_tokens", "perplexity"}`` plus ``"reference_perplexity", "kl_mean",
        "kl_max", "top1_agreement"`` with a reference (see the module doc).
    """
    nll = ref_nll = kl_sum = 0.0
    kl_max, agree, count = 0.0, 0, 0
    for ids in windows:
        target = torch.tensor(ids[1:], dtype=torch.long)
        logp = torch.log_softmax(window_logits(candidate, ids)[:-1].double(), dim=-1)
        nll -= float(logp.gather(1, target[:, None]).sum())
        count += len(ids) - 1
        if reference is None:
            continue
        ref_logp = torch.log_softmax(window_logits(reference, ids)[:-1].double(), dim=-1)
        if ref_logp.shape != logp.shape:
            raise ValueError(f"the reference's vocabulary ({ref_logp.shape[-1]}) differs "
                             f"from the model's ({logp.shape[-1]}); they must share a "
                             "tokenizer")
        ref_nll -= float(ref_logp.gather(1, target[:, None]).sum())
        kl = (ref_logp.exp() * (ref_logp - logp)).sum(-1).clamp(min=0)  # [L - 1]
        kl_sum += float(kl.sum())
        kl_max = max(kl_max, float(kl.max()))
        agree += int((ref_logp.argmax(-1) == logp.argmax(-1)).sum())
    out = {"num_tokens": count, "perplexity": math.exp(nll / count)}
    if reference is not None:
        out.update(reference_perplexity=math.exp(ref_nll / count), kl_mean=kl_sum / count,
                   kl_max=kl_max, top1_agreement=agree / count)
    return out


def evaluate(model: str, reference: str | None = None, text: str | None = None,
             dataset: str = "all", quick: bool = False, seq_len: int | None = None,
             max_windows: int | None = None, dtype: str = "float32",
             quantization: str = "auto") -> EvalResult:
    """``llmserve eval``: ``text`` (else the built-in evaluation set ``dataset``) cut into
    windows of ``seq_len`` tokens (default 512 or the model's maximum if smaller;
    ``quick``: 128 and 4 windows spread over the text; ``max_windows``: the first N),
    each starting with the tokenizer's BOS token when it has one.

    Raises:
        ValueError: a bad model, dataset, too short a text or mismatched vocabularies.
    """
    from llmserve.tokenizer import encode_text

    body = text if text is not None else builtin_text("eval", dataset)  # checked first
    cand = load_model(model, dtype, quantization)
    ref = load_model(reference, dtype, quantization) if reference is not None else None
    max_len = cand.config.max_position_embeddings
    if seq_len is not None and seq_len > max_len:
        raise ValueError(f"--seq-len {seq_len} exceeds the model's max_position_embeddings "
                         f"{max_len}")
    seq_len = seq_len or min(128 if quick else 512, max_len)
    tokens = encode_text(cand.tokenizer, body, "text", add_special_tokens=False)
    windows = token_windows(tokens, seq_len, field="the evaluation text",
                            bos_token_id=cand.tokenizer.bos_token_id)
    if quick and max_windows is None and len(windows) > 4:  # spread over en / zh / code
        windows = [windows[round(i * (len(windows) - 1) / 3)] for i in range(4)]
    windows = windows[:max_windows] if max_windows else windows
    m = eval_windows(windows, cand.model, ref.model if ref is not None else None)
    return EvalResult(model=cand.name, num_tokens=m["num_tokens"], num_windows=len(windows),
                      seq_len=seq_len, perplexity=m["perplexity"],
                      reference=ref.name if ref is not None else None,
                      reference_perplexity=m.get("reference_perplexity"),
                      kl_mean=m.get("kl_mean"), kl_max=m.get("kl_max"),
                      top1_agreement=m.get("top1_agreement"))
