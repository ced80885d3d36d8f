"""``llmserve registry push | pull | list | delete | promote``: the model registry on
S3-compatible storage (:mod:`llmserve.registry.store`). No torch, no engine.

S3 settings: ``--s3-endpoint-url``/``--bucket``/``--prefix``/``--region``, else
``$LLMSERVE_S3_ENDPOINT_URL`` etc., else the ``s3`` section of ``--spec llmserve.yaml``.
Credentials: boto3's chain (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, profiles).
"""

from __future__ import annotations

import argparse
import json
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--s3-endpoint-url", default=None, help="e.g. http://127.0.0.1:9000")
    common.add_argument("--bucket", default=None, help="default llmserve-models")
    common.add_argument("--prefix", default=None, help="key prefix inside the bucket")
    common.add_argument("--region", default=None)
    common.add_argument("--cache-dir", default=None,
                        help="local cache (default ~/.cache/llmserve/registry)")
    common.add_argument("--spec", default=None, help="take S3 settings from this spec")
    common.add_argument("--no-progress", action="store_true", help="no progress bar")
    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    s = sub.add_parser("push", parents=[common], help="upload a model file or directory")
    s.add_argument("path")
    s.add_argument("ref", metavar="NAME@VERSION")
    s = sub.add_parser("pull", parents=[common], help="download (verified) into the cache")
    s.add_argument("ref", metavar="NAME@VERSION|NAME:TAG")
    s = sub.add_parser("list", parents=[common], help="list models, versions and tags")
    s.add_argument("name", nargs="?", default=None)
    s.add_argument("--json", action="store_true")
    s = sub.add_parser("delete", parents=[common], help="delete a version (and unused blobs)")
    s.add_argument("ref", metavar="NAME@VERSION")
    s = sub.add_parser("promote", parents=[common], help="point a tag at a version")
    s.add_argument("ref", metavar="NAME@VERSION")
    s.add_argument("--tag", required=True, help="e.g. prod")


def register(subparsers) -> None:
    p = subparsers.add_parser("registry", help="model registry on S3 (push, pull, list, "
                                               "delete, promote)")
    add_arguments(p)
    p.set_defaults(func=run)


def _registry(args):
    from llmserve.registry.store import Registry

    kw = {"endpoint_url": args.s3_endpoint_url, "bucket": args.bucket, "prefix": args.prefix,
          "region": args.region, "cache_dir": args.cache_dir,
          "progress": not args.no_progress and sys.stderr.isatty()}
    if args.spec:
        from llmserve.deploy.spec import load_spec

        s3 = load_spec(args.spec).s3
        for k, v in (("endpoint_url", s3.endpoint_url), ("bucket", s3.bucket),
                     ("prefix", s3.prefix), ("region", s3.region), ("cache_dir", s3.cache_dir)):
            if kw[k] is None:
                kw[k] = v
    return Registry.from_env(**kw)


def run(args) -> int:
    reg = _registry(args)
    if args.action == "push":
        m = reg.push(args.path, args.ref)
        print(f"pushed {m['name']}@{m['version']}: {len(m['files'])} files, "
              f"{m['total_size']} bytes ({m['uploaded_bytes']} uploaded, the rest already "
              "stored)")
    elif args.action == "pull":
        print(reg.pull(args.ref))
    elif args.action == "list":
        rows = reg.list(args.name)
        if args.json:
            print(json.dumps(rows, indent=1))
        else:
            print(f"{'NAME':24s} {'VERSION':12s} {'SIZE':>14s} {'FILES':>5s} TAGS")
            for r in rows:
                print(f"{r['name']:24s} {r['version']:12s} {r['total_size']:14d} "
                      f"{r['files']:5d} {','.join(r['tags'])}")
    elif args.action == "delete":
        n = reg.delete(args.ref)
        print(f"deleted {args.ref} ({n} unused blobs removed)")
    elif args.action == "promote":
        reg.promote(args.ref, args.tag)
        print(f"{args.ref.split('@')[0]}:{args.tag} -> {args.ref}")
    return 0


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="llmserve registry")
    add_arguments(p)
    args = p.parse_args(argv)
    try:
        return run(args)
    except ValueError as e:  # RegistryError, IntegrityError, bad spec
        print(f"llmserve registry {args.action}: error: {e}", file=sys.stderr)
        return 1 if type(e).__name__ == "IntegrityError" else 2
    except Exception as e:  # botocore: endpoint unreachable, credentials, access denied
        if type(e).__module__.startswith(("botocore", "boto3")):
            print(f"llmserve registry {args.action}: S3 error: {e}", file=sys.stderr)
            return 1
        raise
