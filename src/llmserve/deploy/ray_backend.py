"""``llmserve up --backend ray``: the workers of a deployment on a Ray cluster; Redis,
the router, the gateway and the autoscaler stay on this machine.

Each worker replica is a detached, named Ray actor (:class:`WorkerHost`, name
``<deployment>/<worker id>`` in the ``llmserve`` namespace) that reserves the replica's
CPUs (``tp * pp * dp`` of them; GPUs with ``worker.device: cuda``) and runs
``llmserve serve --host <its node's IP> --port 0 ...`` as its child process, so Ray's
scheduler picks the node and the router reaches the worker over the network. The
serve process dies with its actor (``PR_SET_PDEATHSIG``); ``down`` asks the actor to
stop it (SIGTERM, then SIGKILL) and then kills the actor. ``status``, ``down`` and the
autoscaler find the actors by name through ``RAY_ADDRESS`` (saved in the state file).

Like the ranks of ``--distributed-executor-backend ray`` (vLLM's
``vllm/executor/ray_utils.py``), every node must see the model file at the same path
and run the same Python environment (the actor runs its own ``sys.executable``).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from typing import Any

NAMESPACE = "llmserve"
NODE_IP = "{node_ip}"  # placeholder in the command, filled in on the actor's node


def connect(address: str | None) -> Any:
    """The ``ray`` module, connected to ``address`` (``RAY_ADDRESS`` when None).

    Raises:
        RuntimeError: Ray is not installed, or no cluster answers at the address.
    """
    try:
        import ray
    except ImportError as e:
        raise RuntimeError("--backend ray needs Ray: pip install 'ray>=2.40'") from e
    if not ray.is_initialized():
        address = address or os.environ.get("RAY_ADDRESS")
        if not address:
            raise RuntimeError("--backend ray needs a Ray cluster: pass --ray-address or set "
                               "RAY_ADDRESS (`ray start --head` prints it)")
        try:
            ray.init(address=address, namespace=NAMESPACE, logging_level=logging.WARNING,
                     log_to_driver=False)
        except (ConnectionError, RuntimeError, ValueError) as e:
            raise RuntimeError(f"no Ray cluster at {address!r}: {e}") from e
    return ray


def _die_with_parent() -> None:  # preexec_fn: SIGTERM when the actor's process dies
    import ctypes

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class WorkerHost:
    """A Ray actor that runs one ``llmserve serve`` process on its node."""

    def __init__(self, cmd: list[str], env: dict[str, str], log_path: str) -> None:
        import ray

        self.ip = ray.util.get_node_ip_address()
        cmd = [sys.executable if i == 0 else (self.ip if c == NODE_IP else c)
               for i, c in enumerate(cmd)]
        try:
            os.makedirs(os.path.dirname(log_path), exist_ok=True)
            self.log_path = log_path
        except OSError:  # another node without that directory
            self.log_path = os.path.join("/tmp", os.path.basename(log_path))
        with open(self.log_path, "ab") as log:
            self.popen = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env={**os.environ, "PYTHONUNBUFFERED": "1", **env},
                preexec_fn=_die_with_parent)

    def info(self) -> dict:
        import psutil

        return {"pid": self.popen.pid, "node_ip": self.ip, "log": self.log_path,
                "create_time": psutil.Process(self.popen.pid).create_time()}

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, n: int) -> str:
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return "".join(f.readlines()[-n:])

    def stop(self, timeout_s: float) -> str:
        if self.popen.poll() is not None:
            return "gone"
        self.popen.send_signal(signal.SIGTERM)
        try:
            self.popen.wait(timeout_s)
            return "stopped"
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(5)
            return "killed"


def spawn_actor(name: str, cmd: list[str], env: dict[str, str], log_path: str,
                resources: dict[str, float], address: str | None,
                timeout_s: float = 600.0) -> dict:
    """Start the actor ``name`` (detached) and its process; returns :meth:`WorkerHost.info`
    plus ``ray_address`` and ``ray_actor``.

    Raises:
        RuntimeError: the actor could not be placed within ``timeout_s`` (the cluster's
            free resources are in the message), or the address answers no cluster.
    """
    ray = connect(address)
    opts: dict[str, Any] = {"name": name, "namespace": NAMESPACE, "lifetime": "detached",
                            "max_restarts": 0, "num_cpus": resources.get("CPU", 1),
                            "num_gpus": resources.get("GPU", 0)}
    actor = ray.remote(WorkerHost).options(**opts).remote(cmd, env, log_path)
    ready, _ = ray.wait([actor.info.remote()], timeout=timeout_s)
    if not ready:
        free = ray.available_resources()
        ray.kill(actor)
        raise RuntimeError(f"worker {name} could not be placed on the Ray cluster within "
                           f"{timeout_s:g} s: it needs {resources}, the cluster has {free} "
                           "free")
    info = ray.get(ready[0])
    return {**info, "ray_actor": name, "ray_address": ray.get_runtime_context().gcs_address}


def _actor(extra: dict) -> Any | None:
    ray = connect(extra.get("ray_address"))
    try:
        return ray.get_actor(extra["ray_actor"], namespace=NAMESPACE)
    except ValueError:  # no such actor (it died, or was killed)
        return None


def call(extra: dict, method: str, *args, default: Any = None, timeout_s: float = 60.0):
    """``method(*args)`` on the record's actor; ``default`` when the actor is gone."""
    actor = _actor(extra)
    if actor is None:
        return default
    ray = connect(extra.get("ray_address"))
    try:
        return ray.get(getattr(actor, method).remote(*args), timeout=timeout_s)
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
        return default


def stop_actor(extra: dict, timeout_s: float) -> str:
    """Stop the process (SIGTERM, then SIGKILL), then kill the actor."""
    actor = _actor(extra)
    if actor is None:
        return "gone"
    result = call(extra, "stop", timeout_s, default="killed", timeout_s=timeout_s + 10)
    ray = connect(extra.get("ray_address"))
    ray.kill(actor, no_restart=True)
    deadline = time.monotonic() + 10
    while _actor(extra) is not None and time.monotonic() < deadline:
        time.sleep(0.1)
    return result
