"""LoRA adapters on the OpenAI server (vLLM's ``--lora-modules`` and
``/v1/load_lora_adapter`` / ``/v1/unload_lora_adapter``).

An adapter is served under its name: a request's ``model`` picks it, ``/v1/models``
lists it with ``parent`` = the base model, and an unknown name is a 404
(``model_not_found``). Names map to :class:`~llmserve.lora.LoRARequest` objects in one
:class:`LoRARegistry`; its ids are never reused, so a name unloaded and loaded again
(perhaps from another directory) never meets the old adapter's prefix cache.

Run-time loading is off unless the server was started with
``--allow-runtime-lora-updating`` (vLLM: ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``)::

    POST /v1/load_lora_adapter    {"lora_name": "sql", "lora_path": "/adapters/sql"}
    POST /v1/unload_lora_adapter  {"lora_name": "sql"}
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field

from llmserve.entrypoints.openai.serving_engine import APIError, bad_request
from llmserve.lora import LoRARequest


class LoRARegistry:
    """Adapter name -> :class:`LoRARequest`, thread-safe; ids count up from 1."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_name: dict[str, LoRARequest] = {}
        self._next_id = 1

    def add(self, name: str, path: str) -> LoRARequest:
        """Register ``name``. Raises ValueError if it is taken or empty."""
        with self._lock:
            if name in self._by_name:
                raise ValueError(f"The lora adapter '{name}' has already been loaded.")
            req = LoRARequest(name, self._next_id, path)
            self._next_id += 1
            self._by_name[name] = req
            return req

    def remove(self, name: str) -> LoRARequest | None:
        with self._lock:
            return self._by_name.pop(name, None)

    def get(self, name: str | None) -> LoRARequest | None:
        if name is None:
            return None
        with self._lock:
            return self._by_name.get(name)

    def list(self) -> list[LoRARequest]:
        with self._lock:
            return list(self._by_name.values())


def parse_lora_modules(values: Sequence[str] | None) -> list[tuple[str, str]]:
    """``--lora-modules`` values: ``name=path`` or vLLM's JSON
    ``{"name": ..., "path": ...}``.

    Raises:
        ValueError: naming the malformed value or a repeated name.
    """
    out: list[tuple[str, str]] = []
    for value in values or ():
        if value.lstrip().startswith("{"):
            try:
                obj = json.loads(value)
                name, path = obj["name"], obj["path"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise ValueError(f"--lora-modules: {value!r} is not name=path or "
                                 '{"name": ..., "path": ...}') from None
        else:
            name, sep, path = value.partition("=")
            if not sep:
                raise ValueError(f"--lora-modules: {value!r} is not name=path")
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise ValueError(f"--lora-modules: {value!r} needs a non-empty name and path")
        if any(name == n for n, _ in out):
            raise ValueError(f"--lora-modules: the name {name!r} is given twice")
        out.append((name, path))
    return out


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None  # accepted as vLLM does; the name decides


def install_lora_routes(app: FastAPI, state: Any) -> None:
    """The run-time load/unload routes (``state``: the server's ``ServerState``, with
    ``lora_registry`` and ``served_model_names``)."""

    def lora_engine():
        engine = state.require_engine()
        if engine.engine.lora_manager is None:
            raise bad_request("LoRA is off: start the server with --enable-lora")
        return engine.engine

    @app.post("/v1/load_lora_adapter", response_class=PlainTextResponse)
    async def load_lora_adapter(req: LoadLoRAAdapterRequest) -> PlainTextResponse:
        engine = lora_engine()
        if req.lora_name in state.served_model_names:
            raise bad_request(f"'{req.lora_name}' is the base model's name", "lora_name")
        registry: LoRARegistry = state.lora_registry
        try:
            lora = registry.add(req.lora_name, req.lora_path)
        except ValueError as e:
            raise bad_request(str(e), "lora_name") from None
        try:  # read and check the files off the event loop and the engine thread
            await asyncio.get_running_loop().run_in_executor(None, engine.add_lora, lora)
        except ValueError as e:
            registry.remove(req.lora_name)
            raise bad_request(str(e), "lora_path") from None
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added "
                                 "successfully.")

    @app.post("/v1/unload_lora_adapter", response_class=PlainTextResponse)
    async def unload_lora_adapter(req: UnloadLoRAAdapterRequest) -> PlainTextResponse:
        engine = lora_engine()
        lora = state.lora_registry.remove(req.lora_name)
        if lora is None:
            raise APIError(404, f"The lora adapter '{req.lora_name}' cannot be found.",
                           "not_found_error", "lora_name", "model_not_found")
        engine.remove_lora(lora.lora_int_id)  # requests in flight reload it if needed
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed "
                                 "successfully.")
