"""Audit log: hash chain under concurrent appenders (threads, processes), tamper detection
(edit / delete / swap / truncate name the record), export, PII redaction, the CLI, and
the same on a real Postgres (pgserver bundles one)."""

from __future__ import annotations

import glob
import hashlib
import json
import os
import sqlite3
import subprocess
import sys
import threading

import pytest

from llmserve.entrypoints.cli import main as cli_main
from llmserve.gateway.audit import GENESIS, AuditLog, verify_jsonl

pytestmark = pytest.mark.timeout(120)


def _record(i: int, who: str = "t") -> dict:
    return {"request_id": f"{who}-{i}", "key_id": f"key-{i % 3}", "team": "alpha",
            "model": "smollm2", "endpoint": "/v1/chat/completions",
            "request": {"messages": [{"role": "user", "content": f"hello {i} 你好"}],
                        "max_tokens": 8},
            "response": f"answer number {i} réponse", "stream": i % 2 == 0,
            "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8},
            "latency_ms": 12.5 + i, "status": 200, "finish_reason": "stop",
            "safety": []}


def _fill(url: str, n: int = 50, threads: int = 5) -> None:
    log = AuditLog(url)
    per = n // threads

    def work(t):
        for i in range(per):
            log.append(_record(t * per + i, f"th{t}"))

    ts = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    log.close()


@pytest.fixture
def sqlite_url(tmp_path):
    return f"sqlite:///{tmp_path / 'audit.db'}"


@pytest.fixture
def filled(sqlite_url):
    _fill(sqlite_url)
    return sqlite_url, sqlite_url[len("sqlite:///"):]


def test_hash_is_sha256_of_prev_and_canonical_json(sqlite_url):
    log = AuditLog(sqlite_url)
    a = log.append(_record(0))
    b = log.append(_record(1))
    # the documented definition, computed independently
    body = {k: v for k, v in a.items() if k not in ("hash", "prev_hash")}
    canon = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    assert "你好" in canon and a["seq"] == 1 and a["prev_hash"] == GENESIS
    assert a["hash"] == hashlib.sha256((GENESIS + canon).encode("utf-8")).hexdigest()
    assert b["prev_hash"] == a["hash"] and b["seq"] == 2
    assert a["time"].endswith("+00:00")


def test_threads_chain_verifies(filled):
    url, path = filled
    log = AuditLog(url)
    res = log.verify()
    assert res.ok, res.message
    assert res.count == 50
    recs = list(log.records())
    assert [r["seq"] for r in recs] == list(range(1, 51))
    assert len({r["request_id"] for r in recs}) == 50
    assert all(recs[i]["prev_hash"] == recs[i - 1]["hash"] for i in range(1, 50))
    assert res.head_hash == recs[-1]["hash"]


_WORKER = """
import sys
from llmserve.gateway.audit import AuditLog
log = AuditLog(sys.argv[1])
for i in range(int(sys.argv[3])):
    log.append({"endpoint": "/v1/completions", "request_id": sys.argv[2] + str(i),
                "response": "x" * (i % 7), "status": 200})
"""


def _two_processes(url: str, n: int = 25) -> None:
    procs = [subprocess.Popen([sys.executable, "-c", _WORKER, url, f"p{k}-", str(n)],
                              env=os.environ.copy()) for k in range(2)]
    assert [p.wait(timeout=90) for p in procs] == [0, 0]


def test_two_processes_share_one_sqlite_file(sqlite_url):
    _two_processes(sqlite_url)
    res = AuditLog(sqlite_url).verify()
    assert res.ok and res.count == 50, res.message


def _swap(conn, a: int, b: int) -> None:
    cols = "time, key_id, team, model, endpoint, status, prev_hash, hash, record"
    ra = conn.execute(f"SELECT {cols} FROM audit_log WHERE seq=?", (a,)).fetchone()
    rb = conn.execute(f"SELECT {cols} FROM audit_log WHERE seq=?", (b,)).fetchone()
    sets = ", ".join(f"{c.strip()}=?" for c in cols.split(","))
    conn.execute("UPDATE audit_log SET prev_hash='tmp' WHERE seq=?", (a,))
    conn.execute(f"UPDATE audit_log SET {sets} WHERE seq=?", (*ra, b))
    conn.execute(f"UPDATE audit_log SET {sets} WHERE seq=?", (*rb, a))
    conn.commit()


