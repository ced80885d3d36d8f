/* llmserve CPU kernels: the small fused ops of a decoder layer and paged decode attention.
 *
 * Plain C11, no ATen: built once per machine by llmserve/kernels/__init__.py with the
 * system C compiler (-O3 -march=native) and called through ctypes (about 1 us a call).
 * Every kernel takes a dtype code (0 = float32, 1 = bfloat16); bfloat16 is stored as
 * uint16 and computed in float32, rounded to nearest even where PyTorch rounds, so the
 * elementwise kernels reproduce the eager PyTorch ops of llmserve.layers bit for bit
 * (reductions may differ in summation order).
 *
 * Return value: 0 on success, a negative code for bad arguments (checked by the caller).
 */
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <math.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define DT_F32 0
#define DT_BF16 1

typedef union {
    float f;
    uint32_t u;
    int32_t i;
} bits32;

static inline float bf16_to_f32(uint16_t h) {
    bits32 b;
    b.u = (uint32_t)h << 16;
    return b.f;
}

static inline uint16_t f32_to_bf16(float f) {
    bits32 b;
    b.f = f;
    uint32_t u = b.u;
    uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    uint32_t nan = (u >> 16) | 0x40u;  /* quiet NaN, as c10::BFloat16 */
    return (uint16_t)(((u & 0x7fffffffu) > 0x7f800000u) ? nan : rounded);
}

static inline float bf16_round(float f) { return bf16_to_f32(f32_to_bf16(f)); }

/* round a float32 to the storage dtype and back (identity for float32) */
static inline float round_dt(int dtype, float f) {
    return dtype == DT_BF16 ? bf16_to_f32(f32_to_bf16(f)) : f;
}

static inline float load(int dtype, const void *p, int64_t i) {
    return dtype == DT_BF16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline void store(int dtype, void *p, int64_t i, float f) {
    if (dtype == DT_BF16)
        ((uint16_t *)p)[i] = f32_to_bf16(f);
    else
        ((float *)p)[i] = f;
}

/* float32 row <- row of the storage dtype (vectorizes) */
static inline void load_row(int dtype, float *restrict dst, const void *src, int64_t n) {
    if (dtype == DT_BF16) {
        const uint16_t *s = (const uint16_t *)src;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) dst[i] = bf16_to_f32(s[i]);
    } else {
        memcpy(dst, src, (size_t)n * sizeof(float));
    }
}

static inline void store_row(int dtype, void *dst, const float *restrict src, int64_t n) {
    if (dtype == DT_BF16) {
        uint16_t *d = (uint16_t *)dst;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) d[i] = f32_to_bf16(src[i]);
    } else {
        memcpy(dst, src, (size_t)n * sizeof(float));
    }
}

/* Reductions in 16 independent lanes, then a fixed tree: vectorizes without
 * -ffast-math (GCC otherwise keeps a strict left-to-right order: 1 add per cycle). */
#define LANES 16

static inline float tree16(float *part) {
    for (int w = LANES / 2; w > 0; w >>= 1)
        for (int l = 0; l < w; l++) part[l] += part[l + w];
    return part[0];
}

static inline float dot_f32(const float *restrict a, const float *restrict b, int64_t n) {
    float part[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int l = 0; l < LANES; l++) part[l] += a[i + l] * b[i + l];
    for (int64_t l = 0; l < n - i && l < LANES; l++) part[l] += a[i + l] * b[i + l];
    return tree16(part);
}

static inline float sum_f32(const float *restrict a, int64_t n) {
    float part[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int l = 0; l < LANES; l++) part[l] += a[i + l];
    for (int64_t l = 0; l < n - i && l < LANES; l++) part[l] += a[i + l];
    return tree16(part);
}

static inline float max_f32(const float *restrict a, int64_t n) {
    float part[LANES];
    for (int l = 0; l < LANES; l++) part[l] = -INFINITY;
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int l = 0; l < LANES; l++) part[l] = a[i + l] > part[l] ? a[i + l] : part[l];
    for (int64_t l = 0; l < n - i && l < LANES; l++)
        part[l] = a[i + l] > part[l] ? a[i + l] : part[l];
    for (int w = LANES / 2; w > 0; w >>= 1)
        for (int l = 0; l < w; l++) part[l] = part[l + w] > part[l] ? part[l + w] : part[l];
    return part[0];
}

static inline size_t elem_size(int dtype) { return dtype == DT_BF16 ? 2 : 4; }

/* Row-wise kernels split their rows over the OpenMP threads above this many elements. */
#define ROW_PARALLEL_MIN 32768

static inline int row_threads(int64_t elements) {
#ifdef _OPENMP
    return elements >= ROW_PARALLEL_MIN ? omp_get_max_threads() : 1;
#else
    (void)elements;
    return 1;
#endif
}

/* ------------------------------------------------------------------ RMSNorm
 * out[t] = w * dt(x'[t] / sqrt(mean(x'[t]^2) + eps)),  x' = dt(x + residual) or x
 * (Hugging Face LlamaRMSNorm; the add-norm of vLLM). residual_out receives x'.
 * x: [T, H] with row stride x_stride; out, residual, residual_out, weight contiguous.
 */
