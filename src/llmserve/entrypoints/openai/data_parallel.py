"""``llmserve serve --data-parallel-size N``: N engine replicas behind one API server.

::

    client --> API server (this process, no model)          replicas (each `llmserve serve`,
               router app: cache_aware policy, health,       --data-parallel-size 1, loopback,
               retries (llmserve.router, in-process)  -----> its own process(es), tp ranks too)
               /health: 200 once every replica is ready      dp0  http://127.0.0.1:<port0>
               /metrics: routing + every replica's engine    dp1  http://127.0.0.1:<port1>
                         metrics, label data_parallel_rank   ...

Placement is the router's: the same :class:`~llmserve.router.policies.CacheAwarePolicy`
(longest cached prefix by the engine's own block hashes, :mod:`llmserve.router.prefix`,
unless in-flight load is out of balance; a miss goes to the least-loaded replica) and
the same proxy (retries before the first byte, SSE relay); nothing about routing is
implemented twice. LoRA loads go to every replica and the Batch API to replica 0
(:mod:`~llmserve.entrypoints.openai.dp_routes`). The layer direction holds: this entrypoint imports the serving
plane's pure router package; the router never imports the engine (DESIGN.md section 1).
vLLM's ``--data-parallel-size`` does the same job with engine-core processes behind its
API server and a DP coordinator balancing by queue length.

Each replica gets ``OMP_NUM_THREADS = cores // N`` (unless set) so replicas do not
oversubscribe the cores. A replica that fails to start or exits stops the whole
server with a message naming it and why, and exit code 1 (as a dead tensor-parallel
rank does). With ``--api-key`` the key is checked here; the replicas listen on
loopback only, without a key.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time

from llmserve.distributed.multiproc import describe_exit
from llmserve.entrypoints.openai.dp_routes import install_replica_routes, strip_batch_dir

logger = logging.getLogger("llmserve.server")
LISTENING = re.compile(r"listening on (http://\S+?)(?:\s|$)")
LABEL = "data_parallel_rank"


class Replica:
    """One ``llmserve serve`` child: its process, URL (once it listens) and log tail."""

    def __init__(self, rank: int, cmd: list[str], env: dict[str, str]) -> None:
        self.rank, self.url = rank, None
        self.tail: list[str] = []
        self.listening = threading.Event()
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     env=env, text=True, bufsize=1)
        threading.Thread(target=self._pump, name=f"llmserve-dp{rank}-log", daemon=True).start()

    @property
    def id(self) -> str:
        return f"dp{self.rank}"

    def _pump(self) -> None:
        """Forward the replica's output, prefixed ``[dpN]``; catch its URL."""
        for line in self.proc.stdout:
            self.tail = (self.tail + [line.rstrip()])[-20:]
            if self.url is None and (m := LISTENING.search(line)):
                self.url = m.group(1)
                self.listening.set()
            sys.stdout.write(f"[{self.id}] {line}")
            sys.stdout.flush()


def replica_command(argv: list[str]) -> list[str]:
    """The child command: this ``serve`` command line with one replica, loopback, any
    free port and no API key (later options win in argparse)."""
    return [sys.executable, "-m", "llmserve.entrypoints.cli", *argv,
            "--data-parallel-size", "1", "--host", "127.0.0.1", "--port", "0", "--api-key", ""]


def _serve_argv() -> list[str]:
    argv = sys.argv[1:]
    if "serve" not in argv:
        raise ValueError("--data-parallel-size > 1 needs the `llmserve serve ...` command line")
    return argv[argv.index("serve"):]


def merge_metrics(pages: dict[int, str]) -> str:
    """Prometheus text pages of the replicas -> one page, every sample labelled
    ``data_parallel_rank="<rank>"`` (one HELP/TYPE per family)."""
    from prometheus_client.parser import text_string_to_metric_families

    families: dict[str, tuple[str, str, list[str]]] = {}
    for rank, text in sorted(pages.items()):
        for fam in text_string_to_metric_families(text):
            entry = families.setdefault(fam.name, (fam.documentation, fam.type, []))
            for s in fam.samples:
                labels = {LABEL: str(rank), **s.labels}
                body = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
                entry[2].append(f"{s.name}{{{body}}} {_number(s.value)}")
    out = []
    for name, (doc, kind, samples) in families.items():
        if kind == "counter":  # the exposition names a counter family with its _total
            name += "_total"
        out += [f"# HELP {name} {_escape(doc)}", f"# TYPE {name} {kind}", *samples]
    return "\n".join(out) + "\n"


def _escape(v: str) -> str:
    return str(v).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(v: float) -> str:
    v = float(v)
    if v != v:
        return "NaN"
    if v in (float("inf"), float("-inf")):
        return "+Inf" if v > 0 else "-Inf"
    return repr(v)


