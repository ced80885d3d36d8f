"""``llmserve up | down | status | render | autoscale``: deployment as code.

These commands import neither torch nor the engine (the serving plane), so they
start in about a second; the workers they start are ordinary ``llmserve serve``
processes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

COMMANDS = ("up", "down", "status", "render", "autoscale", "validate")
DEFAULT_STATE_DIR = os.path.join(".llmserve", "deployments")


def _state_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--state-dir", default=os.environ.get("LLMSERVE_STATE_DIR",
                                                         DEFAULT_STATE_DIR),
                   help="where state files and logs live (default $LLMSERVE_STATE_DIR or "
                        f"{DEFAULT_STATE_DIR})")


def register(subparsers) -> None:
    """Add the deployment subcommands (called by :mod:`llmserve.entrypoints.cli`)."""
    p = subparsers.add_parser("validate", help="check a deployment spec (llmserve.yaml)")
    p.add_argument("spec", help="the deployment spec")
    p.set_defaults(func=run_validate)

    p = subparsers.add_parser(
        "up", help="start a deployment (redis, workers, router, gateway) on this machine",
        description="Start the deployment a spec describes as child processes, "
                    "health-checked in dependency order; returns once the gateway answers.")
    p.add_argument("spec", help="the deployment spec (llmserve.yaml)")
    _state_arg(p)
    p.add_argument("--backend", default="local", choices=["local", "ray"],
                   help="where the workers run: local processes, or Ray actors on the "
                        "cluster of --ray-address (the rest stays here); Kubernetes: "
                        "use `render`")
    p.add_argument("--ray-address", default=None,
                   help="with --backend ray: the cluster (default: RAY_ADDRESS)")
    p.add_argument("--timeout", type=float, default=900.0,
                   help="seconds for everything to become healthy (default 900)")
    p.set_defaults(func=run_up)

    for name, helptext in (("down", "stop a deployment started by `up`"),
                           ("status", "show the processes of a deployment")):
        p = subparsers.add_parser(name, help=helptext)
        p.add_argument("target", nargs="?", default=None,
                       help="the spec file or the deployment's name (default: the only one)")
        _state_arg(p)
        if name == "status":
            p.add_argument("--json", action="store_true", help="print JSON")
        p.set_defaults(func=run_down if name == "down" else run_status)

    p = subparsers.add_parser("render", help="write Kubernetes manifests for a spec")
    p.add_argument("spec", help="the deployment spec")
    p.add_argument("--target", default="kubernetes", choices=["kubernetes"])
    p.add_argument("-o", "--output", default="-",
                   help="a file or directory (one file per object); '-' = stdout")
    p.set_defaults(func=run_render)

    p = subparsers.add_parser(
        "autoscale", help="scale a local deployment's workers on load (run by `up`)",
        description="Read the workers' Prometheus metrics and add or drain workers "
                    "through the router; --simulate replays a recorded trace instead.")
    p.add_argument("spec", help="the deployment spec")
    _state_arg(p)
    p.add_argument("--simulate", metavar="TRACE", default=None,
                   help="replay a JSON/CSV trace (t, num_requests_waiting, kv_cache_usage, "
                        "ttft_p90_s per replica or totals) and print the replica curve")
    p.add_argument("--plot", default=None, help="with --simulate: write a PNG plot here")
    p.add_argument("--model", default=None,
                   help="with --simulate: whose replicas.min/max to use (default: the first "
                        "model of the spec)")
    p.add_argument("--once", action="store_true", help="one decision, then exit")
    p.set_defaults(func=run_autoscale)


def _deployment_name(target: str | None, state_dir: str) -> str:
    from llmserve.deploy.procs import find_deployments
    from llmserve.deploy.spec import load_spec

    if target and os.path.isfile(target):
        return load_spec(target).name
    if target:
        return target
    names = find_deployments(state_dir)
    if len(names) != 1:
        raise ValueError(f"{len(names)} deployments under {state_dir} ({', '.join(names)}); "
                         "name one" if names else f"no deployment is up under {state_dir}")
    return names[0]


def run_validate(args) -> int:
    from llmserve.deploy.spec import load_spec

    spec = load_spec(args.spec)
    models = ", ".join(f"{m.name!r} replicas {m.replicas.min}..{m.replicas.max}"
                       for m in spec.models)
    print(f"{args.spec}: ok (deployment {spec.name!r}, model{'s' if len(spec.models) > 1 else ''}"
          f" {models})")
    return 0


def run_up(args) -> int:
    from llmserve.deploy.local import Deployment
    from llmserve.deploy.spec import load_spec

    spec = load_spec(args.spec)
    ray_address = None
    if args.backend == "ray":
        ray_address = args.ray_address or os.environ.get("RAY_ADDRESS")
        if not ray_address:
            print("llmserve up: error: --backend ray needs --ray-address or RAY_ADDRESS "
                  "(`ray start --head` prints it)", file=sys.stderr)
            return 2
    dep = Deployment(spec, args.spec, args.state_dir, ray_address=ray_address)
    try:
        ready = dep.up(timeout_s=args.timeout, log=lambda s: print(s, flush=True))
    except RuntimeError as e:
        print(f"llmserve up: error: {e}", file=sys.stderr)
        return 1
    print(f"llmserve up: {spec.name!r} ready in {ready:.1f} s; "
          f"OpenAI API at {dep.data['gateway_url']}/v1; state {dep.st.path}", flush=True)
    return 0


def run_down(args) -> int:
    from llmserve.deploy.local import Deployment

    dep = Deployment.attach(args.state_dir, _deployment_name(args.target, args.state_dir))
    results = dep.down(log=lambda s: print(s, flush=True))
    killed = [k for k, v in results.items() if v == "killed"]
    print(f"llmserve down: {dep.spec.name!r} stopped ({len(results)} processes"
          f"{', killed: ' + ', '.join(killed) if killed else ''})")
    return 0


def run_status(args) -> int:
    from llmserve.deploy.local import Deployment

    dep = Deployment.attach(args.state_dir, _deployment_name(args.target, args.state_dir))
    rows = dep.status()
    if args.json:
        models = {m.name: [r["id"] for r in rows if r["role"] == "worker"
                           and r.get("model") == m.name] for m in dep.spec.models}
        print(json.dumps({"name": dep.spec.name, "gateway_url": dep.data.get("gateway_url"),
                          "router_url": dep.data.get("router_url"),
                          "ready_s": dep.data.get("ready_s"), "models": models,
                          "procs": rows}, indent=1))
    else:
        print(f"deployment {dep.spec.name!r} ({dep.spec_path})")
        print_status(dep.spec, rows)
    return 0 if all(r["alive"] for r in rows) else 1


def print_status(spec, rows: list[dict]) -> None:
    """The serving plane first, then one block per model: its workers and bounds."""
    head = f"{'ROLE':11s} {'ID':24s} {'PID':>7s} {'ALIVE':6s} {'HEALTH':7s} URL"

    def line(r: dict) -> str:
        return (f"{r['role']:11s} {r['id']:24s} {r['pid']:7d} {str(r['alive']):6s} "
                f"{r['health']:7s} {r['url']}")

    print(head)
    for r in rows:
        if r["role"] != "worker":
            print(line(r))
    for m in spec.models:
        mine = [r for r in rows if r["role"] == "worker" and r.get("model") == m.name]
        healthy = sum(r["health"] == "200" for r in mine)
        print(f"\nmodel {m.name!r} ({m.source}): {len(mine)} worker"
              f"{'s' if len(mine) != 1 else ''}, {healthy} healthy, replicas "
              f"{m.replicas.min}..{m.replicas.max}")
        for r in mine:
            print(line(r))


def run_render(args) -> int:
    from llmserve.deploy.kubernetes import render_kubernetes, write_manifests
    from llmserve.deploy.spec import load_spec

    spec = load_spec(args.spec)
    with open(args.spec, encoding="utf-8") as f:
        docs = render_kubernetes(spec, f.read())
    write_manifests(docs, args.output)
    if args.output != "-":
        print(f"llmserve render: {len(docs)} objects -> {args.output}", file=sys.stderr)
    return 0


def run_autoscale(args) -> int:
    from llmserve.deploy.autoscale_cmd import run

    return run(args)


def main(argv: list[str]) -> int:
    """Entry for ``llmserve <deploy command> ...`` without building the full parser
    (which would import the engine's argument definitions)."""
    parser = argparse.ArgumentParser(prog="llmserve")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    register(sub)
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ValueError as e:
        print(f"llmserve {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
