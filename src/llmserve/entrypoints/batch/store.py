"""Where the server's Batch API keeps its files and batches: plain files in one
directory (``--batch-dir``), so batches survive a restart and resume from their
checkpoints.

::

    DIR/files/file-<hex>.jsonl        an uploaded or produced file's bytes
    DIR/files/file-<hex>.json         its OpenAI file object
    DIR/batches/batch_<hex>.json      the batch object (written atomically)
    DIR/batches/batch_<hex>.ckpt/     its CheckpointStore
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
import uuid
from typing import Any

ID_RE = re.compile(r"^(file|batch)[-_][0-9a-f]{32}$")


def _write_json(path: str, obj: dict) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class BatchDir:
    """Files and batch records under ``root`` (created if missing).

    Raises:
        ValueError: ``root`` cannot be created.
    """

    def __init__(self, root: str) -> None:
        self.root = root
        try:
            os.makedirs(os.path.join(root, "files"), exist_ok=True)
            os.makedirs(os.path.join(root, "batches"), exist_ok=True)
        except OSError as e:
            raise ValueError(f"--batch-dir {root}: cannot create ({e})") from None

    # ------------------------------------------------------------------ files
    def _file(self, file_id: str, ext: str) -> str:
        return os.path.join(self.root, "files", file_id + ext)

    def add_file(self, data: bytes, filename: str, purpose: str) -> dict:
        file_id = f"file-{uuid.uuid4().hex}"
        with open(self._file(file_id, ".jsonl"), "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        obj = {"id": file_id, "object": "file", "bytes": len(data),
               "created_at": int(time.time()), "filename": filename, "purpose": purpose,
               "status": "processed", "status_details": None}
        _write_json(self._file(file_id, ".json"), obj)
        return obj

    def get_file(self, file_id: str) -> dict | None:
        if not ID_RE.match(file_id):
            return None
        try:
            with open(self._file(file_id, ".json"), encoding="utf-8") as f:
                return json.load(f)
        except (OSError, ValueError):
            return None

    def file_content(self, file_id: str) -> bytes:
        with open(self._file(file_id, ".jsonl"), "rb") as f:
            return f.read()

    def list_files(self) -> list[dict]:
        out = []
        for name in os.listdir(os.path.join(self.root, "files")):
            if name.endswith(".json"):
                obj = self.get_file(name[:-5])
                if obj is not None:
                    out.append(obj)
        return sorted(out, key=lambda o: o["created_at"], reverse=True)

    def delete_file(self, file_id: str) -> bool:
        if self.get_file(file_id) is None:
            return False
        for ext in (".json", ".jsonl"):
            with contextlib.suppress(FileNotFoundError):
                os.remove(self._file(file_id, ext))
        return True

    # ------------------------------------------------------------------ batches
    def _batch(self, batch_id: str) -> str:
        return os.path.join(self.root, "batches", batch_id + ".json")

    def checkpoint_dir(self, batch_id: str) -> str:
        return os.path.join(self.root, "batches", batch_id + ".ckpt")

    def save_batch(self, obj: dict) -> None:
        _write_json(self._batch(obj["id"]), obj)

    def get_batch(self, batch_id: str) -> dict[str, Any] | None:
        if not ID_RE.match(batch_id):
            return None
        try:
            with open(self._batch(batch_id), encoding="utf-8") as f:
                return json.load(f)
        except (OSError, ValueError):
            return None

    def list_batches(self) -> list[dict]:
        out = []
        for name in os.listdir(os.path.join(self.root, "batches")):
            if name.endswith(".json"):
                obj = self.get_batch(name[:-5])
                if obj is not None:
                    out.append(obj)
        return sorted(out, key=lambda o: (o["created_at"], o["id"]), reverse=True)