int rms_norm(int dtype, void *out, const void *x, int64_t x_stride, const void *residual,
             void *residual_out, const void *weight, int64_t num_tokens, int64_t hidden,
             float eps) {
    if (hidden <= 0 || hidden > (1 << 20)) return -1;
    size_t es = elem_size(dtype);
    int status = 0;
#pragma omp parallel num_threads(row_threads(num_tokens * hidden)) if (num_tokens * hidden >= ROW_PARALLEL_MIN)
    {
    float *row = malloc((size_t)hidden * 2 * sizeof(float));
    float *w = row + hidden;
    if (!row)
        status = -2;
    else
        load_row(dtype, w, weight, hidden);
#pragma omp for
    for (int64_t t = 0; t < num_tokens; t++) {
        if (!row) continue;
        load_row(dtype, row, (const char *)x + t * x_stride * es, hidden);
        if (residual) {
            const char *res = (const char *)residual + t * hidden * es;
#pragma omp simd
            for (int64_t i = 0; i < hidden; i++)
                row[i] = round_dt(dtype, row[i] + load(dtype, res, i));
            store_row(dtype, (char *)residual_out + t * hidden * es, row, hidden);
        }
        float ss = dot_f32(row, row, hidden);
        float inv = 1.0f / sqrtf(ss / (float)hidden + eps);
#pragma omp simd
        for (int64_t i = 0; i < hidden; i++) row[i] = w[i] * round_dt(dtype, row[i] * inv);
        store_row(dtype, (char *)out + t * hidden * es, row, hidden);
    }
    free(row);
    }
    return status;
}

/* ------------------------------------------------------------------ RoPE, in place
 * x: [T, num_heads, head_dim] with strides (token_stride, head_stride, 1);
 * cos, sin: [T, head_dim / 2] contiguous. rotate_half layout (GPT-NeoX / HF):
 *   x1' = dt(dt(x1 c) - dt(x2 s)),  x2' = dt(dt(x2 c) + dt(x1 s))
 */
int rotary_emb(int dtype, void *x, int64_t num_tokens, int64_t num_heads, int64_t head_dim,
               int64_t token_stride, int64_t head_stride, const void *cos, const void *sin) {
    if (head_dim % 2 || head_dim > 4096) return -1;
    int64_t half = head_dim / 2;
    size_t es = elem_size(dtype);
    float c[2048], s[2048], a[2048], b[2048];
    for (int64_t t = 0; t < num_tokens; t++) {
        load_row(dtype, c, (const char *)cos + t * half * es, half);
        load_row(dtype, s, (const char *)sin + t * half * es, half);
        for (int64_t h = 0; h < num_heads; h++) {
            char *base = (char *)x + (t * token_stride + h * head_stride) * es;
            load_row(dtype, a, base, half);
            load_row(dtype, b, base + half * es, half);
#pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                float x1 = a[i], x2 = b[i];
                a[i] = round_dt(dtype, round_dt(dtype, x1 * c[i]) - round_dt(dtype, x2 * s[i]));
                b[i] = round_dt(dtype, round_dt(dtype, x2 * c[i]) + round_dt(dtype, x1 * s[i]));
            }
            store_row(dtype, base, a, half);
            store_row(dtype, base + half * es, b, half);
        }
    }
    return 0;
}

/* ------------------------------------------------------------------ KV cache write
 * key, value: [T, row] rows (row = num_kv_heads * head_dim contiguous) with strides;
 * caches: [num_slots, row]. Slot -1 skips a token (padding).
 */
int write_kv(int dtype, void *key_cache, void *value_cache, int64_t num_slots, const void *key,
             int64_t key_stride, const void *value, int64_t value_stride,
             const int64_t *slot_mapping, int64_t num_tokens, int64_t row) {
    size_t es = elem_size(dtype);
    for (int64_t t = 0; t < num_tokens; t++)
        if (slot_mapping[t] >= num_slots || slot_mapping[t] < -1) return -3;
    for (int64_t t = 0; t < num_tokens; t++) {
        int64_t slot = slot_mapping[t];
        if (slot < 0) continue;
        memcpy((char *)key_cache + slot * row * es, (const char *)key + t * key_stride * es,
               (size_t)row * es);
        memcpy((char *)value_cache + slot * row * es,
               (const char *)value + t * value_stride * es, (size_t)row * es);
    }
    return 0;
}

/* ------------------------------------------------------------------ SwiGLU
 * x: [T, 2 d] = [gate | up] -> out [T, d] = dt(dt(silu(gate)) * up), silu in float32.
 * expf: Cephes-style range reduction + degree-6 polynomial (about 1 ulp), branch-free
 * so that the loop vectorizes.
 */
static inline float exp_approx(float x) {
    x = x < -87.3f ? -87.3f : (x > 88.7f ? 88.7f : x);  /* (fminf/fmaxf block vectorizing) */
    /* n = round(x / ln 2) by the 1.5 * 2^23 trick (floorf blocks vectorizing) */
    float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    float r = x - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    bits32 scale;
    scale.i = ((int32_t)n + 127) << 23;
    return p * scale.f;
}

