"""Storage for the audit log: SQLite (stdlib ``sqlite3``) and Postgres (``psycopg`` 3).

Both keep two tables::

    audit_log(seq PK, time, key_id, team, model, endpoint, status,   -- index columns,
              prev_hash UNIQUE, hash, record TEXT)                  -- copies of record fields
    audit_head(id = 1, seq, hash)                                    -- last link, same txn

``record`` is the canonical JSON text that was hashed (TEXT, not JSONB, so the
database never rewrites it). The index columns are checked against it on verify.
An append runs ``build(seq, prev_hash) -> (record, hash)`` inside one write
transaction: SQLite ``BEGIN IMMEDIATE`` (file write lock, so other processes wait;
``busy_timeout`` 60 s), Postgres ``pg_advisory_xact_lock(AUDIT_LOCK_KEY)``.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Callable
from dataclasses import dataclass

GENESIS = "0" * 64
INDEX_COLUMNS = ("time", "key_id", "team", "model", "endpoint", "status")
AUDIT_LOCK_KEY = 0x6C6C6D61756474  # "llmaudt": the Postgres advisory-lock key
_BATCH = 1000

_SCHEMA = """
CREATE TABLE IF NOT EXISTS audit_log (
    seq {int} PRIMARY KEY, time TEXT, key_id TEXT, team TEXT, model TEXT, endpoint TEXT,
    status INTEGER, prev_hash TEXT NOT NULL UNIQUE, hash TEXT NOT NULL, record TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS audit_head (
    id INTEGER PRIMARY KEY CHECK (id = 1), seq {int} NOT NULL, hash TEXT NOT NULL);
"""


@dataclass(frozen=True)
class AuditRow:
    """One stored row: ``record`` is the JSON text; ``columns`` the index columns."""

    seq: int
    prev_hash: str
    hash: str
    record: str
    columns: dict


Build = Callable[[int, str], tuple[dict, str]]


def _encode(body: dict) -> str:
    from llmserve.gateway.audit import canonical_json

    return canonical_json(body).decode("utf-8")


def _row(t: tuple) -> AuditRow:
    seq, *cols, prev, h, rec = t
    return AuditRow(seq, prev, h, rec, dict(zip(INDEX_COLUMNS, cols)))


_SELECT = ("SELECT seq, " + ", ".join(INDEX_COLUMNS) + ", prev_hash, hash, record "
           "FROM audit_log WHERE seq > {p} ORDER BY seq LIMIT {n}")
_INSERT = ("INSERT INTO audit_log (seq, " + ", ".join(INDEX_COLUMNS) + ", prev_hash, hash, "
           "record) VALUES ({ph})")


class SQLiteStore:
    """SQLite file (WAL mode) shared by threads and processes."""

    def __init__(self, path: str):
        self.path = path
        self._lock = threading.Lock()
        self._conn = self._connect()
        with self._lock:
            self._conn.executescript(_SCHEMA.format(int="INTEGER"))

    def _connect(self) -> sqlite3.Connection:
        try:
            conn = sqlite3.connect(self.path, timeout=60.0, isolation_level=None,
                                   check_same_thread=False)
            if self.path != ":memory:":
                conn.execute("PRAGMA journal_mode=WAL")
        except sqlite3.Error as e:
            raise ValueError(f"cannot open audit database sqlite:///{self.path}: {e}") from None
        return conn

    def append(self, build: Build) -> tuple[int, str, str, dict]:
        with self._lock:
            c = self._conn
            c.execute("BEGIN IMMEDIATE")
            try:
                head = c.execute("SELECT seq, hash FROM audit_head WHERE id = 1").fetchone()
                seq, prev = (head[0] + 1, head[1]) if head else (1, GENESIS)
                body, h = build(seq, prev)
                c.execute(_INSERT.format(ph=", ".join("?" * (len(INDEX_COLUMNS) + 4))),
                          (seq, *[body.get(k) for k in INDEX_COLUMNS], prev, h, _encode(body)))
                c.execute("INSERT INTO audit_head (id, seq, hash) VALUES (1, ?, ?) "
                          "ON CONFLICT(id) DO UPDATE SET seq = excluded.seq, hash = excluded.hash",
                          (seq, h))
                c.execute("COMMIT")
            except BaseException:
                c.execute("ROLLBACK")
                raise
        return seq, prev, h, body

    def snapshot(self) -> tuple[tuple[int, str] | None, list[AuditRow]]:
        """(head, all rows) read in one read transaction on a fresh connection."""
        conn = self._connect() if self.path != ":memory:" else self._conn
        lock = threading.Lock() if conn is not self._conn else self._lock
        rows: list[AuditRow] = []
        with lock:
            conn.execute("BEGIN")
            try:
                head = conn.execute("SELECT seq, hash FROM audit_head WHERE id = 1").fetchone()
                last = -(2 ** 62)
                while True:
                    batch = conn.execute(_SELECT.format(p="?", n=_BATCH), (last,)).fetchall()
                    rows.extend(_row(t) for t in batch)
                    if len(batch) < _BATCH:
                        break
                    last = batch[-1][0]
            finally:
                conn.execute("ROLLBACK")
                if conn is not self._conn:
                    conn.close()
        return (tuple(head) if head else None), rows

    def close(self) -> None:
        with self._lock:
            self._conn.close()


class PostgresStore:
    """Postgres via psycopg 3; appends serialized by a transaction-scoped advisory lock."""

    def __init__(self, url: str):
        try:
            import psycopg
        except ImportError:
            raise ValueError("a postgresql:// audit database needs psycopg: "
                             "pip install 'psycopg[binary]'") from None
        self._psycopg = psycopg
        self.url = url
        self._lock = threading.Lock()
        try:
            self._conn = psycopg.connect(url)
        except psycopg.Error as e:
            raise ValueError(f"cannot connect to the audit database: {e}") from None
        with self._lock, self._conn.transaction():
            self._conn.execute("SELECT pg_advisory_xact_lock(%s)", (AUDIT_LOCK_KEY,))
            for stmt in _SCHEMA.format(int="BIGINT").split(";"):
                if stmt.strip():
                    self._conn.execute(stmt)

    def append(self, build: Build) -> tuple[int, str, str, dict]:
        with self._lock, self._conn.transaction():
            c = self._conn
            c.execute("SELECT pg_advisory_xact_lock(%s)", (AUDIT_LOCK_KEY,))
            head = c.execute("SELECT seq, hash FROM audit_head WHERE id = 1").fetchone()
            seq, prev = (head[0] + 1, head[1]) if head else (1, GENESIS)
            body, h = build(seq, prev)
            c.execute(_INSERT.format(ph=", ".join(["%s"] * (len(INDEX_COLUMNS) + 4))),
                      (seq, *[body.get(k) for k in INDEX_COLUMNS], prev, h, _encode(body)))
            c.execute("INSERT INTO audit_head (id, seq, hash) VALUES (1, %s, %s) "
                      "ON CONFLICT (id) DO UPDATE SET seq = excluded.seq, hash = excluded.hash",
                      (seq, h))
        return seq, prev, h, body

    def snapshot(self) -> tuple[tuple[int, str] | None, list[AuditRow]]:
        psycopg = self._psycopg
        rows: list[AuditRow] = []
        with psycopg.connect(self.url) as conn:
            conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
            with conn.transaction():
                head = conn.execute("SELECT seq, hash FROM audit_head WHERE id = 1").fetchone()
                last = -(2 ** 62)
                while True:
                    batch = conn.execute(_SELECT.format(p="%s", n=_BATCH), (last,)).fetchall()
                    rows.extend(_row(t) for t in batch)
                    if len(batch) < _BATCH:
                        break
                    last = batch[-1][0]
        return (tuple(head) if head else None), rows

    def close(self) -> None:
        with self._lock:
            self._conn.close()


def open_store(url: str):
    """``sqlite:///PATH`` -> :class:`SQLiteStore`; ``postgresql://...`` -> :class:`PostgresStore`.

    Raises:
        ValueError: any other scheme, or the database cannot be opened.
    """
    if not isinstance(url, str):
        raise ValueError(f"--audit-db must be a URL string, got {type(url).__name__}")
    if url.startswith("sqlite:///"):
        return SQLiteStore(url[len("sqlite:///"):] or ":memory:")
    if url.startswith(("postgresql://", "postgres://")):
        return PostgresStore(url)
    raise ValueError(f"unsupported --audit-db URL {url!r}: use sqlite:///PATH or "
                     "postgresql://USER@HOST:PORT/DB")


__all__ = ["AuditRow", "SQLiteStore", "PostgresStore", "open_store", "GENESIS"]
