"""``llmserve router``: cache-aware routing over OpenAI-compatible workers.

Imports neither torch nor the engine (the serving plane; see DESIGN.md section 1).
Prints ``llmserve router: listening on http://HOST:PORT`` once the socket is bound
(``--port 0`` shows the port the OS chose).
"""

from __future__ import annotations

import argparse
import logging

DEFAULT_PORT = 8080


def _positive_float(text: str) -> float:
    v = float(text)
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return v


def register(subparsers) -> None:
    """Add the ``router`` subcommand (called by :mod:`llmserve.entrypoints.cli`)."""
    p = subparsers.add_parser(
        "router", help="route OpenAI-compatible requests over several workers",
        description="A cache-aware router in front of OpenAI-compatible workers: "
                    "/v1/completions, /v1/chat/completions, /v1/models, /health, /metrics, "
                    "/workers (GET, POST), /workers/{id} (DELETE = drain and remove).")
    p.add_argument("--worker", action="append", default=[], metavar="URL",
                   help="a worker's base URL, e.g. http://127.0.0.1:8000 (repeatable)")
    p.add_argument("--config", default=None, metavar="ROUTER_YAML",
                   help="router.yaml: more workers and tier aliases (llmserve.router.config)")
    p.add_argument("--policy", default="cache_aware",
                   choices=["cache_aware", "prefix_hash", "least_load", "round_robin"],
                   help="routing policy (default cache_aware)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT,
                   help=f"port to bind (default {DEFAULT_PORT}; 0 = any free port)")
    p.add_argument("--block-size", type=int, default=16,
                   help="the workers' KV block size in tokens (default 16, as `serve`)")
    p.add_argument("--balance-abs-threshold", type=int, default=32,
                   help="cache_aware: balance by load when the in-flight gap between workers "
                        "exceeds this (requests) and ... (default 32)")
    p.add_argument("--balance-rel-threshold", type=float, default=1.1,
                   help="cache_aware: ... the most loaded has more than this times the least "
                        "(default 1.1)")
    p.add_argument("--cache-threshold", type=float, default=0.3,
                   help="cache_aware: matched fraction of prompt blocks for a hit (default 0.3)")
    p.add_argument("--max-retries", type=int, default=2,
                   help="retries on other workers before the first byte (default 2)")
    p.add_argument("--health-interval", type=_positive_float, default=2.0,
                   help="seconds between health checks / metrics scrapes (default 2)")
    p.add_argument("--breaker-failures", type=int, default=3,
                   help="consecutive failures that open a worker's circuit (default 3)")
    p.add_argument("--breaker-cooldown", type=float, default=5.0,
                   help="seconds an open circuit waits before a trial request (default 5)")
    p.add_argument("--request-timeout", type=_positive_float, default=600.0,
                   help="seconds to wait for a worker's next byte (default 600)")
    p.add_argument("--redis-url", default=None, metavar="URL",
                   help="share routing state with other router replicas through Redis "
                        "(redis://HOST:PORT/DB, rediss://..., unix:///path.sock): workers, "
                        "health, load, cache view, sessions, round robin")
    p.add_argument("--redis-key-prefix", default="llmserve:router:",
                   help="prefix of the router's Redis keys (default llmserve:router:)")
    p.add_argument("--redis-sync-interval", type=_positive_float, default=0.25,
                   help="seconds between polls of shared membership and health (default "
                        "0.25)")
    p.add_argument("--redis-timeout", type=_positive_float, default=0.5,
                   help="seconds a Redis call may take before this replica routes from its "
                        "cache (default 0.5)")
    p.add_argument("--session-ttl", type=_positive_float, default=3600.0,
                   help="seconds a session's worker is remembered in Redis (default 3600)")
    p.add_argument("-v", "--verbose", action="store_true", help="log routing warnings")
    p.set_defaults(func=run_router)


def run_router(args: argparse.Namespace) -> int:
    import uvicorn

    from llmserve.entrypoints.openai.serve_cmd import bind_socket
    from llmserve.router.app import build_app
    from llmserve.router.config import RouterFileConfig, load_router_config
    from llmserve.router.policies import create_policy
    from llmserve.router.state import WorkerPool

    if args.block_size <= 0:
        raise ValueError(f"--block-size must be positive, got {args.block_size}")
    if args.max_retries < 0:
        raise ValueError(f"--max-retries must be >= 0, got {args.max_retries}")
    policy = create_policy(args.policy, balance_abs_threshold=args.balance_abs_threshold,
                           balance_rel_threshold=args.balance_rel_threshold,
                           cache_threshold=args.cache_threshold)
    pool = WorkerPool(policy, failure_threshold=args.breaker_failures,
                      cooldown_s=args.breaker_cooldown)
    file_cfg = load_router_config(args.config) if args.config else RouterFileConfig()
    for url in dict.fromkeys([*file_cfg.workers, *args.worker]):
        pool.add(url)
    state = None
    if args.redis_url:
        from llmserve.router.redis_state import RedisState
        state = RedisState(pool, args.redis_url, key_prefix=args.redis_key_prefix,
                           sync_interval_s=args.redis_sync_interval,
                           session_ttl_s=args.session_ttl, timeout_s=args.redis_timeout,
                           health_ttl_s=max(10.0, 5 * args.health_interval))
    app = build_app(pool, block_size=args.block_size, max_retries=args.max_retries,
                    health_interval_s=args.health_interval,
                    request_timeout_s=args.request_timeout, tiers=file_cfg.tiers,
                    state=state)
    sock = bind_socket(args.host, args.port)
    host, port = sock.getsockname()[:2]
    url = f"http://{host}:{port}" if ":" not in host else f"http://[{host}]:{port}"
    print(f"llmserve router: listening on {url} ({len(pool.workers)} workers, "
          f"policy {policy.name}, tiers {sorted(file_cfg.tiers) or 'none'}, state "
          f"{'redis' if state else 'memory'})", flush=True)
    level = "info" if args.verbose else "warning"
    logging.getLogger("llmserve.router").setLevel(logging.INFO if args.verbose
                                                  else logging.WARNING)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per proxied call
    config = uvicorn.Config(app, log_level=level, access_log=False)
    uvicorn.Server(config).run(sockets=[sock])
    return 0