int silu_and_mul(int dtype, void *out, const void *x, int64_t num_tokens, int64_t d) {
    size_t es = elem_size(dtype);
    int status = 0;
#pragma omp parallel num_threads(row_threads(num_tokens * d)) if (num_tokens * d >= ROW_PARALLEL_MIN)
    {
    float *buf = malloc((size_t)d * 2 * sizeof(float));
    float *g = buf, *u = buf + d;
    if (!buf) status = -2;
#pragma omp for
    for (int64_t t = 0; t < num_tokens; t++) {
        if (!buf) continue;
        const char *row = (const char *)x + t * 2 * d * es;
        load_row(dtype, g, row, d);
        load_row(dtype, u, row + d * es, d);
        if (dtype == DT_BF16) {
#pragma omp simd
            for (int64_t i = 0; i < d; i++) {
                float silu = bf16_round(g[i] / (1.0f + exp_approx(-g[i])));
                g[i] = bf16_round(silu * u[i]);
            }
        } else {
#pragma omp simd
            for (int64_t i = 0; i < d; i++) g[i] = g[i] / (1.0f + exp_approx(-g[i])) * u[i];
        }
        store_row(dtype, (char *)out + t * d * es, g, d);
    }
    free(buf);
    }
    return status;
}

/* ------------------------------------------------------------------ paged decode attention
 * split-K over fixed spans of each sequence's positions (cpu_kernels_attn.c) */
#include "cpu_kernels_attn.c"

/* ------------------------------------------------------------------ Q8_0 matmul
 * y[m, n] = sum_b d[n, b] * sum_{i < 32} q[n, 32 b + i] * x[m, 32 b + i]   (GGUF Q8_0)
 *   x      [M, K] (row stride x_stride), the storage dtype
 *   codes  [N, K] int8 contiguous; scales [N, K / 32] float32 (the fp16 d, exact)
 *   out    [M, N] the storage dtype (rounded once, from a float32 sum)
 * Every product q * x is exact in float32, so the only roundings are the float32 sums
 * and the output's. Rows of W are split over OpenMP threads; each block of 32 codes is
 * read once for all M rows (M <= 16).
 */
#define PREFETCH_ROWS 4

int q8_0_matmul(int dtype, void *out, const void *x, int64_t x_stride, const int8_t *codes,
                const float *scales, int64_t M, int64_t N, int64_t K, int num_threads) {
    if (K % 32 || M < 1 || M > 16 || N < 1) return -1;
    const int64_t nb = K / 32;
    const size_t es = elem_size(dtype);
    float *xf = malloc((size_t)(M * K) * sizeof(float));
    if (!xf) return -2;
    for (int64_t m = 0; m < M; m++) load_row(dtype, xf + m * K, (const char *)x + m * x_stride * es, K);
    int nt = num_threads < 1 ? 1 : num_threads;
    (void)nt;  /* (unused without OpenMP) */
#pragma omp parallel for schedule(static) num_threads(nt) if (nt > 1 && N * K >= 65536)
    for (int64_t n = 0; n < N; n++) {
        const int8_t *q = codes + n * K;
        const float *d = scales + n * nb;
        float y[16];
#if defined(__AVX512F__)
        __m512 acc[16];
        for (int64_t m = 0; m < M; m++) acc[m] = _mm512_setzero_ps();
        /* prefetch the codes PREFETCH_ROWS rows ahead: the hardware prefetcher alone
         * left ~10-20% of the bandwidth unused (49152 x 576 at batch 1: 1.41 -> 1.25-1.35 ms) */
        if (n + PREFETCH_ROWS < N)
            for (int64_t off = 0; off < K; off += 64)
                _mm_prefetch((const char *)(q + PREFETCH_ROWS * K + off), _MM_HINT_T0);
        for (int64_t b = 0; b < nb; b++) {
            __m512 w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                _mm_loadu_si128((const __m128i *)(q + 32 * b))));
            __m512 w1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                _mm_loadu_si128((const __m128i *)(q + 32 * b + 16))));
            __m512 db = _mm512_set1_ps(d[b]);
            for (int64_t m = 0; m < M; m++) {
                const float *xm = xf + m * K + 32 * b;
                __m512 part = _mm512_mul_ps(w0, _mm512_loadu_ps(xm));
                part = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xm + 16), part);
                acc[m] = _mm512_fmadd_ps(part, db, acc[m]);
            }
        }
        for (int64_t m = 0; m < M; m++) y[m] = _mm512_reduce_add_ps(acc[m]);
#else
        for (int64_t m = 0; m < M; m++) {
            float lanes[LANES] = {0};
            for (int64_t b = 0; b < nb; b++) {
                float part[LANES] = {0};
                const float *xm = xf + m * K + 32 * b;
                for (int h = 0; h < 2; h++)
                    for (int l = 0; l < LANES; l++)
                        part[l] += (float)q[32 * b + 16 * h + l] * xm[16 * h + l];
                for (int l = 0; l < LANES; l++) lanes[l] += part[l] * d[b];
            }
            y[m] = tree16(lanes);
        }
#endif
        for (int64_t m = 0; m < M; m++) store(dtype, out, m * N + n, y[m]);
    }
    free(xf);
    return 0;
}

