"""A real S3-compatible endpoint for tests: ``moto_server`` (moto[server]) on a free
loopback port, with dummy credentials in the environment."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import pytest

CREDS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
         "AWS_DEFAULT_REGION": "us-east-1"}


@dataclass
class MotoServer:
    proc: subprocess.Popen
    url: str
    log_path: str

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_moto() -> MotoServer:
    """Start moto_server; sets the dummy AWS credentials in ``os.environ`` (children
    inherit them)."""
    pytest.importorskip("moto")
    boto3 = pytest.importorskip("boto3")
    os.environ.update(CREDS)
    port = free_port()
    fd, log_path = tempfile.mkstemp(prefix="moto-", suffix=".log")
    with os.fdopen(fd, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1",
                                 "-p", str(port)], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    client = boto3.client("s3", endpoint_url=url, region_name="us-east-1")
    deadline = time.monotonic() + 60
    while True:
        try:
            client.list_buckets()
            return MotoServer(proc, url, log_path)
        except Exception:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                with open(log_path) as f:
                    pytest.fail(f"moto_server did not start:\n{f.read()}")
            time.sleep(0.1)
