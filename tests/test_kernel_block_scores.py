"""Per-KV-block attention scores from the C paged decode kernels (issue 15, item 2).

Oracle: ``layers/attention/scored.py`` (``scored_attention``, PyTorch float32 softmax over
the gathered context): the kernels' accumulators must hold the same per-block sums of
the softmax probabilities (over query heads), to float tolerance, for float32 and
bfloat16 pages, int8 / fp8 pages (against the same path over the dequantized cache),
sequences of one span and of several 512-position spans, windows that cut spans off
mid-block, and grouped-query heads. Scores and outputs of a sequence are the same bits
alone or batched, on any thread count; without accumulators the output is unchanged.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from llmserve.kernels import get_cpu_kernels
from llmserve.layers.attention import CommonAttentionMetadata, ReferenceAttentionBackend
from llmserve.layers.attention.kv_quant import quantize_kv
from llmserve.layers.attention.scored import BlockScoreRequest, scored_attention

BS = 16
# one position; one span; exactly one span; one span + 1; several spans + a tail
LENS = [1, 37, 512, 513, 1100, 2000]


@pytest.fixture(scope="module")
def kernels():
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler: the layers run their PyTorch code")
    k = get_cpu_kernels()
    assert k is not None
    return k


def _paged(gen, seq_lens, num_blocks, num_kv_heads, head_dim, dtype, fmt):
    """Random K/V pages (``fmt``: quantized) and a shuffled block table per sequence
    (block 0 unused)."""
    shape = (num_blocks, BS, num_kv_heads, head_dim)
    key_cache = torch.randn(shape, generator=gen) * 2
    value_cache = torch.randn(shape, generator=gen)
    if fmt is None:
        key_cache, value_cache = key_cache.to(dtype), value_cache.to(dtype)
    else:
        key_cache, value_cache = quantize_kv(key_cache, fmt), quantize_kv(value_cache, fmt)
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables, used = [], 0
    for n in seq_lens:
        tables.append(perm[used:used + -(-n // BS)])
        used += len(tables[-1])
    return key_cache, value_cache, tables


def _case(dtype, heads, window, seed=0, fmt=None):
    """Random paged caches, one decode query per sequence of LENS, and the oracle's
    outputs and block scores (every sequence scored but the second)."""
    num_heads, num_kv_heads, head_dim = heads
    gen = torch.Generator().manual_seed(seed)
    key_cache, value_cache, tables = _paged(gen, LENS, 2 * sum(-(-n // BS) for n in LENS),
                                            num_kv_heads, head_dim, dtype, fmt)
    md = CommonAttentionMetadata.from_lists([1] * len(LENS), LENS, tables, BS,
                                            sliding_window=window)
    # peaked softmax rows: the combine's rescaling between spans matters
    query = (torch.randn(len(LENS), num_heads, head_dim, generator=gen) * 2).to(dtype)
    scale = head_dim ** -0.5
    backend = ReferenceAttentionBackend(num_heads, head_dim, num_kv_heads, scale)
    md.block_scores = {i: BlockScoreRequest(0, torch.zeros(len(t)))
                       for i, t in enumerate(tables) if i != 1}
    want = scored_attention(backend, query, key_cache, value_cache, md)
    want_scores = [None if i == 1 else md.block_scores[i].scores for i in range(len(LENS))]
    return query, key_cache, value_cache, md, scale, want, want_scores


def _run(kernels, fmt, query, key_cache, value_cache, table, seq_lens, scale, window,
         threads, arrays=None):
    scores = None if arrays is None else kernels.block_score_arrays(arrays)
    if fmt is None:
        return kernels.paged_attention_decode(query, key_cache, value_cache, table, seq_lens,
                                              scale, window, threads, scores)
    return kernels.paged_attention_decode_quant(fmt, query, key_cache, value_cache, table,
                                                seq_lens, scale, window, threads, scores)


def _fresh(want_scores, start=None):
    """Accumulators to run into (``start``: their initial values, else zeros)."""
    return [None if w is None else (torch.zeros_like(w) if start is None else start[i].clone())
            for i, w in enumerate(want_scores)]


def _check(kernels, dtype, heads, window, fmt=None):
    query, key_cache, value_cache, md, scale, want, want_scores = _case(dtype, heads, window,
                                                                        fmt=fmt)
    table, seq_lens = md.block_table, md.seq_lens
    plain = _run(kernels, fmt, query, key_cache, value_cache, table, seq_lens, scale, window, 2)
    # accumulators start non-zero: the kernel adds into them (every layer does)
    start = [None if w is None else torch.rand(w.shape) for w in want_scores]
    arrays = _fresh(want_scores, start)
    out = _run(kernels, fmt, query, key_cache, value_cache, table, seq_lens, scale, window, 2,
               arrays)
    assert torch.equal(out, plain)  # scoring never changes the output
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-5
    torch.testing.assert_close(out.float(), want.float(), atol=tol, rtol=tol)
    for i, (got, ref) in enumerate(zip(arrays, want_scores, strict=True)):
        if ref is None:
            assert got is None
            continue
        # each head's probabilities sum to 1 over the attended keys
        torch.testing.assert_close(float((got - start[i]).sum()), float(heads[0]), rtol=1e-5,
                                   atol=1e-5)
        torch.testing.assert_close(got - start[i], ref, atol=2e-6, rtol=1e-4)
        if window is not None:  # blocks wholly before the window get nothing
            first = max(0, LENS[i] - window) // BS
            assert torch.equal(got[:first], start[i][:first])
    return query, key_cache, value_cache, table, seq_lens, scale, out, arrays, want_scores


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(9, 3, 64), (8, 8, 128), (4, 2, 80)])
@pytest.mark.parametrize("window", [None, 700])
def test_decode_block_scores_equal_scored_attention(kernels, dtype, heads, window):
    """GQA 9/3 (the default model), MHA with head_dim 128, head_dim 80 (the portable
    loop); window 700 starts the attended range mid-block and cuts spans across blocks."""
    _check(kernels, dtype, heads, window)


@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("window", [None, 700])
def test_quantized_page_block_scores_equal_scored_attention(kernels, fmt, window):
    _check(kernels, torch.bfloat16, (9, 3, 64), window, fmt)


@pytest.mark.parametrize("fmt", [None, "int8"])
def test_block_scores_do_not_depend_on_the_batch_or_threads(kernels, fmt):
    query, key_cache, value_cache, table, seq_lens, scale, out, arrays, want = _check(
        kernels, torch.bfloat16, (9, 3, 64), 1300, fmt)
    batched = _fresh(want)
    out = _run(kernels, fmt, query, key_cache, value_cache, table, seq_lens, scale, 1300, 2,
               batched)
    for s in range(len(LENS)):
        if want[s] is None:
            continue
        for threads in (1, 3):
            alone = [torch.zeros_like(want[s])]
            got = _run(kernels, fmt, query[s:s + 1], key_cache, value_cache, table[s:s + 1],
                       seq_lens[s:s + 1], scale, 1300, threads, alone)
            assert torch.equal(got[0], out[s]), (s, threads)
            assert torch.equal(alone[0], batched[s]), (s, threads)


def test_bad_block_score_arrays_are_errors(kernels):
    query, key_cache, value_cache, md, scale, _, want = _case(torch.float32, (9, 3, 64), None)
    arrays = _fresh(want)
    arrays[4] = torch.zeros(len(arrays[4]) - 1)  # one block short
    with pytest.raises(ValueError, match="shorter than its sequence's blocks"):
        _run(kernels, None, query, key_cache, value_cache, md.block_table, md.seq_lens, scale,
             None, 1, arrays)
    with pytest.raises(ValueError, match="float32"):
        kernels.block_score_arrays([torch.zeros(3, dtype=torch.float64)])
    with pytest.raises(ValueError, match="sequences"):
        _run(kernels, None, query, key_cache, value_cache, md.block_table, md.seq_lens, scale,
             None, 1, _fresh(want)[:2])


def _mixed_step(window, prompt_first_row):
    """Two decodes (one over three spans) then two prompt chunks; KV of the step's
    tokens given as K/V rows (the backend writes them)."""
    gen = torch.Generator().manual_seed(3)
    heads, kv_heads, dim = 9, 3, 64
    key_cache = torch.randn(200, BS, kv_heads, dim, generator=gen)
    value_cache = torch.randn(key_cache.shape, generator=gen)
    query_lens, seq_lens = [1, 1, 20, 9], [1100, 40, 60, 9]
    perm = (torch.randperm(199, generator=gen) + 1).tolist()
    tables, used = [], 0
    for n in seq_lens:
        tables.append(perm[used:used + -(-n // BS)])
        used += len(tables[-1])
    md = CommonAttentionMetadata.from_lists(query_lens, seq_lens, tables, BS)
    num_tokens = sum(query_lens)
    query = torch.randn(num_tokens, heads, dim, generator=gen)
    key = torch.randn(num_tokens, kv_heads, dim, generator=gen)
    value = torch.randn(num_tokens, kv_heads, dim, generator=gen)
    requests = {0: 0, 1: 0}  # both decodes scored
    if prompt_first_row is not None:
        requests[2] = prompt_first_row  # SnapKV's window rows of the first prompt
    return query, key, value, key_cache, value_cache, md, tables, requests


@pytest.mark.parametrize("layer_window", [None, 600])
@pytest.mark.parametrize("prompt_first_row", [None, 12])
def test_cpu_backend_scores_decodes_in_the_kernel(kernels, layer_window, prompt_first_row):
    """A mixed step: the decode rows' scores come from the C kernel and equal the PyTorch
    scored path; their outputs are the unscored step's bits. A scored prompt's rows take
    the kernel too (one-token decodes); with none scored the prompt rows are the unscored
    step's bits."""
    from llmserve.layers.attention import scored
    from llmserve.layers.attention.cpu import CpuAttentionBackend

    query, key, value, key_cache, value_cache, md, tables, requests = _mixed_step(
        layer_window, prompt_first_row)
    backend = CpuAttentionBackend(9, 64, 3, 0.125, sliding_window=layer_window)

    def run(scores, kernel_scores=True):
        common = CommonAttentionMetadata.from_lists(md.query_lens, md.seq_lens_list, tables, BS)
        common.block_scores = None if scores is None else {
            i: BlockScoreRequest(r, torch.zeros(len(tables[i]))) for i, r in scores.items()}
        kc, vc = key_cache.clone(), value_cache.clone()
        saved = scored.KERNEL_DECODE_SCORES, scored.KERNEL_PROMPT_SCORES
        scored.KERNEL_DECODE_SCORES = scored.KERNEL_PROMPT_SCORES = kernel_scores
        try:
            out = backend.forward(query, key, value, kc, vc,
                                  CpuAttentionBackend.build_metadata(common))
        finally:
            scored.KERNEL_DECODE_SCORES, scored.KERNEL_PROMPT_SCORES = saved
        return out, {i: r.scores for i, r in (common.block_scores or {}).items()}

    plain, _ = run(None)
    got, got_scores = run(requests)
    want, want_scores = run(requests, kernel_scores=False)  # every row through PyTorch
    assert torch.equal(got[:2], plain[:2])  # decode rows: the kernel, scored or not
    if prompt_first_row is None:
        assert torch.equal(got[2:], plain[2:])
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    assert got_scores.keys() == want_scores.keys()
    for i in got_scores:
        torch.testing.assert_close(got_scores[i], want_scores[i], atol=2e-6, rtol=1e-4)
    assert float(got_scores[0].sum()) == pytest.approx(9.0, rel=1e-5)
    # the halves of a mixed step (models/llama.py runs decode and prompt rows apart)
    common = CommonAttentionMetadata.from_lists(md.query_lens, md.seq_lens_list, tables, BS)
    common.block_scores = {i: BlockScoreRequest(r, torch.zeros(len(tables[i])))
                           for i, r in requests.items()}
    decodes, prompts = CpuAttentionBackend.build_metadata(common).split_decodes()
    kc, vc = key_cache.clone(), value_cache.clone()
    halves = torch.cat([backend.forward(query[:2], key[:2], value[:2], kc, vc, decodes),
                        backend.forward(query[2:], key[2:], value[2:], kc, vc, prompts)])
    assert torch.equal(halves, got)
    for i, r in common.block_scores.items():
        assert torch.equal(r.scores, got_scores[i])