/* ---- GGUF block matmul: y = x W^T straight from the file's blocks ----------------------
 *
 * W [N, K] is N rows of K / QB blocks (ggml-common.h layouts, little-endian). Each block
 * is decoded to int8 codes q and, per 16 weights, a float32 scale s and offset o, such
 * that the weight is  w = q * s - o  computed in that order (one product, one difference,
 * each rounded once): exactly the gguf.quants reference formula in float32, since every
 * product of fp16 scales and small integers below is exact in float32.
 *
 *   Q5_0  22 B / 32: | d | qh u32 | qs[16] |        q = (nib | bit << 4) - 16, s = d, o = 0
 *   Q8_0  34 B / 32: | d | q[32] int8 |              s = d, o = 0
 *   Q4_K 144 B / 256: | d | dmin | sc[12] | qs[128] |         8 groups of 32:
 *                     s = d * sc_j, o = dmin * m_j (6-bit sc_j, m_j packed in sc[12])
 *   Q5_K 176 B / 256: | d | dmin | sc[12] | qh[32] | qs[128] | as Q4_K, + bit j of qh[l]
 *   Q6_K 210 B / 256: | ql[128] | qh[64] | sc[16] int8 | d |  16 groups of 16, s = d * sc,
 *                     q = (nibble | 2 bits << 4) - 32
 * d, dmin: fp16. Q4_K/Q5_K group j of 32 reads qs[32 (j / 2) + l], low nibble for even j.
 */
#define GGML_Q5_0 6
#define GGML_Q8_0 8
#define GGML_Q4_K 12
#define GGML_Q5_K 13
#define GGML_Q6_K 14

static inline float fp16_to_f32(const uint8_t *p) {
    uint16_t h = (uint16_t)(p[0] | (p[1] << 8));
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ffu;
    bits32 b;
    if (exp == 0x1f) {
        b.u = sign | 0x7f800000u | (man << 13);
    } else if (exp) {
        b.u = sign | ((exp + 112) << 23) | (man << 13);
    } else {  /* zero or subnormal: man * 2^-24, exact */
        b.f = (float)man * 5.9604644775390625e-08f;
        b.u |= sign;
    }
    return b.f;
#endif
}

/* weights and bytes per block; 0 for a type this kernel does not know */
static inline int gguf_block_weights(int qtype) {
    return qtype == GGML_Q5_0 || qtype == GGML_Q8_0 ? 32 :
           qtype == GGML_Q4_K || qtype == GGML_Q5_K || qtype == GGML_Q6_K ? 256 : 0;
}

static inline int gguf_block_bytes(int qtype) {
    switch (qtype) {
    case GGML_Q5_0: return 22;
    case GGML_Q8_0: return 34;
    case GGML_Q4_K: return 144;
    case GGML_Q5_K: return 176;
    case GGML_Q6_K: return 210;
    default: return 0;
    }
}