@pytest.mark.parametrize("tamper,seq,reason", [
    ("edit_text", 17, "edited"), ("edit_column", 5, "edited"), ("delete", 23, "deleted"),
    ("delete_first", 1, "deleted"), ("swap", 10, "reordered"), ("truncate", 50, "truncated"),
    ("insert_past_head", 51, "inserted"),
])
def test_tampering_is_named(filled, capsys, tamper, seq, reason):
    url, path = filled
    assert cli_main(["audit", "verify", "--audit-db", url]) == 0
    conn = sqlite3.connect(path)
    if tamper == "edit_text":
        n = conn.execute("UPDATE audit_log SET record = replace(record, 'answer number', "
                         "'ANSWER number') WHERE seq = 17").rowcount
        assert n == 1
    elif tamper == "edit_column":
        conn.execute("UPDATE audit_log SET model = 'gpt-4' WHERE seq = 5")
    elif tamper == "delete":
        conn.execute("DELETE FROM audit_log WHERE seq = 23")
    elif tamper == "delete_first":
        conn.execute("DELETE FROM audit_log WHERE seq = 1")
    elif tamper == "swap":
        _swap(conn, 10, 30)
    elif tamper == "truncate":
        conn.execute("DELETE FROM audit_log WHERE seq = 50")
    elif tamper == "insert_past_head":  # a well-formed forged row chained onto seq 50
        h50, rec = conn.execute("SELECT hash, record FROM audit_log WHERE seq = 50").fetchone()
        body = dict(json.loads(rec), seq=51, response="forged")
        canon = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        conn.execute("INSERT INTO audit_log (seq, prev_hash, hash, record, time, key_id, team, "
                     "model, endpoint, status) VALUES (51, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                     (h50, hashlib.sha256((h50 + canon).encode()).hexdigest(), canon,
                      *[body[k] for k in ("time", "key_id", "team", "model", "endpoint",
                                          "status")]))
    conn.commit()
    conn.close()
    res = AuditLog(url).verify()
    assert not res.ok and res.bad_seq == seq and res.reason == reason, res
    capsys.readouterr()
    assert cli_main(["audit", "verify", "--audit-db", url]) == 1
    err = capsys.readouterr().err
    assert f"record seq {seq}" in err and reason in err


def test_cli_exit_codes_in_a_real_process(filled):
    url, path = filled
    cmd = [sys.executable, "-m", "llmserve.entrypoints.cli", "audit", "verify", "--audit-db", url]
    ok = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and "50 records" in ok.stdout
    conn = sqlite3.connect(path)
    n = conn.execute("UPDATE audit_log SET record = replace(record, 'hello', 'HELLO') "
                     "WHERE seq = 8").rowcount
    conn.commit()
    assert n == 1
    conn.close()
    bad = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and "record seq 8" in bad.stderr
    wrong = subprocess.run(cmd[:-1] + ["mysql://x"], capture_output=True, text=True, timeout=60)
    assert wrong.returncode == 2 and "unsupported --audit-db URL" in wrong.stderr
    missing = subprocess.run(cmd[:-1] + [url + ".typo"], capture_output=True, text=True,
                             timeout=60)
    assert missing.returncode == 2 and "no audit database" in missing.stderr
    assert not os.path.exists(path + ".typo")


def test_export_jsonl_verifies_and_detects_edits(filled, tmp_path, capsys):
    url, _ = filled
    out = tmp_path / "audit.jsonl"
    assert cli_main(["audit", "export", "--audit-db", url, "--out", str(out)]) == 0
    lines = out.read_text(encoding="utf-8").splitlines()
    assert len(lines) == 50
    first = json.loads(lines[0])
    assert first["seq"] == 1 and first["prev_hash"] == GENESIS and "你好" in lines[0]
    assert verify_jsonl(str(out)).ok
    assert cli_main(["audit", "verify", "--jsonl", str(out)]) == 0
    rec = json.loads(lines[30])
    rec["usage"]["completion_tokens"] = 999
    lines[30] = json.dumps(rec, ensure_ascii=False)
    out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    res = verify_jsonl(str(out))
    assert not res.ok and res.bad_seq == 31
    assert cli_main(["audit", "verify", "--jsonl", str(out)]) == 1


