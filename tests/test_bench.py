"""``llmserve bench``: metric arithmetic on synthetic timestamps, datasets, and the
three commands end to end at a tiny size (serve against a stub streaming server)."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import numpy as np
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from llmserve.benchmarks.datasets import (
    prefix_repetition_requests,
    random_requests,
    sharegpt_requests,
)
from llmserve.benchmarks.metrics import (
    RequestResult,
    calculate_metrics,
    format_metrics,
    parse_goodput,
    request_tpot,
)
from llmserve.benchmarks.offline import run_latency
from llmserve.entrypoints.cli import main


# ---------------------------------------------------------------- metrics
def result_from_times(sent: float, token_times: list[float], prompt_len=10) -> RequestResult:
    """A request sent at ``sent`` whose tokens arrived at ``token_times`` (seconds)."""
    return RequestResult(success=True, prompt_len=prompt_len, output_len=len(token_times),
                         ttft=token_times[0] - sent, latency=token_times[-1] - sent,
                         itl=list(np.diff(token_times)))


def test_metrics_on_synthetic_timestamps():
    a = result_from_times(0.0, [0.10, 0.15, 0.20, 0.25, 0.30])  # TTFT 100 ms, gaps 50 ms
    b = result_from_times(1.0, [1.30, 1.40, 1.50])  # TTFT 300 ms, gaps 100 ms
    c = result_from_times(2.0, [2.05])  # one token: no TPOT
    failed = RequestResult(success=False, error="HTTP 500")
    assert request_tpot(a) == pytest.approx(0.05) and request_tpot(c) is None
    m = calculate_metrics([a, b, c, failed], duration_s=4.0, goodput_slos={"ttft": 0.2})
    assert (m.completed, m.failed, m.total_input, m.total_output) == (3, 1, 30, 9)
    assert m.request_throughput == pytest.approx(3 / 4)
    assert m.output_throughput == pytest.approx(9 / 4)
    assert m.total_token_throughput == pytest.approx(39 / 4)
    assert m.ttft_ms.mean == pytest.approx(150.0) and m.ttft_ms.median == pytest.approx(100.0)
    assert m.tpot_ms.mean == pytest.approx(75.0)  # (50 + 100) / 2; c has no TPOT
    assert m.itl_ms.mean == pytest.approx((4 * 50 + 2 * 100) / 6)
    assert m.e2el_ms.percentiles["p50"] == pytest.approx(300.0)
    # numpy linear interpolation over [50, 300, 500] ms
    assert m.e2el_ms.percentiles["p90"] == pytest.approx(460.0)
    assert m.e2el_ms.percentiles["p99"] == pytest.approx(496.0)
    assert m.request_goodput == pytest.approx(2 / 4)  # a and c meet TTFT <= 200 ms
    both = calculate_metrics([a, b, c], 4.0, parse_goodput(["ttft:500", "tpot:60"]))
    assert both.request_goodput == pytest.approx(2 / 4)  # b's TPOT 100 ms misses; c counts 0
    assert "Request goodput" in format_metrics(both) and "P99 ITL" in format_metrics(both)


def test_parse_goodput_errors():
    assert parse_goodput(["e2el:1500"]) == {"e2el": 1.5}
    for bad in (["ttft"], ["latency:5"], ["tpot:x"], ["ttft:-1"]):
        with pytest.raises(ValueError, match="goodput"):
            parse_goodput(bad)
    with pytest.raises(ValueError, match="positive"):
        calculate_metrics([], 0.0)


# ---------------------------------------------------------------- datasets
class CharTokenizer:
    vocab_size = 50000

    def encode(self, text):
        return [ord(ch) for ch in text]

    def decode(self, ids):
        return "".join(chr(65 + i % 26) for i in ids)


def test_random_and_prefix_datasets():
    reqs = random_requests(50, 100, 20, range_ratio=0.5, seed=3, tokenizer=CharTokenizer())
    assert all(50 <= r.prompt_len <= 150 and 10 <= r.expected_output_len <= 30 for r in reqs)
    assert all(len(r.prompt) == r.prompt_len == len(r.prompt_token_ids) for r in reqs)
    again = random_requests(50, 100, 20, range_ratio=0.5, seed=3, tokenizer=CharTokenizer())
    assert [r.prompt_token_ids for r in again] == [r.prompt_token_ids for r in reqs]
    pre = prefix_repetition_requests(12, 16, 4, 3, 8, seed=1, vocab_size=1000)
    assert len({tuple(r.prompt_token_ids[:16]) for r in pre}) == 3
    assert all(r.prompt_len == 20 and r.expected_output_len == 8 for r in pre)
    with pytest.raises(ValueError, match="range ratio"):
        random_requests(1, 10, 10, range_ratio=1.0)


def test_sharegpt_dataset(tmp_path):
    convs = [{"conversations": [{"from": "human", "value": f"question number {i}?"},
                                {"from": "gpt", "value": "an answer of some length"}]}
             for i in range(5)] + [{"conversations": [{"from": "human", "value": "hi"}]}]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(convs))
    reqs = sharegpt_requests(str(path), 4, CharTokenizer(), seed=0)
    assert len(reqs) == 4 and all(r.expected_output_len == 24 for r in reqs)
    assert sharegpt_requests(str(path), 2, CharTokenizer(), output_len=7)[0].expected_output_len == 7
    with pytest.raises(ValueError, match="usable"):
        sharegpt_requests(str(path), 6, CharTokenizer())


# ---------------------------------------------------------------- offline commands
@pytest.mark.model
def test_bench_throughput_cli_native(tmp_path, capsys):
    out = tmp_path / "tp.json"
    assert main(["bench", "throughput", "--num-prompts", "3", "--random-input-len", "12",
                 "--random-output-len", "4", "--ignore-eos", "--kv-cache-memory", "32MiB",
                 "--max-model-len", "256", "--dtype", "bfloat16", "--quantization",
                 "gguf-native", "--disable-tqdm", "--output-json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert (res["num_requests"], res["total_input_tokens"], res["total_output_tokens"]) == (3, 36, 12)
    assert res["tokens_per_second"] > res["output_tokens_per_second"] > 0
    assert res["weights"] == "gguf-native"
    assert "requests/s" in capsys.readouterr().out


@pytest.mark.model
def test_bench_latency(llm_fp32):
    res = run_latency(llm_fp32, batch_size=2, input_len=8, output_len=4, num_iters=1,
                      num_iters_warmup=0)
    assert res["batch_size"] == 2 and res["num_iters"] == 1
    # 4 tokens each: the first step (prefill) samples token 1, then 3 decode steps
    assert res["steps_per_batch"] == 4
    d = res["decode_step_ms"]
    assert 0 < d["median"] <= d["p90"] <= d["p99"]
    assert res["ttft_ms"]["p99"] >= res["ttft_ms"]["median"] > 0
    assert res["decode_tokens_per_second"] == pytest.approx(2000 / d["median"])
    with pytest.raises(ValueError, match="batch_size"):
        run_latency(llm_fp32, 0, 8, 5)


def test_bench_latency_cli_flags():
    from llmserve.entrypoints.cli import build_parser

    args = build_parser().parse_args(["bench", "latency", "--batch-size", "64", "--input-len",
                                      "32", "--output-len", "256", "--quantization", "none"])
    assert (args.batch_size, args.input_len, args.output_len, args.quantization) == (
        64, 32, 256, "none")


# ---------------------------------------------------------------- serve, against a stub server
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_stub_app(delay_s: float = 0.01, words_per_request: int = 4):
    """A minimal OpenAI-compatible streaming server: one word per chunk, usage at the end."""
    app = FastAPI()
    seen: list[dict] = []

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "stub-model", "object": "model"}]}

    async def stream(body: dict, chat: bool):
        n = min(body.get("max_tokens") or words_per_request, words_per_request)
        for i in range(n):
            await asyncio.sleep(delay_s)
            choice = ({"index": 0, "delta": {"content": f" w{i}"}} if chat else
                      {"index": 0, "text": f" w{i}"})
            yield f"data: {json.dumps({'choices': [choice]})}\n\n"
        usage = {"prompt_tokens": 7, "completion_tokens": n, "total_tokens": 7 + n}
        yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
        yield "data: [DONE]\n\n"

    async def handle(request: Request, chat: bool):
        body = await request.json()
        seen.append(body)
        if body.get("model") != "stub-model":
            return JSONResponse({"error": {"message": "unknown model"}}, status_code=404)
        return StreamingResponse(stream(body, chat), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await handle(request, chat=True)

    app.state.seen = seen
    return app


@pytest.fixture(scope="module")
def stub_server():
    import uvicorn

    app = make_stub_app()
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 20
    while not server.started and time.time() < deadline:
        time.sleep(0.05)
    assert server.started, "stub server did not start"
    yield f"http://127.0.0.1:{port}", app
    server.should_exit = True
    thread.join(timeout=10)


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_bench_serve_against_stub(stub_server, tmp_path, capsys, endpoint):
    url, app = stub_server
    out = tmp_path / "serve.json"
    assert main(["bench", "serve", "--base-url", url, "--endpoint", endpoint,
                 "--num-prompts", "6", "--random-input-len", "16", "--random-output-len", "3",
                 "--request-rate", "50", "--max-concurrency", "2", "--ignore-eos",
                 "--goodput", "ttft:5000", "tpot:5000", "--disable-tqdm",
                 "--save-result", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["model"] == "stub-model" and (res["completed"], res["failed"]) == (6, 0)
    assert res["output_lens"] == [3] * 6 and res["input_lens"] == [7] * 6  # from usage
    assert res["total_output"] == 18 and res["request_goodput"] == pytest.approx(
        res["request_throughput"])
    assert all(len(itl) == 2 for itl in res["itls"]) and min(res["ttfts"]) > 0
    assert res["mean_tpot_ms"] > 0 and res["p99_itl_ms"] >= res["median_itl_ms"] > 0
    body = app.state.seen[-1]
    assert body["stream"] and body["ignore_eos"] and body["max_tokens"] == 3
    assert ("messages" in body) == (endpoint == "/v1/chat/completions")
    assert "Successful requests:" in capsys.readouterr().out


def test_bench_serve_unreachable(capsys):
    port = _free_port()
    assert main(["bench", "serve", "--base-url", f"http://127.0.0.1:{port}", "--model", "m",
                 "--num-prompts", "2", "--random-input-len", "4", "--random-output-len", "2",
                 "--disable-tqdm"]) == 2
    assert "test request" in capsys.readouterr().err
