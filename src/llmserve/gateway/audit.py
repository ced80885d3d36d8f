"""Tamper-evident audit log: one hash-chained record per gateway request.

Each stored record ``R`` (a JSON object) carries ``seq`` (1, 2, 3, ...), and the
row stores ``prev_hash`` and ``hash`` beside it::

    hash(R_n) = sha256( prev_hash_n  ||  canonical_json(R_n) )     prev_hash_n = hash(R_{n-1})
    prev_hash_1 = GENESIS = "0" * 64

    +-------+------------+-------------------+----------------+
    | seq 1 | prev=000.. | record JSON (R_1) | hash h1        |
    | seq 2 | prev=h1    | record JSON (R_2) | hash h2        |
    | seq 3 | prev=h2    | record JSON (R_3) | hash h3        |  head: (3, h3)
    +-------+------------+-------------------+----------------+

``prev_hash`` enters the hash as its 64 lowercase hex characters (ASCII bytes).
**Canonical JSON** (:func:`canonical_json`): ``json.dumps(R, sort_keys=True,
separators=(",", ":"), ensure_ascii=False, allow_nan=False)`` encoded as UTF-8;
floats as Python writes them (shortest round-trip repr); NaN/Infinity refused.
``R`` includes ``seq`` but neither ``hash`` nor ``prev_hash``.

Editing a record breaks its hash; deleting one breaks the next row's ``prev_hash``
(and the ``seq`` run); swapping two rows breaks ``seq``/``prev_hash`` at the first
of them. Truncating the tail is caught by the ``head`` row (last seq and hash,
written in the same transaction); anchor :attr:`VerifyResult.head_hash` outside
the database to also catch an attacker who rewrites the head.

Appends are serialized so the chain never forks: SQLite ``BEGIN IMMEDIATE`` (a
write lock on the file, so several processes may share one file) and, on
Postgres, ``pg_advisory_xact_lock`` held for the transaction; ``prev_hash`` is
also ``UNIQUE`` in the schema. Storage details live in ``audit_store.py``.

Record fields (all optional except ``endpoint``; extra keys are kept):
``time`` (ISO 8601 UTC, filled in if absent), ``request_id``, ``key_id``,
``team``, ``model``, ``endpoint``, ``request`` (the JSON body), ``response``
(full text, or the streamed chunks joined), ``stream`` (bool), ``usage``
(``prompt_tokens``/``completion_tokens``/``total_tokens``), ``latency_ms``,
``status`` (HTTP code), ``finish_reason``, ``safety`` (list of verdict dicts),
``redactions`` (filled in by PII redaction: counts per PII type).
"""

from __future__ import annotations

import asyncio
import datetime as _dt
import hashlib
import json
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from llmserve.gateway.audit_store import AuditRow, open_store

GENESIS = "0" * 64

_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "time": (str,), "request_id": (str,), "key_id": (str,), "team": (str,),
    "model": (str,), "endpoint": (str,), "request": (dict, list, str),
    "response": (str,), "stream": (bool,), "usage": (dict,),
    "latency_ms": (int, float), "status": (int,), "finish_reason": (str,),
    "safety": (list,), "redactions": (dict,),
}


def canonical_json(record: dict) -> bytes:
    """The canonical UTF-8 JSON bytes of ``record`` (sorted keys, no spaces).

    Raises:
        ValueError: the record holds a value JSON cannot represent (NaN, a set, ...).
    """
    try:
        return json.dumps(record, sort_keys=True, separators=(",", ":"),
                          ensure_ascii=False, allow_nan=False).encode("utf-8")
    except (TypeError, ValueError) as e:
        raise ValueError(f"audit record is not JSON-serializable: {e}") from None


def chain_hash(prev_hash: str, record: dict) -> str:
    """``sha256(prev_hash || canonical_json(record))`` as 64 lowercase hex chars."""
    return hashlib.sha256(prev_hash.encode("ascii") + canonical_json(record)).hexdigest()


