"""``llmserve prune MODEL --pattern 2:4|unstructured --sparsity S --method M --output DIR``
(algorithms: :mod:`llmserve.compress.prune`)."""

from __future__ import annotations

import argparse
import json
from typing import Any


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "prune", help="prune a model's weights (magnitude, Wanda, SparseGPT; 2:4 or "
                      "unstructured) and report perplexity before and after",
        description="Zero weights of every decoder linear, layer by layer with "
                    "calibration text, write a Hugging Face directory (dense tensors with "
                    "zeros; config.json's sparsity_config says how) and report perplexity "
                    "and KL to the original (llmserve eval --quick). On CPU a pruned model "
                    "runs at dense speed.")
    p.add_argument("model", help="model name, GGUF file or Hugging Face directory")
    p.add_argument("--method", default="wanda", help="magnitude, wanda or sparsegpt (wanda)")
    p.add_argument("--pattern", default="2:4", help="2:4 or unstructured (2:4)")
    p.add_argument("--sparsity", type=float, default=0.5,
                   help="fraction of zeros, in (0, 1); 2:4 means 0.5 (default 0.5)")
    p.add_argument("--calib", default=None,
                   help="calibration text file (default: the built-in calibration text)")
    p.add_argument("--num-samples", type=int, default=16, help="calibration windows (16)")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per window (256)")
    p.add_argument("--output", required=True, help="output directory")
    p.add_argument("--no-eval", action="store_true", help="skip the before/after report")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=_run)


def prune_checkpoint(model: str, o: Any, output: str, calib: str | None = None,
                     num_samples: int = 16, seq_len: int = 256, progress: bool = True,
                     evaluate: bool = True) -> dict[str, Any]:
    """Prune ``model`` with options ``o`` (:class:`~llmserve.compress.prune.PruneOptions`)
    and write ``output``; returns the report (sparsity; with ``evaluate``, perplexity
    of the original and of the pruned model and the KL of the pruned one to it).

    Raises:
        ValueError: bad options, too little calibration text, a bad model or output.
    """
    from llmserve.compress.evaluate import evaluate as run_eval
    from llmserve.compress.hf_dir import save_hf_dir
    from llmserve.compress.prune import check_options, prune_model
    from llmserve.compress.quantize import calibration_ids, load_float_model

    check_options(o)
    net, tokenizer, _ = load_float_model(model)
    ids = None if o.method == "magnitude" else calibration_ids(tokenizer, calib, num_samples,
                                                               seq_len)
    sparsity = prune_model(net, o, ids, progress=progress)
    save_hf_dir(net, tokenizer, output, {"sparsity_config": {
        # compressed-tensors' SparsityCompressionConfig field names; dense tensors
        "format": "dense", "sparsity_structure": o.pattern, "global_sparsity": sparsity,
        "targets": ["Linear"], "ignore": ["lm_head"], "method": o.method}})
    report: dict[str, Any] = {"output": output, "method": o.method, "pattern": o.pattern,
                              "sparsity": sparsity}
    if evaluate:
        r = run_eval(output, reference=model, quick=True)
        report.update(perplexity_before=r.reference_perplexity, perplexity_after=r.perplexity,
                      kl_mean=r.kl_mean, top1_agreement=r.top1_agreement)
    return report


def _run(args: argparse.Namespace) -> int:
    from llmserve.compress.prune import PruneOptions

    o = PruneOptions(method=args.method, pattern=args.pattern, sparsity=args.sparsity)
    report = prune_checkpoint(args.model, o, args.output, args.calib, args.num_samples,
                              args.seq_len, progress=not args.no_progress,
                              evaluate=not args.no_eval)
    if args.json:
        print(json.dumps(report))
    else:
        print(f"wrote {args.output}: {o.method} {o.pattern}, {report['sparsity']:.1%} of the "
              "decoder linears' weights are zero")
        if "perplexity_after" in report:
            print(f"perplexity {report['perplexity_before']:.2f} -> "
                  f"{report['perplexity_after']:.2f} (llmserve eval --quick); KL to the "
                  f"original {report['kl_mean']:.4f} nats, top-1 agreement "
                  f"{report['top1_agreement']:.1%}")
    return 0
