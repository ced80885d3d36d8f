"""``llmserve audit verify|export``: check and export the gateway's audit log.

Imports neither torch nor the engine.

* ``llmserve audit verify --audit-db URL`` exits 0 and prints the record count and
  head hash, or exits 1 naming the first edited, deleted or reordered record.
* ``llmserve audit export --audit-db URL --out FILE`` writes canonical JSONL
  (``--out -`` for stdout); ``llmserve audit verify --jsonl FILE`` checks an export.
"""

from __future__ import annotations

import sys


def register(subparsers) -> None:
    p = subparsers.add_parser("audit", help="verify or export the gateway audit log",
                              description="Verify the hash chain of, or export, the gateway's "
                                          "audit log.")
    sub = p.add_subparsers(dest="audit_command", metavar="ACTION", required=True)
    v = sub.add_parser("verify", help="walk the hash chain; exit 1 on a broken chain")
    src = v.add_mutually_exclusive_group(required=True)
    src.add_argument("--audit-db", help="sqlite:///PATH or postgresql://...")
    src.add_argument("--jsonl", help="verify a file written by 'llmserve audit export'")
    v.set_defaults(func=_run_verify)
    e = sub.add_parser("export", help="write every record as JSON lines")
    e.add_argument("--audit-db", required=True, help="sqlite:///PATH or postgresql://...")
    e.add_argument("--out", required=True, help="output file ('-' = stdout)")
    e.set_defaults(func=_run_export)


def _run_verify(args) -> int:
    from llmserve.gateway.audit import AuditLog, verify_jsonl

    if args.jsonl:
        try:
            res = verify_jsonl(args.jsonl)
        except (OSError, ValueError) as e:
            raise ValueError(f"cannot read {args.jsonl}: {e}") from None
    else:
        _require_existing(args.audit_db)
        with AuditLog(args.audit_db) as log:
            res = log.verify()
    print(res.message, file=sys.stdout if res.ok else sys.stderr)
    return 0 if res.ok else 1


def _require_existing(url: str) -> None:
    """verify/export never create a database: a mistyped SQLite path is an error."""
    import os

    if url.startswith("sqlite:///"):
        path = url[len("sqlite:///"):]
        if path and path != ":memory:" and not os.path.exists(path):
            raise ValueError(f"no audit database at {path}")


def _run_export(args) -> int:
    from llmserve.gateway.audit import AuditLog

    _require_existing(args.audit_db)
    with AuditLog(args.audit_db) as log:
        n = log.export(sys.stdout if args.out == "-" else args.out)
    print(f"exported {n} records", file=sys.stderr)
    return 0
