"""Jump-forward decoding of grammar-forced tokens (issue 17, structured outputs).

After each sampled token the runner appends the tokens the grammar forces next
(xgrammar's ``find_jump_forward_tokens``, at most ``MAX_JUMP_FORWARD_TOKENS`` at once);
the scheduler computes them in the next step as one chunk. The oracle for the output is transformers on the same weights with
the grammar replayed by an independent xgrammar matcher: every forced run is exactly
what the grammar forces after the token before it, and every sampled (greedy) token is
transformers' argmax among the tokens the grammar allows there, given all the earlier
tokens, the forced ones included (so their KV, computed as a chunk, is right).
"""

from __future__ import annotations

import json

import pytest
import torch

from llmserve.worker.model_runner import MAX_JUMP_FORWARD_TOKENS
from tests.conftest import engine_variant

jsonschema = pytest.importorskip("jsonschema")
xgr = pytest.importorskip("xgrammar")

pytestmark = pytest.mark.model

# long property names and an enum: most of the output is forced
SCHEMA = {
    "type": "object",
    "properties": {
        "customer_full_name": {"type": "string", "maxLength": 12},
        "customer_account_number": {"type": "integer", "minimum": 0, "maximum": 99999},
        "membership_level": {"enum": ["bronze_member", "silver_member", "gold_member"]},
        "is_premium_subscriber": {"type": "boolean"},
    },
    "required": ["customer_full_name", "customer_account_number", "membership_level",
                 "is_premium_subscriber"],
    "additionalProperties": False,
}
PROMPT = "A customer record as JSON:"


def _run(llm, max_tokens: int = 120, **params) -> tuple[list[int], str, int, str]:
    """(output token ids, text, engine steps, finish reason) of one greedy request."""
    from llmserve import SamplingParams, StructuredOutputsParams

    engine = llm.engine
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens,
                        structured_outputs=StructuredOutputsParams(json=SCHEMA), **params)
    engine.add_request("jf", PROMPT, sp)
    steps, done = 0, None
    while engine.has_unfinished_requests():
        steps += 1
        done = next((o for o in engine.step() if o.finished), done)
    c = done.outputs[0]
    return list(c.token_ids), c.text, steps, c.finish_reason


def _replay_against_transformers(hf_model, llm, prompt_ids: list[int], out: list[int]) -> int:
    """Check ``out`` as the module docstring says; returns the number of forced tokens."""
    from llmserve import StructuredOutputsParams

    engine = llm.engine
    compiled = engine.structured_output.compile(StructuredOutputsParams(json=SCHEMA))
    matcher = compiled.new_matcher()._m  # a fresh xgrammar matcher on the same grammar
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt_ids + out])).logits[0, len(prompt_ids) - 1:]
    bitmask = xgr.allocate_token_bitmask(1, engine.config.model_config.vocab_size)
    j, forced_total = 0, 0
    while j < len(out):
        matcher.fill_next_token_bitmask(bitmask, 0)
        allowed = logits[j, :engine.config.model_config.vocab_size].clone()
        xgr.apply_token_bitmask_inplace(allowed[None], bitmask)
        assert out[j] == int(allowed.argmax()), f"sampled token {j}"
        assert matcher.accept_token(out[j])
        forced = matcher.find_jump_forward_tokens()[:MAX_JUMP_FORWARD_TOKENS]  # one jump
        if matcher.is_terminated() or j + 1 == len(out):
            break
        assert out[j + 1:j + 1 + len(forced)] == forced, f"forced run after token {j}"
        for t in forced:
            assert matcher.accept_token(t)
        forced_total += len(forced)
        j += 1 + len(forced)
    return forced_total


def test_forced_runs_match_the_grammar_and_transformers(llm_fp32, hf_model):
    out, text, steps, reason = _run(llm_fp32)
    assert reason == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)
    prompt_ids = llm_fp32.engine.tokenize_prompt(PROMPT)[1]
    forced = _replay_against_transformers(hf_model, llm_fp32, prompt_ids, out)
    assert forced > len(out) // 2  # the keys, quotes and separators
    # one step per sampled token (+ the prompt's): the forced ones cost no step of their own
    assert steps <= len(out) - forced + 1
    # off (--no-jump-forward), or with logprobs (forced tokens have none): a step a token
    off = engine_variant(llm_fp32, jump_forward=False)
    off_out, off_text, off_steps, _ = _run(off)
    jsonschema.validate(json.loads(off_text), SCHEMA)
    assert off_steps == len(off_out)
    lp_out, _, lp_steps, _ = _run(llm_fp32, logprobs=0)
    assert lp_steps == len(lp_out)
    # a forced run longer than the room left is cut at max_tokens: the first sampled
    # token ('{"'), then the forced key, cut to 5 tokens in all, in one step
    short, short_text, short_steps, reason = _run(llm_fp32, max_tokens=5)
    assert (short, reason, short_steps) == (out[:5], "length", 1)
    assert out[:5] == short and text.startswith(short_text)


def test_no_jump_forward_flag_parses():
    import argparse

    from llmserve.engine.arg_utils import EngineArgs

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    assert EngineArgs.from_cli_args(parser.parse_args([])).jump_forward
    assert not EngineArgs.from_cli_args(parser.parse_args(["--no-jump-forward"])).jump_forward
