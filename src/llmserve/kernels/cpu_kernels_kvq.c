/* Quantized KV cache pages (int8 / fp8 e4m3): the KV write and paged decode attention.
 *
 * Included at the end of cpu_kernels.c (it uses that file's helpers: load_row, store_row,
 * dot_f32, fp16_to_f32) and cpu_kernels_attn.c's (softmax_stats, slot_cursor, attn_args,
 * attn_span, run_paged_decode: the same split-K spans).
 *
 * A quantized cache holds, per token and KV head, head_dim one-byte codes followed by
 * that row's fp16 scale (little endian), so the scales live inside their block:
 *
 *   cache [num_blocks, block_size, num_kv_heads, head_dim + 2] bytes
 *   slot row (one token):  | head 0: q0 .. q(D-1) | s0 s1 | head 1: ... | s0 s1 | ...
 *
 *   int8 (symmetric absmax, per token per head; LMDeploy / KIVI's per-token V):
 *       s = fp16(absmax / 127),  q = clamp(rint(x / s), -127, 127),  x' = q * s
 *   fp8 e4m3fn (OCP FP8, max 448; vLLM's fp8 KV with a per-token-per-head scale):
 *       s = fp16(absmax / 448),  q = e4m3fn(clamp(x / s, -448, 448)) (round to nearest
 *       even, as c10::Float8_e4m3fn),  x' = f32(q) * s
 *   (scale fp16(min(absmax / qmax, 65504)); an all-zero row has s = 0 and codes 0)
 *
 * The attention kernel reads each row's codes and scale in its position loop and
 * dequantizes that row only (no block is ever expanded): scores = (q . codes) * s * scale,
 * output += (p * s) * codes. Float32 math throughout, as paged_attention_decode.
 */
#define KVQ_INT8 0
#define KVQ_FP8 1
#define KVQ_MAX_HEAD_DIM 1024

/* float32 -> IEEE fp16 bits, round to nearest even (finite inputs below 65520) */
static inline uint16_t kvq_f32_to_fp16(float f) {
    bits32 b;
    b.f = f;
    uint32_t sign = (b.u >> 16) & 0x8000u, ax = b.u & 0x7fffffffu;
    if (ax >= 0x7f800000u) return (uint16_t)(sign | 0x7c00u | (ax > 0x7f800000u ? 0x200u : 0));
    if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);  /* rounds to inf */
    if (ax < 0x38800000u) {  /* below 2^-14: a subnormal half, m * 2^-24 */
        bits32 a;
        a.u = ax;
        return (uint16_t)(sign | (uint32_t)rintf(a.f * 16777216.0f));
    }
    uint32_t r = ax + 0xfffu + ((ax >> 13) & 1u) - 0x38000000u;  /* RNE, rebias 127 -> 15 */
    return (uint16_t)(sign | (r >> 13));
}

static inline float kvq_scale_of(const uint8_t *row, int64_t head_dim) {
    return fp16_to_f32(row + head_dim);
}

/* float32 (|f| <= 448) -> e4m3fn bits, round to nearest even (c10's algorithm) */
static inline uint8_t kvq_f32_to_e4m3(float f) {
    bits32 b;
    b.f = f;
    uint32_t sign = b.u & 0x80000000u, u = b.u ^ sign;
    uint8_t res;
    if (u < (121u << 23)) {  /* below 2^-6: subnormal, ulp 2^-9 (the 2^14 add rounds) */
        bits32 a, d;
        a.u = u;
        d.u = 141u << 23;
        a.f = a.f + d.f;
        res = (uint8_t)(a.u - d.u);
    } else {
        uint32_t odd = (u >> 20) & 1u;
        u += ((uint32_t)(7 - 127) << 23) + 0x7ffffu + odd;
        res = (uint8_t)(u >> 20);
    }
    return (uint8_t)(res | (sign >> 24));
}

static inline float kvq_e4m3_to_f32(uint8_t c) {
    uint32_t sign = (uint32_t)(c & 0x80u) << 24, e = (c >> 3) & 0xfu, m = c & 7u;
    bits32 n, s;
    n.u = sign | ((e + 120u) << 23) | (m << 20);
    s.f = (float)m * 0.001953125f;  /* m * 2^-9 */
    s.u |= sign;
    return e ? n.f : s.f;
}

