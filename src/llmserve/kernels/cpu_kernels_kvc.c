/* KIVI-style per-channel int8 keys (--kv-key-quant per-channel), per-token int8 values.
 *
 * Included after cpu_kernels_kvq.c (uses kvq_f32_to_fp16, kvq_quantize_row, kvq_codes,
 * fp16_to_f32, load_row, dot_f32, softmax_stats, run_paged_decode). Layout and rules:
 * layers/attention/kv_quant_pc.py (the PyTorch reference, same bytes):
 *
 *   key_cache   [num_blocks, block_size + 2, Hkv, D] bytes
 *               rows 0..bs-1: codes; rows bs, bs+1: fp16 scale s[h][d] (2 * Hkv * D bytes)
 *   value_cache [num_blocks, block_size, Hkv, D + 2] bytes (cpu_kernels_kvq.c, per token)
 *
 *   offset 0:  s = fp16(|x| / 127);  else n = fp16(|x| / 127), if n > s: the block's earlier
 *   codes of that channel become rint((c * s) / n) and s = n;  c = clamp(rint(x / s), +-127)
 *
 * Decode: scores_j = scale * sum_d (q_d * s_d) c_jd, q scaled once per block.
 */
#define KVQ_INT8_KC 2

/* key [Hkv * D] floats -> block (slot / bs), offset slot % bs */
static void kvc_write_key(uint8_t *key_cache, int64_t slot, int64_t bs, int64_t Hkv,
                          int64_t D, const float *x) {
    const int64_t row = Hkv * D, blk = slot / bs, off = slot - blk * bs;
    uint8_t *base = key_cache + blk * (bs + 2) * row, *sc = base + bs * row;
    for (int64_t i = 0; i < row; i++) {
        float need = fabsf(x[i]) / 127.0f;
        if (need > 65504.0f) need = 65504.0f;
        uint16_t nh = kvq_f32_to_fp16(need);
        uint8_t p[2] = {(uint8_t)(nh & 0xff), (uint8_t)(nh >> 8)};
        const float n = fp16_to_f32(p);
        float s = off == 0 ? 0.f : fp16_to_f32(sc + 2 * i);
        if (off == 0 || n > s) {
            for (int64_t o = 0; o < off; o++) {  /* re-round the channel's earlier codes */
                int8_t *c = (int8_t *)base + o * row + i;
                float v = rintf(((float)*c * s) / n);
                *c = (int8_t)(v > 127.f ? 127.f : (v < -127.f ? -127.f : v));
            }
            sc[2 * i] = p[0];
            sc[2 * i + 1] = p[1];
            s = n;
        }
        float v = s == 0.f ? 0.f : rintf(x[i] / s);
        v = v > 127.f ? 127.f : (v < -127.f ? -127.f : v);
        base[off * row + i] = (uint8_t)(int8_t)v;
    }
}

/* key, value: [T, Hkv * D] rows of the model dtype (row strides given); slot -1 skips.
 * Tokens are written in order (a later token of a block may re-round an earlier one). */
int write_kv_quant_kc(int dtype, uint8_t *key_cache, uint8_t *value_cache, int64_t num_blocks,
                      int64_t block_size, const void *key, int64_t key_stride,
                      const void *value, int64_t value_stride, const int64_t *slot_mapping,
                      int64_t num_tokens, int64_t num_kv_heads, int64_t head_dim) {
    if (head_dim <= 0 || head_dim > KVQ_MAX_HEAD_DIM || num_kv_heads <= 0 || block_size <= 0)
        return -1;
    const int64_t num_slots = num_blocks * block_size, row = num_kv_heads * head_dim;
    for (int64_t t = 0; t < num_tokens; t++)
        if (slot_mapping[t] >= num_slots || slot_mapping[t] < -1) return -3;
    const size_t es = elem_size(dtype);
    const int64_t rb = head_dim + 2, sb = num_kv_heads * rb;
    float *buf = malloc((size_t)row * sizeof(float));
    if (!buf) return -2;
    for (int64_t t = 0; t < num_tokens; t++) {
        int64_t slot = slot_mapping[t];
        if (slot < 0) continue;
        load_row(dtype, buf, (const char *)key + t * key_stride * es, row);
        kvc_write_key(key_cache, slot, block_size, num_kv_heads, head_dim, buf);
        for (int64_t h = 0; h < num_kv_heads; h++) {
            load_row(dtype, buf, (const char *)value + (t * value_stride + h * head_dim) * es,
                     head_dim);
            kvq_quantize_row(KVQ_INT8, value_cache + slot * sb + h * rb, buf, head_dim);
        }
    }
    free(buf);
    return 0;
}

