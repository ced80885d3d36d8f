"""Structured outputs: offline (``StructuredOutputsParams``) and through a real server
with the official ``openai`` client (``chat.completions.parse`` with a pydantic model,
streamed and not; ``response_format``; vLLM's ``guided_*`` extras). Every output is
checked by an independent validator: ``jsonschema`` for JSON, ``re.fullmatch`` for
regexes and for the language of the Lark / EBNF grammars.
"""

from __future__ import annotations

import asyncio
import json
import re

import pytest

from tests.test_server import MODEL, start_server, stop_server

jsonschema = pytest.importorskip("jsonschema")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pydantic = pytest.importorskip("pydantic")
pytest.importorskip("xgrammar")

pytestmark = pytest.mark.model

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8},
                 "maxItems": 3},
    },
    "required": ["name", "age", "role", "tags"],
    "additionalProperties": False,
}
LARK = 'start: greeting " " name "!"\ngreeting: "hello" | "hi"\nname: /[a-z]{2,8}/\n'
LARK_RE = r"(hello|hi) [a-z]{2,8}!"
EBNF = 'root ::= "(" num ("," num)* ")"\nnum ::= [1-9] [0-9]?'
EBNF_RE = r"\([1-9][0-9]?(,[1-9][0-9]?)*\)"
SEEDS = range(2)


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=20)
    country: str = pydantic.Field(max_length=20)
    population_millions: int
    is_capital: bool


NUM_STREAMED = 4
PROMPTS = [f"Tell me about {c} as JSON." for c in (
    "Paris", "Tokyo", "Lima", "Oslo", "Cairo", "Delhi", "Rome", "Quito", "Seoul", "Accra",
    "a small town", "the biggest city you know", "your favourite city", "Berlin", "Madrid",
    "Nairobi", "Hanoi", "Dublin", "a city by the sea", "Ottawa")]


def _sampled(**so):
    from llmserve import SamplingParams, StructuredOutputsParams

    return [SamplingParams(temperature=1.0, seed=s, max_tokens=60,
                           structured_outputs=StructuredOutputsParams(**so)) for s in SEEDS]


def test_offline_outputs_follow_their_grammar(llm_fp32):
    llm = llm_fp32
    chat = [[{"role": "user", "content": "Describe a user account as JSON."}]] * len(SEEDS)
    for out in llm.chat(chat, _sampled(json=SCHEMA), use_tqdm=False):
        assert out.outputs[0].finish_reason == "stop", out.outputs[0].text
        jsonschema.validate(json.loads(out.outputs[0].text), SCHEMA)
    cases = [({"regex": r"[0-9]{3}-[A-Z]{2}"}, r"[0-9]{3}-[A-Z]{2}"),
             ({"choice": ["red", "green", "light blue"]}, r"red|green|light blue"),
             ({"grammar": LARK}, LARK_RE), ({"grammar": EBNF}, EBNF_RE)]
    for so, pattern in cases:
        outs = llm.generate(["Answer:"] * len(SEEDS), _sampled(**so), use_tqdm=False)
        for out in outs:
            assert re.fullmatch(pattern, out.outputs[0].text), (so, out.outputs[0].text)
    # json_object: some JSON object
    for out in llm.generate(["A JSON object:"] * 2, _sampled(json_object=True)[:2],
                            use_tqdm=False):
        if out.outputs[0].finish_reason == "stop":
            assert isinstance(json.loads(out.outputs[0].text), dict)


def test_grammar_cache_and_errors(llm_fp32):
    from llmserve import SamplingParams, StructuredOutputsParams

    cache = llm_fp32.engine.structured_output
    before = cache.num_compiles
    for _ in range(3):  # same schema, new params objects (key order differs): one compile
        cache.compile(StructuredOutputsParams(json={"type": "object", "properties": {
            "zz": {"type": "integer"}}, "required": ["zz"]}))
        cache.compile(StructuredOutputsParams(json={"required": ["zz"], "properties": {
            "zz": {"type": "integer"}}, "type": "object"}))
    assert cache.num_compiles == before + 1
    with pytest.raises(ValueError, match="structured_outputs"):
        StructuredOutputsParams(regex="a", choice=["b"])
    with pytest.raises(ValueError, match="structured_outputs.regex"):
        llm_fp32.generate(["x"], SamplingParams(
            structured_outputs=StructuredOutputsParams(regex="a(b")), use_tqdm=False)
    with pytest.raises(ValueError, match="structured_outputs.json"):
        llm_fp32.generate(["x"], SamplingParams(
            structured_outputs=StructuredOutputsParams(json="{not json")), use_tqdm=False)


