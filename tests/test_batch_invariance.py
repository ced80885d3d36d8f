"""Batch invariance (issue 20): a greedy output must not depend on its step's company.

The oracle is the engine itself with each prompt run alone (and, for the prefix
cache, with a cache salt that no other request shares): the same request batched
with 15 others, arriving while others decode (mixed prefill + decode steps),
chunked at other boundaries, or reusing cached prefix blocks must give the same
token ids and the same logprobs, bit for bit.

* default format (bfloat16, ``gguf-hybrid``): batching, arrival order, prefill
  chunking and prefix-cache hits change nothing (decode rows always through the
  packed kernels; prompt rows, a one-token prompt chunk included, through the dense
  copy and the prefill attention's fixed 32-row tiles); output tokens recomputed
  after a preemption run as the decodes they first were. Not covered: a reply sent
  back as the next request's prompt (its tokens are then prompt tokens);
* ``--deterministic``: all of the above, and that too (every token one decode).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from llmserve.layers.batch_invariant import CHUNK_ROWS, chunked_linear
from llmserve.layers.quantization.dense_prefill import (
    PrepackedDenseWeight,
    can_prepack,
    dense_linear,
)

TOPICS = ["a chef", "a pilot", "a dragon", "a robot", "a sailor", "a teacher", "a cat", "a king",
          "a doctor", "a farmer", "a painter", "a spy", "a ghost", "a wizard", "a miner",
          "a baker"]
# the prompts: 16 short ones, no full KV block (16 tokens) in common
PROMPTS = [f"Write a short story number {i} about {t}. Once upon a time"
           for i, t in enumerate(TOPICS)]
# a shared prefix of 3 full KV blocks: prefix-cache hits, and (with a 32-token step
# budget) chunk boundaries that move with the batch
PREFIX = "You are a helpful assistant who writes very short stories for children. " * 4
MAX_TOKENS = 8


def _params():
    from llmserve import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=0)


def _result(out) -> tuple:
    c = out.outputs[0]
    lps = [{t: lp.logprob for t, lp in d.items()} for d in c.logprobs]
    return tuple(c.token_ids), lps


def _run(engine, prompts: list[str], *, stagger: bool = False,
         salts: list[str | None] | None = None, cached: list | None = None) -> list[tuple]:
    """Generate for ``prompts`` on ``engine``; ``stagger``: add one request per engine step
    (each prefill then shares its step with the earlier requests' decodes). ``cached``
    receives each request's number of prompt tokens served from the prefix cache."""
    salts = salts or [None] * len(prompts)
    ids, done = [], {}

    def collect(outs):
        done.update({o.request_id: o for o in outs if o.finished})

    for p, salt in zip(prompts, salts):
        ids.append(engine.add_request(None, p, _params(), cache_salt=salt))
        if stagger:
            collect(engine.step())
    while engine.has_unfinished_requests():
        collect(engine.step())
    if cached is not None:
        cached.extend(done[i].num_cached_tokens for i in ids)
    return [_result(done[i]) for i in ids]


def _alone(engine, prompts: list[str], salted: bool = False,
           cached: list | None = None) -> list[tuple]:
    return [_run(engine, [p], salts=[f"alone-{i}" if salted else None], cached=cached)[0]
            for i, p in enumerate(prompts)]


def _diverging(got: list[tuple], want: list[tuple]) -> list[int]:
    return [i for i, (g, w) in enumerate(zip(got, want)) if g != w]


@pytest.fixture(scope="module")
def default_llm():
    """The default format (bfloat16, gguf-hybrid), prefix cache off, a step budget that
    takes every prompt whole."""
    from llmserve import LLM

    llm = LLM(dtype="bfloat16", kv_cache_memory="128MiB", max_model_len=512,
              enable_prefix_caching=False)
    assert llm.engine.runner.model.model.layers[0].mlp.down_proj.quant_method.config.name \
        == "gguf-hybrid"
    return llm


@pytest.mark.model
def test_default_format_greedy_output_is_batch_invariant(default_llm):
    """16 prompts alone vs batched vs arriving one per step beside running decodes.

    Before the fix (gguf-hybrid chose int4 or dense by the step's token count):
    11 of 16 diverged batched (issue 20)."""
    engine = default_llm.engine
    alone = _alone(engine, PROMPTS)
    assert _diverging(_run(engine, PROMPTS), alone) == []
    assert _diverging(_run(engine, PROMPTS, stagger=True), alone) == []


@pytest.mark.model
def test_default_format_greedy_output_ignores_prefix_cache_and_chunking(default_llm):
    """Default format: 16 prompts (half behind the shared 3-block prefix) give the same
    tokens and logprobs computed whole (cache off, one step) as chunked by a 40-token
    budget, with the prefix cache hit, and with every full block cached (prompts of
    16 k + 1 tokens then compute one token: a one-token prompt chunk).

    Before the fixed prefill tiles (issue 20), measured on these prompts: 14 of 16
    differed chunked, 12 of 16 with cache hits, 15 of 16 fully cached (the prefill
    SDPA's summation order followed the chunk's query and key lengths)."""
    from tests.conftest import engine_variant

    prompts = [PREFIX + p if i % 2 else p for i, p in enumerate(PROMPTS)]
    prompts[10] += ","  # 17 tokens
    prompts[11] = PREFIX + "Write a short story about a cat. Once upon a time,"  # 65
    want = _run(default_llm.engine, prompts)  # each prompt whole, in one step
    engine = engine_variant(default_llm, scheduler={"max_num_batched_tokens": 40},
                            cache={"enable_prefix_caching": True}).engine  # same weights
    assert engine.config.cache_config.enable_prefix_caching
    cached_salted, cached_warm, cached_full = [], [], []
    salts = [f"salt-{i}" for i in range(len(prompts))]
    # chunked, no hits (unique salts)
    assert _diverging(_run(engine, prompts, salts=salts, cached=cached_salted), want) == []
    # chunked, the shared prefix from the cache once its first request computed it
    assert _diverging(_run(engine, prompts, cached=cached_warm), want) == []
    # every full block of every prompt cached
    assert _diverging(_run(engine, prompts, cached=cached_full), want) == []
    lens = [len(engine.tokenizer.encode(p)) for p in prompts]
    assert sum(cached_salted) == 0 and max(cached_warm) >= 48
    assert cached_full == [(n - 1) // 16 * 16 for n in lens]
    assert {lens[10] - cached_full[10], lens[11] - cached_full[11]} == {1}


@pytest.mark.model
@pytest.mark.parametrize("prefix_caching", [False, True])
def test_default_format_greedy_output_ignores_preemption(default_llm, prefix_caching):
    """Default format: 16 prompts batched in a KV pool too small for all of them
    (recompute preemptions; with the prefix cache a resumed request finds its full
    blocks, output tokens among them, and recomputes the rest) give the tokens and
    logprobs of each prompt alone. The recomputed output tokens run as one-token
    decodes, as they first ran (before: prompt-path kernels, other bits)."""
    from tests.conftest import engine_variant

    want = _alone(default_llm.engine, PROMPTS)
    engine = engine_variant(default_llm, cache={"num_gpu_blocks_override": 12,
                                                "enable_prefix_caching": prefix_caching}
                            ).engine
    assert _diverging(_run(engine, PROMPTS), want) == []
    assert engine.scheduler.stats.num_preemptions_total > 0


@pytest.mark.model
def test_deterministic_mode_greedy_output_ignores_batch_chunks_and_prefix_cache():
    """--deterministic: a 32-token budget chunks the ~75-token prompts at boundaries
    that move with the batch; the shared prefix hits the prefix cache when batched,
    never alone (unique cache salts)."""
    from llmserve import LLM

    llm = LLM(dtype="bfloat16", kv_cache_memory="128MiB", max_model_len=512,
              deterministic=True, max_num_batched_tokens=32)
    engine = llm.engine
    assert engine.config.deterministic and engine.config.cache_config.enable_prefix_caching
    prompts = [PREFIX + p for p in PROMPTS]
    cached_alone, cached_batched, cached_staggered = [], [], []
    alone = _alone(engine, prompts, salted=True, cached=cached_alone)  # chunks of 32
    assert _diverging(_run(engine, prompts, cached=cached_batched), alone) == []
    assert _diverging(_run(engine, prompts, stagger=True, cached=cached_staggered), alone) == []
    assert sum(cached_alone) == 0 and min(cached_staggered) >= 48  # 3 full prefix blocks
    assert sum(cached_batched) > 0


# ---------------------------------------------------------------- the kernels' contract
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("in_features", [576, 1536])
def test_chunked_linear_gives_each_row_the_same_bits_for_any_batch(dtype, in_features):
    """oneDNN's float32 GEMM does not (its kernel changes with M; measured M = 1, 4, 16),
    the fixed-shape chunks of batch_invariant.chunked_linear do."""
    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(320, in_features, generator=gen) * 0.05).to(dtype)
    x = torch.randn(70, in_features, generator=gen).to(dtype)
    alone = torch.cat([chunked_linear(x[i:i + 1], weight) for i in range(70)])
    for m in (2, 5, CHUNK_ROWS, CHUNK_ROWS + 1, 70):
        assert torch.equal(chunked_linear(x[:m], weight), alone[:m]), m
    torch.testing.assert_close(alone.float(), F.linear(x, weight).float(),
                               rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("prepacked", [False, True])
@pytest.mark.parametrize("shape", [(576, 1536), (1536, 8960)])
def test_hybrid_dense_rows_bf16_same_bits_for_any_batch(prepacked, shape):
    """gguf-hybrid's prompt rows (dense_linear: fixed 64-row chunks), on the plain bf16
    weight and on oneDNN's prepacked one: a row's bits do not depend on the rows beside
    it; the two layouts agree to bf16 rounding."""
    gen = torch.Generator().manual_seed(1)
    weight = (torch.randn(*shape, generator=gen) * 0.05).to(torch.bfloat16)
    x = torch.randn(150, shape[1], generator=gen).to(torch.bfloat16)
    w = weight
    if prepacked:
        if not can_prepack(weight):
            pytest.skip("this torch build has no oneDNN")
        w = PrepackedDenseWeight(weight)
    alone = torch.cat([dense_linear(x[i:i + 1], w) for i in range(150)])
    for m in (2, 3, 17, 64, 65, 150):
        assert torch.equal(dense_linear(x[:m], w), alone[:m]), m
    assert torch.equal(dense_linear(x[70:], w), alone[70:])  # other chunk positions
    torch.testing.assert_close(alone.float(), F.linear(x, weight).float(), rtol=2e-2, atol=2e-2)


def test_default_format_prepacks_prompt_rows(default_llm):
    """The default engine runs its prompt rows on prepacked weights and keeps no plain
    copy beside them (the ledger counts them once)."""
    from llmserve.layers.quantization.gguf_native import GGUFNativeLinearMethod

    methods = [(m, m.quant_method) for m in default_llm.engine.runner.model.modules()
               if isinstance(getattr(m, "quant_method", None), GGUFNativeLinearMethod)]
    if not methods or not can_prepack(torch.empty(1, 1, dtype=torch.bfloat16)) or \
            default_llm.engine.config.dtype != "bfloat16":
        pytest.skip("the default format here is not bf16 gguf-hybrid with oneDNN")
    prepacked = [m for m, q in methods if q.prefill is not None]
    assert len(prepacked) == 30 * 4  # qkv, o, gate_up, down of 30 layers
    assert all(m.weight.device.type == "meta" for m in prepacked)


def test_deterministic_flag_parses_and_refuses_what_it_cannot_run():
    import argparse

    from llmserve.engine.arg_utils import EngineArgs, check_deterministic_supported

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    assert EngineArgs.from_cli_args(parser.parse_args(["--deterministic"])).deterministic
    assert not EngineArgs.from_cli_args(parser.parse_args([])).deterministic
    check_deterministic_supported("cpu", "bfloat16", "cpu")  # supported: no error
    with pytest.raises(ValueError, match="dtype 'float16'"):
        check_deterministic_supported("cpu", "float16", "cpu")
    with pytest.raises(ValueError, match="attention backend 'reference'"):
        check_deterministic_supported("cpu", "float32", "reference")
    with pytest.raises(ValueError, match="--device cpu"):
        check_deterministic_supported("cuda:0", "bfloat16", "cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 7])
def test_prefill_attention_rows_ignore_chunking_and_cached_prefix(dtype, window):
    """The cpu backend's prompt rows: the same bits computed whole, in chunks cut
    anywhere, after a cached prefix, beside other prompts, with garbage in every
    slot the row may not see (free slots, other blocks, the rest of the last block)."""
    from llmserve.layers.attention import CommonAttentionMetadata, CpuAttentionBackend

    gen = torch.Generator().manual_seed(2)
    heads, kv_heads, dim, block_size, seq_len = 9, 3, 64, 16, 150
    backend = CpuAttentionBackend(heads, dim, kv_heads, dim ** -0.5, sliding_window=window)
    query = torch.randn(seq_len, heads, dim, generator=gen).to(dtype)
    key = torch.randn(seq_len, kv_heads, dim, generator=gen).to(dtype)
    value = torch.randn(seq_len, kv_heads, dim, generator=gen).to(dtype)
    blocks = list(range(3, 3 + -(-seq_len // block_size)))
    other_blocks = list(range(20, 24))  # another prompt, computed in the same steps

    def attend(chunks: list[int], other_len: int = 0) -> torch.Tensor:
        """Run the prompt as consecutive chunks of these lengths; its rows' output."""
        key_cache = torch.randn(40, block_size, kv_heads, dim, generator=gen).to(dtype) * 3
        value_cache = torch.randn(40, block_size, kv_heads, dim, generator=gen).to(dtype)
        outs, done = [], 0
        for n in chunks:
            lens, tables = [n], [blocks]
            q, k, v = query[done:done + n], key[done:done + n], value[done:done + n]
            if other_len:  # a fresh prompt first in the step
                lens, tables = [other_len, n], [other_blocks, blocks]
                q, k, v = (torch.cat([torch.randn(other_len, *t.shape[1:], generator=gen)
                                      .to(dtype), t]) for t in (q, k, v))
            common = CommonAttentionMetadata.from_lists(
                lens, [other_len, done + n][-len(lens):], tables, block_size)
            # a one-token prompt chunk is a prefill (the runner's rule), not a decode
            common = dataclasses.replace(common, num_decodes=0)
            out = backend.forward(q, k, v, key_cache, value_cache,
                                  CpuAttentionBackend.build_metadata(common))
            outs.append(out[-n:])
            done += n
        return torch.cat(outs)

    whole = attend([seq_len])
    for chunks in ([48, 102], [1, 40, 1, 108], [33, 31, 86], [149, 1], [7] * 21 + [3]):
        assert torch.equal(attend(chunks), whole), chunks
    assert torch.equal(attend([64, 86], other_len=50), whole)