static void kvq_quantize_row(int fmt, uint8_t *dst, const float *x, int64_t D) {
    float amax = 0.f;
    for (int64_t d = 0; d < D; d++) {
        float a = fabsf(x[d]);
        amax = a > amax ? a : amax;
    }
    float sf = amax / (fmt == KVQ_FP8 ? 448.0f : 127.0f);
    if (sf > 65504.0f) sf = 65504.0f;
    uint16_t sh = kvq_f32_to_fp16(sf);
    uint8_t p[2] = {(uint8_t)(sh & 0xff), (uint8_t)(sh >> 8)};
    float s = fp16_to_f32(p);
    dst[D] = p[0];
    dst[D + 1] = p[1];
    if (s == 0.f) {
        memset(dst, 0, (size_t)D);
        return;
    }
    if (fmt == KVQ_INT8) {
        for (int64_t d = 0; d < D; d++) {
            float v = rintf(x[d] / s);
            v = v > 127.f ? 127.f : (v < -127.f ? -127.f : v);
            dst[d] = (uint8_t)(int8_t)v;
        }
    } else {
        for (int64_t d = 0; d < D; d++) {
            float v = x[d] / s;
            v = v > 448.f ? 448.f : (v < -448.f ? -448.f : v);
            dst[d] = kvq_f32_to_e4m3(v);
        }
    }
}

/* ------------------------------------------------------------------ quantized KV write
 * key, value: [T, num_kv_heads * head_dim] rows of the model dtype (row strides given);
 * caches: [num_slots, num_kv_heads, head_dim + 2] bytes. Slot -1 skips a token.
 */
int write_kv_quant(int fmt, int dtype, uint8_t *key_cache, uint8_t *value_cache,
                   int64_t num_slots, const void *key, int64_t key_stride, const void *value,
                   int64_t value_stride, const int64_t *slot_mapping, int64_t num_tokens,
                   int64_t num_kv_heads, int64_t head_dim) {
    if ((fmt != KVQ_INT8 && fmt != KVQ_FP8) || head_dim <= 0 || head_dim > KVQ_MAX_HEAD_DIM ||
        num_kv_heads <= 0)
        return -1;
    for (int64_t t = 0; t < num_tokens; t++)
        if (slot_mapping[t] >= num_slots || slot_mapping[t] < -1) return -3;
    const size_t es = elem_size(dtype);
    const int64_t rb = head_dim + 2, sb = num_kv_heads * rb;
    float buf[KVQ_MAX_HEAD_DIM];
    for (int64_t t = 0; t < num_tokens; t++) {
        int64_t slot = slot_mapping[t];
        if (slot < 0) continue;
        for (int64_t h = 0; h < num_kv_heads; h++) {
            load_row(dtype, buf, (const char *)key + (t * key_stride + h * head_dim) * es,
                     head_dim);
            kvq_quantize_row(fmt, key_cache + slot * sb + h * rb, buf, head_dim);
            load_row(dtype, buf, (const char *)value + (t * value_stride + h * head_dim) * es,
                     head_dim);
            kvq_quantize_row(fmt, value_cache + slot * sb + h * rb, buf, head_dim);
        }
    }
    return 0;
}

/* ------------------------------------------------------------------ quantized paged decode
 * As paged_attention_decode (same arguments and layout of query, out, block_table,
 * seq_lens, window), over quantized caches [num_blocks, block_size, Hkv, D + 2] bytes.
 */
static inline void kvq_codes(int fmt, float *restrict dst, const uint8_t *restrict src,
                             const int64_t D) {
    if (fmt == KVQ_INT8) {
#pragma omp simd
        for (int64_t d = 0; d < D; d++) dst[d] = (float)(int8_t)src[d];
    } else {
#pragma omp simd
        for (int64_t d = 0; d < D; d++) dst[d] = kvq_e4m3_to_f32(src[d]);
    }
}

/* acc[H * D] = sum_j p[h, j] * V_j over a span's n positions from `start` on (p: scores
 * [H, n] after the softmax), quantized value rows dequantized one at a time; shared by the
 * per-token (this file) and per-channel-key (cpu_kernels_kvc.c) decode kernels */
static inline __attribute__((always_inline)) void kvq_accumulate_values(
    const int fmt, const int64_t *table, const int64_t bs, const int64_t start, const int64_t n,
    const uint8_t *vc, const int64_t Hkv, const int64_t G, const int64_t D,
    const float *scores, float *kv, float *acc) {
    const int64_t rb = D + 2, sb = Hkv * rb;  /* bytes per head row, per slot */
    for (int64_t i = 0; i < Hkv * G * D; i++) acc[i] = 0.f;
    slot_cursor cur = slots_from(table, bs, start);
    for (int64_t j = 0; j < n; j++) {
        const uint8_t *vp = vc + next_slot(&cur) * sb;
        for (int64_t kvh = 0; kvh < Hkv; kvh++) {
            const uint8_t *r = vp + kvh * rb;
            kvq_codes(fmt, kv, r, D);
            const float s = kvq_scale_of(r, D);
            for (int64_t g = 0; g < G; g++) {
                const float p = scores[(kvh * G + g) * n + j] * s;
                float *o = acc + (kvh * G + g) * D;
#pragma omp simd
                for (int64_t d = 0; d < D; d++) o[d] += p * kv[d];
            }
        }
    }
}

