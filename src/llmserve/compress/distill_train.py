"""``llmserve distill``: train a student on a teacher (transformers, PyTorch, CPU or GPU).

::

    teacher (eval, no_grad) --logits [B, L, V]--+
                                                 +-- loss (distill.py) -- backward
    student (train) ---------logits [B, L, V]---+     x 1/K, K = --grad-accum micro-batches
                                                       -> AdamW step (grad norm clipped)

* ``whitebox``: windows of ``--seq-len`` tokens of ``--data`` (default: the built-in
  calibration text, never the evaluation text), each starting with BOS; loss
  fkl / rkl / jsd at ``--temperature`` (+ ``--hidden-loss-weight`` x hidden MSE).
* ``blackbox``: the teacher writes text (greedy, transformers ``generate``) for the
  prompts in ``--data`` (one per non-empty line, at most ``seq_len / 2`` tokens each, up
  to ``max_prompts``), filling each sample to ``--seq-len`` tokens; the student trains
  with cross-entropy on the teacher's tokens only (sequence-level KD, Kim & Rush 2016).
* Samples are drawn in a random order per epoch (``randperm`` seeded by ``seed +
  epoch``), so the data position (samples consumed) fixes the next batch.
* Every ``--save-every`` steps ``OUTPUT/checkpoint/trainer_state.pt`` holds the student
  and projection weights, AdamW state, step, data position, RNG states and the loss
  history; ``--resume`` continues that run on the same loss curve.
* The result is a Hugging Face directory (safetensors, config, tokenizer) that
  ``llmserve`` loads, plus ``distill.json`` (options, loss curve, perplexity and KL to
  the teacher before and after, through ``compress/evaluate.py``).
* ``via``: a chain teacher -> via[0] -> ... -> student, each stage's output the next
  stage's teacher (written to ``OUTPUT/stage-1``, ...).
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import tempfile
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from llmserve.compress.distill import (
    HiddenProjection,
    blackbox_samples,
    check_loss,
    collate,
    distill_loss,
    hidden_loss,
    sample_order,
    student_from_spec,
    token_divergence,
    whitebox_samples,
)

MODES = ("whitebox", "blackbox")
CKPT_DIR = "checkpoint"
STATE_FILE = "trainer_state.pt"
# options that must match for --resume to continue the same run
RESUME_KEYS = ("loss", "temperature", "jsd_beta", "hidden_loss_weight", "mode", "grad_accum",
               "lr", "batch_size", "seq_len", "seed", "weight_decay", "max_grad_norm",
               "keep_sparsity")


@dataclass
class DistillOptions:
    """``llmserve distill`` settings (validated by :func:`check_options`).

    ``student`` is a model (HF directory, GGUF, name); ``student_from_teacher`` a spec
    (``"drop every other layer"``); exactly one is given. ``via``: intermediate students
    (each a model or a spec applied to the previous stage). ``lr`` is AdamW's learning
    rate, ``save_every`` 0 = no checkpoints. ``keep_sparsity``: sparse fine-tuning, the
    zeros of the student's linears (a ``llmserve prune`` output) stay zero."""

    teacher: str | None
    output: str
    steps: int
    student: str | None = None
    student_from_teacher: str | None = None
    via: tuple[str, ...] = ()
    data: str | None = None
    loss: str = "fkl"
    temperature: float = 1.0
    jsd_beta: float = 0.5
    hidden_loss_weight: float = 0.0
    mode: str = "whitebox"
    grad_accum: int = 1
    lr: float = 1e-4
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    batch_size: int = 4
    seq_len: int = 128
    save_every: int = 0
    resume: bool = False
    seed: int = 0
    max_prompts: int = 256
    eval_text: str | None = None
    evaluate: bool = True
    progress: bool = True
    keep_sparsity: bool = False


