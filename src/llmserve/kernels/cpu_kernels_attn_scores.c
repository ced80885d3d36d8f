/* Per-KV-block attention scores of the paged decode kernel (included by
 * cpu_kernels_attn.c after attn_args / attn_span; uses sum_f32, exp_approx).
 *
 * KV eviction by attention (H2O: Zhang et al., NeurIPS 2023; SnapKV: Li et al., 2024)
 * ranks a sequence's KV blocks by the attention they receive. With score accumulators
 * (attn_args.score_ptrs[s]: a float32 array of at least ceil(L_s / block_size) entries,
 * 0 = sequence s is not scored), the kernel adds, for block b of scored sequence s,
 *
 *   scores[b] += sum_h sum_{j in block b, j attended} p_h(j),   p_h = softmax of head h
 *
 * (summed over the query heads; every layer's call adds into the same array). The
 * probabilities come out of the split-K attention itself, not a second pass:
 *
 *   span pass (span i, positions [start, start + n), local m_ih, l_ih per head h):
 *       the span function leaves p'_h(j) = exp(s_hj - m_ih) / l_ih in its score buffer
 *       [H, n]; per head and per block b touched by the span, blk_i[h][b] = sum_j p'_h(j)
 *   combine pass (final M_h = max_i m_ih, L_h = sum_i l_ih exp(m_ih - M_h)):
 *       p_h(j) = p'_h(j) * w_ih / L_h with w_ih = l_ih exp(m_ih - M_h), so
 *       scores[b] += sum_h blk_i[h][b] * w_ih / L_h      (span after span, in order)
 *
 * A sequence of one span adds sum_h blk[h][b] directly in the span pass. Either way one
 * thread adds into a sequence's array, in a fixed order that depends on the sequence
 * alone, so the scores are deterministic and batch-invariant like the output. (Two
 * scored sequences of one call must not share an array.)
 */

/* first block and block count of a span */
static inline int64_t span_block0(const attn_args *a, const attn_span *sp) {
    return sp->start / a->block_size;
}

static inline int64_t span_num_blocks(const attn_args *a, const attn_span *sp) {
    return (sp->start + sp->n - 1) / a->block_size - sp->start / a->block_size + 1;
}

static inline float *score_array(const attn_args *a, int64_t seq) {
    return a->score_ptrs ? (float *)(uintptr_t)a->score_ptrs[seq] : NULL;
}

/* The span pass's share: probs [H][n] are the span's local softmax rows (see above).
 * A split span keeps per head block sums in sp->blk [H][nb]; a whole sequence adds
 * the sum over heads into its array at once. */
static void span_block_scores(const attn_args *a, const attn_span *sp, const float *probs) {
    const int64_t H = a->num_heads, bs = a->block_size, n = sp->n;
    const int64_t b0 = span_block0(a, sp), nb = span_num_blocks(a, sp);
    float *acc = sp->blk ? NULL : score_array(a, sp->seq) + b0;
    for (int64_t b = 0; b < nb; b++) {
        int64_t lo = (b0 + b) * bs - sp->start, hi = lo + bs;
        lo = lo < 0 ? 0 : lo;
        hi = hi > n ? n : hi;
        float total = 0.f;
        for (int64_t h = 0; h < H; h++) {
            float s = sum_f32(probs + h * n + lo, hi - lo);
            if (sp->blk)
                sp->blk[h * nb + b] = s;
            else
                total += s;
        }
        if (acc) acc[b] += total;
    }
}

/* The combine pass's share for a sequence of k > 1 spans (sp .. sp + k - 1, parts
 * [k][H][2 + D]); final[h] = (M_h, L_h) from combine_spans; coef: H floats of scratch. */
static void combine_block_scores(const attn_args *a, const attn_span *sp, int64_t k,
                                 const float *parts, const float *final, float *coef) {
    const int64_t H = a->num_heads, D = a->head_dim, stride = H * (2 + D);
    float *acc = score_array(a, sp->seq);
    for (int64_t i = 0; i < k; i++) {
        const attn_span *s = sp + i;
        const int64_t b0 = span_block0(a, s), nb = span_num_blocks(a, s);
        for (int64_t h = 0; h < H; h++) {
            const float *p = parts + i * stride + h * (2 + D);
            coef[h] = p[1] * exp_approx(p[0] - final[2 * h]) / final[2 * h + 1];
        }
        for (int64_t b = 0; b < nb; b++) {
            float total = 0.f;
            for (int64_t h = 0; h < H; h++) total += s->blk[h * nb + b] * coef[h];
            acc[b0 + b] += total;
        }
    }
}
