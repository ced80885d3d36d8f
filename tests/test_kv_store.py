"""The shared KV cache store (issue 12 item 5) against a real ``redis-server``.

Two engines on the same weights (worker A and worker B, float32) share one Redis:
B serves a long prefix that A computed, loading its blocks instead of computing
them. The oracle is a third engine without the store (a cold run on B): same
greedy tokens and the same logprobs, bit for bit. The step budget (160 tokens,
10 blocks) makes every engine cut the prompt at the same chunk boundaries, so a
load from the store must reproduce the cold run's arithmetic exactly; a corrupt,
truncated or other-dtype entry must be a miss (fewer cached tokens), never a
different output.
"""

from __future__ import annotations

import os

import httpx
import pytest

from llmserve.kv_cache.kv_store import (
    KVStoreLayout,
    RedisKVStore,
    block_key,
    decode_block,
    encode_block,
)
from tests.gateway_procs import start_redis

BS = 16
CHUNK = 160  # max_num_batched_tokens: 10 blocks per prefill step
PREFIX_BLOCKS = 20
BAD = 10  # the block the corruptions hit: a chunk boundary, so B's chunks stay aligned
MAX_TOKENS = 4


@pytest.fixture(scope="module")
def redis_url():
    proc = start_redis()
    yield proc.url
    proc.stop()


def _layout(**kw) -> KVStoreLayout:
    base = dict(model_id="m", dtype="float32", block_size=4, num_layers=2, num_kv_heads=1,
                head_dim=2)
    return KVStoreLayout(**{**base, **kw})


def test_value_framing_rejects_corrupt_truncated_and_mismatched_entries():
    lay = _layout()
    h = bytes(range(32))
    body = os.urandom(lay.block_nbytes)
    value = encode_block(lay, h, body)
    assert bytes(decode_block(lay, h, value)) == body
    flipped = bytearray(value)
    flipped[-5] ^= 0xFF  # a bit flip in the KV bytes
    assert decode_block(lay, h, bytes(flipped)) is None
    assert decode_block(lay, h, value[:-1]) is None  # truncated
    assert decode_block(lay, h, value + b"x") is None  # trailing garbage
    assert decode_block(lay, h, None) is None and decode_block(lay, h, b"") is None
    assert decode_block(lay, bytes(32), value) is None  # stored for another block
    other = _layout(dtype="bfloat16")
    assert decode_block(lay, h, encode_block(other, h, os.urandom(other.block_nbytes))) is None
    assert decode_block(lay, h, encode_block(lay, h, body).replace(b'"m"', b'"n"')) is None
    assert block_key(lay, h) != block_key(_layout(model_id="other"), h)
    with pytest.raises(ValueError, match="block body"):
        encode_block(lay, h, body[:-1])
    with pytest.raises(ValueError, match="dtype"):
        _layout(dtype="int3")


def test_store_lookup_stops_at_first_miss_and_bad_urls_are_value_errors(redis_url):
    lay = _layout(model_id="lookup-test")
    store = RedisKVStore(redis_url, lay, ttl_s=60)
    hashes = [bytes([i]) * 32 for i in range(5)]
    bodies = [os.urandom(lay.block_nbytes) for _ in hashes]
    assert store.put_async(hashes[:2] + hashes[3:], lambda: bodies[:2] + bodies[3:])
    assert store.flush()
    got = store.lookup(hashes)
    assert [bytes(b) for b in got] == bodies[:2]  # block 2 is missing: the chain ends
    assert 0 < store.client.ttl(block_key(lay, hashes[0])) <= 60
    store.client.set(block_key(lay, hashes[2]), encode_block(lay, hashes[2], bodies[2])[:-3])
    assert len(store.lookup(hashes)) == 2 and store.stats.invalid == 1
    store.close()
    # Redis going away: lookups are misses, writes are dropped, nothing raises
    doomed = start_redis()
    lost = RedisKVStore(doomed.url, lay)
    doomed.stop()
    assert lost.lookup(hashes) == [] and lost.stats.errors == 1
    assert lost.put_async(hashes[:1], lambda: bodies[:1]) and lost.flush()
    assert lost.stats.writes_dropped == 1 and lost.stats.writes == 0
    lost.close()
    with pytest.raises(ValueError, match="redis://"):
        RedisKVStore("http://localhost:1", lay)
    with pytest.raises(ValueError, match="cannot reach Redis"):
        RedisKVStore("redis://127.0.0.1:1/0", lay)
    from llmserve.config import CacheConfig

    with pytest.raises(ValueError, match="kv_store_ttl"):
        CacheConfig(kv_store=redis_url, kv_store_ttl=0)


