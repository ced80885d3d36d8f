"""Prompt logprobs on the server, and lm-evaluation-harness against it.

One real ``llmserve serve`` process (float32, the default model) for the module; the
offline ``LLM`` (float32, same model) is the reference for the loglikelihoods.
lm-eval's ``local-completions`` model runs a loglikelihood (multiple-choice) task and
a generation task defined in a local YAML file over a local JSONL file (the ``json``
builder of ``datasets``: nothing is downloaded), with its remote tokenizer (our
``/tokenizer_info`` and ``/tokenize``).
"""

from __future__ import annotations

import json
import os

import pytest

from tests.test_server import MODEL, start_server, stop_server

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

pytestmark = pytest.mark.model

ATOL = 1e-3  # same engine and weights; only the batch composition differs
TEXT = "The capital of France is Paris, and the capital of Italy is Rome."
DOCS = [
    {"question": "The capital of France is", "choices": [" Paris", " Berlin", " a cat"],
     "answer": 0},
    {"question": "Two plus two equals", "choices": [" four", " green"], "answer": 0},
    {"question": "The sky is usually", "choices": [" blue", " made of cheese"], "answer": 0},
]


@pytest.fixture(scope="module")
def server(llm_fp32):
    srv = start_server()
    yield srv
    assert stop_server(srv) == 0, srv.log()


def _offline_prompt_logprobs(llm, ids: list[int]) -> list[float | None]:
    from llmserve import SamplingParams

    out = llm.generate([{"prompt_token_ids": ids}],
                       SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1),
                       use_tqdm=False)[0]
    return [None] + [e[t].logprob for e, t in zip(out.prompt_logprobs[1:], ids[1:])]


def test_echo_logprobs_max_tokens_0(server, llm_fp32):
    ids = llm_fp32.get_tokenizer().encode(TEXT)
    ref = _offline_prompt_logprobs(llm_fp32, ids)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x")
    for prompt in (TEXT, ids):
        r = client.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=2,
                                      max_tokens=0, temperature=0)
        c = r.choices[0]
        assert c.text == TEXT
        assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 0
        lp = c.logprobs
        assert len(lp.tokens) == len(ids) and "".join(lp.tokens) == TEXT
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert lp.text_offset == [len("".join(lp.tokens[:j])) for j in range(len(ids))]
        for j in range(1, len(ids)):
            assert abs(lp.token_logprobs[j] - ref[j]) < ATOL, j
            assert lp.tokens[j] in lp.top_logprobs[j]
            assert max(lp.top_logprobs[j].values()) >= lp.token_logprobs[j] - 1e-6
    # echo + logprobs with generated tokens: the prompt's entries, then one per token
    r = client.completions.create(model=MODEL, prompt=TEXT, echo=True, logprobs=0,
                                  max_tokens=3, temperature=0)
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == len(ids) + r.usage.completion_tokens
    assert r.choices[0].text.startswith(TEXT)
    # the same streamed
    chunks = list(client.completions.create(model=MODEL, prompt=TEXT, echo=True, logprobs=1,
                                            max_tokens=0, stream=True))
    streamed = [v for ch in chunks for c in ch.choices if c.logprobs
                for v in c.logprobs.token_logprobs]
    assert streamed[0] is None and len(streamed) == len(ids)
    assert all(abs(a - b) < ATOL for a, b in zip(streamed[1:], ref[1:]))
    assert "".join(c.text for ch in chunks for c in ch.choices) == TEXT


def test_prompt_logprobs_extra_and_errors(server, llm_fp32):
    ids = llm_fp32.get_tokenizer().encode(TEXT)
    ref = _offline_prompt_logprobs(llm_fp32, ids)
    r = httpx.post(server.url + "/v1/completions", json={
        "model": MODEL, "prompt": ids, "max_tokens": 1, "prompt_logprobs": 0,
        "temperature": 0}, timeout=60)
    assert r.status_code == 200, r.text
    plp = r.json()["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(ids)
    for j in range(1, len(ids)):
        assert abs(plp[j][str(ids[j])]["logprob"] - ref[j]) < ATOL
    r = httpx.post(server.url + "/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1,
        "prompt_logprobs": 1}, timeout=60)
    assert r.status_code == 200 and r.json()["prompt_logprobs"][0] is None
    for body, param in (({"max_tokens": 0}, "max_tokens"), ({"prompt_logprobs": 21},
                                                          "prompt_logprobs")):
        r = httpx.post(server.url + "/v1/completions",
                       json={"model": MODEL, "prompt": TEXT, **body}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def _encode_pair(tok, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's split (TemplateAPI._encode_pair): trailing spaces move to the continuation."""
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        continuation, context = context[-n_spaces:] + continuation, context[:-n_spaces]
    whole = tok.encode(context + continuation, add_special_tokens=False)
    ctx = tok.encode(context, add_special_tokens=False)
    return ctx, whole[len(ctx):]


def test_lm_eval_local_completions(server, llm_fp32, tmp_path):
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # the local json builder only
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    common = (f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
              "test_split: test\n")
    (tmp_path / "ll.yaml").write_text(
        "task: llmserve_tiny_mc\n" + common + "output_type: multiple_choice\n"
        "doc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\ndoc_to_target: answer\n"
        "metric_list:\n  - metric: acc\n")
    (tmp_path / "gen.yaml").write_text(
        "task: llmserve_tiny_gen\n" + common + "output_type: generate_until\n"
        "doc_to_text: '{{question}}'\ndoc_to_target: '{{choices[answer]}}'\n"
        "generation_kwargs:\n  until: ['\\n', '.']\n  max_gen_toks: 4\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n")
    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=(f"base_url={server.url}/v1/completions,model={MODEL},"
                    "tokenizer_backend=remote,num_concurrent=1,max_retries=1"),
        tasks=["llmserve_tiny_mc", "llmserve_tiny_gen"],
        task_manager=TaskManager(include_path=str(tmp_path)), log_samples=True)
    tok = llm_fp32.get_tokenizer()
    samples = results["samples"]["llmserve_tiny_mc"]
    assert len(samples) == len(DOCS)
    num_checked, max_diff = 0, 0.0
    for s in samples:
        for (context, continuation), resp in zip(s["arguments"], s["resps"]):
            ctx, cont = _encode_pair(tok, context, continuation)
            ids = ctx + cont
            ref = _offline_prompt_logprobs(llm_fp32, ids)
            expected = sum(ref[len(ctx):])
            got, _is_greedy = resp[0]
            assert abs(float(got) - expected) < 5 * ATOL, (context, continuation, got, expected)
            max_diff = max(max_diff, abs(float(got) - expected))
            num_checked += 1
    assert num_checked == sum(len(d["choices"]) for d in DOCS)
    acc = results["results"]["llmserve_tiny_mc"]["acc,none"]
    print(f"lm-eval tiny multiple-choice acc={acc}; {num_checked} loglikelihoods equal "
          f"the offline prompt logprobs (max |server - offline| = {max_diff:.2e} nats)")
    # the generation task: lm-eval's outputs are the server's greedy completions
    from llmserve import SamplingParams

    for s in results["samples"]["llmserve_tiny_gen"]:
        context = s["arguments"][0][0]
        ref = llm_fp32.generate([context], SamplingParams(temperature=0.0, max_tokens=4,
                                                          stop=["\n", "."]),
                                use_tqdm=False)[0].outputs[0].text
        assert s["resps"][0][0] == ref