/* one sequence, all heads; D and fmt compile-time constants in the common cases */
static inline __attribute__((always_inline)) void kvq_attend_core(
    const attn_args *a, const attn_span *sp, float *scores, float *qbuf, float *kv, float *acc,
    float *stats, const int64_t D, const int fmt) {
    const size_t es = elem_size(a->dtype);
    const int64_t H = a->num_heads, Hkv = a->num_kv_heads, G = H / Hkv, bs = a->block_size;
    const int64_t n = sp->n, seq = sp->seq;
    const int64_t *table = a->block_table + seq * a->bt_stride;
    const int64_t rb = D + 2, sb = Hkv * rb;  /* bytes per head row, per slot */
    const uint8_t *kc = (const uint8_t *)a->key_cache, *vc = (const uint8_t *)a->value_cache;
    load_row(a->dtype, qbuf, (const char *)a->query + seq * a->q_stride * es, H * D);
    slot_cursor cur = slots_from(table, bs, sp->start);
    for (int64_t j = 0; j < n; j++) {
        const uint8_t *kp = kc + next_slot(&cur) * sb;
        for (int64_t kvh = 0; kvh < Hkv; kvh++) {
            const uint8_t *r = kp + kvh * rb;
            kvq_codes(fmt, kv, r, D);
            const float s = kvq_scale_of(r, D) * a->scale;
            for (int64_t g = 0; g < G; g++)
                scores[(kvh * G + g) * n + j] = dot_f32(qbuf + (kvh * G + g) * D, kv, D) * s;
        }
    }
    for (int64_t h = 0; h < H; h++) softmax_stats(scores + h * n, n, stats + 2 * h);
    kvq_accumulate_values(fmt, table, bs, sp->start, n, vc, Hkv, G, D, scores, kv, acc);
}

#if defined(__AVX512F__)
/* 16 codes -> 16 float32 lanes (unscaled) */
static inline __m512 kvq_load16(const int fmt, const uint8_t *p) {
    __m128i b = _mm_loadu_si128((const __m128i *)p);
    if (fmt == KVQ_INT8) return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
    __m512i x = _mm512_cvtepu8_epi32(b);
    __m512i sign = _mm512_slli_epi32(_mm512_and_si512(x, _mm512_set1_epi32(0x80)), 24);
    __m512i e = _mm512_and_si512(_mm512_srli_epi32(x, 3), _mm512_set1_epi32(0xf));
    __m512i m = _mm512_and_si512(x, _mm512_set1_epi32(7));
    __m512i normal = _mm512_or_si512(
        sign, _mm512_or_si512(_mm512_slli_epi32(_mm512_add_epi32(e, _mm512_set1_epi32(120)), 23),
                              _mm512_slli_epi32(m, 20)));
    __m512i sub = _mm512_or_si512(
        sign, _mm512_castps_si512(_mm512_mul_ps(_mm512_cvtepi32_ps(m),
                                                _mm512_set1_ps(0.001953125f))));
    __mmask16 is_sub = _mm512_cmpeq_epi32_mask(e, _mm512_setzero_si512());
    return _mm512_castsi512_ps(_mm512_mask_blend_epi32(is_sub, normal, sub));
}

/* kvq_attend_core with AVX-512 (head_dim a multiple of 16, at most 256): each position's
 * rows are converted once into registers and used by every query head of their group. */