class DictStore:
    """The store's scheduler-facing contract (lookup, a chained prefix) over a dict."""

    def __init__(self, blocks: dict[bytes, bytes]) -> None:
        self.blocks = blocks
        self.calls = 0

    def lookup(self, hashes):
        self.calls += 1
        out = []
        for h in hashes:
            if h not in self.blocks:
                break
            out.append(self.blocks[h])
        return out


def test_scheduler_loads_store_hits_as_computed_blocks_and_does_not_write_them_back():
    from llmserve.config import SchedulerConfig
    from llmserve.kv_cache import KVCacheManager, extend_block_hashes
    from llmserve.scheduler import Scheduler
    from tests.test_prefix_cache import req
    from tests.test_scheduler import FakeRunner

    bs = 4
    tokens = list(range(100, 122))  # 5 full blocks + 2 tokens
    hashes = extend_block_hashes([], tokens, bs)
    store = DictStore({h: b"kv%d" % i for i, h in enumerate(hashes[:3])})  # blocks 0..2
    kv = KVCacheManager(8, bs, enable_caching=True, kv_store=store)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64,
                                      max_model_len=64), kv)
    sched.add_request(req("a", tokens, max_tokens=1))
    out = sched.schedule()
    loads = [op for op in out.kv_cache_ops if op[0] == "load"]
    block_ids = kv.get_block_ids("a")
    assert loads == [("load", b"kv0", block_ids[0]), ("load", b"kv1", block_ids[1]),
                     ("load", b"kv2", block_ids[2])]
    assert out.num_scheduled_tokens == {"a": len(tokens) - 12}
    assert out.scheduled_new_reqs[0].num_computed_tokens == 12
    assert sched.stats.kv_store_hits_total == 12 and sched.stats.prefix_cache_hits_total == 0
    sched.update_from_output(out, FakeRunner(bs).execute(out))
    # blocks 3 and 4 were computed here: only they are written; 0..2 came from the store
    assert kv.pop_newly_cached() == [(hashes[3], block_ids[3]), (hashes[4], block_ids[4])]
    assert store.calls == 1
    # the loaded blocks are now local prefix-cache blocks: no second store lookup
    sched.add_request(req("b", tokens[:20] + [7, 7], max_tokens=1))
    out = sched.schedule()
    assert out.scheduled_new_reqs[0].num_computed_tokens == 20
    assert not [op for op in out.kv_cache_ops if op[0] == "load"] and store.calls == 1


# ---------------------------------------------------------------- two engines, one Redis
def _engine(base_llm, redis_url: str | None):
    from tests.conftest import engine_variant

    return engine_variant(base_llm, scheduler={"max_num_batched_tokens": CHUNK},
                          cache={"kv_store": redis_url})


def _generate(llm, ids: list[int]) -> tuple[tuple[int, ...], list[dict], int]:
    from llmserve import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=3)
    out = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
    c = out.outputs[0]
    lps = [{t: lp.logprob for t, lp in d.items()} for d in c.logprobs]
    return tuple(c.token_ids), lps, out.num_cached_tokens


def _prompts(tokenizer) -> tuple[list[int], list[int], list[int]]:
    text = ("The history of the city begins with a small fishing village on the river. "
            "Merchants arrived, then a bridge, a market and a cathedral were built. ") * 30
    prefix = tokenizer.encode(text)[:PREFIX_BLOCKS * BS]
    assert len(prefix) == PREFIX_BLOCKS * BS
    suffix_a = tokenizer.encode(" Summarize the economy of the city in one sentence:")
    suffix_b = tokenizer.encode(" Question: what was built after the bridge? Answer:")
    return prefix, prefix + suffix_a, prefix + suffix_b


