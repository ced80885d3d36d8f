"""OpenAI's Batch API on a real ``llmserve serve`` process, driven by the official
``openai`` SDK (``files.create`` -> ``batches.create`` -> ``batches.retrieve`` ->
``files.content``): outputs equal the same requests sent one by one to
``/v1/chat/completions`` (greedy); a server killed with SIGKILL mid-batch resumes it
on restart with each ``custom_id`` exactly once; cancel and bad input behave as
OpenAI's."""

from __future__ import annotations

import io
import json
import signal
import time

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from tests.test_batch import checkpointed  # noqa: E402
from tests.test_server import MODEL, start_server, stop_server  # noqa: E402

pytestmark = pytest.mark.model

N = 16
KEY = "sk-batch-test"


def batch_input(n: int, bad: int | None = None) -> bytes:
    lines = []
    for i in range(n):
        body = {"model": MODEL, "messages": [{"role": "user", "content": f"Say the number {i}"}],
                "max_tokens": 4, "temperature": 0}
        if i == bad:
            body["max_tokens"] = -1
        lines.append(json.dumps({"custom_id": f"task-{i}", "method": "POST",
                                 "url": "/v1/chat/completions", "body": body}))
    return ("\n".join(lines) + "\n").encode()


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=KEY, timeout=120, max_retries=0)


def wait_status(c: openai.OpenAI, batch_id: str, statuses: tuple[str, ...],
                timeout: float = 600.0):
    deadline = time.monotonic() + timeout
    while True:
        b = c.batches.retrieve(batch_id)
        if b.status in statuses:
            return b
        assert b.status not in ("failed", "expired"), b
        assert time.monotonic() < deadline, b
        time.sleep(0.2)


def lines(c: openai.OpenAI, file_id: str) -> list[dict]:
    return [json.loads(x) for x in c.files.content(file_id).text.splitlines() if x.strip()]


def test_sdk_flow_kill9_resume_cancel_and_errors(tmp_path):
    batch_dir = str(tmp_path / "batches")
    # two requests in flight: results land two at a time, so the kill after the third
    # is mid-batch (with all 16 in flight they finish in the same steps, before it)
    first = start_server("--api-key", KEY, "--batch-dir", batch_dir, "--max-num-seqs", "2")
    try:
        c = client(first.url)
        f = c.files.create(file=("in.jsonl", io.BytesIO(batch_input(N)), "application/jsonl"),
                           purpose="batch")
        assert f.purpose == "batch" and f.bytes > 0
        b = c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                             completion_window="24h", metadata={"job": "nightly"})
        assert b.status == "in_progress" and b.request_counts.total == N
        ckpt = f"{batch_dir}/batches/{b.id}.ckpt"
        deadline = time.monotonic() + 600
        while checkpointed(ckpt) < 3:  # mid-batch, by results, not by time
            assert time.monotonic() < deadline and first.proc.poll() is None, first.log()
            time.sleep(0.02)
        first.proc.send_signal(signal.SIGKILL)
        first.proc.wait(timeout=60)
        done_at_kill = checkpointed(ckpt)
        assert done_at_kill < N
    finally:
        if first.proc.poll() is None:
            first.proc.kill()

    second = start_server("--api-key", KEY, "--batch-dir", batch_dir)
    try:
        c = client(second.url)
        b = wait_status(c, b.id, ("completed",))
        assert b.request_counts.completed == N and b.request_counts.failed == 0
        assert b.error_file_id is None and b.metadata == {"job": "nightly"}
        out = lines(c, b.output_file_id)
        ids = [x["custom_id"] for x in out]
        assert sorted(ids) == sorted(f"task-{i}" for i in range(N))  # each once
        assert "resuming batch" in second.log()
        # greedy: the same as the online endpoint, request by request
        for x in out[::8]:
            i = int(x["custom_id"].split("-")[1])
            ref = c.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"Say the number {i}"}],
                max_tokens=4, temperature=0)
            assert x["response"]["status_code"] == 200
            assert x["response"]["body"]["choices"][0]["message"]["content"] == \
                ref.choices[0].message.content

        # a bad line goes to the error file with its custom_id; the rest succeed
        f2 = c.files.create(file=("e.jsonl", io.BytesIO(batch_input(3, bad=2))),
                            purpose="batch")
        b2 = wait_status(c, c.batches.create(input_file_id=f2.id,
                                             endpoint="/v1/chat/completions",
                                             completion_window="24h").id, ("completed",))
        assert (b2.request_counts.completed, b2.request_counts.failed) == (2, 1)
        err = lines(c, b2.error_file_id)
        assert [e["custom_id"] for e in err] == ["task-2"]
        assert err[0]["response"]["status_code"] == 400
        assert err[0]["response"]["body"]["error"]["param"] == "max_tokens"
        assert len(lines(c, b2.output_file_id)) == 2

        # cancel: what finished is kept, the rest is left out
        f3 = c.files.create(file=("c.jsonl", io.BytesIO(batch_input(N))), purpose="batch")
        b3 = c.batches.create(input_file_id=f3.id, endpoint="/v1/chat/completions",
                              completion_window="24h")
        assert c.batches.cancel(b3.id).status in ("cancelling", "cancelled")
        b3 = wait_status(c, b3.id, ("cancelled",))
        got = lines(c, b3.output_file_id) if b3.output_file_id else []
        assert len(got) == b3.request_counts.completed <= N and b3.cancelled_at
        assert {b.id, b2.id, b3.id} <= {x.id for x in c.batches.list().data}

        # OpenAI-style errors
        with pytest.raises(openai.BadRequestError, match="custom_id"):
            bad = c.files.create(file=("d.jsonl", io.BytesIO(
                b'{"custom_id": "a", "url": "/v1/chat/completions", "body": {}}\n'
                b'{"custom_id": "a", "url": "/v1/chat/completions", "body": {}}\n')),
                purpose="batch")
            c.batches.create(input_file_id=bad.id, endpoint="/v1/chat/completions",
                             completion_window="24h")
        with pytest.raises(openai.NotFoundError):
            c.batches.retrieve("batch_" + "0" * 32)
        with pytest.raises(openai.BadRequestError, match="purpose"):
            c.files.create(file=("x.jsonl", io.BytesIO(b"{}")), purpose="fine-tune")
        r = httpx.get(second.url + "/v1/batches", timeout=30)
        assert r.status_code == 401
    finally:
        stop_server(second)
