"""SamplingParams: defaults, normalization, sampling type, and validation errors."""

from __future__ import annotations

import pytest

from llmserve.sampling_params import MAX_LOGPROBS, SamplingParams, SamplingType


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.max_tokens, p.min_tokens, p.seed, p.logprobs) == (16, 0, None, None)
    assert p.stop == [] and p.stop_token_ids == []
    assert p.skip_special_tokens and p.spaces_between_special_tokens
    assert not p.ignore_eos and not p.include_stop_str_in_output
    assert p.sampling_type == SamplingType.RANDOM


def test_normalization():
    p = SamplingParams(stop="###", stop_token_ids=(3, 7), top_k=-1, temperature=1, top_p=1)
    assert p.stop == ["###"] and p.stop_token_ids == [3, 7] and p.top_k == 0
    assert isinstance(p.temperature, float) and isinstance(p.top_p, float)
    assert SamplingParams(stop=["a", "bc"]).stop == ["a", "bc"]
    assert SamplingParams(max_tokens=None, min_tokens=1000).max_tokens is None


@pytest.mark.parametrize("temperature", [0.0, 0, 1e-6])
def test_greedy_resets_filters(temperature):
    p = SamplingParams(temperature=temperature, top_p=0.5, top_k=5, min_p=0.2, seed=3)
    assert p.sampling_type == SamplingType.GREEDY
    assert (p.top_p, p.top_k, p.min_p) == (1.0, 0, 0.0)


def test_sampling_type():
    assert SamplingParams(temperature=0.7, seed=0).sampling_type == SamplingType.RANDOM_SEED
    assert SamplingParams(temperature=0.7).sampling_type == SamplingType.RANDOM
    assert SamplingParams(temperature=1e-5).sampling_type == SamplingType.RANDOM


def test_clone_is_deep():
    p = SamplingParams(stop=["x"], stop_token_ids=[1], seed=5, logprobs=MAX_LOGPROBS)
    q = p.clone()
    assert q == p and q is not p
    q.stop.append("y")
    q.stop_token_ids.append(2)
    assert p.stop == ["x"] and p.stop_token_ids == [1]


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"n": 0}, "n"),
    ({"temperature": -1.0}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"temperature": float("inf")}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.01}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"min_p": -0.1}, "min_p"),
    ({"min_p": 1.5}, "min_p"),
    ({"seed": 2**64}, "seed"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"presence_penalty": -2.1}, "presence_penalty"),
    ({"frequency_penalty": 3.0}, "frequency_penalty"),
    ({"frequency_penalty": -2.01}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": -1.0}, "repetition_penalty"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 17, "max_tokens": 16}, "min_tokens"),
    ({"stop": [""]}, "stop"),
    ({"stop": ""}, "stop"),
    ({"stop": ["ok", 3]}, "stop"),
    ({"stop": 5}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop_token_ids": [1.0]}, "stop_token_ids"),
    ({"stop_token_ids": [True]}, "stop_token_ids"),
    ({"stop_token_ids": 3}, "stop_token_ids"),
    ({"logprobs": -1}, "logprobs"),
    ({"logprobs": MAX_LOGPROBS + 1}, "logprobs"),
])
def test_out_of_range_raises_naming_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field} must"):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"max_tokens": "5"}, "max_tokens"),
    ({"max_tokens": 1.5}, "max_tokens"),
    ({"max_tokens": 5.0}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"),
    ({"n": 2.0}, "n"),
    ({"top_k": "3"}, "top_k"),
    ({"min_tokens": None}, "min_tokens"),
    ({"seed": 1.5}, "seed"),
    ({"seed": False}, "seed"),
    ({"logprobs": True}, "logprobs"),
    ({"temperature": "0.5"}, "temperature"),
    ({"temperature": None}, "temperature"),
    ({"top_p": True}, "top_p"),
    ({"repetition_penalty": "1"}, "repetition_penalty"),
    ({"ignore_eos": 1}, "ignore_eos"),
    ({"skip_special_tokens": "yes"}, "skip_special_tokens"),
    ({"include_stop_str_in_output": None}, "include_stop_str_in_output"),
])
def test_wrong_type_raises_naming_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field} must be an? "):
        SamplingParams(**kwargs)


def test_messages_say_what_is_allowed():
    with pytest.raises(ValueError, match=r"temperature must be >= 0, got -1.0"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\], got 0.0"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match=r"max_tokens must be an int or None, got str '5'"):
        SamplingParams(max_tokens="5")


def test_boundaries_accepted():
    SamplingParams(top_p=1.0, min_p=1.0, presence_penalty=-2, frequency_penalty=2,
                   logprobs=0, min_tokens=16, max_tokens=16, top_k=1, seed=-(2**63))
    SamplingParams(logprobs=MAX_LOGPROBS, seed=2**64 - 1, repetition_penalty=1e-3)
