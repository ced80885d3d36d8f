"""OpenAI's Files and Batch API on ``llmserve serve`` (https://platform.openai.com/docs/
api-reference/batch), run by the engine next to online traffic.

=================================  ======  ===============================================
route                              method  answer
=================================  ======  ===============================================
/v1/files                          POST    multipart ``file`` + ``purpose=batch``: a file
/v1/files                          GET     the files, newest first
/v1/files/{file_id}                GET     the file object; DELETE removes it
/v1/files/{file_id}/content        GET     its bytes (JSONL)
/v1/batches                        POST    ``{input_file_id, endpoint, completion_window}``
/v1/batches                        GET     the batches, newest first (``limit``, ``after``)
/v1/batches/{batch_id}             GET     the batch object (live ``request_counts``)
/v1/batches/{batch_id}/cancel      POST    stop it: requests in flight are aborted, the
                                           rest left out (cancelling -> cancelled, with
                                           the results so far in its files)
=================================  ======  ===============================================

A batch runs through :func:`~llmserve.entrypoints.batch.runner.run_batch` with up to
``max_num_seqs`` requests in flight, its results checkpointed one by one; on
completion the successes go to ``output_file_id`` and the failures to
``error_file_id`` (lines as OpenAI writes them, in input order). With ``--batch-dir``
everything is on disk: a server killed mid-batch resumes it on its next start,
skipping every ``custom_id`` already done. At shutdown (SIGTERM) running batches stop
taking new requests and those in flight get ``grace_s`` seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import tempfile
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, Response

from llmserve.entrypoints.batch.batch_format import ENDPOINTS, digest, parse_batch
from llmserve.entrypoints.batch.checkpoint import CheckpointStore, peek_counts
from llmserve.entrypoints.batch.runner import handler_executor, run_batch
from llmserve.entrypoints.batch.store import BatchDir
from llmserve.entrypoints.openai.serving_engine import APIError, bad_request

logger = logging.getLogger("llmserve.batch")
COMPLETION_WINDOW_S = 24 * 3600
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")


def not_found(what: str, ident: str) -> APIError:
    return APIError(404, f"No such {what}: {ident!r}", "invalid_request_error", "id",
                    "not_found")


class BatchManager:
    """Runs and records batches; one per server (``state`` is its ServerState)."""

    def __init__(self, state: Any, root: BatchDir, grace_s: float = 30.0) -> None:
        self.state, self.dir, self.grace_s = state, root, grace_s
        self.stops: dict[str, asyncio.Event] = {}
        self.aborts: dict[str, asyncio.Event] = {}
        self.tasks: dict[str, asyncio.Task] = {}
        self.objs: dict[str, dict] = {}  # the live record of each running batch

    def create(self, input_file_id: str, endpoint: str, window: str,
               metadata: dict | None) -> dict:
        f = self.dir.get_file(input_file_id)
        if f is None:
            raise not_found("file", input_file_id)
        if f["purpose"] != "batch":
            raise bad_request(f"file {input_file_id} has purpose {f['purpose']!r}, not "
                              f"'batch'", "input_file_id")
        if endpoint not in ENDPOINTS:
            raise bad_request(f"endpoint must be one of {', '.join(ENDPOINTS)}, got "
                              f"{endpoint!r}", "endpoint")
        if window != "24h":
            raise bad_request(f"completion_window must be '24h', got {window!r}",
                              "completion_window")
        text = self.dir.file_content(input_file_id).decode("utf-8", errors="replace")
        try:
            items = parse_batch(text, f"file {input_file_id}", endpoint)
        except ValueError as e:
            raise bad_request(str(e), "input_file_id") from None
        now = int(time.time())
        obj = {"id": f"batch_{uuid.uuid4().hex}", "object": "batch", "endpoint": endpoint,
               "errors": None, "input_file_id": input_file_id, "completion_window": window,
               "status": "in_progress", "output_file_id": None, "error_file_id": None,
               "created_at": now, "in_progress_at": now,
               "expires_at": now + COMPLETION_WINDOW_S, "finalizing_at": None,
               "completed_at": None, "failed_at": None, "expired_at": None,
               "cancelling_at": None, "cancelled_at": None,
               "request_counts": {"total": len(items), "completed": 0, "failed": 0},
               "metadata": metadata}
        self.dir.save_batch(obj)
        self.start(obj, items, text)
        return obj

    def start(self, obj: dict, items: list, text: str) -> None:
        stop, abort = asyncio.Event(), asyncio.Event()
        if obj["status"] == "cancelling":
            stop.set()
            abort.set()
        self.stops[obj["id"]], self.aborts[obj["id"]] = stop, abort
        self.objs[obj["id"]] = obj
        self.tasks[obj["id"]] = asyncio.create_task(self._run(obj, items, text, stop, abort))

    async def _run(self, obj: dict, items: list, text: str, stop: asyncio.Event,
                   abort: asyncio.Event) -> None:
        bid = obj["id"]
        store = CheckpointStore(self.dir.checkpoint_dir(bid), digest(text), len(items))
        try:
            engine = self.state.require_engine()
            execute = handler_executor(self.state.completion, self.state.chat)
            await run_batch(items, execute, store, engine.max_num_seqs, stop, self.grace_s,
                            abort=abort)
            if stop.is_set() and not abort.is_set():
                return  # the server is stopping: resume on the next start
            ok, failed = store.counts()
            cancelled = abort.is_set()
            obj.update(status="finalizing", finalizing_at=int(time.time()))
            obj["request_counts"].update(completed=ok, failed=failed)
            self.dir.save_batch(obj)
            name = f"{bid}_output.jsonl"
            good, bad = store.lines(ok=True), store.lines(ok=False)
            if good:
                obj["output_file_id"] = self.dir.add_file(
                    "".join(x + "\n" for x in good).encode(), name, "batch_output")["id"]
            if bad:
                obj["error_file_id"] = self.dir.add_file(
                    "".join(x + "\n" for x in bad).encode(), f"{bid}_errors.jsonl",
                    "batch_output")["id"]
            now = int(time.time())
            if cancelled or ok + failed < len(items):
                obj.update(status="cancelled", cancelled_at=now)
            else:
                obj.update(status="completed", completed_at=now)
            self.dir.save_batch(obj)
        except Exception as e:  # the engine failed: record it rather than hang
            logger.exception("batch %s failed", bid)
            obj.update(status="failed", failed_at=int(time.time()),
                       errors={"object": "list", "data": [
                           {"code": "server_error", "message": f"{type(e).__name__}: {e}",
                            "param": None, "line": None}]})
            self.dir.save_batch(obj)
        finally:
            store.close()
            self.tasks.pop(bid, None)
            self.objs.pop(bid, None)

    def get(self, batch_id: str) -> dict:
        obj = self.objs.get(batch_id) or self.dir.get_batch(batch_id)
        if obj is None:
            raise not_found("batch", batch_id)
        obj = json.loads(json.dumps(obj))  # a copy: the runner keeps updating its own
        if obj["status"] in ACTIVE:
            counts = peek_counts(self.dir.checkpoint_dir(batch_id))
            if counts is not None:
                obj["request_counts"].update(completed=counts[0], failed=counts[1])
        return obj

    def cancel(self, batch_id: str) -> dict:
        obj = self.objs.get(batch_id) or self.get(batch_id)
        if obj["status"] not in ACTIVE:
            raise bad_request(f"batch {batch_id} is {obj['status']}; only an active batch "
                              f"can be cancelled", "batch_id")
        if obj["status"] != "cancelling":
            obj.update(status="cancelling", cancelling_at=int(time.time()))
            self.dir.save_batch(obj)
            for events in (self.aborts, self.stops):
                if batch_id in events:
                    events[batch_id].set()
        return self.get(batch_id)

    async def resume_when_ready(self) -> None:
        """Once the engine is up, restart every batch a previous process left active."""
        while not self.state.ready:
            if self.state.load_error is not None:
                return
            await asyncio.sleep(0.2)
        for obj in self.dir.list_batches():
            if obj["status"] in ACTIVE and obj["id"] not in self.tasks:
                text = self.dir.file_content(obj["input_file_id"]).decode("utf-8", "replace")
                items = parse_batch(text, obj["input_file_id"], obj["endpoint"])
                logger.warning("resuming batch %s (%s)", obj["id"], obj["status"])
                self.start(obj, items, text)

    async def shutdown(self) -> None:
        for bid, stop in list(self.stops.items()):
            if bid in self.tasks:
                stop.set()
        if self.tasks:
            await asyncio.wait(list(self.tasks.values()), timeout=self.grace_s + 5)


def install_batch_api(app: FastAPI, state: Any, batch_dir: str | None = None,
                      grace_s: float = 30.0) -> BatchManager:
    """Add the Files and Batch routes; ``batch_dir`` None: a temporary directory (no
    resume across restarts)."""
    root = BatchDir(batch_dir or tempfile.mkdtemp(prefix="llmserve-batches-"))
    mgr = BatchManager(state, root, grace_s)
    inner = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(a):
        async with inner(a) as value:
            resume = asyncio.create_task(mgr.resume_when_ready())
            try:
                yield value
            finally:
                resume.cancel()
                await mgr.shutdown()

    app.router.lifespan_context = lifespan

    @app.post("/v1/files", include_in_schema=False)
    async def upload(request: Request) -> Response:
        form = await request.form()
        purpose, upload = form.get("purpose"), form.get("file")
        if purpose != "batch":
            raise bad_request(f"purpose must be 'batch' (the only one served), got "
                              f"{purpose!r}", "purpose")
        if upload is None or isinstance(upload, str):
            raise bad_request("send the file as multipart field 'file'", "file")
        data = await upload.read()
        return JSONResponse(root.add_file(data, upload.filename or "upload.jsonl", purpose))

    @app.get("/v1/files", include_in_schema=False)
    async def list_files() -> Response:
        return JSONResponse({"object": "list", "data": root.list_files(), "has_more": False})

    @app.get("/v1/files/{file_id}", include_in_schema=False)
    async def get_file(file_id: str) -> Response:
        obj = root.get_file(file_id)
        if obj is None:
            raise not_found("file", file_id)
        return JSONResponse(obj)

    @app.delete("/v1/files/{file_id}", include_in_schema=False)
    async def delete_file(file_id: str) -> Response:
        if not root.delete_file(file_id):
            raise not_found("file", file_id)
        return JSONResponse({"id": file_id, "object": "file", "deleted": True})

    @app.get("/v1/files/{file_id}/content", include_in_schema=False)
    async def file_content(file_id: str) -> Response:
        if root.get_file(file_id) is None:
            raise not_found("file", file_id)
        return Response(root.file_content(file_id), media_type="application/octet-stream")

    @app.post("/v1/batches", include_in_schema=False)
    async def create(request: Request) -> Response:
        state.require_engine()
        try:
            body = await request.json()
        except ValueError:
            raise bad_request("the request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise bad_request("the request body must be a JSON object")
        for field in ("input_file_id", "endpoint", "completion_window"):
            if not isinstance(body.get(field), str):
                raise bad_request(f"{field} is required and must be a string", field)
        meta = body.get("metadata")
        if meta is not None and not isinstance(meta, dict):
            raise bad_request("metadata must be an object", "metadata")
        return JSONResponse(mgr.create(body["input_file_id"], body["endpoint"],
                                       body["completion_window"], meta))

    @app.get("/v1/batches", include_in_schema=False)
    async def list_batches(limit: int = 20, after: str | None = None) -> Response:
        items = root.list_batches()
        if after is not None:
            ids = [b["id"] for b in items]
            items = items[ids.index(after) + 1:] if after in ids else []
        page = items[:max(1, min(limit, 100))]
        return JSONResponse({"object": "list", "data": page,
                             "first_id": page[0]["id"] if page else None,
                             "last_id": page[-1]["id"] if page else None,
                             "has_more": len(items) > len(page)})

    @app.get("/v1/batches/{batch_id}", include_in_schema=False)
    async def get_batch(batch_id: str) -> Response:
        return JSONResponse(mgr.get(batch_id))

    @app.post("/v1/batches/{batch_id}/cancel", include_in_schema=False)
    async def cancel(batch_id: str) -> Response:
        return JSONResponse(mgr.cancel(batch_id))

    return mgr