static inline void k_scale_min(const uint8_t *sc, int j, int *s, int *m) {
    if (j < 4) {
        *s = sc[j] & 63;
        *m = sc[j + 4] & 63;
    } else {
        *s = (sc[j + 4] & 0xF) | ((sc[j - 4] >> 6) << 4);
        *m = (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4);
    }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define GGUF_SIMD_DECODE 1
static inline __m256i ld256(const uint8_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
static inline void st256(int8_t *p, __m256i v) { _mm256_store_si256((__m256i *)p, v); }
/* per byte: (v >> k) & mask (a 16-bit shift, then a byte mask drops the neighbour's bits) */
static inline __m256i bits8(__m256i v, int k, int mask) {
    return _mm256_and_si256(_mm256_srli_epi16(v, k), _mm256_set1_epi8((char)mask));
}
#endif

/* one block -> q[QB] int8 (64-byte aligned), s[QB / 16], o[QB / 16] */
static inline __attribute__((always_inline)) void gguf_decode_block(
        const int qtype, const uint8_t *restrict b, int8_t *restrict q, float *restrict s,
        float *restrict o) {
    if (qtype == GGML_Q8_0) {
        float d = fp16_to_f32(b);
        memcpy(q, b + 2, 32);
        s[0] = s[1] = d;
        o[0] = o[1] = 0.0f;
    } else if (qtype == GGML_Q5_0) {
        float d = fp16_to_f32(b);
        uint32_t qh = (uint32_t)b[2] | ((uint32_t)b[3] << 8) | ((uint32_t)b[4] << 16) |
                      ((uint32_t)b[5] << 24);
        const uint8_t *qs = b + 6;
#ifdef GGUF_SIMD_DECODE
        __m128i v = _mm_loadu_si128((const __m128i *)qs), m4 = _mm_set1_epi8(0xF);
        __m256i nib = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m4),
                                       _mm_and_si128(v, m4));
        __m256i hi = _mm256_maskz_mov_epi8((__mmask32)qh, _mm256_set1_epi8(16));
        st256(q, _mm256_sub_epi8(_mm256_or_si256(nib, hi), _mm256_set1_epi8(16)));
#else
        for (int l = 0; l < 16; l++) {
            q[l] = (int8_t)(((qs[l] & 0xF) | (((qh >> l) & 1) << 4)) - 16);
            q[l + 16] = (int8_t)(((qs[l] >> 4) | (((qh >> (l + 16)) & 1) << 4)) - 16);
        }
#endif
        s[0] = s[1] = d;
        o[0] = o[1] = 0.0f;
    } else if (qtype == GGML_Q4_K || qtype == GGML_Q5_K) {
        float d = fp16_to_f32(b), dmin = fp16_to_f32(b + 2);
        const uint8_t *sc = b + 4;
        const uint8_t *qh = b + 16;
        const uint8_t *qs = qtype == GGML_Q4_K ? b + 16 : b + 48;
#ifdef GGUF_SIMD_DECODE
        __m256i h = qtype == GGML_Q5_K ? ld256(qh) : _mm256_setzero_si256();
        for (int c = 0; c < 4; c++) {  /* 32 bytes of qs -> groups 2c (low) and 2c + 1 (high) */
            __m256i v = ld256(qs + 32 * c);
            __m256i lo = bits8(v, 0, 0xF), hi = bits8(v, 4, 0xF);
            if (qtype == GGML_Q5_K) {
                lo = _mm256_or_si256(lo, _mm256_slli_epi16(bits8(h, 2 * c, 1), 4));
                hi = _mm256_or_si256(hi, _mm256_slli_epi16(bits8(h, 2 * c + 1, 1), 4));
            }
            st256(q + 64 * c, lo);
            st256(q + 64 * c + 32, hi);
        }
#else
        for (int c = 0; c < 4; c++) {
            const uint8_t *p = qs + 32 * c;
            int8_t *lo = q + 64 * c, *hi = q + 64 * c + 32;
            for (int l = 0; l < 32; l++) {
                int hb = qtype == GGML_Q5_K ? qh[l] : 0;
                lo[l] = (int8_t)((p[l] & 0xF) | (((hb >> (2 * c)) & 1) << 4));
                hi[l] = (int8_t)((p[l] >> 4) | (((hb >> (2 * c + 1)) & 1) << 4));
            }
        }
#endif
        for (int j = 0; j < 8; j++) {
            int sj, mj;
            k_scale_min(sc, j, &sj, &mj);
            s[2 * j] = s[2 * j + 1] = d * (float)sj;
            o[2 * j] = o[2 * j + 1] = dmin * (float)mj;
        }
    } else {  /* Q6_K */
        const uint8_t *ql = b, *qh = b + 128;
        const int8_t *sc = (const int8_t *)(b + 192);
        float d = fp16_to_f32(b + 208);
        for (int h = 0; h < 2; h++) {
            const uint8_t *pl = ql + 64 * h, *ph = qh + 32 * h;
            int8_t *y = q + 128 * h;
#ifdef GGUF_SIMD_DECODE
            __m256i l0 = ld256(pl), l1 = ld256(pl + 32), hh = ld256(ph), c32 = _mm256_set1_epi8(32);
#define Q6(L, SH, K) _mm256_sub_epi8(_mm256_or_si256(bits8(L, SH, 0xF), \
                     _mm256_slli_epi16(bits8(hh, K, 3), 4)), c32)
            st256(y, Q6(l0, 0, 0));
            st256(y + 32, Q6(l1, 0, 2));
            st256(y + 64, Q6(l0, 4, 4));
            st256(y + 96, Q6(l1, 4, 6));
#undef Q6
#else
            for (int l = 0; l < 32; l++) {
                y[l] = (int8_t)(((pl[l] & 0xF) | (((ph[l] >> 0) & 3) << 4)) - 32);
                y[l + 32] = (int8_t)(((pl[l + 32] & 0xF) | (((ph[l] >> 2) & 3) << 4)) - 32);
                y[l + 64] = (int8_t)(((pl[l] >> 4) | (((ph[l] >> 4) & 3) << 4)) - 32);
                y[l + 96] = (int8_t)(((pl[l + 32] >> 4) | (((ph[l] >> 6) & 3) << 4)) - 32);
            }
#endif
        }
        for (int g = 0; g < 16; g++) {
            s[g] = d * (float)sc[g];
            o[g] = 0.0f;
        }
    }
}

/* the weights of one row, formed in float32 (w = q * s - o) 16 at a time */
#if defined(__AVX512F__)
static inline __m512 gguf_weights16(const int8_t *q, float s, float o, const int has_o) {
    __m512 w = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
        _mm_load_si128((const __m128i *)q))), _mm512_set1_ps(s));
    return has_o ? _mm512_sub_ps(w, _mm512_set1_ps(o)) : w;
}

/* MM (a constant) rows of x against one decoded row; two accumulators per x row
 * (even / odd groups) keep the FMA chains short and in registers */
static inline __attribute__((always_inline)) void gguf_tile(
        const int MM, const int has_o, const int8_t *restrict q, const float *restrict s,
        const float *restrict o, int64_t ng, const float *restrict xf, int64_t K,
        float *restrict y) {
    __m512 acc[4][2];
    for (int m = 0; m < MM; m++) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
    int64_t g = 0;
    for (; g + 2 <= ng; g += 2) {
        __m512 w0 = gguf_weights16(q + 16 * g, s[g], o[g], has_o);
        __m512 w1 = gguf_weights16(q + 16 * g + 16, s[g + 1], o[g + 1], has_o);
        for (int m = 0; m < MM; m++) {
            acc[m][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xf + m * K + 16 * g), acc[m][0]);
            acc[m][1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xf + m * K + 16 * g + 16), acc[m][1]);
        }
    }
    for (; g < ng; g++) {
        __m512 w0 = gguf_weights16(q + 16 * g, s[g], o[g], has_o);
        for (int m = 0; m < MM; m++)
            acc[m][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xf + m * K + 16 * g), acc[m][0]);
    }
    for (int m = 0; m < MM; m++) y[m] = _mm512_reduce_add_ps(_mm512_add_ps(acc[m][0], acc[m][1]));
}
#endif

