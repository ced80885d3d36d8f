"""``bench serve``: load an OpenAI-compatible endpoint and measure it (any engine).

Requests stream (SSE, ``stream: true``); each content-bearing chunk is a token
arrival for TTFT/ITL (a chunk carrying several tokens counts once, as in vLLM).
Token counts come from the server's ``usage`` (``stream_options.include_usage``),
else from tokenizing the generated text. Arrivals: Poisson at
``request_rate`` requests/s (exponential gaps, seeded), or all at once for
``inf``; ``max_concurrency`` caps requests in flight.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass

import httpx
from tqdm.auto import tqdm

from llmserve.benchmarks.datasets import SampleRequest
from llmserve.benchmarks.metrics import RequestResult

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")


@dataclass
class ServeConfig:
    """Where and how to send requests.

    ``request_rate``: requests/s (``float("inf")`` = all at once); ``max_concurrency``:
    None = unlimited; ``ignore_eos`` is sent as vLLM's extension field.
    """

    base_url: str
    endpoint: str = "/v1/completions"
    model: str | None = None
    request_rate: float = float("inf")
    max_concurrency: int | None = None
    ignore_eos: bool = False
    temperature: float = 0.0
    timeout_s: float = 600.0
    seed: int = 0
    api_key: str | None = None

    def __post_init__(self) -> None:
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint must be one of {list(ENDPOINTS)}, got {self.endpoint!r}")
        if not self.request_rate > 0:
            raise ValueError(f"request rate must be > 0 (or inf), got {self.request_rate}")
        if self.max_concurrency is not None and self.max_concurrency <= 0:
            raise ValueError(f"max concurrency must be positive, got {self.max_concurrency}")


def build_payload(cfg: ServeConfig, req: SampleRequest, model: str) -> dict:
    """The JSON body for one request on ``cfg.endpoint``."""
    body = {"model": model, "max_tokens": req.expected_output_len, "stream": True,
            "stream_options": {"include_usage": True}, "temperature": cfg.temperature}
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    if cfg.endpoint == "/v1/chat/completions":
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt
    return body


def _chunk_text(chunk: dict) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    c = choices[0]
    if "delta" in c:
        return (c["delta"] or {}).get("content") or ""
    return c.get("text") or ""


async def send_request(client: httpx.AsyncClient, cfg: ServeConfig, req: SampleRequest,
                       model: str, tokenizer=None) -> RequestResult:
    """Send one streaming request; never raises (failures come back as ``success=False``)."""
    body = build_payload(cfg, req, model)
    result = RequestResult(success=False, prompt_len=req.prompt_len)
    text_parts: list[str] = []
    usage = None
    t0 = last = time.perf_counter()
    try:
        async with client.stream("POST", cfg.endpoint, json=body) as resp:
            if resp.status_code != 200:
                detail = (await resp.aread()).decode("utf-8", "replace")[:500]
                result.error = f"HTTP {resp.status_code}: {detail}"
                return result
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("usage"):
                    usage = chunk["usage"]
                text = _chunk_text(chunk)
                if not text:
                    continue
                now = time.perf_counter()
                if not text_parts:
                    result.ttft = now - t0
                else:
                    result.itl.append(now - last)
                last = now
                text_parts.append(text)
    except (httpx.HTTPError, json.JSONDecodeError, asyncio.TimeoutError) as e:
        result.error = f"{type(e).__name__}: {e}"
        return result
    result.latency = time.perf_counter() - t0
    if not text_parts:
        result.error = "no tokens streamed"
        return result
    result.success = True
    result.generated_text = "".join(text_parts)
    if usage and usage.get("completion_tokens") is not None:
        result.output_len = int(usage["completion_tokens"])
        if usage.get("prompt_tokens"):
            result.prompt_len = int(usage["prompt_tokens"])
    elif tokenizer is not None:
        result.output_len = len(tokenizer.encode(result.generated_text))
    else:  # no usage, no tokenizer: one token per chunk
        result.output_len = len(text_parts)
    return result


async def _arrivals(n: int, rate: float, seed: int):
    """Yield request indices 0..n-1, spaced by exponential gaps of mean 1/rate seconds."""
    rng = random.Random(seed)
    for i in range(n):
        yield i
        if rate != float("inf") and i < n - 1:
            await asyncio.sleep(rng.expovariate(rate))


async def discover_model(client: httpx.AsyncClient) -> str:
    """The first model id from ``GET /v1/models``.

    Raises:
        ValueError: the endpoint is unreachable or lists no model.
    """
    try:
        resp = await client.get("/v1/models")
        resp.raise_for_status()
        return resp.json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
        raise ValueError(f"cannot list models at {client.base_url}/v1/models ({e}); "
                         "pass --model") from None


async def run_serve(cfg: ServeConfig, requests: list[SampleRequest], tokenizer=None,
                    use_tqdm: bool = True) -> tuple[list[RequestResult], float, str]:
    """Run the benchmark: one test request, then all ``requests`` with the arrival pattern.

    Returns:
        ``(results in request order, wall seconds from first send to last reply, model)``.

    Raises:
        ValueError: the server is unreachable or the test request fails.
    """
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else None
    limits = httpx.Limits(max_connections=cfg.max_concurrency or 1000,
                          max_keepalive_connections=cfg.max_concurrency or 1000)
    async with httpx.AsyncClient(base_url=cfg.base_url.rstrip("/"), timeout=cfg.timeout_s,
                                 headers=headers, limits=limits) as client:
        model = cfg.model or await discover_model(client)
        probe = SampleRequest(requests[0].prompt, requests[0].prompt_token_ids,
                              requests[0].prompt_len, min(4, requests[0].expected_output_len))
        test = await send_request(client, cfg, probe, model, tokenizer)
        if not test.success:
            raise ValueError(f"test request to {cfg.base_url}{cfg.endpoint} failed: {test.error}")
        sem = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
        bar = tqdm(total=len(requests), desc="requests", disable=not use_tqdm,
                   dynamic_ncols=True)

        async def one(req: SampleRequest) -> RequestResult:
            if sem is None:
                r = await send_request(client, cfg, req, model, tokenizer)
            else:
                async with sem:
                    r = await send_request(client, cfg, req, model, tokenizer)
            bar.update(1)
            return r

        tasks = []
        start = time.perf_counter()
        async for i in _arrivals(len(requests), cfg.request_rate, cfg.seed):
            tasks.append(asyncio.create_task(one(requests[i])))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        bar.close()
    return list(results), duration, model
