"""A worker that is not ours behind ``llmserve router``: llama-cpp-python's
OpenAI-compatible server (no ``/health``, no ``/tokenize``, no ``llmserve:`` metrics)
on the default GGUF. The router must see it healthy (through ``/v1/models``), learn
its model name, and route to it with the default ``cache_aware`` policy degraded to
load balancing. Oracle: the same request sent to the worker directly.
"""

from __future__ import annotations

import socket
import sys

import pytest

pytest.importorskip("llama_cpp.server.app", reason="llama-cpp-python[server] (test extra)")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from tests.test_router import Proc, start_router  # noqa: E402,F401

pytestmark = pytest.mark.model
ALIAS = "smollm2-llamacpp"


@pytest.fixture(scope="module")
def llama_worker():
    from llmserve.loader.source import default_gguf_path

    with socket.socket() as s:  # llama_cpp.server prints no bound port: pick one
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    p = Proc([sys.executable, "-m", "llama_cpp.server", "--model", default_gguf_path(),
              "--model_alias", ALIAS, "--host", "127.0.0.1", "--port", str(port),
              "--n_ctx", "1024", "--n_threads", "1", "--verbose", "False"],
             r"Uvicorn running on (http://127\.0\.0\.1:\d+)")
    p.url = f"http://127.0.0.1:{port}"
    try:
        import time

        deadline = time.monotonic() + 120
        while True:  # no /health: wait for /v1/models
            try:
                if httpx.get(p.url + "/v1/models", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if p.proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"llama_cpp.server did not start:\n{p.log()}")
            time.sleep(0.2)
        yield p
    finally:
        p.stop()


def test_third_party_worker_behind_the_router(llama_worker):
    assert httpx.get(llama_worker.url + "/health", timeout=10).status_code == 404
    router = Proc([sys.executable, "-m", "llmserve.entrypoints.cli", "router", "--port", "0",
                   "--health-interval", "0.5", "--worker", llama_worker.url],
                  r"router: listening on (http://127\.0\.0\.1:\d+)")
    try:
        import time

        deadline = time.monotonic() + 60
        while True:  # the router's /health is 200 once its one worker is healthy
            try:
                if httpx.get(router.url + "/health", timeout=5).status_code == 200 \
                        if router.url else False:
                    break
            except httpx.TransportError:
                pass
            if not router.url:
                import re

                m = re.search(router.pattern, router.log())
                router.url = m.group(1) if m else ""
            if router.proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"router did not become healthy:\n{router.log()}")
            time.sleep(0.2)
        (w,) = httpx.get(router.url + "/workers", timeout=10).json()["workers"]
        assert w["healthy"] and w["models"] == [ALIAS]
        client = openai.OpenAI(base_url=router.url + "/v1", api_key="none", timeout=120)
        direct = openai.OpenAI(base_url=llama_worker.url + "/v1", api_key="none", timeout=120)
        kw = dict(model=ALIAS, prompt="The capital of France is", max_tokens=8, temperature=0)
        via = client.completions.with_raw_response.create(**kw)
        assert via.headers["x-llmserve-worker"] == w["id"]
        assert via.headers["x-llmserve-route-reason"] in ("miss", "balance")
        assert via.parse().choices[0].text == direct.completions.create(**kw).choices[0].text
        chat = client.chat.completions.create(
            model=ALIAS, messages=[{"role": "user", "content": "Say hi."}], max_tokens=8,
            temperature=0)
        assert chat.choices[0].message.content
        # (streams are not compared: llama-cpp-python 0.3.36's server itself drops tokens
        # of some streams and closes each one without ending the chunked body)
        with pytest.raises(openai.NotFoundError):
            client.completions.create(**{**kw, "model": "not-served-here"})
    finally:
        router.stop()
