"""``llmserve up`` of a spec with ``worker: {pp: 2, dp: 2}``, as real processes on
loopback: the worker is a data-parallel front over two engine replicas, each a 2-stage
pipeline (``--pipeline-parallel-size 2``, a second rank process per replica). Requests
go through the gateway and the router with the official ``openai`` client; the oracle
for the greedy text is our offline ``LLM`` on the same model with one process, the
replicas are seen on the front's ``/metrics`` (its ``data_parallel_rank`` label), and
``down`` must leave none of the rank processes behind."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
psutil = pytest.importorskip("psutil")

from llmserve.gateway.keys import hash_secret, new_secret  # noqa: E402

pytestmark = pytest.mark.model
CLI = [sys.executable, "-m", "llmserve.entrypoints.cli"]
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at",
           "The first three planets are"]


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # five engine processes on 2 cores
    return subprocess.run(CLI + list(args), capture_output=True, text=True, timeout=timeout,
                          env=env)


def test_pp2_dp2_worker_answers_as_one_process_and_stops_cleanly(tmp_path):
    from llmserve import LLM, SamplingParams

    key_id, secret = new_secret("all")
    spec = tmp_path / "llmserve.yaml"
    spec.write_text(textwrap.dedent(f"""\
        name: ppdp
        models:
          - name: chat
            dtype: float32
            worker: {{pp: 2, dp: 2, max_num_seqs: 4, kv_cache_memory: 32MiB,
                      max_model_len: 512}}
        router: {{health_interval_s: 0.5}}
        gateway:
          teams: {{research: {{rpm: 100000}}}}
          keys:
            - {{id: {key_id}, team: research, key_hash: "{hash_secret(secret)}"}}
        """))
    state = str(tmp_path / "state")
    up = cli("up", str(spec), "--state-dir", state, timeout=600)
    assert up.returncode == 0, up.stdout + up.stderr
    status = json.loads(cli("status", "--state-dir", state, "--json").stdout)
    try:
        worker, = [p for p in status["procs"] if p["role"] == "worker"]
        # the front, 2 replicas, each with its pipeline stage-1 rank (multiprocessing
        # also starts a resource tracker per replica; count the engine processes)
        tree = psutil.Process(worker["pid"]).children(recursive=True)
        ranks = [p for p in tree if "spawn_main" in " ".join(p.cmdline())]
        replicas = [p for p in tree if "serve" in p.cmdline()]
        assert (len(replicas), len(ranks)) == (2, 2), [p.cmdline()[:4] for p in tree]

        c = openai.OpenAI(base_url=status["gateway_url"] + "/v1", api_key=secret,
                          timeout=120, max_retries=0)
        got = [c.completions.create(model="chat", prompt=p, max_tokens=8, temperature=0)
               for p in PROMPTS]
        assert all(r.model == "chat" and r.usage.completion_tokens == 8 for r in got)
        llm = LLM(dtype="float32", max_model_len=512, kv_cache_memory=32 * 2**20)
        ref = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8),
                           use_tqdm=False)
        assert [r.choices[0].text for r in got] == [o.outputs[0].text for o in ref]

        metrics = httpx.get(worker["url"] + "/metrics", timeout=10).text
        done: dict[str, float] = {}  # per replica, summed over finished_reason
        for m in re.finditer(r'^llmserve:request_success_total\{[^}]*data_parallel_rank='
                             r'"(\d)"[^}]*\} (\S+)', metrics, re.M):
            done[m.group(1)] = done.get(m.group(1), 0.0) + float(m.group(2))
        assert sum(done.values()) == len(PROMPTS), done
        ranks_seen = set(re.findall(r'^llmserve:num_requests_running\{[^}]*data_parallel_rank='
                                    r'"(\d)"', metrics, re.M))
        assert ranks_seen == {"0", "1"}, ranks_seen
    finally:
        down = cli("down", "--state-dir", state, timeout=120)
    assert down.returncode == 0, down.stdout + down.stderr
    _, alive = psutil.wait_procs(tree, timeout=30)
    assert not alive, [p.pid for p in alive]
