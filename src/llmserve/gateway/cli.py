"""``llmserve gateway``: start the gateway (uvicorn) in front of OpenAI-compatible
upstreams. The master key comes from ``$LLMSERVE_MASTER_KEY`` (never a flag, so it
stays out of process listings), an upstream API key from ``$LLMSERVE_UPSTREAM_API_KEY``.

Start-up prints ``llmserve gateway: listening on http://HOST:PORT`` once the socket
is bound (``--port 0`` picks a free port).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "gateway", help="API gateway: keys, RBAC, rate limits and quotas via Redis",
        description="Serve the llmserve gateway in front of OpenAI-compatible upstreams.")
    add_arguments(p)
    p.set_defaults(func=run)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--upstream", action="append", required=True, metavar="URL",
                   help="base URL of an OpenAI-compatible server (repeatable)")
    p.add_argument("--redis-url", required=True,
                   help="redis://HOST:PORT/DB, rediss://... or unix:///path/redis.sock")
    p.add_argument("--config", default=None,
                   help="gateway.yaml: teams, keys, limits, audit_db, safety policies")
    p.add_argument("--audit-db", default=None, metavar="URL",
                   help="audit log: sqlite:///PATH or postgresql://... (overrides audit_db "
                        "in the config; default: no audit log)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080, help="0 = a free port")
    p.add_argument("--upstream-timeout", type=float, default=600.0,
                   help="seconds an upstream request may take (default 600)")
    p.add_argument("-v", "--verbose", action="store_true")


def run(args) -> int:
    import uvicorn

    from llmserve.gateway.app import build_app
    from llmserve.gateway.config import GatewayConfig, load_yaml

    extra = load_yaml(args.config) if args.config else {}
    if args.audit_db:
        extra["audit_db"] = args.audit_db
    config = GatewayConfig(
        upstreams=tuple(u.rstrip("/") for u in args.upstream), redis_url=args.redis_url,
        master_key=os.environ.get("LLMSERVE_MASTER_KEY") or None,
        upstream_api_key=os.environ.get("LLMSERVE_UPSTREAM_API_KEY") or None,
        upstream_timeout_s=args.upstream_timeout, **extra)
    app = build_app(config, **hooks_from_config(config))
    family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
    try:
        sock = socket.create_server((args.host, args.port), family=family, backlog=2048)
    except OSError as e:
        raise ValueError(f"cannot listen on {args.host}:{args.port}: {e.strerror}") from None
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if family == socket.AF_INET6 else host
    print(f"llmserve gateway: listening on http://{shown}:{port}", flush=True)
    uv = uvicorn.Config(app, log_level="info" if args.verbose else "warning",
                        access_log=args.verbose, timeout_graceful_shutdown=5)
    uvicorn.Server(uv).run(sockets=[sock])
    return 0


def hooks_from_config(config) -> dict:
    """``audit`` / ``safety`` keyword arguments of ``build_app`` from the config: an
    :class:`~.integration.GatewayAudit` on ``config.audit_db`` and a
    :class:`~.integration.GatewaySafety` on ``config.safety`` (always: a team's own
    policy can be set at run time through the admin API)."""
    from llmserve.gateway.integration import GatewayAudit, GatewaySafety

    out = {"safety": GatewaySafety(config.safety)}
    if config.audit_db:
        from llmserve.gateway.audit import AuditLog

        out["audit"] = GatewayAudit(AuditLog(config.audit_db), config.audit_redact)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="llmserve gateway")
    add_arguments(p)
    args = p.parse_args(argv)
    try:
        return run(args)
    except ValueError as e:
        print(f"llmserve gateway: error: {e}", file=sys.stderr)
        return 2
