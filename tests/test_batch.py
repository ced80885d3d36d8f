"""``llmserve batch run`` as real processes: killed with SIGKILL at random points
(three seeds) and restarted, then stopped with SIGTERM and restarted, it ends with
exactly one result per ``custom_id`` and the same greedy text as an uninterrupted
run. Kill points are counts of checkpointed results (polled from the checkpoint
file), not times; nothing asserts on timing."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import sqlite3
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.model

N = 80  # a SIGTERM at 10 done (<= 26 after its grace), then 2 kills at <= 8 past the last
# (<= 15 more finish in the same steps, max-concurrency 16): at most 72 done, 54+ never sent
CMD = [sys.executable, "-m", "llmserve.entrypoints.cli", "batch", "run", "--dtype", "float32",
       "--kv-cache-memory", "128MiB", "--max-concurrency", "16", "--no-progress"]
TIMEOUT = 600.0


def write_input(path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for i in range(N):  # short distinct prompts: no shared full KV block
            f.write(json.dumps({"custom_id": f"req-{i}", "method": "POST",
                                "url": "/v1/completions",
                                "body": {"prompt": f"Item {i} of the list is",
                                         "max_tokens": 5, "temperature": 0}}) + "\n")


def start(inp: str, out: str, ckpt: str, log: str) -> subprocess.Popen:
    f = open(log, "w")  # noqa: SIM115 - closed with the process
    return subprocess.Popen([*CMD, inp, "-o", out, "--checkpoint", ckpt], stdout=f,
                            stderr=subprocess.STDOUT, env={**os.environ,
                                                           "PYTHONUNBUFFERED": "1"})


def checkpointed(ckpt: str) -> int:
    path = os.path.join(ckpt, "checkpoint.sqlite")
    if not os.path.exists(path):
        return 0
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=30)
    try:
        return db.execute("SELECT COUNT(*) FROM results").fetchone()[0]
    except sqlite3.OperationalError:  # the table is not created yet
        return 0
    finally:
        db.close()


def wait_until(proc: subprocess.Popen, ckpt: str, count: int, log: str) -> None:
    deadline = time.monotonic() + TIMEOUT
    while checkpointed(ckpt) < count:
        assert proc.poll() is None, read(log)
        assert time.monotonic() < deadline, read(log)
        time.sleep(0.02)


def texts(out: str) -> dict[str, list[str]]:
    """custom_id -> every text given for it (a duplicate shows as two)."""
    res: dict[str, list[str]] = {}
    with open(out, encoding="utf-8") as f:
        for line in f:
            obj = json.loads(line)
            assert obj["error"] is None and obj["response"]["status_code"] == 200, obj
            res.setdefault(obj["custom_id"], []).append(
                obj["response"]["body"]["choices"][0]["text"])
    return res


def read(path: str) -> str:
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()


def finish(proc: subprocess.Popen, log: str) -> tuple[int, str]:
    code = proc.wait(timeout=TIMEOUT)
    return code, read(log)


def test_kill9_and_sigterm_resume_without_loss_or_duplicates(tmp_path):
    inp, ref = str(tmp_path / "in.jsonl"), str(tmp_path / "ref.jsonl")
    write_input(inp)
    code, log = finish(start(inp, ref, str(tmp_path / "ref.ckpt"), str(tmp_path / "r.log")),
                       str(tmp_path / "r.log"))
    assert code == 0, log
    reference = texts(ref)
    assert sorted(reference) == sorted(f"req-{i}" for i in range(N))

    out, ckpt = str(tmp_path / "out.jsonl"), str(tmp_path / "ckpt")
    submitted = 0
    durable = 0
    for run, seed in enumerate(("sigterm", 1, 2)):  # SIGTERM first: work is left unsent
        log = str(tmp_path / f"run{run}.log")
        proc = start(inp, out, ckpt, log)
        kill_at = durable + (random.Random(seed).randint(3, 8) if seed != "sigterm" else 10)
        wait_until(proc, ckpt, kill_at, log)
        if seed == "sigterm":
            proc.send_signal(signal.SIGTERM)
            code, text = finish(proc, log)
            assert code == 143, text
            m = re.search(r"submitted (\d+), finished (\d+), unfinished (\d+)", text)
            assert m and m.group(1) == m.group(2), text  # all in flight finished in grace
            submitted += int(m.group(1))
        else:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=60)
        m = re.search(r"(\d+) already done", read(log))
        assert m and int(m.group(1)) == durable, read(log)  # nothing lost
        durable = checkpointed(ckpt)
        assert durable >= kill_at
        assert not os.path.exists(out)
    log = str(tmp_path / "last.log")
    code, text = finish(start(inp, out, ckpt, log), log)
    assert code == 0, text
    assert f"{durable} already done" in text
    m = re.search(r"submitted (\d+), finished (\d+)", text)
    assert int(m.group(1)) == N - durable == int(m.group(2))  # done ones are not redone
    got = texts(out)
    assert sorted(got) == sorted(reference)
    assert all(len(v) == 1 for v in got.values())
    assert got == reference  # greedy: same text as the uninterrupted run
