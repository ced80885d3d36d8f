"""``llmserve serve --speculative-config``: greedy completions through the official
``openai`` client equal the offline engine's without speculation, and ``/metrics``
carries vLLM's ``spec_decode_*`` counters; a bad config fails at start-up naming
the field."""

from __future__ import annotations

import json
import subprocess
import sys

import openai
import pytest

from llmserve import SamplingParams
from tests.test_server import metrics, start_server, stop_server

pytestmark = pytest.mark.model

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
        "prompt_lookup_max": 3}
PROMPT = ("Repeat the list exactly: red, green, blue, yellow, red, green, blue, yellow, "
          "red, green,")


@pytest.fixture(scope="module")
def spec_server():
    server = start_server("--speculative-config", json.dumps(SPEC))
    yield server
    assert stop_server(server) == 0, server.log()


def test_spec_server_greedy_matches_and_metrics(spec_server, llm_fp32):
    client = openai.OpenAI(base_url=spec_server.url + "/v1", api_key="unused",
                           max_retries=0, timeout=300)
    resp = client.completions.create(model="smollm2-135m-instruct", prompt=PROMPT,
                                     max_tokens=16, temperature=0.0)
    ref = llm_fp32.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=16),
                            use_tqdm=False)[0].outputs[0]
    assert resp.choices[0].text == ref.text
    m = metrics(spec_server.url)
    drafts = m["llmserve:spec_decode_num_draft_tokens_total"]
    accepted = m["llmserve:spec_decode_num_accepted_tokens_total"]
    assert m["llmserve:spec_decode_num_drafts_total"] > 0 and 0 < accepted <= drafts
    assert m['llmserve:spec_decode_num_accepted_tokens_per_pos_total{position="0"}'] > 0
    per_pos = sum(v for k, v in m.items()
                  if k.startswith("llmserve:spec_decode_num_accepted_tokens_per_pos_total"))
    assert per_pos == accepted


def test_bad_speculative_config_fails_at_start_naming_the_field():
    bad = json.dumps({"method": "ngram", "num_speculative_tokens": 0})
    proc = subprocess.run([sys.executable, "-m", "llmserve.entrypoints.cli", "serve",
                           "--port", "0", "--speculative-config", bad],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "num_speculative_tokens" in proc.stdout + proc.stderr