/* one row n: y[m] = sum_k x[m, k] w[n, k] for m < M (qtype a constant after inlining).
 * The row is decoded once into qbuf [K] int8 and sbuf, obuf [K / 16], then multiplied
 * by the x rows four at a time. */
static inline __attribute__((always_inline)) void gguf_row(
        const int qtype, const uint8_t *restrict row, int64_t nb, const float *restrict xf,
        int64_t M, int64_t K, int8_t *restrict qbuf, float *restrict sbuf,
        float *restrict obuf, float *restrict y) {
    const int qb = qtype == GGML_Q5_0 || qtype == GGML_Q8_0 ? 32 : 256;
    const int bb = gguf_block_bytes(qtype);
    const int has_o = qtype == GGML_Q4_K || qtype == GGML_Q5_K;
    for (int64_t b = 0; b < nb; b++)
        gguf_decode_block(qtype, row + b * bb, qbuf + b * qb, sbuf + b * (qb / 16),
                          obuf + b * (qb / 16));
    const int64_t ng = K / 16;
#if defined(__AVX512F__)
    for (int64_t m0 = 0; m0 < M; m0 += 4) {
        const float *xm = xf + m0 * K;
        switch (M - m0 >= 4 ? 4 : M - m0) {
        case 1: gguf_tile(1, has_o, qbuf, sbuf, obuf, ng, xm, K, y + m0); break;
        case 2: gguf_tile(2, has_o, qbuf, sbuf, obuf, ng, xm, K, y + m0); break;
        case 3: gguf_tile(3, has_o, qbuf, sbuf, obuf, ng, xm, K, y + m0); break;
        default: gguf_tile(4, has_o, qbuf, sbuf, obuf, ng, xm, K, y + m0); break;
        }
    }
#else
    for (int64_t m = 0; m < M; m++) {
        float lanes[LANES] = {0};
        for (int64_t g = 0; g < ng; g++) {
            const float *xk = xf + m * K + 16 * g;
            for (int l = 0; l < LANES; l++)
                lanes[l] += ((float)qbuf[16 * g + l] * sbuf[g] - obuf[g]) * xk[l];
        }
        y[m] = tree16(lanes);
    }
#endif
}

#if defined(__AVX512BF16__) && defined(GGUF_SIMD_DECODE)
#define GGUF_BF16_DOT 1
/* bfloat16 activations: the codes become exact bfloat16 integers by a table lookup and
 * meet x in VDPBF16PS (exact products, float32 sums); per 32 weights one partial sum
 * [16 lanes], scaled by its group's s (Q6_K: lanes 0-7 and 8-15 are two groups of 16).
 * Q4_K / Q5_K offsets: sum_j o_j * (sum of x over group j), subtracted at the end.
 * One-hot x still returns each weight as round(q s - o): the reference value. */
typedef struct {
    __m512i lo, hi;  /* bf16 of the code's value, codes 0..31 and 32..63 */
} gguf_table;

static inline gguf_table gguf_make_table(int qtype) {
    uint16_t t[64] __attribute__((aligned(64)));
    int bias = qtype == GGML_Q6_K ? 32 : qtype == GGML_Q5_0 ? 16 : 0;
    for (int i = 0; i < 64; i++) t[i] = f32_to_bf16((float)(i - bias));
    gguf_table r = {_mm512_load_si512(t), _mm512_load_si512(t + 32)};
    return r;
}

static inline __m512bh gguf_lookup(const int qtype, gguf_table t, __m256i codes) {
    __m512i idx = _mm512_cvtepu8_epi16(codes);
    __m512i w = qtype == GGML_Q6_K ? _mm512_permutex2var_epi16(t.lo, idx, t.hi)
                                   : _mm512_permutexvar_epi16(idx, t.lo);
    return (__m512bh)w;
}

