"""``llmserve up --backend ray`` on a real two-node Ray cluster on loopback
(``ray.cluster_utils.Cluster``: a head and a second raylet, one CPU each). Two worker
replicas of one CPU each can only be placed one per node; Redis, the router and the
gateway run here. Requests go through the gateway with the official ``openai`` client
(oracle: our offline ``LLM`` on the same model); ``down`` must leave no actor and no
``llmserve serve`` process behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

ray = pytest.importorskip("ray")
openai = pytest.importorskip("openai")
psutil = pytest.importorskip("psutil")

from llmserve.gateway.keys import hash_secret, new_secret  # noqa: E402

pytestmark = pytest.mark.model
CLI = [sys.executable, "-m", "llmserve.entrypoints.cli"]
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at",
           "The first three planets are"]


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("RAY_ADDRESS", None)  # the address comes from the flag or the state file
    return subprocess.run(CLI + list(args), capture_output=True, text=True, timeout=timeout,
                          env=env)


def test_up_places_one_worker_per_ray_node_and_down_removes_them(ray_cluster, tmp_path):
    from llmserve import LLM, SamplingParams

    key_id, secret = new_secret("all")
    spec = tmp_path / "llmserve.yaml"
    spec.write_text(textwrap.dedent(f"""\
        name: onray
        models:
          - name: chat
            dtype: float32
            worker: {{max_num_seqs: 4, kv_cache_memory: 32MiB, max_model_len: 512}}
            replicas: {{min: 2, max: 2}}
        router: {{health_interval_s: 0.5}}
        gateway:
          teams: {{research: {{rpm: 100000}}}}
          keys:
            - {{id: {key_id}, team: research, key_hash: "{hash_secret(secret)}"}}
        """))
    state = str(tmp_path / "state")
    no_cluster = cli("up", str(spec), "--state-dir", state, "--backend", "ray")
    assert no_cluster.returncode == 2 and "RAY_ADDRESS" in no_cluster.stderr
    up = cli("up", str(spec), "--state-dir", state, "--backend", "ray", "--ray-address",
             ray_cluster.address, timeout=600)
    assert up.returncode == 0, up.stdout + up.stderr
    try:
        status = json.loads(cli("status", "--state-dir", state, "--json").stdout)
        workers = [p for p in status["procs"] if p["role"] == "worker"]
        assert len(workers) == 2 and all(w["alive"] and w["health"] == "200" for w in workers)
        assert not any("127.0.0.1" in w["url"] for w in workers)  # each on its node's IP
        # both nodes' single CPU is taken by a worker actor: one replica per node
        assert ray.available_resources().get("CPU", 0) == 0
        actors = ray.util.list_named_actors(all_namespaces=True)
        assert sorted(a["name"] for a in actors if a["namespace"] == "llmserve") == \
            ["onray/worker-chat-0", "onray/worker-chat-1"]

        c = openai.OpenAI(base_url=status["gateway_url"] + "/v1", api_key=secret,
                          timeout=120, max_retries=0)
        got = [c.completions.create(model="chat", prompt=p, max_tokens=8, temperature=0)
               for p in PROMPTS]
        llm = LLM(dtype="float32", max_model_len=512, kv_cache_memory=32 * 2**20)
        ref = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8),
                           use_tqdm=False)
        assert [r.choices[0].text for r in got] == [o.outputs[0].text for o in ref]
    finally:
        down = cli("down", "--state-dir", state, timeout=180)
    assert down.returncode == 0, down.stdout + down.stderr
    assert not [a for a in ray.util.list_named_actors(all_namespaces=True)
                if a["namespace"] == "llmserve"]
    _, alive = psutil.wait_procs([psutil.Process(w["pid"]) for w in workers
                                  if psutil.pid_exists(w["pid"])], timeout=30)
    assert not alive
