"""``llmserve distill`` (see :mod:`llmserve.compress.distill_train`)."""

from __future__ import annotations

import argparse
import json


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "distill", help="distil a teacher model into a smaller student (KD training)",
        description="Train STUDENT to imitate TEACHER on a text (white-box: match its "
                    "next-token distributions with forward/reverse KL or generalized JSD "
                    "at a temperature, optionally its hidden states; black-box: "
                    "cross-entropy on text the teacher writes), then write a Hugging Face "
                    "directory llmserve loads and report perplexity and KL to the teacher "
                    "before and after (llmserve eval --quick on the built-in eval text).")
    p.add_argument("--teacher", default=None, help="teacher: model name, GGUF or HF directory")
    who = p.add_mutually_exclusive_group()
    who.add_argument("--student", default=None, help="student model (same vocabulary)")
    who.add_argument("--student-from-teacher", default=None, metavar="SPEC",
                     help='build the student from the teacher: "drop every other layer"')
    p.add_argument("--via", action="append", default=[], metavar="DIR_OR_SPEC",
                   help="step-by-step: an intermediate student (model or spec), trained "
                        "first and then used as the teacher of the next (repeatable)")
    p.add_argument("--data", default=None,
                   help="training text file (default: the built-in calibration text); "
                        "blackbox: one prompt per line")
    p.add_argument("--steps", type=int, required=True, help="optimizer steps (per stage)")
    p.add_argument("--output", required=True, help="output directory")
    p.add_argument("--loss", default="fkl", help="fkl, rkl or jsd (default fkl)")
    p.add_argument("--temperature", type=float, default=1.0, help="softmax temperature (1)")
    p.add_argument("--jsd-beta", type=float, default=0.5, help="jsd's beta in [0, 1] (0.5)")
    p.add_argument("--hidden-loss-weight", type=float, default=0.0,
                   help="weight of the hidden-state MSE (learned projection; default 0)")
    p.add_argument("--mode", default="whitebox", help="whitebox or blackbox")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per step (1)")
    p.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate (1e-4)")
    p.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay (0)")
    p.add_argument("--max-grad-norm", type=float, default=1.0,
                   help="gradient-norm clip, 0 = off (1.0)")
    p.add_argument("--batch-size", type=int, default=4, help="sequences per micro-batch (4)")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (128)")
    p.add_argument("--save-every", type=int, default=0,
                   help="checkpoint every N steps to OUTPUT/checkpoint (0 = never)")
    p.add_argument("--resume", action="store_true",
                   help="continue from OUTPUT/checkpoint (same options)")
    p.add_argument("--seed", type=int, default=0, help="data order / projection seed (0)")
    p.add_argument("--max-prompts", type=int, default=256, help="blackbox: prompts (256)")
    p.add_argument("--eval-text", default=None,
                   help="text file for the before/after report (default: built-in eval)")
    p.add_argument("--keep-sparsity", action="store_true",
                   help="sparse fine-tuning: the zeros of a pruned --student stay zero")
    p.add_argument("--no-eval", action="store_true", help="skip the before/after report")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=_run_distill)


def _line(name: str, m: dict | None) -> str:
    if not m:
        return f"{name}: not measured"
    return (f"{name}: perplexity {m['perplexity']:.4f} (teacher {m['reference_perplexity']:.4f}),"
            f" KL(teacher || student) mean {m['kl_mean']:.4f} nats, max {m['kl_max']:.4f}, "
            f"top-1 agreement {100 * m['top1_agreement']:.1f}%")


def _run_distill(args: argparse.Namespace) -> int:
    from llmserve.compress.distill_train import DistillOptions, distill

    opts = DistillOptions(
        teacher=args.teacher, output=args.output, steps=args.steps, student=args.student,
        student_from_teacher=args.student_from_teacher, via=tuple(args.via), data=args.data,
        loss=args.loss, temperature=args.temperature, jsd_beta=args.jsd_beta,
        hidden_loss_weight=args.hidden_loss_weight, mode=args.mode, grad_accum=args.grad_accum,
        lr=args.lr, weight_decay=args.weight_decay, max_grad_norm=args.max_grad_norm,
        batch_size=args.batch_size, seq_len=args.seq_len, save_every=args.save_every,
        resume=args.resume, seed=args.seed, max_prompts=args.max_prompts,
        eval_text=args.eval_text, evaluate=not args.no_eval, progress=not args.no_progress,
        keep_sparsity=args.keep_sparsity)
    result = distill(opts)
    if args.json:
        print(json.dumps(result.as_dict()))
        return 0
    for stage in result.stages or [result.as_dict()]:
        h = stage["loss_history"]
        print(f"{stage['student']} <- {stage['teacher']}: {stage['steps']} steps, loss "
              f"{h[0]:.4f} -> {h[-1]:.4f}, wrote {stage['output']}")
        print("  " + _line("before", stage["before"]))
        print("  " + _line("after ", stage["after"]))
    if result.after and "vs_teacher" in result.after:
        print(_line("final vs the original teacher", result.after["vs_teacher"]))
    return 0