static inline __attribute__((always_inline)) void kvq_attend_avx512(
    const attn_args *a, const attn_span *sp, float *scores, float *qbuf, float *acc,
    float *stats, const int64_t D, const int fmt) {
    const size_t es = elem_size(a->dtype);
    const int64_t H = a->num_heads, Hkv = a->num_kv_heads, G = H / Hkv, bs = a->block_size;
    const int64_t n = sp->n, seq = sp->seq;
    const int64_t *table = a->block_table + seq * a->bt_stride;
    const int64_t rb = D + 2, sb = Hkv * rb, V = D / 16;
    const uint8_t *kc = (const uint8_t *)a->key_cache, *vc = (const uint8_t *)a->value_cache;
    load_row(a->dtype, qbuf, (const char *)a->query + seq * a->q_stride * es, H * D);
    slot_cursor cur = slots_from(table, bs, sp->start);
    for (int64_t j = 0; j < n; j++) {
        const uint8_t *kp = kc + next_slot(&cur) * sb;
        for (int64_t kvh = 0; kvh < Hkv; kvh++) {
            const uint8_t *r = kp + kvh * rb;
            __m512 k[16];
            for (int64_t v = 0; v < V; v++) k[v] = kvq_load16(fmt, r + v * 16);
            const float s = kvq_scale_of(r, D) * a->scale;
            for (int64_t g = 0; g < G; g++) {
                const float *q = qbuf + (kvh * G + g) * D;
                __m512 d = _mm512_mul_ps(_mm512_loadu_ps(q), k[0]);
                for (int64_t v = 1; v < V; v++)
                    d = _mm512_fmadd_ps(_mm512_loadu_ps(q + v * 16), k[v], d);
                scores[(kvh * G + g) * n + j] = _mm512_reduce_add_ps(d) * s;
            }
        }
    }
    for (int64_t h = 0; h < H; h++) softmax_stats(scores + h * n, n, stats + 2 * h);
    for (int64_t i = 0; i < H * D; i++) acc[i] = 0.f;
    cur = slots_from(table, bs, sp->start);
    for (int64_t j = 0; j < n; j++) {
        const uint8_t *vp = vc + next_slot(&cur) * sb;
        for (int64_t kvh = 0; kvh < Hkv; kvh++) {
            const uint8_t *r = vp + kvh * rb;
            __m512 val[16];
            for (int64_t v = 0; v < V; v++) val[v] = kvq_load16(fmt, r + v * 16);
            const float s = kvq_scale_of(r, D);
            for (int64_t g = 0; g < G; g++) {
                __m512 p = _mm512_set1_ps(scores[(kvh * G + g) * n + j] * s);
                float *o = acc + (kvh * G + g) * D;
                for (int64_t v = 0; v < V; v++)
                    _mm512_storeu_ps(o + v * 16,
                                     _mm512_fmadd_ps(p, val[v], _mm512_loadu_ps(o + v * 16)));
            }
        }
    }
}
#endif

static void kvq_attend_span(const attn_args *a, int fmt, const attn_span *sp, float *scores,
                            float *qbuf, float *kv, float *acc, float *stats) {
    const int64_t D = a->head_dim;
#if defined(__AVX512F__)
    if (D % 16 == 0 && D <= 256) {
        if (fmt == KVQ_INT8) {
            if (D == 64) return kvq_attend_avx512(a, sp, scores, qbuf, acc, stats, 64, KVQ_INT8);
            return kvq_attend_avx512(a, sp, scores, qbuf, acc, stats, D, KVQ_INT8);
        }
        if (D == 64) return kvq_attend_avx512(a, sp, scores, qbuf, acc, stats, 64, KVQ_FP8);
        return kvq_attend_avx512(a, sp, scores, qbuf, acc, stats, D, KVQ_FP8);
    }
#endif
    if (fmt == KVQ_INT8) {
        if (D == 64) return kvq_attend_core(a, sp, scores, qbuf, kv, acc, stats, 64, KVQ_INT8);
        if (D == 128) return kvq_attend_core(a, sp, scores, qbuf, kv, acc, stats, 128, KVQ_INT8);
        return kvq_attend_core(a, sp, scores, qbuf, kv, acc, stats, D, KVQ_INT8);
    }
    if (D == 64) return kvq_attend_core(a, sp, scores, qbuf, kv, acc, stats, 64, KVQ_FP8);
    if (D == 128) return kvq_attend_core(a, sp, scores, qbuf, kv, acc, stats, 128, KVQ_FP8);
    kvq_attend_core(a, sp, scores, qbuf, kv, acc, stats, D, KVQ_FP8);
}

int paged_attention_decode_quant(int fmt, int dtype, void *out, const void *query,
                                 int64_t q_stride, const uint8_t *key_cache,
                                 const uint8_t *value_cache, int64_t num_blocks,
                                 const int64_t *block_table, int64_t bt_width,
                                 int64_t bt_stride, const int64_t *seq_lens, int64_t num_seqs,
                                 int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                 int64_t block_size, float scale, int64_t window,
                                 int num_threads, const int64_t *score_ptrs,
                                 const int64_t *score_lens) {
    if ((fmt != KVQ_INT8 && fmt != KVQ_FP8) || num_kv_heads <= 0 ||
        num_heads % num_kv_heads || head_dim <= 0 || block_size <= 0 ||
        (score_ptrs && !score_lens))
        return -1;
    attn_args a = {dtype, out, query, key_cache, value_cache, block_table, seq_lens,
                   num_seqs, num_heads, num_kv_heads, head_dim, block_size, bt_stride, q_stride,
                   window, scale, score_ptrs, score_lens};
    return run_paged_decode(&a, fmt, kvq_attend_span, num_blocks, bt_width, num_threads);
}