def check_options(o: DistillOptions) -> None:
    """Raises ValueError naming the flag: missing ``--teacher``; not exactly one of
    ``--student`` / ``--student-from-teacher``; ``--steps`` / ``--grad-accum`` /
    ``--batch-size`` < 1; ``--seq-len`` < 2; ``--lr`` <= 0; ``--save-every`` < 0; an
    unknown ``--mode`` or ``--loss``; ``--temperature`` <= 0; ``--jsd-beta`` outside
    [0, 1]; ``--hidden-loss-weight`` < 0 or with ``--mode blackbox``."""
    if not o.teacher:
        raise ValueError("--teacher is required (a model name, GGUF file or HF directory)")
    if (o.student is None) == (o.student_from_teacher is None):
        raise ValueError("pass exactly one of --student MODEL and --student-from-teacher SPEC")
    for flag, value, low in (("--steps", o.steps, 1), ("--grad-accum", o.grad_accum, 1),
                             ("--batch-size", o.batch_size, 1), ("--seq-len", o.seq_len, 2),
                             ("--save-every", o.save_every, 0), ("--max-prompts",
                                                                 o.max_prompts, 1)):
        if not isinstance(value, int) or value < low:
            raise ValueError(f"{flag} must be an integer >= {low}, got {value!r}")
    if not o.lr > 0:
        raise ValueError(f"--lr must be > 0, got {o.lr!r}")
    if o.mode not in MODES:
        raise ValueError(f"--mode must be one of {list(MODES)}, got {o.mode!r}")
    check_loss(o.loss, o.temperature, o.jsd_beta)
    if not o.hidden_loss_weight >= 0:
        raise ValueError(f"--hidden-loss-weight must be >= 0, got {o.hidden_loss_weight!r}")
    if o.hidden_loss_weight > 0 and o.mode == "blackbox":
        raise ValueError("--hidden-loss-weight needs --mode whitebox (black-box sees text only)")


def _load(model: str, flag: str) -> tuple[Any, Any]:
    from llmserve.compress.quantize import load_float_model

    try:
        net, tokenizer, _ = load_float_model(model)
    except (ValueError, OSError) as e:
        raise ValueError(f"{flag} {model!r}: {e}") from None
    return net, tokenizer


def vocab_size(model: torch.nn.Module) -> int:
    """Rows of the LM head (the logits' last dimension)."""
    return int(model.get_output_embeddings().weight.shape[0])


def build_student(spec_or_model: str, teacher: torch.nn.Module, flag: str) -> torch.nn.Module:
    """The student: a spec (``student_from_spec``) applied to ``teacher``, else a model
    loaded in float32. Raises ValueError naming ``flag`` when its vocabulary size differs
    from the teacher's."""
    if os.path.exists(spec_or_model) or "layer" not in spec_or_model.lower():
        student, _ = _load(spec_or_model, flag)
    else:
        student = student_from_spec(spec_or_model, teacher, flag)
    if vocab_size(student) != vocab_size(teacher):
        raise ValueError(f"{flag} {spec_or_model!r} has vocabulary size {vocab_size(student)}"
                         f", the teacher's is {vocab_size(teacher)}; they must share a tokenizer")
    return student


def micro_loss(student, teacher, projection, input_ids: torch.Tensor, mask: torch.Tensor,
               o: DistillOptions) -> torch.Tensor:
    """The loss of one micro-batch (``input_ids [B, L]``, ``mask [B, L - 1]``)."""
    hidden = o.hidden_loss_weight > 0
    s_out = student(input_ids=input_ids, output_hidden_states=hidden, use_cache=False)
    s_logits = s_out.logits[:, :-1]  # [B, L - 1, V]
    if o.mode == "blackbox":
        return F.cross_entropy(s_logits[mask].float(), input_ids[:, 1:][mask])
    with torch.no_grad():
        t_out = teacher(input_ids=input_ids, output_hidden_states=hidden, use_cache=False)
    loss = distill_loss(s_logits, t_out.logits[:, :-1], o.loss, o.temperature, o.jsd_beta,
                        mask)
    if hidden:
        pad = F.pad(mask, (0, 1))  # [B, L]: hidden states at every real position
        pad[:, -1] = mask[:, -1]
        loss = loss + o.hidden_loss_weight * hidden_loss(s_out.hidden_states,
                                                         t_out.hidden_states, projection, pad)
    return loss


@torch.no_grad()
def mean_kl(student, teacher, windows: list[list[int]], loss: str = "fkl",
            temperature: float = 1.0, beta: float = 0.5) -> float:
    """Mean per-position divergence (nats; fkl = KL(teacher || student)) over
    ``windows`` (token lists) under teacher forcing, transformers forward passes."""
    total, count = 0.0, 0
    for ids in windows:
        x = torch.tensor([ids])
        div = token_divergence(student(input_ids=x).logits[0, :-1],
                               teacher(input_ids=x).logits[0, :-1], loss, temperature, beta)
        total, count = total + float(div.double().sum()), count + div.numel()
    return total / count


def _state(student, projection, opt, step, position, history) -> dict[str, Any]:
    return {"student": student.state_dict(),
            "projection": projection.state_dict() if projection is not None else None,
            "optimizer": opt.state_dict(), "step": step, "data_position": position,
            "loss_history": list(history),
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate()}}