@pytest.fixture(scope="module")
def server():
    srv = start_server()
    yield srv
    assert stop_server(srv) == 0, srv.log()


def test_openai_parse_with_pydantic_model(server):
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    schema = City.model_json_schema()

    async def parse(prompt: str, i: int):
        return await client.chat.completions.parse(
            model=MODEL, messages=[{"role": "user", "content": prompt}], response_format=City,
            temperature=0.8, seed=i, max_tokens=120)

    async def stream(prompt: str, i: int):
        async with client.chat.completions.stream(
                model=MODEL, messages=[{"role": "user", "content": prompt}],
                response_format=City, temperature=0.8, seed=100 + i, max_tokens=120) as s:
            return await s.get_final_completion()

    async def run_all():
        return await asyncio.gather(*[parse(p, i) for i, p in enumerate(PROMPTS)],
                                    *[stream(p, i) for i, p in enumerate(PROMPTS[:NUM_STREAMED])])

    results = asyncio.run(run_all())
    assert len(results) == len(PROMPTS) + NUM_STREAMED
    for r in results:
        msg = r.choices[0].message
        assert r.choices[0].finish_reason == "stop"
        assert isinstance(msg.parsed, City), msg.content
        jsonschema.validate(json.loads(msg.content), schema)


def test_server_guided_extras_and_response_format(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    cases = [({"guided_choice": ["yes", "no"]}, r"yes|no"),
             ({"guided_regex": r"[a-c]{4}"}, r"[a-c]{4}"),
             ({"guided_grammar": LARK}, LARK_RE)]
    for extra, pattern in cases:
        r = client.completions.create(model=MODEL, prompt="Reply:", n=3, temperature=1.0,
                                      max_tokens=30, extra_body=extra)
        for c in r.choices:
            assert re.fullmatch(pattern, c.text), (extra, c.text)
        chunks = list(client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Reply."}], temperature=1.0,
            max_tokens=30, stream=True, extra_body=extra))
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        assert re.fullmatch(pattern, text), (extra, text)
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "A user, as JSON."}],
        max_tokens=100, temperature=0.7, seed=3, response_format={
            "type": "json_schema", "json_schema": {"name": "u", "schema": SCHEMA,
                                                   "strict": True}})
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    r = client.completions.create(model=MODEL, prompt="A user as JSON:", max_tokens=100,
                                  temperature=0.7, seed=4, extra_body={"guided_json": SCHEMA})
    jsonschema.validate(json.loads(r.choices[0].text), SCHEMA)
    # errors: 400 naming the field
    for body, param in (({"guided_regex": "a(b"}, "guided_regex"),
                        ({"guided_json": "{nope"}, "guided_json"),
                        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
                        ({"response_format": {"type": "json_schema"}}, "response_format")):
        resp = httpx.post(server.url + "/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "x"}], **body},
            timeout=60)
        assert resp.status_code == 400, (body, resp.text)
        assert resp.json()["error"]["param"] == param, (body, resp.text)


def test_bitmask_applies_to_listed_rows_only():
    """xgrammar's bit layout (bit t % 32 of word t // 32); unlisted rows untouched."""
    import torch

    from llmserve.layers.sampler import apply_token_bitmask
    from llmserve.structured_output import allocate_bitmask

    logits = torch.randn(4, 100)
    bitmask = allocate_bitmask(2, 100)
    bitmask[:] = 0
    bitmask[0, 0] = 1 << 5  # row 1 of the batch allows token 5 only
    bitmask[1, 3] = 1 << 2  # row 3 allows token 98 only
    out = apply_token_bitmask(logits, bitmask, torch.tensor([1, 3]))
    assert torch.equal(out[0], logits[0]) and torch.equal(out[2], logits[2])
    assert torch.isfinite(out[1]).sum() == 1 and out[1, 5] == logits[1, 5]
    assert torch.isfinite(out[3]).sum() == 1 and out[3, 98] == logits[3, 98]
    assert torch.equal(apply_token_bitmask(logits[[1, 3]], bitmask), out[[1, 3]])