@pytest.mark.parametrize("dtype,fmt", [(torch.float32, None), (torch.bfloat16, None),
                                       (torch.float32, "int8"), (torch.bfloat16, "fp8_e4m3")])
@pytest.mark.parametrize("window", [None, 300])
@pytest.mark.parametrize("first_row", [0, 700])
def test_prompt_block_scores_equal_scored_attention(kernels, dtype, fmt, window, first_row):
    """Scored prompt rows through the kernels (each token a one-token decode): outputs and
    block scores equal ``scored_attention``'s, for a whole prompt over several spans, a
    chunk after cached context and an unscored prompt beside them; H2O scores every
    row (``first_row`` 0), SnapKV its window (700: some rows of the long prompt only)."""
    from llmserve.layers.attention.cpu import CpuAttentionBackend
    from llmserve.layers.attention.scored import kernel_prompt_scores

    gen = torch.Generator().manual_seed(5)
    heads, kv_heads, dim = 9, 3, 64
    query_lens, seq_lens = [1100, 40, 300], [1100, 600, 300]
    key_cache, value_cache, tables = _paged(gen, seq_lens, 2 + sum(-(-n // BS) for n in seq_lens),
                                            kv_heads, dim, dtype, fmt)
    query = (torch.randn(sum(query_lens), heads, dim, generator=gen) * 2).to(dtype)
    backend = CpuAttentionBackend(heads, dim, kv_heads, dim ** -0.5, sliding_window=window)

    def common():
        md = CommonAttentionMetadata.from_lists(query_lens, seq_lens, tables, BS,
                                                sliding_window=window)
        md.block_scores = {i: BlockScoreRequest(first_row, torch.zeros(len(tables[i])))
                           for i in (0, 1)}  # the third prompt is not scored
        return md

    want_md = common()
    want = scored_attention(backend, query, key_cache, value_cache, want_md)
    got_md = common()
    metadata = CpuAttentionBackend.build_metadata(got_md)
    got = kernel_prompt_scores(backend, query, key_cache, value_cache, metadata, got_md)
    again = kernel_prompt_scores(backend, query, key_cache, value_cache, metadata, got_md)
    assert torch.equal(got, again)  # a second layer: the same tables, scores added again
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-5
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    for i in (0, 1):
        ref, mine = want_md.block_scores[i].scores, got_md.block_scores[i].scores / 2
        torch.testing.assert_close(mine, ref, atol=1e-4, rtol=1e-4)
        rows = max(0, query_lens[i] - first_row)
        assert float(mine.sum()) == pytest.approx(heads * rows, rel=1e-5)