/* MM (constant) bf16 x rows (row stride xs elements) against one row of blocks */
static inline __attribute__((always_inline)) void gguf_row_bf16_tile(
        const int qtype, const int MM, gguf_table tab, const uint8_t *restrict row, int64_t nb,
        const uint16_t *restrict x, int64_t xs, const float *restrict xsum, int64_t ngs,
        float *restrict y) {
    const int bb = gguf_block_bytes(qtype), qb = gguf_block_weights(qtype);
    __m512 acc[4][2];  /* even / odd chunks: two short FMA chains per x row */
    float omin[4] = {0, 0, 0, 0};
    for (int m = 0; m < MM; m++) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
    const __m256i m4 = _mm256_set1_epi8(0xF);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = row + b * bb;
        const uint16_t *xb = x + b * qb;
#define DOT(CHUNK, WV, SV)                                                                   \
    for (int m = 0; m < MM; m++) {                                                         \
        __m512bh xv = (__m512bh)_mm512_loadu_si512(xb + m * xs + 32 * (CHUNK));            \
        acc[m][(CHUNK) & 1] = _mm512_fmadd_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), WV, xv), \
                                              SV, acc[m][(CHUNK) & 1]);                   \
    }
        if (qtype == GGML_Q5_0) {
            uint32_t qh = (uint32_t)blk[2] | ((uint32_t)blk[3] << 8) | ((uint32_t)blk[4] << 16) |
                          ((uint32_t)blk[5] << 24);
            __m128i v = _mm_loadu_si128((const __m128i *)(blk + 6)), n4 = _mm_set1_epi8(0xF);
            __m256i codes = _mm256_or_si256(
                _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), n4), _mm_and_si128(v, n4)),
                _mm256_maskz_mov_epi8((__mmask32)qh, _mm256_set1_epi8(16)));
            __m512bh wv = gguf_lookup(qtype, tab, codes);
            __m512 sv = _mm512_set1_ps(fp16_to_f32(blk));
            DOT(0, wv, sv)
        } else if (qtype == GGML_Q4_K || qtype == GGML_Q5_K) {
            float d = fp16_to_f32(blk), dmin = fp16_to_f32(blk + 2);
            const uint8_t *sc = blk + 4, *qs = blk + (qtype == GGML_Q4_K ? 16 : 48);
            __m256i h = qtype == GGML_Q5_K ? ld256(blk + 16) : _mm256_setzero_si256();
            for (int j = 0; j < 8; j++) {
                __m256i v = ld256(qs + 32 * (j / 2));
                __m256i codes = j % 2 ? bits8(v, 4, 0xF) : _mm256_and_si256(v, m4);
                if (qtype == GGML_Q5_K)
                    codes = _mm256_or_si256(codes, _mm256_slli_epi16(bits8(h, j, 1), 4));
                int sj, mj;
                k_scale_min(sc, j, &sj, &mj);
                __m512bh wv = gguf_lookup(qtype, tab, codes);
                __m512 sv = _mm512_set1_ps(d * (float)sj);
                DOT(j, wv, sv)
                float o = dmin * (float)mj;
                for (int m = 0; m < MM; m++) omin[m] += o * xsum[m * ngs + b * 8 + j];
            }
        } else {  /* Q6_K */
            /* the 16 group scales d * sc_g, exact; chunk c uses groups 2c, 2c + 1 */
            __m512 svec = _mm512_mul_ps(_mm512_set1_ps(fp16_to_f32(blk + 208)),
                _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 192)))));
            const __m512i pair = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
            for (int hf = 0; hf < 2; hf++) {
                __m256i l0 = ld256(blk + 64 * hf), l1 = ld256(blk + 64 * hf + 32);
                __m256i hh = ld256(blk + 128 + 32 * hf);
                __m256i c4[4] = {
                    _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_slli_epi16(bits8(hh, 0, 3), 4)),
                    _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_slli_epi16(bits8(hh, 2, 3), 4)),
                    _mm256_or_si256(bits8(l0, 4, 0xF), _mm256_slli_epi16(bits8(hh, 4, 3), 4)),
                    _mm256_or_si256(bits8(l1, 4, 0xF), _mm256_slli_epi16(bits8(hh, 6, 3), 4))};
                for (int c = 0; c < 4; c++) {
                    int g = 8 * hf + 2 * c;  /* groups g (lanes 0-7) and g + 1 (lanes 8-15) */
                    __m512 sv = _mm512_permutexvar_ps(
                        _mm512_add_epi32(pair, _mm512_set1_epi32(g)), svec);
                    __m512bh wv = gguf_lookup(qtype, tab, c4[c]);
                    DOT(4 * hf + c, wv, sv)
                }
            }
        }
#undef DOT
    }
    for (int m = 0; m < MM; m++)
        y[m] = _mm512_reduce_add_ps(_mm512_add_ps(acc[m][0], acc[m][1])) - omin[m];
}

static inline __attribute__((always_inline)) void gguf_row_bf16(
        const int qtype, gguf_table tab, const uint8_t *restrict row, int64_t nb,
        const uint16_t *restrict x, int64_t xs, const float *restrict xsum, int64_t M,
        int64_t ngs, float *restrict y) {
    for (int64_t m0 = 0; m0 < M; m0 += 4) {
        const uint16_t *xm = x + m0 * xs;
        const float *sm = xsum + m0 * ngs;
        switch (M - m0 >= 4 ? 4 : M - m0) {
        case 1: gguf_row_bf16_tile(qtype, 1, tab, row, nb, xm, xs, sm, ngs, y + m0); break;
        case 2: gguf_row_bf16_tile(qtype, 2, tab, row, nb, xm, xs, sm, ngs, y + m0); break;
        case 3: gguf_row_bf16_tile(qtype, 3, tab, row, nb, xm, xs, sm, ngs, y + m0); break;
        default: gguf_row_bf16_tile(qtype, 4, tab, row, nb, xm, xs, sm, ngs, y + m0); break;
        }
    }
}

