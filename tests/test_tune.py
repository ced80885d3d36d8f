"""``llmserve tune``: the choice rules as pure functions on hand-made measurements,
one real (small) probe of the default model whose choice must follow those rules
from its own reported measurements, the per-machine cache, and how ``llmserve up``
passes tuned values to the workers."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from llmserve.deploy.local import tune_command
from llmserve.deploy.spec import parse_spec
from llmserve.deploy.worker_args import worker_args
from llmserve.entrypoints.tune_cmd import pick_budget, pick_kv_memory

STEPS = {256: 0.020, 512: 0.035, 1024: 0.060, 2048: 0.130, 4096: 0.300}


def test_pick_budget_throughput_and_latency():
    # prefill tokens/s: 12800, 14629, 17067 (best), 15754, 13653; 90% of best = 15360
    b, why = pick_budget(STEPS, "throughput", 0.1)
    assert b == 1024 and "within 10%" in why
    assert pick_budget(STEPS, "latency", 0.100)[0] == 1024  # 60 ms <= 100 < 130
    assert pick_budget(STEPS, "latency", 0.050)[0] == 512  # 35 ms <= 50 < 60
    b, why = pick_budget(STEPS, "latency", 0.010)
    assert b == 256 and "no budget" in why
    with pytest.raises(ValueError, match="goal"):
        pick_budget(STEPS, "fast", 0.1)


def test_pick_kv_memory():
    # 8 x 2048 x 46080 B = 720 MiB, under half of 4 GiB
    kv, why = pick_kv_memory(46080, 8, 2048, 4 * 2**30)
    assert kv == 8 * 2048 * 46080 and "720 MiB" in why
    kv, why = pick_kv_memory(46080, 8, 2048, 2**30)  # capped at half of 1 GiB
    assert kv == 2**29 and "capped" in why
    assert pick_kv_memory(46080, 1, 16, 2**30)[0] == 64 * 16 * 46080  # at least 64 blocks


SPEC = """\
name: t
models:
  - name: m
    worker: {max_num_seqs: 2, max_model_len: 256, kv_cache_memory: auto,
             max_num_batched_tokens: auto, tune_goal: latency, tbt_slo_ms: 250}
"""


def test_up_passes_tuned_values_to_workers():
    from llmserve.entrypoints.cli import build_parser

    m = parse_spec(SPEC).models[0]
    cmd = tune_command(m)
    a = build_parser().parse_args(cmd[3:])
    assert (a.command, a.goal, a.tbt_slo_ms, a.max_num_seqs, a.max_model_len) == \
        ("tune", "latency", 250.0, 2, 256)
    args = worker_args(m, {"max_num_batched_tokens": 512, "kv_cache_memory": 123456789})
    a = build_parser().parse_args(["serve", *args])
    assert (a.max_num_batched_tokens, a.kv_cache_memory) == (512, "123456789")
    assert "--max-num-batched-tokens" not in worker_args(m)  # untuned: engine defaults
    fixed = parse_spec(SPEC.replace("kv_cache_memory: auto,", "kv_cache_memory: 64MiB,")
                       .replace("max_num_batched_tokens: auto,", "")).models[0]
    assert tune_command(fixed) is None


@pytest.mark.model
def test_real_probe_follows_its_rules_and_is_cached(tmp_path):
    cmd = [sys.executable, "-m", "llmserve.entrypoints.cli", "tune", "--json", "--dtype",
           "float32", "--budgets", "32,64", "--repeats", "1", "--max-num-seqs", "2",
           "--max-model-len", "256", "--goal", "throughput", "--cache-dir", str(tmp_path)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout.strip().splitlines()[-1])
    m = r["measured"]
    steps = {int(k): v for k, v in m["step_s"].items()}
    assert sorted(steps) == [32, 64] and all(v > 0 for v in steps.values())
    assert (r["max_num_batched_tokens"], r["why"]["max_num_batched_tokens"]) == \
        pick_budget(steps, "throughput", 0.1)
    assert m["kv_bytes_per_token"] == 2 * 30 * 3 * 64 * 4  # layers x KV heads x dim, fp32
    assert r["kv_cache_memory"] == pick_kv_memory(m["kv_bytes_per_token"], 2, 256,
                                                  m["available_bytes"])[0]
    assert r["cached"] is False
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    r2 = json.loads(again.stdout.strip().splitlines()[-1])
    assert r2["cached"] is True and r2["max_num_batched_tokens"] == r["max_num_batched_tokens"]