/* one span of one sequence, all heads (the attn_span_fn of run_paged_decode) */
static inline __attribute__((always_inline)) void kvc_attend_core(
    const attn_args *a, const attn_span *sp, float *scores, float *qbuf, float *kv, float *acc,
    float *stats, const int64_t D) {
    const size_t es = elem_size(a->dtype);
    const int64_t H = a->num_heads, Hkv = a->num_kv_heads, G = H / Hkv, bs = a->block_size;
    const int64_t n = sp->n, seq = sp->seq, row = Hkv * D;
    const int64_t *table = a->block_table + seq * a->bt_stride;
    const uint8_t *kc = (const uint8_t *)a->key_cache, *vc = (const uint8_t *)a->value_cache;
    /* acc holds the raw query during the score pass; qbuf the query times the block's scales */
    load_row(a->dtype, acc, (const char *)a->query + seq * a->q_stride * es, H * D);
    slot_cursor cur = slots_from(table, bs, sp->start);
    int64_t scaled_blk = -1;
    for (int64_t j = 0; j < n; j++) {
        const int64_t blk = cur.table[cur.blk], off = cur.off;
        next_slot(&cur);
        const uint8_t *base = kc + blk * (bs + 2) * row;
        if (blk != scaled_blk) {
            const uint8_t *sc = base + bs * row;
            for (int64_t kvh = 0; kvh < Hkv; kvh++)
                for (int64_t g = 0; g < G; g++)
                    for (int64_t d = 0; d < D; d++)
                        qbuf[(kvh * G + g) * D + d] =
                            acc[(kvh * G + g) * D + d] * fp16_to_f32(sc + 2 * (kvh * D + d));
            scaled_blk = blk;
        }
        for (int64_t kvh = 0; kvh < Hkv; kvh++) {
            kvq_codes(KVQ_INT8, kv, base + off * row + kvh * D, D);
            for (int64_t g = 0; g < G; g++)
                scores[(kvh * G + g) * n + j] =
                    dot_f32(qbuf + (kvh * G + g) * D, kv, D) * a->scale;
        }
    }
    for (int64_t h = 0; h < H; h++) softmax_stats(scores + h * n, n, stats + 2 * h);
    kvq_accumulate_values(KVQ_INT8, table, bs, sp->start, n, vc, Hkv, G, D, scores, kv, acc);
}

static void kvc_attend_span(const attn_args *a, int fmt, const attn_span *sp, float *scores,
                            float *qbuf, float *kv, float *acc, float *stats) {
    (void)fmt;
    const int64_t D = a->head_dim;
    if (D == 64) return kvc_attend_core(a, sp, scores, qbuf, kv, acc, stats, 64);
    if (D == 128) return kvc_attend_core(a, sp, scores, qbuf, kv, acc, stats, 128);
    kvc_attend_core(a, sp, scores, qbuf, kv, acc, stats, D);
}

/* As paged_attention_decode_quant (one query token per row of block_table / seq_lens),
 * over a per-channel key cache. */
int paged_attention_decode_quant_kc(int dtype, void *out, const void *query, int64_t q_stride,
                                    const uint8_t *key_cache, const uint8_t *value_cache,
                                    int64_t num_blocks, const int64_t *block_table,
                                    int64_t bt_width, int64_t bt_stride,
                                    const int64_t *seq_lens, int64_t num_seqs,
                                    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                    int64_t block_size, float scale, int64_t window,
                                    int num_threads) {
    if (num_kv_heads <= 0 || num_heads % num_kv_heads || head_dim <= 0 || block_size <= 0)
        return -1;
    attn_args a = {dtype, out, query, key_cache, value_cache, block_table, seq_lens,
                   num_seqs, num_heads, num_kv_heads, head_dim, block_size, bt_stride, q_stride,
                   window, scale, NULL, NULL};  /* no block scores (not with h2o/snapkv) */
    return run_paged_decode(&a, KVQ_INT8_KC, kvc_attend_span, num_blocks, bt_width,
                            num_threads);
}

/* Token by token (kv_quant_pc.py, sequential_attention): write token t's K/V at
 * slot_mapping[t], then attend query t over its context (block_table row t, seq_lens[t]),
 * so each token sees the cache as it stood right after its own write. */
int paged_prefill_quant_kc(int dtype, void *out, const void *query, int64_t q_stride,
                           const void *key, int64_t key_stride, const void *value,
                           int64_t value_stride, const int64_t *slot_mapping,
                           uint8_t *key_cache, uint8_t *value_cache, int64_t num_blocks,
                           const int64_t *block_table, int64_t bt_width, int64_t bt_stride,
                           const int64_t *seq_lens, int64_t num_tokens, int64_t num_heads,
                           int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                           float scale, int64_t window, int num_threads) {
    const size_t es = elem_size(dtype);
    for (int64_t t = 0; t < num_tokens; t++) {
        int status = write_kv_quant_kc(dtype, key_cache, value_cache, num_blocks, block_size,
                                       (const char *)key + t * key_stride * es, key_stride,
                                       (const char *)value + t * value_stride * es,
                                       value_stride, slot_mapping + t, 1, num_kv_heads,
                                       head_dim);
        if (!status)
            status = paged_attention_decode_quant_kc(
                dtype, (char *)out + t * num_heads * head_dim * es,
                (const char *)query + t * q_stride * es, q_stride, key_cache, value_cache,
                num_blocks, block_table + t * bt_stride, bt_width, bt_stride, seq_lens + t, 1,
                num_heads, num_kv_heads, head_dim, block_size, scale, window, num_threads);
        if (status) return status;
    }
    return 0;
}