static int gguf_matmul_bf16(int qtype, uint16_t *out, int64_t out_stride, const uint16_t *x,
                            int64_t x_stride, const uint8_t *w, int64_t M, int64_t N, int64_t K,
                            int nt) {
    const int qb = gguf_block_weights(qtype), bb = gguf_block_bytes(qtype);
    const int64_t nb = K / qb, row_bytes = nb * bb, ngs = K / 32;
    float *xsum = malloc((size_t)(M * ngs) * sizeof(float));  /* sum of x per 32 weights */
    if (!xsum) return -2;
    for (int64_t m = 0; m < M; m++)
        for (int64_t g = 0; g < ngs; g++) {
            float part[LANES] = {0};
            for (int l = 0; l < 32; l++) part[l % LANES] += bf16_to_f32(x[m * x_stride + 32 * g + l]);
            xsum[m * ngs + g] = tree16(part);
        }
    const gguf_table tab = gguf_make_table(qtype);
    (void)nt;
#pragma omp parallel for schedule(static) num_threads(nt) if (nt > 1 && N * K >= 65536)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *row = w + n * row_bytes;
        float y[16];
        if (n + PREFETCH_ROWS < N)
            for (int64_t off = 0; off < row_bytes; off += 64)
                __builtin_prefetch(row + PREFETCH_ROWS * row_bytes + off, 0, 3);
        switch (qtype) {
        case GGML_Q5_0: gguf_row_bf16(GGML_Q5_0, tab, row, nb, x, x_stride, xsum, M, ngs, y); break;
        case GGML_Q4_K: gguf_row_bf16(GGML_Q4_K, tab, row, nb, x, x_stride, xsum, M, ngs, y); break;
        case GGML_Q5_K: gguf_row_bf16(GGML_Q5_K, tab, row, nb, x, x_stride, xsum, M, ngs, y); break;
        default: gguf_row_bf16(GGML_Q6_K, tab, row, nb, x, x_stride, xsum, M, ngs, y); break;
        }
        for (int64_t m = 0; m < M; m++) out[m * out_stride + n] = f32_to_bf16(y[m]);
    }
    free(xsum);
    return 0;
}
#endif

/* out[m, n] (row stride out_stride elements) = sum_k x[m, k] w[n, k], float32 FMAs.
 * M in 1..16 (callers split larger batches), K a multiple of the block size. */
int gguf_matmul(int qtype, int dtype, void *out, int64_t out_stride, const void *x,
                int64_t x_stride, const uint8_t *w, int64_t M, int64_t N, int64_t K,
                int num_threads) {
    const int qb = gguf_block_weights(qtype), bb = gguf_block_bytes(qtype);
    if (!qb || K % qb || M < 1 || M > 16 || N < 1 || out_stride < N) return -1;
    const int64_t nb = K / qb, row_bytes = nb * bb;
    const size_t es = elem_size(dtype);
    int nt = num_threads < 1 ? 1 : num_threads;
    (void)nt;
#ifdef GGUF_BF16_DOT
    if (dtype == DT_BF16 && qtype != GGML_Q8_0)
        return gguf_matmul_bf16(qtype, (uint16_t *)out, out_stride, (const uint16_t *)x, x_stride,
                                w, M, N, K, nt);
#endif
    float *xf = malloc((size_t)(M * K) * sizeof(float));
    if (!xf) return -2;
    for (int64_t m = 0; m < M; m++) load_row(dtype, xf + m * K, (const char *)x + m * x_stride * es, K);
    int failed = 0;
#pragma omp parallel num_threads(nt) if (nt > 1 && N * K >= 65536)
    {
        /* one decoded row per thread: int8 codes [K] (64-byte aligned), scales, offsets */
        size_t nbuf = (size_t)(K + 64) + 2 * (size_t)(K / 16 + 16) * sizeof(float);
        char *buf = aligned_alloc(64, (nbuf + 63) / 64 * 64);  /* a multiple of the alignment */
        if (!buf) {
#pragma omp atomic write
            failed = 1;
        } else {
            int8_t *qbuf = (int8_t *)buf;
            float *sbuf = (float *)(buf + K + 64 - K % 64), *obuf = sbuf + K / 16 + 16;
#pragma omp for schedule(static)
            for (int64_t n = 0; n < N; n++) {
                const uint8_t *row = w + n * row_bytes;
                float y[16];
                if (n + PREFETCH_ROWS < N)
                    for (int64_t off = 0; off < row_bytes; off += 64)
                        __builtin_prefetch(row + PREFETCH_ROWS * row_bytes + off, 0, 3);
                switch (qtype) {
#define ROW(T) gguf_row(T, row, nb, xf, M, K, qbuf, sbuf, obuf, y); break
                case GGML_Q5_0: ROW(GGML_Q5_0);
                case GGML_Q8_0: ROW(GGML_Q8_0);
                case GGML_Q4_K: ROW(GGML_Q4_K);
                case GGML_Q5_K: ROW(GGML_Q5_K);
                default: ROW(GGML_Q6_K);
#undef ROW
                }
                for (int64_t m = 0; m < M; m++) store(dtype, out, m * out_stride + n, y[m]);
            }
            free(buf);
        }
    }
    free(xf);
    return failed ? -2 : 0;
}

/* quantized KV cache pages: write_kv_quant, paged_attention_decode_quant */
#include "cpu_kernels_kvq.c"

/* per-channel int8 keys (KIVI): write_kv_quant_kc, paged_{attention_decode,prefill}_quant_kc */
#include "cpu_kernels_kvc.c"

/* GGUF Q4_K / Q6_K x Q8_K int8-activation matmul (VNNI) for decode rows */
#include "cpu_kernels_vnni.c"

/* the same arithmetic on Q4_K / Q6_K repacked 16 rows to a tile (decode rows) */
#include "cpu_kernels_x16.c"
