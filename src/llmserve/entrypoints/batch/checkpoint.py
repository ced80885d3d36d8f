"""A batch's durable checkpoint: one SQLite file, one row per finished ``custom_id``.

Every result is committed on its own as it finishes (WAL journal,
``synchronous=FULL``: the commit returns after the WAL is fsynced), so a process
killed at any point (``kill -9``, a spot instance reclaimed) loses only requests
that had not finished; the primary key on ``custom_id`` makes a result impossible to
store twice. A checkpoint remembers the sha256 of its input and refuses another.
"""

from __future__ import annotations

import os
import sqlite3

FILE_NAME = "checkpoint.sqlite"


class CheckpointStore:
    """Results of one batch input in ``directory`` (created if missing).

    Raises:
        ValueError: the directory holds the checkpoint of another input, or cannot be
            created or opened.
    """

    def __init__(self, directory: str, input_digest: str, total: int) -> None:
        try:
            os.makedirs(directory, exist_ok=True)
            self.path = os.path.join(directory, FILE_NAME)
            self.db = sqlite3.connect(self.path, isolation_level=None)
        except (OSError, sqlite3.Error) as e:
            raise ValueError(f"checkpoint {directory}: cannot open ({e})") from None
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=FULL")
        self.db.execute("CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT)")
        self.db.execute("CREATE TABLE IF NOT EXISTS results (custom_id TEXT PRIMARY KEY, "
                        "idx INTEGER NOT NULL, ok INTEGER NOT NULL, line TEXT NOT NULL)")
        row = self.db.execute("SELECT value FROM meta WHERE key = 'input_sha256'").fetchone()
        if row is None:
            self.db.execute("INSERT INTO meta VALUES ('input_sha256', ?), ('total', ?)",
                            (input_digest, str(total)))
        elif row[0] != input_digest:
            self.db.close()
            raise ValueError(f"checkpoint {directory} belongs to another input (sha256 "
                             f"{row[0][:12]}..., this one {input_digest[:12]}...); pass "
                             f"another --checkpoint directory or delete it")

    def done(self) -> set[str]:
        """The custom_ids already finished."""
        return {r[0] for r in self.db.execute("SELECT custom_id FROM results")}

    def counts(self) -> tuple[int, int]:
        """(finished with a 2xx response, finished otherwise)."""
        ok, total = self.db.execute("SELECT COALESCE(SUM(ok), 0), COUNT(*) FROM results"
                                    ).fetchone()
        return int(ok), int(total) - int(ok)

    def add(self, custom_id: str, index: int, ok: bool, line: str) -> bool:
        """Store one result durably; False if that custom_id was already stored."""
        cur = self.db.execute("INSERT OR IGNORE INTO results VALUES (?, ?, ?, ?)",
                              (custom_id, index, int(ok), line))
        return cur.rowcount == 1

    def lines(self, ok: bool | None = None) -> list[str]:
        """Stored result lines in input order (only successes / failures if ``ok``)."""
        q = "SELECT line FROM results"
        args: tuple = ()
        if ok is not None:
            q += " WHERE ok = ?"
            args = (int(ok),)
        return [r[0] for r in self.db.execute(q + " ORDER BY idx", args)]

    def close(self) -> None:
        self.db.close()


def peek_counts(directory: str) -> tuple[int, int] | None:
    """(succeeded, failed) of the checkpoint in ``directory``, read-only, from any
    thread or process while a writer runs (WAL); None if there is none yet."""
    path = os.path.join(directory, FILE_NAME)
    if not os.path.exists(path):
        return None
    try:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5)
        try:
            ok, total = db.execute("SELECT COALESCE(SUM(ok), 0), COUNT(*) FROM results"
                                   ).fetchone()
        finally:
            db.close()
    except sqlite3.Error:
        return None
    return int(ok), int(total) - int(ok)


def write_atomic(path: str, lines: list[str]) -> None:
    """Write ``lines`` (JSONL) to ``path`` through a fsynced temporary file and a
    rename, so a reader never sees half a file."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        for line in lines:
            f.write(line + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