@pytest.fixture(scope="module")
def shared(llm_fp32, redis_url):
    """The prompts, the cold run on B (no store) and worker A after it computed the
    prefix (its blocks in Redis)."""
    prefix, prompt_a, prompt_b = _prompts(llm_fp32.get_tokenizer())
    cold = _engine(llm_fp32, None)
    want = _generate(cold, prompt_b)
    assert want[2] == 0
    worker_a = _engine(llm_fp32, redis_url)
    _generate(worker_a, prompt_a)
    store_a = worker_a.engine.kv_store
    assert store_a.flush() and store_a.stats.writes >= PREFIX_BLOCKS
    yield {"prefix": prefix, "prompt_b": prompt_b, "want": want, "worker_a": worker_a}
    store_a.close()


@pytest.mark.model
def test_worker_b_loads_the_prefix_worker_a_computed(llm_fp32, redis_url, shared):
    import torch

    prefix, prompt_b = shared["prefix"], shared["prompt_b"]
    want_tokens, want_lps, _ = shared["want"]
    store_a = shared["worker_a"].engine.kv_store
    worker_b = _engine(llm_fp32, redis_url)
    store_b = worker_b.engine.kv_store
    assert store_b.layout == store_a.layout

    def run_b(expect_cached: int) -> None:
        assert worker_b.engine.scheduler.kv_cache_manager.reset_prefix_cache()
        tokens, lps, cached = _generate(worker_b, prompt_b)
        assert store_b.flush()  # B's own writes (blocks it recomputed) are done
        assert cached == expect_cached
        assert tokens == want_tokens
        assert lps == want_lps  # bit for bit: loaded KV is the KV a cold run computes

    run_b(PREFIX_BLOCKS * BS)  # every full prefix block came from A through Redis
    assert store_b.stats.hits == PREFIX_BLOCKS
    assert worker_b.engine.scheduler.stats.kv_store_hits_total == PREFIX_BLOCKS * BS

    from llmserve.kv_cache import extend_block_hashes

    block_hashes = extend_block_hashes([], prefix, BS)  # the engine's chained hashes
    client = store_b.client
    key = block_key(store_b.layout, block_hashes[BAD])
    good = client.get(key)
    # 1. flipped bytes in the KV of block BAD: blocks before it load, the rest are recomputed
    # (and written back by B)
    bad = bytearray(good)
    for i in range(len(bad) - 4000, len(bad), 97):
        bad[i] ^= 0x5A
    client.set(key, bytes(bad))
    run_b(BAD * BS)
    assert store_b.stats.invalid == 1
    # 2. the same block from a bfloat16 worker (same model and block, another dtype)
    body = torch.frombuffer(bytearray(decode_block(store_b.layout, block_hashes[BAD], good)),
                            dtype=torch.float32).to(torch.bfloat16)
    from dataclasses import replace

    bf16 = replace(store_b.layout, dtype="bfloat16")
    client.set(key, encode_block(bf16, block_hashes[BAD], body.view(torch.uint8).numpy()
                                 .tobytes()))
    run_b(BAD * BS)
    # 3. the block truncated
    client.set(key, good[:-100])
    run_b(BAD * BS)
    assert store_b.stats.invalid == 3
    # B recomputed the block and wrote it back: its next lookup finds the whole chain
    assert client.get(key) == good
    run_b(PREFIX_BLOCKS * BS)
    store_b.close()


@pytest.mark.model
def test_server_with_kv_store_serves_the_prefix_from_redis(llm_fp32, redis_url, shared):
    """``llmserve serve --kv-store``: a worker process loads worker A's blocks; the
    OpenAI usage reports them as cached tokens and the greedy text is the cold run's."""
    from tests.test_server import MODEL, metrics, start_server, stop_server

    server = start_server("--kv-store", redis_url, "--max-num-batched-tokens", str(CHUNK),
                          "--max-model-len", "2048")
    try:
        r = httpx.post(server.url + "/v1/completions", timeout=300, json={
            "model": MODEL, "prompt": shared["prompt_b"], "max_tokens": MAX_TOKENS,
            "temperature": 0})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == PREFIX_BLOCKS * BS
        want_text = llm_fp32.get_tokenizer().decode(list(shared["want"][0]))
        assert body["choices"][0]["text"] == want_text
        assert metrics(server.url)["llmserve:kv_store_hits_total"] == PREFIX_BLOCKS * BS
    finally:
        assert stop_server(server) == 0, server.log()