def _front_app(pool, replicas: list[Replica], args: argparse.Namespace):
    """The router app over the replicas, with the data-parallel ``/health`` and
    ``/metrics`` in front of the router's own."""
    import asyncio

    import httpx
    from fastapi.responses import JSONResponse, Response

    from llmserve.router.app import build_app

    app = build_app(pool, block_size=args.block_size, health_interval_s=1.0)
    client = httpx.AsyncClient(timeout=10.0)

    async def get(url: str) -> httpx.Response | None:
        try:
            return await client.get(url)
        except httpx.HTTPError:
            return None

    async def health() -> Response:
        answers = await asyncio.gather(*(get(r.url + "/health") for r in replicas))
        waiting = [r.id for r, a in zip(replicas, answers, strict=True)
                   if a is None or a.status_code != 200]
        if not waiting:  # ready: the router's view too, not at its next round (<= 1 s
            # later), so a request sent right after this answer is routed
            checker = app.state.health_checker
            await asyncio.gather(*(checker.check(w) for w in list(pool.workers.values())
                                   if not w.healthy))
            return Response(status_code=200)
        return JSONResponse({"error": {"message": f"data-parallel replicas not ready: "
                                                  f"{', '.join(waiting)}",
                                       "type": "server_error", "param": None, "code": 503}},
                            status_code=503)

    async def metrics() -> Response:
        answers = await asyncio.gather(*(get(r.url + "/metrics") for r in replicas))
        pages = {r.rank: a.text for r, a in zip(replicas, answers, strict=True)
                 if a is not None and a.status_code == 200}
        routing, ctype = pool.metrics.render(list(pool.workers.values()))
        return Response(routing.decode() + merge_metrics(pages), media_type=ctype)

    install_replica_routes(app, replicas, pool)  # LoRA to all, Batch API pinned to dp0
    for path, endpoint in (("/health", health), ("/metrics", metrics)):
        app.add_api_route(path, endpoint, methods=["GET"])
        app.router.routes.insert(0, app.router.routes.pop())  # before the router's own
    if args.api_key:
        from llmserve.entrypoints.openai.api_server import APIKeyMiddleware

        open_paths = ("/health", "/metrics") if args.allow_unauthenticated_metrics \
            else ("/health",)
        app.add_middleware(APIKeyMiddleware, api_key=args.api_key, open_paths=open_paths)
    return app


def run_data_parallel(args: argparse.Namespace) -> int:
    """Start ``args.data_parallel_size`` replicas and serve the front until SIGTERM or
    a replica dies; returns the exit code (1 if a replica failed).

    Raises:
        ValueError: options that do not combine with data parallelism, an unbindable
            address, or a bad size.
    """
    import uvicorn

    from llmserve.entrypoints.openai.serve_cmd import bind_socket
    from llmserve.router.policies import create_policy
    from llmserve.router.state import WorkerPool

    n = args.data_parallel_size
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"data_parallel_size must be a positive integer, got {n!r}")
    if args.register_with:
        raise ValueError("--register-with does not combine with --data-parallel-size "
                         "(register the replicas' front with the router instead)")
    argv = _serve_argv()
    sock = bind_socket(args.host, args.port)
    host, port = sock.getsockname()[:2]
    url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
    print(f"llmserve: listening on {url} (OpenAI-compatible API over {n} data-parallel "
          f"replicas; /health is 503 until all are ready)", flush=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("LLMSERVE_API_KEY", None)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // n)))
    failure: dict[str, str] = {}
    replicas: list[Replica] = []

    def on_term(*_) -> None:  # SIGTERM before the front serves: stop the replicas too
        raise SystemExit(0)
    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        # replica 0 alone keeps --batch-dir: the front pins the Batch API to it
        replicas += [Replica(r, replica_command(argv if r == 0 else strip_batch_dir(argv)),
                             env) for r in range(n)]
        _wait_listening(replicas, 300.0)
    except (RuntimeError, SystemExit) as e:
        _stop(replicas)
        sock.close()
        signal.signal(signal.SIGTERM, previous)
        if isinstance(e, SystemExit):
            return 0
        print(f"llmserve serve: error: {e}", file=sys.stderr, flush=True)
        return 1
    signal.signal(signal.SIGTERM, previous)
    policy = create_policy("cache_aware")
    pool = WorkerPool(policy)
    for r in replicas:
        pool.add(r.url, r.id)
    logging.getLogger("llmserve.router").setLevel(logging.WARNING)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    app = _front_app(pool, replicas, args)
    server = uvicorn.Server(uvicorn.Config(app, log_level=args.log_level,
                                           access_log=not args.disable_uvicorn_access_log))
    closing = threading.Event()

    def watch() -> None:  # the first replica to exit stops the server
        while not closing.is_set():
            for r in replicas:
                if r.proc.poll() is not None and not closing.is_set():
                    failure["msg"] = (f"data-parallel replica {r.rank} (pid {r.proc.pid}) "
                                      f"{describe_exit(r.proc.returncode)}")
                    logger.error("%s; the server stops", failure["msg"])
                    server.should_exit = True
                    return
            time.sleep(0.1)
    threading.Thread(target=watch, name="llmserve-dp-monitor", daemon=True).start()
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        server.run(sockets=[sock])
    finally:
        closing.set()
        signal.signal(signal.SIGTERM, previous)
        sock.close()
        _stop(replicas)
    if failure:
        print(f"llmserve serve: error: {failure['msg']}", file=sys.stderr, flush=True)
        return 1
    return 0


def _wait_listening(replicas: list[Replica], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for r in replicas:
        while not r.listening.wait(0.1):
            if r.proc.poll() is not None:
                r.listening.wait(1.0)
                raise RuntimeError(f"data-parallel replica {r.rank} "
                                   f"{describe_exit(r.proc.returncode)} before it listened: "
                                   + " | ".join(r.tail[-5:]))
            if time.monotonic() > deadline:
                raise RuntimeError(f"data-parallel replica {r.rank} did not listen within "
                                   f"{timeout_s:g} s")


def _stop(replicas: list[Replica], timeout_s: float = 30.0) -> None:
    """SIGTERM every replica (graceful), then SIGKILL what is left."""
    for r in replicas:
        if r.proc.poll() is None:
            r.proc.terminate()
    deadline = time.monotonic() + timeout_s
    for r in replicas:
        try:
            r.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            r.proc.kill()
            r.proc.wait(5)