def test_pii_redaction_of_the_stored_copy(sqlite_url):
    log = AuditLog(sqlite_url)
    rec = _record(0)
    rec["request"]["messages"][0]["content"] = "mail bob@example.com card 4111 1111 1111 1111"
    rec["response"] = "sure, bob@example.com, IP 10.1.2.3"
    stored = log.append(rec, redact_pii=["email", "card"])
    assert stored["request"]["messages"][0]["content"] == "mail [EMAIL] card [CARD]"
    assert stored["response"] == "sure, [EMAIL], IP 10.1.2.3"  # ipv4 not in this policy
    assert stored["redactions"] == {"card": 1, "email": 2}
    log.append(_record(1), redact_pii="all")
    assert log.verify().ok
    log.close()
    path = sqlite_url[len("sqlite:///"):]
    conn = sqlite3.connect(path)
    text = "".join(r[0] for r in conn.execute("SELECT record FROM audit_log"))
    conn.close()
    assert "[EMAIL]" in text and "bob@example.com" not in text and "4111 1111" not in text
    for f in glob.glob(path + "*"):  # the db file and its WAL
        with open(f, "rb") as fh:
            assert b"bob@example.com" not in fh.read()
    log = AuditLog(sqlite_url)
    with pytest.raises(ValueError, match="unknown PII type"):
        log.append(_record(2), redact_pii=["dna"])


@pytest.mark.parametrize("bad,match", [
    ("not a dict", "must be a dict"), ({"status": 200}, "'endpoint' is required"),
    ({"endpoint": "/v1/x", "status": "200"}, "'status' must be int"),
    ({"endpoint": "/v1/x", "latency_ms": float("nan")}, "not JSON-serializable"),
    ({"endpoint": "/v1/x", "hash": "x"}, "reserved"),
    ({"endpoint": "/v1/x", "request": {"a": {1, 2}}}, "not JSON-serializable"),
])
def test_bad_records_raise_valueerror(sqlite_url, bad, match):
    log = AuditLog(sqlite_url)
    with pytest.raises(ValueError, match=match):
        log.append(bad)
    assert log.verify().count == 0


def test_bad_url():
    with pytest.raises(ValueError, match="unsupported --audit-db URL"):
        AuditLog("mysql://localhost/x")


# ---------------------------------------------------------------- real Postgres
@pytest.fixture(scope="module")
def pg_url(tmp_path_factory):
    pgserver = pytest.importorskip("pgserver")
    pytest.importorskip("psycopg")
    srv = pgserver.get_server(str(tmp_path_factory.mktemp("pg")), cleanup_mode="stop")
    try:
        yield srv.get_uri()
    finally:
        srv.cleanup()


def test_postgres_threads_and_processes_and_tamper(pg_url, capsys):
    import psycopg

    with psycopg.connect(pg_url, autocommit=True) as c:
        c.execute("DROP TABLE IF EXISTS audit_log, audit_head")
    _fill(pg_url, n=20, threads=4)
    _two_processes(pg_url, n=15)
    log = AuditLog(pg_url)
    res = log.verify()
    assert res.ok and res.count == 50, res.message
    assert cli_main(["audit", "verify", "--audit-db", pg_url]) == 0
    with psycopg.connect(pg_url, autocommit=True) as c:
        c.execute("UPDATE audit_log SET record = replace(record, '\"status\":200', "
                  "'\"status\":201') WHERE seq = 33")
    res = log.verify()
    assert not res.ok and res.bad_seq == 33 and res.reason == "edited"
    capsys.readouterr()
    assert cli_main(["audit", "verify", "--audit-db", pg_url]) == 1
    assert "record seq 33" in capsys.readouterr().err
    with psycopg.connect(pg_url, autocommit=True) as c:
        c.execute("DELETE FROM audit_log WHERE seq = 12")
    res = log.verify()
    assert not res.ok and res.bad_seq == 12 and res.reason == "deleted"
    log.close()