@dataclass(frozen=True)
class VerifyResult:
    """Outcome of :meth:`AuditLog.verify`.

    ``ok`` is False when the chain is broken; ``bad_seq`` then names the first
    record that was edited, deleted (the first missing seq) or moved, and
    ``reason`` is one of ``edited``, ``deleted``, ``reordered``, ``truncated``,
    ``inserted`` (rows past the head row).
    """

    ok: bool
    count: int
    head_hash: str
    bad_seq: int | None = None
    reason: str | None = None
    message: str = ""


def verify_rows(rows: Iterable[AuditRow], head: tuple[int, str] | None = None) -> VerifyResult:
    """Walk ``rows`` (in stored ``seq`` order) and check every link of the chain.

    ``head`` is the stored (last seq, last hash), if the store keeps one.
    """
    expected_prev, expected_seq, count = GENESIS, 1, 0
    for row in rows:
        try:
            record = json.loads(row.record)
        except json.JSONDecodeError:
            return _broken(count, expected_prev, row.seq, "edited", "its JSON does not parse")
        if not isinstance(record, dict):
            return _broken(count, expected_prev, row.seq, "edited", "it is not a JSON object")
        rec_seq = record.get("seq")
        if row.prev_hash != expected_prev or row.seq != expected_seq or rec_seq != row.seq:
            if chain_hash(row.prev_hash, record) != row.hash:
                return _broken(count, expected_prev, row.seq, "edited", "its hash does not match")
            if isinstance(rec_seq, int) and rec_seq > expected_seq and row.seq == rec_seq:
                missing = (f"seq {expected_seq}" if rec_seq == expected_seq + 1
                           else f"seq {expected_seq}..{rec_seq - 1}")
                return _broken(count, expected_prev, expected_seq, "deleted",
                               f"{missing} missing before seq {row.seq}")
            return _broken(count, expected_prev, row.seq, "reordered",
                           f"row holds record seq {rec_seq} whose predecessor is not seq "
                           f"{row.seq - 1}")
        if chain_hash(row.prev_hash, record) != row.hash:
            return _broken(count, expected_prev, row.seq, "edited", "its hash does not match")
        for col, val in row.columns.items():
            if record.get(col) != val:
                return _broken(count, expected_prev, row.seq, "edited",
                               f"column {col!r} differs from the hashed record")
        expected_prev, expected_seq, count = row.hash, expected_seq + 1, count + 1
    if head is not None and (head[0] != count or head[1] != expected_prev):
        if head[0] > count:
            return _broken(count, expected_prev, count + 1, "truncated",
                           f"the head says seq {head[0]} but the chain ends at seq {count}")
        if head[0] < count:
            return _broken(count, expected_prev, head[0] + 1, "inserted",
                           f"the head says seq {head[0]} but the chain goes on to seq {count}")
        return _broken(count, expected_prev, count, "edited",
                       "its hash differs from the one in the head row")
    return VerifyResult(True, count, expected_prev, message=f"OK: {count} records, head "
                        f"{expected_prev}")


def _broken(count: int, head: str, seq: int, reason: str, detail: str) -> VerifyResult:
    return VerifyResult(False, count, head, seq, reason,
                        f"audit chain broken at record seq {seq} ({reason}): {detail}")


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="milliseconds")


def validate_record(record: dict) -> dict:
    """Check field types; return a shallow copy with ``time`` filled in.

    Raises:
        ValueError: not a dict, ``endpoint`` missing, a reserved key present
            (``seq``, ``hash``, ``prev_hash``), or a field of the wrong type.
    """
    if not isinstance(record, dict):
        raise ValueError(f"audit record must be a dict, got {type(record).__name__}")
    for k in ("seq", "hash", "prev_hash"):
        if k in record:
            raise ValueError(f"audit record field {k!r} is reserved (set by the log)")
    if not record.get("endpoint"):
        raise ValueError("audit record field 'endpoint' is required")
    for k, types in _FIELD_TYPES.items():
        v = record.get(k)
        if v is not None and (not isinstance(v, types) or (bool not in types
                                                              and isinstance(v, bool))):
            allowed = "/".join(t.__name__ for t in types)
            raise ValueError(f"audit record field {k!r} must be {allowed}, "
                             f"got {type(v).__name__}")
    out = dict(record)
    out.setdefault("time", _now())
    canonical_json(out)  # raises ValueError early on non-JSON values
    return out


