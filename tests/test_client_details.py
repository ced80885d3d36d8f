"""The smaller things real clients send (issue 17, item 5), against one real server with
the official ``openai`` client and httpx: ``best_of`` with ``n``, ``logit_bias``, four
``stop`` strings, ``stream_options.continuous_usage_stats``, ``service_tier`` and
``metadata``, ``input_text`` content parts, ``X-Request-Id``, a batch of prompts with
``n``, and cached-token usage in a stream."""

from __future__ import annotations

import pytest

from tests.test_server import MODEL, start_server, stop_server

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

pytestmark = pytest.mark.model

PROMPT = "Once upon a time, in a small village,"


@pytest.fixture(scope="module")
def server(llm_fp32):
    srv = start_server()
    yield srv
    assert stop_server(srv) == 0, srv.log()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)


def test_best_of_picks_the_most_likely_candidate(client, server):
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=1.0, seed=7)
    all3 = client.completions.create(n=3, logprobs=0, **kw)
    sums = [sum(c.logprobs.token_logprobs) for c in all3.choices]
    best = client.completions.create(n=1, best_of=3, **kw)
    assert len(best.choices) == 1 and best.choices[0].logprobs is None
    assert best.choices[0].text == all3.choices[max(range(3), key=sums.__getitem__)].text
    two = client.completions.create(n=2, best_of=3, **kw)
    order = sorted(range(3), key=lambda i: -sums[i])[:2]
    assert [c.text for c in two.choices] == [all3.choices[i].text for i in order]
    assert [c.index for c in two.choices] == [0, 1]
    for body in ({"n": 2, "best_of": 1}, {"best_of": 2, "stream": True}):
        r = httpx.post(server.url + "/v1/completions",
                       json={"model": MODEL, "prompt": PROMPT, **body}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "best_of", r.text


def test_logit_bias_and_stop(client, llm_fp32):
    tok = llm_fp32.get_tokenizer()
    target = tok.encode(" banana", add_special_tokens=False)[0]
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0,
                                  logit_bias={str(target): 100})
    assert r.choices[0].text == tok.decode([target] * 3)
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0,
                                      logprobs=0)
    first = tok.encode(plain.choices[0].text, add_special_tokens=False)[0]
    banned = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1,
                                       temperature=0, logit_bias={str(first): -100})
    assert banned.choices[0].text != plain.choices[0].text
    stops = [" the", " and", ",", "."]
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0,
                                  stop=stops)
    assert not any(s in r.choices[0].text for s in stops)
    assert r.choices[0].finish_reason == "stop"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=PROMPT, logit_bias={"x": 1})


def test_continuous_usage_metadata_and_request_id(client, server):
    chunks = list(client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    with_choices = [c for c in chunks if c.choices]
    assert with_choices and all(c.usage is not None for c in with_choices)
    counts = [c.usage.completion_tokens for c in with_choices]
    assert counts == sorted(counts) and chunks[-1].usage.completion_tokens == 5
    chat = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    assert all(c.usage is not None for c in chat if c.choices and c.choices[0].delta.content)
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
        service_tier="auto", metadata={"team": "a"}, temperature=0)
    assert r.choices[0].message.content
    r = httpx.post(server.url + "/v1/completions", headers={"X-Request-Id": "abc-123"},
                   json={"model": MODEL, "prompt": PROMPT, "max_tokens": 1}, timeout=60)
    assert r.headers["x-request-id"] == "abc-123"
    r = httpx.get(server.url + "/v1/models", timeout=60)
    assert r.headers["x-request-id"].startswith("req-")


def test_input_text_parts_batch_with_n_and_cached_usage(client, llm_fp32):
    from llmserve import SamplingParams

    text_msg = [{"role": "user", "content": [{"type": "text", "text": "Name a color."}]}]
    input_msg = [{"role": "user", "content": [{"type": "input_text", "text": "Name a color."}]}]
    a = client.chat.completions.create(model=MODEL, messages=text_msg, max_tokens=5,
                                       temperature=0)
    b = client.chat.completions.create(model=MODEL, messages=input_msg, max_tokens=5,
                                       temperature=0)
    assert a.choices[0].message.content == b.choices[0].message.content
    prompts = ["The sun is", "My favourite food is"]
    r = client.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=4,
                                  temperature=0)
    ref = llm_fp32.generate(prompts, SamplingParams(temperature=0, max_tokens=4),
                            use_tqdm=False)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == [o.outputs[0].text for o in ref for _ in range(2)]
    long_prompt = "Tell me a story about a dragon. " * 12
    for _ in range(2):
        chunks = list(client.completions.create(
            model=MODEL, prompt=long_prompt, max_tokens=2, temperature=0, stream=True,
            stream_options={"include_usage": True}))
        usage = chunks[-1].usage
    assert usage.prompt_tokens_details.cached_tokens > 0
