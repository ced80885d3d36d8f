"""Knowledge-distillation losses, the hidden-state projection, layer-dropped students and
the training samples (the loop is in :mod:`llmserve.compress.distill_train`).

White-box losses compare the next-token distributions of a teacher ``p_T`` and a student
``p_S`` at temperature ``tau`` (both ``softmax(logits / tau)``), per token position,
averaged over positions, and multiplied by ``tau**2`` so gradient magnitudes do not
shrink as ``tau`` grows (Hinton, Vinyals, Dean 2015, "Distilling the Knowledge in a
Neural Network", section 2)::

    fkl  forward KL   KL(p_T || p_S) = sum_v p_T(v) (log p_T(v) - log p_S(v))   mode covering
    rkl  reverse KL   KL(p_S || p_T)                                           mode seeking
    jsd  generalized Jensen-Shannon, beta in [0, 1], M = beta p_T + (1 - beta) p_S:
         JSD_beta = beta KL(p_T || M) + (1 - beta) KL(p_S || M)
         (GKD: Agarwal et al. 2024, "On-Policy Distillation of Language Models: Learning
         from Self-Generated Mistakes"; TRL's ``GKDTrainer.generalized_jsd_loss``).
         JSD_beta / beta -> fkl as beta -> 0 and JSD_beta / (1 - beta) -> rkl as
         beta -> 1; at exactly beta = 0 / 1 (where JSD_beta is 0) this returns fkl / rkl,
         as TRL does. beta = 0.5 is the symmetric JSD.

All KLs are in nats. Optional hidden-state loss (TinyBERT: Jiao et al. 2020, "TinyBERT:
Distilling BERT for Natural Language Understanding"): ``MSE(h_S W + b, h_T)`` through one learned :class:`HiddenProjection` shared by the
matched layers (student layer ``j`` of ``L_S`` <-> teacher layer ``round(j L_T / L_S)``).
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

LOSSES = ("fkl", "rkl", "jsd")
DROP_EVERY_OTHER = "drop every other layer"


def check_loss(loss: str, temperature: float, beta: float) -> None:
    """Raises ValueError (naming ``--loss``, ``--temperature`` or ``--jsd-beta``) for an
    unknown loss, ``temperature <= 0`` (or not finite) or ``beta`` outside [0, 1]."""
    if loss not in LOSSES:
        raise ValueError(f"--loss must be one of {list(LOSSES)}, got {loss!r}")
    if not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"--temperature must be a finite number > 0, got {temperature!r}")
    if not (0.0 <= beta <= 1.0):
        raise ValueError(f"--jsd-beta must be in [0, 1], got {beta!r}")


def _kl(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """KL(p || q) per position from log-probabilities ``[..., V]`` -> ``[...]`` (nats)."""
    return F.kl_div(log_q, log_p, reduction="none", log_target=True).sum(-1)


def token_divergence(student_logits: torch.Tensor, teacher_logits: torch.Tensor,
                     loss: str = "fkl", temperature: float = 1.0,
                     beta: float = 0.5) -> torch.Tensor:
    """Per-position divergence ``[...]`` (nats, without the ``tau**2`` factor) between
    ``softmax(student_logits / tau)`` and ``softmax(teacher_logits / tau)``, both
    ``[..., V]`` (see the module doc for ``loss`` and ``beta``).

    Raises:
        ValueError: a bad loss / temperature / beta, or the two vocabularies differ.
    """
    check_loss(loss, temperature, beta)
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(f"student logits {tuple(student_logits.shape)} and teacher logits "
                         f"{tuple(teacher_logits.shape)} differ (vocabulary sizes must match)")
    dtype = torch.promote_types(student_logits.dtype, torch.float32)  # float32 or float64
    log_s = F.log_softmax(student_logits.to(dtype) / temperature, dim=-1)
    log_t = F.log_softmax(teacher_logits.to(dtype) / temperature, dim=-1)
    if loss == "fkl" or (loss == "jsd" and beta == 0.0):
        return _kl(log_t, log_s)
    if loss == "rkl" or (loss == "jsd" and beta == 1.0):
        return _kl(log_s, log_t)
    log_m = torch.logsumexp(torch.stack([log_t + math.log(beta),
                                         log_s + math.log1p(-beta)]), dim=0)
    return beta * _kl(log_t, log_m) + (1.0 - beta) * _kl(log_s, log_m)


def distill_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor,
                 loss: str = "fkl", temperature: float = 1.0, beta: float = 0.5,
                 mask: torch.Tensor | None = None) -> torch.Tensor:
    """Scalar white-box loss: ``tau**2 *`` mean over positions of :func:`token_divergence`.

    Args:
        student_logits, teacher_logits: ``[B, L, V]`` (or ``[N, V]``) float logits.
        mask: optional bool ``[B, L]`` (``[N]``): positions that count (all by default).

    Raises:
        ValueError: as :func:`token_divergence`.
    """
    div = token_divergence(student_logits, teacher_logits, loss, temperature, beta)
    if mask is not None:
        div = div[mask]
    return temperature ** 2 * div.mean()


class HiddenProjection(nn.Linear):
    """Learned map student hidden ``[..., H_S]`` -> teacher hidden ``[..., H_T]``."""

    def __init__(self, student_hidden: int, teacher_hidden: int) -> None:
        super().__init__(student_hidden, teacher_hidden, bias=True)


def layer_map(num_student_layers: int, num_teacher_layers: int) -> list[tuple[int, int]]:
    """Pairs ``(j, round(j L_T / L_S))`` for ``j = 1 .. L_S`` into the ``hidden_states``
    tuples transformers returns (index 0 = embeddings, ``j`` = after layer ``j``)."""
    return [(j, round(j * num_teacher_layers / num_student_layers))
            for j in range(1, num_student_layers + 1)]


def hidden_loss(student_hidden: tuple[torch.Tensor, ...], teacher_hidden: tuple[torch.Tensor, ...],
                projection: HiddenProjection,
                mask: torch.Tensor | None = None) -> torch.Tensor:
    """Mean over matched layers of ``MSE(projection(h_S_j), h_T_map(j))``; each tuple holds
    ``[B, L, H]`` tensors (``output_hidden_states=True``); ``mask`` bool ``[B, L]``."""
    pairs = layer_map(len(student_hidden) - 1, len(teacher_hidden) - 1)
    total = student_hidden[0].new_zeros(())
    for j, k in pairs:
        diff = projection(student_hidden[j]) - teacher_hidden[k].detach()
        total = total + (diff[mask] if mask is not None else diff).pow(2).mean()
    return total / len(pairs)


def _decoder_layers(model: nn.Module) -> nn.ModuleList:
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"--student-from-teacher needs a decoder with model.layers "
                         f"(Llama, Mistral, Qwen2, Qwen3), got {type(model).__name__}")
    return layers


def drop_every_other_layer(teacher: nn.Module) -> nn.Module:
    """A student that is a deep copy of the transformers causal LM ``teacher`` keeping
    decoder layers 0, 2, 4, ... (``ceil(L / 2)`` of ``L``): the embedding, final norm and
    LM head are copied unchanged, ``config.num_hidden_layers`` (and ``layer_types`` when
    the config has it) updated, each kept attention's ``layer_idx`` renumbered.

    Raises:
        ValueError: the model has no ``model.layers`` or has a single layer.
    """
    layers = _decoder_layers(teacher)
    if len(layers) < 2:
        raise ValueError(f"--student-from-teacher {DROP_EVERY_OTHER!r}: the teacher has "
                         f"{len(layers)} layer(s); at least 2 are needed")
    keep = list(range(0, len(layers), 2))
    student = copy.deepcopy(teacher)
    student.model.layers = nn.ModuleList(student.model.layers[i] for i in keep)
    cfg = student.config
    cfg.num_hidden_layers = len(keep)
    if getattr(cfg, "layer_types", None) is not None:
        cfg.layer_types = [cfg.layer_types[i] for i in keep]
    for new, layer in enumerate(student.model.layers):
        for mod in layer.modules():
            if hasattr(mod, "layer_idx"):
                mod.layer_idx = new
    return student


def student_from_spec(spec: str, teacher: nn.Module,
                      flag: str = "--student-from-teacher") -> nn.Module:
    """Build a student from ``teacher`` by a spec: only ``"drop every other layer"``
    (case, ``-`` / ``_`` and extra spaces ignored).

    Raises:
        ValueError: an unknown spec (naming ``flag``).
    """
    if " ".join(spec.lower().replace("-", " ").replace("_", " ").split()) != DROP_EVERY_OTHER:
        raise ValueError(f"{flag} must be a model or {DROP_EVERY_OTHER!r}, got {spec!r}")
    return drop_every_other_layer(teacher)


# ---- training data (o: DistillOptions) ----

def _text(o: Any) -> tuple[str, str]:
    from llmserve.compress.texts import builtin_text, read_text_file

    if o.data:
        return read_text_file(o.data, "--data"), f"--data {o.data!r}"
    return builtin_text("calib"), "the built-in calibration text"


def whitebox_samples(tokenizer: Any, o: Any) -> list[list[int]]:
    """Windows of ``o.seq_len`` tokens of the training text (BOS first when defined)."""
    from llmserve.compress.texts import token_windows
    from llmserve.tokenizer import encode_text

    text, where = _text(o)
    ids = encode_text(tokenizer, text, "--data", add_special_tokens=False)
    return token_windows(ids, o.seq_len, field=where, bos_token_id=tokenizer.bos_token_id)


@torch.no_grad()
def blackbox_samples(teacher: torch.nn.Module, tokenizer: Any,
                     o: Any) -> list[tuple[list[int], int]]:
    """``(prompt + teacher tokens, prompt length)`` per prompt line; the teacher continues
    greedily to ``o.seq_len`` tokens in all (EOS suppressed: fixed lengths)."""
    from llmserve.tokenizer import encode_text

    text, where = _text(o)
    bos = [] if tokenizer.bos_token_id is None else [tokenizer.bos_token_id]
    room = max(1, o.seq_len // 2 - len(bos))
    prompts = [bos + encode_text(tokenizer, line, "--data", add_special_tokens=False)[:room]
               for line in text.splitlines() if line.strip()][:o.max_prompts]
    prompts = [p for p in prompts if p]
    if not prompts:
        raise ValueError(f"{where} has no prompt lines for --mode blackbox")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    out = []
    for p in prompts:
        new = o.seq_len - len(p)
        ids = teacher.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p),
                               dtype=torch.long), max_new_tokens=new, min_new_tokens=new,
                               do_sample=False, pad_token_id=pad)
        out.append((ids[0].tolist(), len(p)))
    return out


def sample_order(num_samples: int, position: int, count: int, seed: int) -> list[int]:
    """Indices of samples ``position .. position + count - 1`` in the stream of epochs,
    each epoch a permutation seeded by ``seed + epoch``."""
    out, perms = [], {}
    for pos in range(position, position + count):
        epoch = pos // num_samples
        if epoch not in perms:
            gen = torch.Generator().manual_seed(seed + epoch)
            perms[epoch] = torch.randperm(num_samples, generator=gen).tolist()
        out.append(perms[epoch][pos % num_samples])
    return out


def collate(samples: list[tuple[list[int], int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ``input_ids [B, L]`` and ``mask [B, L - 1]``: position ``i`` predicts
    token ``i + 1``, counted when that token is real and not part of the prompt (no
    attention mask is needed: padding only follows real tokens under causal attention)."""
    length = max(len(ids) for ids, _ in samples)
    input_ids = torch.zeros(len(samples), length, dtype=torch.long)
    mask = torch.zeros(len(samples), length - 1, dtype=torch.bool)
    for b, (ids, start) in enumerate(samples):
        input_ids[b, :len(ids)] = torch.tensor(ids)
        mask[b, max(start - 1, 0):len(ids) - 1] = True
    return input_ids, mask