class AuditLog:
    """Append-only, hash-chained audit log on SQLite (default) or Postgres.

    Args:
        url: ``sqlite:///PATH`` (``sqlite:///:memory:`` for tests) or
            ``postgresql://user:pw@host:port/db`` (needs ``psycopg``).
        redactor: optional ``(record, pii_types) -> record`` applied before
            storing when :meth:`append` gets ``redact_pii`` (default
            :func:`llmserve.gateway.audit_redact.redact_record`).

    Thread-safe; several processes may append to one database.

    Raises:
        ValueError: unsupported URL scheme.
    """

    def __init__(self, url: str, redactor=None):
        self.url = url
        self._store = open_store(url)
        self._redactor = redactor

    def append(self, record: dict, redact_pii: Sequence[str] | str | None = None) -> dict:
        """Append one record; return it as stored (with ``seq``, ``prev_hash``, ``hash``).

        ``redact_pii`` (a team policy's list of PII types, or ``"all"``) masks
        those PII types in ``request``/``response`` of the stored copy and counts
        them in ``redactions``.

        Raises:
            ValueError: bad record (see :func:`validate_record`).
        """
        rec = validate_record(record)
        if redact_pii:
            redactor = self._redactor
            if redactor is None:
                from llmserve.gateway.audit_redact import redact_record as redactor
            rec = redactor(rec, redact_pii)

        def build(seq: int, prev_hash: str) -> tuple[dict, str]:
            body = dict(rec, seq=seq)
            return body, chain_hash(prev_hash, body)

        seq, prev_hash, h, body = self._store.append(build)
        return dict(body, prev_hash=prev_hash, hash=h)

    async def aappend(self, record: dict, redact_pii: Sequence[str] | str | None = None) -> dict:
        """:meth:`append` in a worker thread, for async servers."""
        return await asyncio.to_thread(self.append, record, redact_pii)

    def rows(self) -> list[AuditRow]:
        """Stored rows in ``seq`` order (one consistent snapshot)."""
        return self._store.snapshot()[1]

    def records(self) -> Iterator[dict]:
        """Stored records (with ``prev_hash`` and ``hash``) in ``seq`` order."""
        for row in self.rows():
            yield dict(json.loads(row.record), prev_hash=row.prev_hash, hash=row.hash)

    def verify(self) -> VerifyResult:
        """Walk the whole chain; name the first edited, deleted or reordered record."""
        head, rows = self._store.snapshot()
        return verify_rows(rows, head)

    def export(self, out) -> int:
        """Write every record as one canonical JSON line (with ``prev_hash``, ``hash``).

        ``out`` is a path or a text file object. The file verifies on its own with
        :func:`verify_jsonl`. Returns the number of records written.
        """
        if isinstance(out, (str, os.PathLike)):
            with open(out, "w", encoding="utf-8") as f:
                return self.export(f)
        n = 0
        for rec in self.records():
            out.write(canonical_json(rec).decode("utf-8") + "\n")
            n += 1
        return n

    def close(self) -> None:
        self._store.close()

    def __enter__(self) -> AuditLog:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def verify_jsonl(path: str) -> VerifyResult:
    """Verify a file written by :meth:`AuditLog.export` (no head: tails not checked)."""

    def rows() -> Iterator[AuditRow]:
        with open(path, encoding="utf-8") as f:
            for i, line in enumerate(f, 1):
                rec = json.loads(line)
                prev, h = rec.pop("prev_hash", ""), rec.pop("hash", "")
                seq = rec.get("seq") if isinstance(rec.get("seq"), int) else -i
                yield AuditRow(seq, prev, h, json.dumps(rec, ensure_ascii=False), {})

    return verify_rows(rows())
