"""AsyncLLM on the real default model: streamed DELTA outputs equal the offline
LLM's text, validation errors come back as ValueError before any output, a closed
generator aborts its request (KV blocks freed), concurrent requests are batched,
a failing step does not kill the loop, shutdown ends the streams.

Waits are bounded polls, never sleeps used as assertions.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.conftest import engine_variant

pytestmark = pytest.mark.model

PROMPT = "The capital of France is"


def _greedy(max_tokens: int = 8, **kw):
    from llmserve import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


@pytest.fixture(scope="module")
def async_llm(llm_fp32):
    from llmserve.engine.async_llm import AsyncLLM

    engine = AsyncLLM(engine_variant(llm_fp32).engine)
    yield engine
    engine.shutdown()


def _wait_idle(engine, timeout: float = 60.0):
    """Poll until no request runs or waits; returns the last snapshot."""
    deadline = time.monotonic() + timeout
    while True:
        s = engine.get_stats()
        if s.num_running_reqs == 0 and s.num_waiting_reqs == 0:
            return s
        assert time.monotonic() < deadline, f"engine still busy: {s}"
        time.sleep(0.02)


async def _text(engine, prompt, params, request_id):
    parts, final = [], None
    async for out in engine.generate(prompt, params, request_id):
        parts.append(out.outputs[0].text)
        final = out
    return "".join(parts), final


def test_stream_equals_offline_llm(async_llm, llm_fp32):
    ref = llm_fp32.generate([PROMPT], _greedy(), use_tqdm=False)[0].outputs[0]
    text, final = asyncio.run(_text(async_llm, PROMPT, _greedy(), "a-1"))
    assert text == ref.text
    assert final.finished and final.outputs[0].finish_reason == ref.finish_reason


def test_validation_error_before_any_output(async_llm):
    too_long = {"prompt_token_ids": [1] * async_llm.max_model_len}

    async def run():
        gen = async_llm.generate(too_long, _greedy(), "bad-1")
        with pytest.raises(ValueError, match=str(async_llm.max_model_len)):
            await gen.__anext__()
        with pytest.raises(ValueError, match="prompt"):
            await async_llm.add_request("bad-2", "", _greedy())
        return await _text(async_llm, PROMPT, _greedy(2), "after-bad")

    text, final = asyncio.run(run())
    assert final.finished and text


def test_closing_the_generator_aborts_and_frees_blocks(async_llm):
    baseline = _wait_idle(async_llm).kv_cache_usage

    async def run():
        gen = async_llm.generate(PROMPT, _greedy(2000, ignore_eos=True), "disc-1")
        first = await gen.__anext__()
        assert not first.finished
        await gen.aclose()  # what a client disconnect does to the server's generator

    asyncio.run(run())
    s = _wait_idle(async_llm)
    assert s.kv_cache_usage == baseline


def test_cancelled_consumer_aborts(async_llm):
    async def run():
        started = asyncio.Event()

        async def consume():
            async for _ in async_llm.generate(PROMPT, _greedy(2000, ignore_eos=True), "cx-1"):
                started.set()

        task = asyncio.create_task(consume())
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(run())
    assert _wait_idle(async_llm).num_running_reqs == 0


def test_concurrent_requests_are_batched(async_llm, llm_fp32):
    prompts = [f"Question {i}: what is {i} plus {i}? Answer:" for i in range(6)]
    refs = [o.outputs[0].text for o in llm_fp32.generate(prompts, _greedy(6), use_tqdm=False)]

    async def run():
        return await asyncio.gather(*(_text(async_llm, p, _greedy(6), f"c-{i}")
                                      for i, p in enumerate(prompts)))

    results = asyncio.run(run())
    assert [t for t, _ in results] == refs
    assert async_llm.get_stats().max_batch_size_seen > 1


def test_step_exception_fails_requests_but_not_the_loop(llm_fp32, monkeypatch):
    from llmserve.engine.async_llm import AsyncLLM, EngineStepError

    engine = AsyncLLM(engine_variant(llm_fp32).engine)
    real_step = engine.engine.step
    calls = {"n": 0}

    def flaky_step():
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected failure")
        return real_step()

    monkeypatch.setattr(engine.engine, "step", flaky_step)
    try:
        async def run():
            with pytest.raises(EngineStepError, match="injected failure"):
                await _text(engine, PROMPT, _greedy(4), "boom-1")
            return await _text(engine, PROMPT, _greedy(4), "ok-1")

        text, final = asyncio.run(run())
        assert final.finished and text
        assert _wait_idle(engine).kv_cache_usage == 0.0
    finally:
        engine.shutdown()


def test_shutdown_ends_streams_and_refuses_new_requests(llm_fp32):
    from llmserve.engine.async_llm import AsyncLLM, EngineShutdownError

    engine = AsyncLLM(engine_variant(llm_fp32).engine)

    async def run():
        gen = engine.generate(PROMPT, _greedy(2000, ignore_eos=True), "sd-1")
        await gen.__anext__()
        engine.shutdown()
        last = None
        async for out in gen:
            last = out
        assert last is not None and last.outputs[0].finish_reason == "abort"
        with pytest.raises(EngineShutdownError):
            await engine.add_request("sd-2", PROMPT, _greedy())

    asyncio.run(run())
    assert not engine.is_running


def test_abort_all_ends_streams_with_abort_outputs(async_llm):
    async def run():
        gen = async_llm.generate(PROMPT, _greedy(2000, ignore_eos=True), "ab-1")
        await gen.__anext__()
        assert async_llm.abort_all() == 1
        outs = [out async for out in gen]
        assert outs and outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"

    asyncio.run(run())
    assert _wait_idle(async_llm).num_running_reqs == 0


def test_admission_counts_until_each_request_leaves_the_engine(async_llm):
    """``add_requests`` admits all or none against ``max_num_admitted``; ``num_admitted``
    drops when a request finishes, is aborted (consumer gone) or is rejected."""
    from llmserve.engine.async_llm import EngineOverloadedError, NewRequest

    def wait_admitted(n: int) -> None:
        deadline = time.monotonic() + 60
        while async_llm.num_admitted != n:
            assert time.monotonic() < deadline, async_llm.num_admitted
            time.sleep(0.02)

    long = _greedy(2000, ignore_eos=True)

    async def run():
        streams = await async_llm.add_requests(
            [NewRequest(f"adm-{i}", PROMPT, long) for i in range(3)], max_num_admitted=4)
        assert async_llm.num_admitted == 3
        with pytest.raises(EngineOverloadedError) as e:
            await async_llm.add_requests([NewRequest(f"adm-x{i}", PROMPT, long)
                                          for i in range(2)], max_num_admitted=4)
        assert (e.value.num_admitted, e.value.num_requested, e.value.limit) == (3, 2, 4)
        assert async_llm.num_admitted == 3  # nothing of the refused pair was admitted
        with pytest.raises(ValueError):  # one bad prompt: none of the pair stays
            await async_llm.add_requests([NewRequest("adm-ok", PROMPT, long),
                                          NewRequest("adm-bad", "", long)], max_num_admitted=5)
        streams[0].abort()  # a consumer that hangs up
        await asyncio.to_thread(wait_admitted, 2)
        short = await async_llm.add_request("adm-short", PROMPT, _greedy(2))
        async for _ in short:
            pass
        await asyncio.to_thread(wait_admitted, 2)  # finished: released
        for s in streams[1:]:
            s.abort()

    asyncio.run(run())
    wait_admitted(0)
    assert _wait_idle(async_llm).num_running_reqs == 0