def save_checkpoint(path: str, state: dict[str, Any]) -> None:
    """Write ``state`` to ``path`` atomically (temporary file, then rename)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    torch.save(state, tmp)
    os.replace(tmp, path)


def _restore(path: str, student, projection, opt, o: DistillOptions) -> tuple[int, int, list]:
    state = torch.load(path, weights_only=True)
    saved = state.get("options", {})
    for key in RESUME_KEYS:
        if key in saved and saved[key] != getattr(o, key):
            raise ValueError(f"--resume: {path} was written with --{key.replace('_', '-')} "
                             f"{saved[key]!r}, got {getattr(o, key)!r}")
    student.load_state_dict(state["student"])
    if projection is not None and state["projection"] is not None:
        projection.load_state_dict(state["projection"])
    opt.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"]["torch"])
    random.setstate(_as_tuple(state["rng"]["python"]))
    return state["step"], state["data_position"], list(state["loss_history"])


def _as_tuple(x):
    return tuple(_as_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x


def sparsity_masks(model: torch.nn.Module) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
    """``[(weight, keep)]`` for every linear below the LM head that holds zeros, ``keep``
    a bool tensor of the weight's shape (True = not pruned). Re-applied after each
    optimizer step, it holds the pruning mask while the rest trains (the sparse
    fine-tuning of SparseGPT section 5 / Wanda's LoRA recovery, here on all weights).

    Raises:
        ValueError: no linear holds a zero (the student was never pruned).
    """
    masks = [(m.weight, m.weight.detach() != 0) for name, m in model.named_modules()
             if isinstance(m, torch.nn.Linear) and not name.endswith("lm_head")]
    masks = [(w, keep) for w, keep in masks if not bool(keep.all())]
    if not masks:
        raise ValueError("--keep-sparsity: the student's linears hold no zeros; pass a "
                         "pruned student (llmserve prune ... --output DIR; --student DIR)")
    return masks


def train(student, teacher, samples: list[tuple[list[int], int]], o: DistillOptions,
          ckpt_path: str | None = None) -> list[float]:
    """Run ``o.steps`` optimizer steps on ``student`` in place; returns the loss of
    every step (mean over its ``o.grad_accum`` micro-batches). With ``o.save_every`` it
    writes ``ckpt_path`` every that many steps and after the last one; with ``o.resume``
    and an existing ``ckpt_path`` it continues from there (the curve so far included;
    a larger ``o.steps`` extends a finished run)."""
    from tqdm import tqdm

    torch.manual_seed(o.seed)
    random.seed(o.seed)
    teacher.eval()
    teacher.requires_grad_(False)
    student.train()
    student.requires_grad_(True)  # a copy of the (frozen) teacher starts frozen
    projection = None
    if o.hidden_loss_weight > 0:
        projection = HiddenProjection(student.config.hidden_size, teacher.config.hidden_size)
    masks = sparsity_masks(student) if o.keep_sparsity else []
    params = list(student.parameters()) + (list(projection.parameters()) if projection else [])
    opt = torch.optim.AdamW(params, lr=o.lr, weight_decay=o.weight_decay)
    step, position, history = 0, 0, []
    if o.resume and ckpt_path and os.path.isfile(ckpt_path):
        step, position, history = _restore(ckpt_path, student, projection, opt, o)
    bar = tqdm(total=o.steps, initial=min(step, o.steps), desc=f"distill {o.mode} "
               f"{o.loss if o.mode == 'whitebox' else 'ce'}", unit="step",
               disable=not o.progress)
    while step < o.steps:
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for _ in range(o.grad_accum):
            idx = sample_order(len(samples), position, o.batch_size, o.seed)
            position += o.batch_size
            input_ids, mask = collate([samples[i] for i in idx])
            loss = micro_loss(student, teacher, projection, input_ids, mask, o) / o.grad_accum
            loss.backward()
            total += float(loss.detach())
        if o.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(params, o.max_grad_norm)
        opt.step()
        with torch.no_grad():
            for weight, keep in masks:
                weight.mul_(keep)
        step += 1
        history.append(total)
        bar.update(1)
        bar.set_postfix(loss=f"{total:.4f}")
        if ckpt_path and o.save_every and (step % o.save_every == 0 or step == o.steps):
            state = _state(student, projection, opt, step, position, history)
            state["options"] = dataclasses.asdict(o)
            save_checkpoint(ckpt_path, state)
    bar.close()
    student.eval()
    return history


@dataclass
class DistillResult:
    """One stage (or the whole chain, with ``stages``): where it was written, the loss
    curve, and ``llmserve eval`` metrics of the student against its teacher before and
    after training (``EvalResult.as_dict()``: perplexity, kl_mean, top1_agreement, ...)."""

    output: str
    teacher: str
    student: str
    steps: int
    loss_history: list[float]
    before: dict[str, Any] | None = None
    after: dict[str, Any] | None = None
    stages: list[dict[str, Any]] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def save_student(student, tokenizer: Any, output: str) -> str:
    """Write ``student`` and ``tokenizer`` as a Hugging Face directory
    (:func:`llmserve.compress.hf_dir.save_hf_dir`)."""
    from llmserve.compress.hf_dir import save_hf_dir

    return save_hf_dir(student, tokenizer, output)


def _eval(model: str, teacher: str, o: DistillOptions) -> dict[str, Any]:
    from llmserve.compress.evaluate import evaluate
    from llmserve.compress.texts import read_text_file

    text = read_text_file(o.eval_text, "--eval-text") if o.eval_text else None
    seq = min(o.seq_len, 128) if text is not None else None
    return evaluate(model, reference=teacher, text=text, quick=True, seq_len=seq).as_dict()


def distill_stage(o: DistillOptions, student_spec: str, flag: str) -> DistillResult:
    """Distil ``o.teacher`` into ``student_spec`` (a model or a spec) and write
    ``o.output``; under ``o.resume`` a finished output of as many steps (``distill.json``)
    is reused, else training continues from ``OUTPUT/checkpoint``."""
    report = os.path.join(o.output, "distill.json")
    if o.resume and os.path.isfile(report):
        with open(report, encoding="utf-8") as f:
            done = json.load(f)
        if done.get("finished") and done.get("steps") == o.steps:
            names = {f.name for f in dataclasses.fields(DistillResult)}
            return DistillResult(**{k: v for k, v in done.items() if k in names})
    teacher, tokenizer = _load(o.teacher, "--teacher")
    teacher.requires_grad_(False)
    student = build_student(student_spec, teacher, flag)
    ckpt_dir = os.path.join(o.output, CKPT_DIR)
    if o.mode == "whitebox":
        samples = [(w, 0) for w in whitebox_samples(tokenizer, o)]
    else:
        cache = os.path.join(ckpt_dir, "blackbox_samples.json")
        if o.resume and os.path.isfile(cache):
            with open(cache, encoding="utf-8") as f:
                samples = [tuple(s) for s in json.load(f)]
        else:
            samples = blackbox_samples(teacher, tokenizer, o)
            os.makedirs(ckpt_dir, exist_ok=True)
            with open(cache, "w", encoding="utf-8") as f:
                json.dump(samples, f)
    before = None
    if o.evaluate:
        if os.path.exists(student_spec):
            before = _eval(student_spec, o.teacher, o)
        else:
            with tempfile.TemporaryDirectory(prefix="llmserve-distill-") as tmp:
                before = _eval(save_student(student, tokenizer, tmp), o.teacher, o)
    history = train(student, teacher, samples, o, os.path.join(ckpt_dir, STATE_FILE))
    save_student(student, tokenizer, o.output)
    after = _eval(o.output, o.teacher, o) if o.evaluate else None
    result = DistillResult(o.output, o.teacher, student_spec, o.steps, history, before, after)
    with open(report, "w", encoding="utf-8") as f:
        json.dump({**result.as_dict(), "finished": True, "options": dataclasses.asdict(o)},
                  f, indent=1)
    return result


def distill(o: DistillOptions) -> DistillResult:
    """``llmserve distill``: validate ``o``, then one stage per student of the chain
    ``o.via + (student,)``, each trained ``o.steps`` steps on the previous one (stage
    ``i < n`` written to ``OUTPUT/stage-i``, the last to ``OUTPUT``). Returns the last
    stage's result with every stage's in ``stages`` (for a chain, ``after`` of the last
    stage is measured against the original teacher too, under ``"vs_teacher"``).

    Raises:
        ValueError: bad options (see :func:`check_options`), an unloadable model, a
            vocabulary mismatch, too little data, or a ``--resume`` with other options.
    """
    check_options(o)
    chain = [*o.via, o.student if o.student is not None else o.student_from_teacher]
    flags = ["--via"] * len(o.via) + ["--student" if o.student is not None
                                      else "--student-from-teacher"]
    teacher, results = o.teacher, []
    for i, (spec, flag) in enumerate(zip(chain, flags)):
        out = o.output if i == len(chain) - 1 else os.path.join(o.output, f"stage-{i + 1}")
        stage = dataclasses.replace(o, teacher=teacher, output=out)
        results.append(distill_stage(stage, spec, flag))
        teacher = out
    last = results[-1]
    last.stages = [r.as_dict() for r in results] if len(results) > 1 else []
    if len(results) > 1 and o.evaluate and last.after is not None:
        last.after = {**last.after, "vs_teacher": _eval(o.output, o.teacher, o)}
    return last
