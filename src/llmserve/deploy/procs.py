"""Child processes of a local deployment: start (detached, logs to a file), wait for
the ``listening on URL`` line and a 200 from ``/health``, stop (SIGTERM, then SIGKILL),
and a JSON state file so ``llmserve status`` / ``down`` find them later.

A process is identified by pid *and* start time (psutil), so a pid the OS reused for
another program is never signalled.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field

import httpx
import psutil

LISTEN_RE = re.compile(r"listening on (https?://[^\s(]+)")
CLI = [sys.executable, "-m", "llmserve.entrypoints.cli"]


@dataclass
class ProcRecord:
    """One child: ``role`` is redis, worker, router, gateway or autoscaler."""

    role: str
    id: str
    pid: int
    create_time: float
    cmd: list[str]
    log: str
    url: str = ""
    extra: dict = field(default_factory=dict)

    def process(self) -> psutil.Process | None:
        """The live process, or None (gone, a zombie, or the pid was reused)."""
        try:
            p = psutil.Process(self.pid)
            if abs(p.create_time() - self.create_time) > 1.0 \
                    or p.status() == psutil.STATUS_ZOMBIE:
                return None
            return p
        except psutil.Error:
            return None

    @property
    def on_ray(self) -> bool:
        """Run by a Ray actor (``up --backend ray``, :mod:`.ray_backend`), maybe on
        another node: liveness, log and stop go through the actor."""
        return "ray_actor" in self.extra

    def alive(self) -> bool:
        if self.on_ray:
            from llmserve.deploy.ray_backend import call

            return bool(call(self.extra, "alive", default=False))
        return self.process() is not None

    def log_tail(self, n: int = 30) -> str:
        if self.on_ray:
            from llmserve.deploy.ray_backend import call

            return call(self.extra, "log_tail", n, default="")
        try:
            with open(self.log, encoding="utf-8", errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return ""


def spawn(role: str, pid_id: str, cmd: list[str], log_path: str,
          env: dict | None = None) -> ProcRecord:
    """Start ``cmd`` in its own session (Ctrl-C on ``up`` does not reach it), stdout and
    stderr appended to ``log_path``."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        created = psutil.Process(proc.pid).create_time()
    except psutil.Error:
        created = time.time()
    rec = ProcRecord(role, pid_id, proc.pid, created, cmd, log_path)
    rec._popen = proc  # not saved; lets the starting process reap its own children
    return rec


def wait_ready(rec: ProcRecord, deadline: float, health_path: str = "/health") -> None:
    """Wait for the URL line in the log, then for a 200 on ``health_path``.

    Raises:
        RuntimeError: the process exited or ``deadline`` (monotonic s) passed; the
            message has the end of its log.
    """
    while True:
        popen = getattr(rec, "_popen", None)
        if popen is not None:
            popen.poll()  # reap, so an exited child is not a zombie "alive"
        if not rec.url:
            m = LISTEN_RE.search(rec.log_tail(200))
            rec.url = m.group(1).rstrip("/") if m else ""
        if rec.url:
            try:
                if httpx.get(rec.url + health_path, timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
        if not rec.alive():
            raise RuntimeError(f"{rec.role} {rec.id} exited during start-up; its log "
                               f"({rec.log}) ends:\n{rec.log_tail()}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{rec.role} {rec.id} was not healthy in time; its log "
                               f"({rec.log}) ends:\n{rec.log_tail()}")
        time.sleep(0.1)


def stop(rec: ProcRecord, timeout_s: float = 30.0) -> str:
    """SIGTERM, wait up to ``timeout_s``, then SIGKILL. Returns what happened:
    ``gone`` (was not running), ``stopped`` or ``killed``."""
    if rec.on_ray:
        from llmserve.deploy.ray_backend import stop_actor

        return stop_actor(rec.extra, timeout_s)
    p = rec.process()
    if p is None:
        return "gone"
    try:
        p.send_signal(signal.SIGTERM)
    except psutil.Error:
        return "gone"
    popen = getattr(rec, "_popen", None)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if popen is not None:
            popen.poll()
        if rec.process() is None:
            return "stopped"
        time.sleep(0.05)
    try:
        p.kill()
        p.wait(5)
    except psutil.Error:
        pass
    if popen is not None:
        popen.poll()
    return "killed"


class StateFile:
    """``<state_dir>/<deployment>/state.json``: the spec path and every child, written
    atomically (write + rename) after each change."""

    def __init__(self, state_dir: str, name: str) -> None:
        self.dir = os.path.join(os.path.abspath(state_dir), name)
        self.path = os.path.join(self.dir, "state.json")
        self.name = name

    def exists(self) -> bool:
        return os.path.isfile(self.path)

    def load(self) -> dict:
        """Raises ValueError when there is no state file (nothing is up)."""
        try:
            with open(self.path, encoding="utf-8") as f:
                data = json.load(f)
        except FileNotFoundError:
            raise ValueError(f"deployment {self.name!r} is not up (no {self.path})") from None
        data["procs"] = [ProcRecord(**p) for p in data.get("procs", [])]
        return data

    def save(self, data: dict) -> None:
        os.makedirs(self.dir, exist_ok=True)
        out = dict(data)
        out["procs"] = [asdict(p) for p in data["procs"]]
        tmp = self.path + f".tmp{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=1)
        os.replace(tmp, self.path)

    def remove(self) -> None:
        if os.path.exists(self.path):
            os.remove(self.path)


def find_deployments(state_dir: str) -> list[str]:
    """Names of the deployments with a state file under ``state_dir``."""
    root = os.path.abspath(state_dir)
    if not os.path.isdir(root):
        return []
    return sorted(d for d in os.listdir(root)
                  if os.path.isfile(os.path.join(root, d, "state.json")))
