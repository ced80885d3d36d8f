"""Precision and recall of each content-safety check on the labelled evaluation set.

    PYTHONPATH=src python benchmarks/safety_eval.py [--data benchmarks/data/safety_eval.jsonl]
        [--judge-url http://127.0.0.1:8000/v1 --judge-model NAME] [--show-errors]

The set (``benchmarks/data/safety_eval.jsonl``, one JSON object a line: ``id``,
``label`` in benign|injection|harmful|pii, ``lang`` en|zh, ``text``) was written by
hand for this project. A check's positives are the items whose label is its target
(``injection`` -> injection, ``harmful`` -> harmful, ``pii`` -> pii, ``llm_judge`` ->
injection or harmful); an item counts as predicted positive when the check returns
any verdict. Prints a Markdown table: overall and per language.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from llmserve.gateway.safety import build_check  # noqa: E402

TARGETS = {"injection": {"injection"}, "harmful": {"harmful"}, "pii": {"pii"},
           "llm_judge": {"injection", "harmful"}}
DEFAULT_DATA = os.path.join(os.path.dirname(__file__), "data", "safety_eval.jsonl")


def load(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        items = [json.loads(line) for line in f if line.strip()]
    for it in items:
        if it.get("label") not in ("benign", "injection", "harmful", "pii") or not it.get("text"):
            raise ValueError(f"{path}: bad item {it!r}")
    return items


def prf(pred: list[bool], gold: list[bool]) -> tuple[int, int, int, float, float]:
    tp = sum(p and g for p, g in zip(pred, gold))
    fp = sum(p and not g for p, g in zip(pred, gold))
    fn = sum(g and not p for p, g in zip(pred, gold))
    prec = tp / (tp + fp) if tp + fp else float("nan")
    rec = tp / (tp + fn) if tp + fn else float("nan")
    return tp, fp, fn, prec, rec


def evaluate(items: list[dict], checks: dict) -> tuple[list[dict], list[str]]:
    rows, errors = [], []
    for name, chk in checks.items():
        t0 = time.perf_counter()
        pred = [bool(chk.check(it["text"])) for it in items]
        ms = (time.perf_counter() - t0) * 1000 / len(items)
        gold = [it["label"] in TARGETS[name] for it in items]
        for lang in ("all", "en", "zh"):
            idx = [i for i, it in enumerate(items) if lang == "all" or it["lang"] == lang]
            tp, fp, fn, p, r = prf([pred[i] for i in idx], [gold[i] for i in idx])
            rows.append({"check": name, "lang": lang, "n": len(idx), "tp": tp, "fp": fp,
                         "fn": fn, "precision": p, "recall": r, "ms_per_item": ms})
        for it, p, g in zip(items, pred, gold):
            if p != g:
                errors.append(f"{name}: {'FP' if p else 'FN'} {it['id']}: {it['text']}")
    return rows, errors


def table(rows: list[dict]) -> str:
    out = ["| check | lang | items | TP | FP | FN | precision | recall | ms/item |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        out.append(f"| {r['check']} | {r['lang']} | {r['n']} | {r['tp']} | {r['fp']} | "
                   f"{r['fn']} | {r['precision']:.2f} | {r['recall']:.2f} | "
                   f"{r['ms_per_item']:.2f} |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", default=DEFAULT_DATA)
    ap.add_argument("--judge-url", default=None, help="also evaluate llm_judge at this /v1 URL")
    ap.add_argument("--judge-model", default="default")
    ap.add_argument("--show-errors", action="store_true")
    args = ap.parse_args(argv)
    items = load(args.data)
    checks = {n: build_check({"check": n, "action": "flag"})
              for n in ("injection", "harmful", "pii")}
    if args.judge_url:
        checks["llm_judge"] = build_check({"check": "llm_judge", "action": "flag",
                                           "url": args.judge_url, "model": args.judge_model,
                                           "on_error": "allow", "timeout": 120})
    counts = {lab: sum(it["label"] == lab for it in items)
              for lab in ("benign", "injection", "harmful", "pii")}
    print(f"{len(items)} items: " + ", ".join(f"{k} {v}" for k, v in counts.items()))
    rows, errors = evaluate(items, checks)
    print(table(rows))
    if args.show_errors:
        print("\n".join(errors))
    return 0


if __name__ == "__main__":
    sys.exit(main())
