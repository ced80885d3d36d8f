"""The batch format, checkpoint and runner without a model (fast): input errors name
the line and field; a checkpoint refuses another input and never stores a custom_id
twice; the runner keeps ``max_in_flight`` requests going, skips what is done, and on
stop lets in-flight requests finish (or aborts them)."""

from __future__ import annotations

import asyncio
import json

import pytest

from llmserve.entrypoints.batch.batch_format import digest, parse_batch
from llmserve.entrypoints.batch.checkpoint import CheckpointStore, peek_counts
from llmserve.entrypoints.batch.runner import run_batch


def line(cid="a", url="/v1/completions", body=None, **extra) -> str:
    return json.dumps({"custom_id": cid, "method": "POST", "url": url,
                       "body": {"prompt": "x"} if body is None else body, **extra})


@pytest.mark.parametrize("text, needle", [
    ("{not json", "line 1: not valid JSON"),
    ("[1]", "line 1: expected a JSON object"),
    (json.dumps({"url": "/v1/completions", "body": {}}), "line 1: custom_id must be"),
    (line() + "\n\n" + line(), "line 3: custom_id 'a' repeats line 1"),
    (line(method="GET"), "line 1: method must be POST"),
    (line(url="/v1/embeddings"), "line 1: url must be one of"),
    (line(body=[1]), "line 1: body must be a JSON object"),
    ("\n  \n", "the batch has no requests"),
])
def test_parse_errors_name_line_and_field(text, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(")):
        parse_batch(text, "in.jsonl")


def test_endpoint_must_match_and_items_keep_order():
    text = line("a") + "\n" + line("b", "/v1/chat/completions", {"messages": []})
    items = parse_batch(text)
    assert [(i.index, i.custom_id, i.url) for i in items] == [
        (0, "a", "/v1/completions"), (1, "b", "/v1/chat/completions")]
    with pytest.raises(ValueError, match="line 2: url '/v1/chat/completions' differs"):
        parse_batch(text, endpoint="/v1/completions")


def test_checkpoint_is_durable_and_belongs_to_one_input(tmp_path):
    d = str(tmp_path / "ck")
    s = CheckpointStore(d, digest("input"), 3)
    assert s.add("b", 1, True, '{"b": 1}') and s.add("a", 0, False, '{"a": 0}')
    assert not s.add("b", 1, True, '{"b": 2}')  # never twice
    s.close()
    s = CheckpointStore(d, digest("input"), 3)  # reopened, as after a kill
    assert s.done() == {"a", "b"} and s.counts() == (1, 1)
    assert s.lines() == ['{"a": 0}', '{"b": 1}'] and s.lines(ok=True) == ['{"b": 1}']
    assert peek_counts(d) == (1, 1)
    s.close()
    with pytest.raises(ValueError, match="belongs to another input"):
        CheckpointStore(d, digest("other input"), 3)


def run(coro):
    return asyncio.run(coro)


def test_runner_concurrency_skip_and_stop(tmp_path):
    items = parse_batch("\n".join(line(f"r{i}") for i in range(20)))
    store = CheckpointStore(str(tmp_path / "ck"), "d", 20)
    store.add("r0", 0, True, "{}")
    live, peak = 0, 0

    async def execute(item):
        nonlocal live, peak
        live += 1
        peak = max(peak, live)
        await asyncio.sleep(0.01)
        live -= 1
        return 200, {"id": item.custom_id}, None

    res = run(run_batch(items, execute, store, max_in_flight=4))
    assert (res.skipped, res.submitted, res.finished, res.unfinished) == (1, 19, 19, 0)
    assert peak == 4 and len(store.done()) == 20

    async def stopped(abort: bool):
        store2 = CheckpointStore(str(tmp_path / f"ck{abort}"), "d", 20)
        stop, abort_ev = asyncio.Event(), asyncio.Event()
        gate = asyncio.Event()

        async def slow(item):
            if item.index == 3:  # the 4th request in flight: stop now
                stop.set()
                if abort:
                    abort_ev.set()
            await gate.wait() if abort else await asyncio.sleep(0.01)
            return 200, {}, None

        r = await run_batch(items, slow, store2, 4, stop, grace_s=60, abort=abort_ev)
        return r, len(store2.done())

    r, stored = run(stopped(False))
    assert r.stopped and r.submitted == 4 and r.finished == 4 == stored  # grace: finished
    r, stored = run(stopped(True))
    assert r.stopped and r.finished == 0 == stored and r.unfinished == 20  # aborted
