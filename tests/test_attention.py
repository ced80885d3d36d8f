"""Paged attention backends: the cpu backend against the reference backend,
and both against dense attention over contiguous K/V (no paging)."""

from __future__ import annotations

import random

import pytest
import torch

from llmserve.layers.attention import (
    AttentionBackend,
    CommonAttentionMetadata,
    CpuAttentionBackend,
    available_backends,
    get_attn_backend,
    register_backend,
)
from llmserve.layers.attention.cpu import PREFILL_TILE


def make_batch(specs, num_heads, num_kv_heads, head_dim, block_size, dtype, window=None, seed=0):
    """A step over sequences ``specs = [(num_cached, query_len), ...]`` (decodes first).

    Returns (query, key, value, key_cache, value_cache, common, full_kv) where
    ``full_kv[i]`` is sequence i's whole contiguous (key, value) ``[seq_len, Hkv, D]``;
    the cached part is already written to shuffled, non-contiguous blocks.
    """
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    blocks_needed = [-(-(c + q) // block_size) for c, q in specs]
    num_blocks = sum(blocks_needed) + 3
    pool = list(range(num_blocks))
    rng.shuffle(pool)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.randn(shape, generator=gen).to(dtype)  # garbage in unused slots
    value_cache = torch.randn(shape, generator=gen).to(dtype)
    block_tables, queries, keys, values, full_kv = [], [], [], [], []
    for (cached, query_len), n in zip(specs, blocks_needed, strict=True):
        blocks, pool = pool[:n], pool[n:]
        block_tables.append(blocks)
        seq_len = cached + query_len
        k = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        for p in range(cached):
            key_cache[blocks[p // block_size], p % block_size] = k[p]
            value_cache[blocks[p // block_size], p % block_size] = v[p]
        keys.append(k[cached:])
        values.append(v[cached:])
        queries.append(torch.randn(query_len, num_heads, head_dim, generator=gen).to(dtype))
        full_kv.append((k, v))
    common = CommonAttentionMetadata.from_lists(
        [q for _, q in specs], [c + q for c, q in specs], block_tables, block_size,
        sliding_window=window)
    return (torch.cat(queries), torch.cat(keys), torch.cat(values), key_cache, value_cache,
            common, full_kv)


def dense_attention(query, full_kv, specs, scale, window):
    """fp32 attention over contiguous K/V per sequence (no cache involved)."""
    outs, start = [], 0
    for (cached, query_len), (k, v) in zip(specs, full_kv, strict=True):
        q = query[start:start + query_len].float()
        start += query_len
        group = q.shape[1] // k.shape[1]
        k = k.float().repeat_interleave(group, 1)
        v = v.float().repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        qpos = torch.arange(cached, cached + query_len)[:, None]
        kpos = torch.arange(cached + query_len)[None, :]
        allowed = kpos <= qpos
        if window is not None:
            allowed &= kpos > qpos - window
        probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        outs.append(torch.einsum("hqk,khd->qhd", probs, v))
    return torch.cat(outs)


def run_backend(name, batch, num_heads, num_kv_heads, head_dim):
    query, key, value, key_cache, value_cache, common, _ = batch
    key_cache, value_cache = key_cache.clone(), value_cache.clone()
    cls = get_attn_backend(name)
    backend = cls(num_heads, head_dim, num_kv_heads, head_dim ** -0.5)
    out = backend.forward(query, key, value, key_cache, value_cache, cls.build_metadata(common))
    return out, key_cache, value_cache


CASES = {
    "decodes": [(7, 1), (0, 1), (12, 1), (30, 1)],
    "fresh_prefill": [(0, 11)],
    "chunk_with_context": [(9, 6)],
    "prefills": [(0, 5), (3, 9), (16, 1), (0, 2)],
    "mixed": [(8, 1), (0, 1), (21, 1), (5, 8), (0, 7), (13, 3)],
    "long_mixed": [(40, 1), (3, 1), (33, 17), (0, 29)],
    "long_prefills": [(70, 30), (0, 75), (31, 2)],  # several tiles, a window's late start
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("heads", [(4, 4, 16), (9, 3, 64), (8, 2, 32)])
@pytest.mark.parametrize("window", [None, 6])
def test_backends_match_dense_fp32(case, heads, window, kernel_mode):
    num_heads, num_kv_heads, head_dim = heads
    specs = CASES[case]
    batch = make_batch(specs, num_heads, num_kv_heads, head_dim, block_size=4,
                       dtype=torch.float32, window=window, seed=len(specs) + head_dim)
    query, key, value, key_cache, value_cache, common, full_kv = batch
    expected = dense_attention(query, full_kv, specs, head_dim ** -0.5, window)
    outputs = {}
    for name in ("reference", "cpu"):
        out, kc, vc = run_backend(name, batch, num_heads, num_kv_heads, head_dim)
        assert out.shape == query.shape and out.dtype == query.dtype
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
        flat = kc.view(-1, num_kv_heads, head_dim)
        torch.testing.assert_close(flat[common.slot_mapping], key)  # K/V written in place
        torch.testing.assert_close(vc.view(-1, num_kv_heads, head_dim)[common.slot_mapping], value)
        outputs[name] = out
    torch.testing.assert_close(outputs["cpu"], outputs["reference"], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", ["mixed", "fresh_prefill", "long_mixed"])
@pytest.mark.parametrize("window", [None, 5])
def test_cpu_matches_reference_half_precision(dtype, case, window, kernel_mode):
    specs = CASES[case]
    batch = make_batch(specs, 9, 3, 64, block_size=8, dtype=dtype, window=window, seed=3)
    ref, _, _ = run_backend("reference", batch, 9, 3, 64)
    out, _, _ = run_backend("cpu", batch, 9, 3, 64)
    assert out.dtype == dtype
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-3
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


def test_cpu_random_shapes():
    rng = random.Random(7)
    for trial in range(12):
        num_decodes = rng.randint(0, 5)
        specs = [(rng.randint(0, 30), 1) for _ in range(num_decodes)]
        specs += [(rng.choice([0, rng.randint(1, 25)]), rng.randint(1, 20))
                  for _ in range(rng.randint(0 if num_decodes else 1, 4))]
        block_size = rng.choice([1, 2, 4, 16])
        window = rng.choice([None, None, 3, 10])
        batch = make_batch(specs, 6, 2, 8, block_size, torch.float32, window, seed=trial)
        ref, ref_kc, _ = run_backend("reference", batch, 6, 2, 8)
        out, kc, _ = run_backend("cpu", batch, 6, 2, 8)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5, msg=f"{specs} {window}")
        torch.testing.assert_close(kc, ref_kc)


def test_cpu_metadata_groups():
    specs = CASES["mixed"]
    *_, common, _ = make_batch(specs, 4, 2, 8, block_size=4, dtype=torch.float32)
    assert common.num_decodes == 3 and common.num_tokens == 21
    md = CpuAttentionBackend.build_metadata(common)
    assert md.decode_block_table.shape == (3, 6)  # longest decode context 22 -> 6 blocks
    assert md.decode_seq_lens.tolist() == common.seq_lens_list[:3]
    assert md.decode_mask is None  # built on first use by the PyTorch decode path
    assert [(p.token_start, p.token_end) for p in md.prefills] == [(0, 8), (8, 15), (15, 18)]
    tile = PREFILL_TILE
    for p, q_len, seq_len in zip(md.prefills, common.query_lens[3:], common.seq_lens_list[3:]):
        first = (seq_len - q_len) // tile * tile  # tiles at fixed positions
        assert p.row_offset == seq_len - q_len - first
        assert p.num_rows == -(-seq_len // tile) * tile - first
        assert p.block_table.shape == (1, -(-(first + p.num_rows) // 4))  # null-padded
        assert [(t.row_start, t.key_start, t.key_end) for t in p.tiles] == \
            [(r, 0, first + r + tile) for r in range(0, p.num_rows, tile)]
        for t in p.tiles:
            assert t.mask.shape == (1, 1, tile, t.key_end)
            assert t.mask[0, 0].sum(-1).tolist() == list(range(first + t.row_start + 1,
                                                               first + t.row_start + tile + 1))
    windowed = CpuAttentionBackend.build_metadata(
        CommonAttentionMetadata.from_lists([30], [100], [list(range(1, 26))], 4,
                                           sliding_window=10))
    assert [(t.key_start, t.key_end) for t in windowed.prefills[0].tiles] == \
        [(52, 96), (84, 128)]  # the window's first block on
    assert windowed.prefills[0].tiles[1].mask[0, 0].sum(-1).tolist() == [10] * tile


def test_registry_and_errors():
    assert {"cpu", "reference"} <= set(available_backends())
    with pytest.raises(ValueError, match=r"unknown attention backend 'nope'.*cpu.*reference"):
        get_attn_backend("nope")

    class Dup(AttentionBackend):
        name = "cpu"

        def forward(self, *args):  # pragma: no cover
            raise NotImplementedError

    with pytest.raises(ValueError, match="already registered"):
        register_backend(Dup)
    with pytest.raises(ValueError, match="num_kv_heads"):
        CpuAttentionBackend(6, 8, 4, 1.0)
    with pytest.raises(ValueError, match="blocks cannot hold"):
        CommonAttentionMetadata.from_lists([3], [9], [[0, 1]], 4)
    with pytest.raises(ValueError, match="query_len"):
        CommonAttentionMetadata.from_lists([5], [3], [[0]], 4)
