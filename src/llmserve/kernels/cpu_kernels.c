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
#include <pthread.h>
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
    for (int64_t t = i; t < n; t++) part[t - i] += a[t] * b[t];
    return tree16(part);
}

static inline float sum_f32(const float *restrict a, int64_t n) {
    float part[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int l = 0; l < LANES; l++) part[l] += a[i + l];
    for (int64_t t = i; t < n; t++) part[t - i] += a[t];
    return tree16(part);
}

static inline float max_f32(const float *restrict a, int64_t n) {
    float part[LANES];
    for (int l = 0; l < LANES; l++) part[l] = -INFINITY;
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int l = 0; l < LANES; l++) part[l] = a[i + l] > part[l] ? a[i + l] : part[l];
    for (int64_t t = i; t < n; t++) part[t - i] = a[t] > part[t - i] ? a[t] : part[t - i];
    for (int w = LANES / 2; w > 0; w >>= 1)
        for (int l = 0; l < w; l++) part[l] = part[l + w] > part[l] ? part[l + w] : part[l];
    return part[0];
}

static inline size_t elem_size(int dtype) { return dtype == DT_BF16 ? 2 : 4; }

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
    float *row = malloc((size_t)hidden * 2 * sizeof(float));
    if (!row) return -2;
    float *w = row + hidden;
    load_row(dtype, w, weight, hidden);
    for (int64_t t = 0; t < num_tokens; t++) {
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
    return 0;
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
    float *buf = malloc((size_t)d * 2 * sizeof(float));
    if (!buf) return -2;
    float *g = buf, *u = buf + d;
    for (int64_t t = 0; t < num_tokens; t++) {
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
    return 0;
}

/* ------------------------------------------------------------------ paged decode attention
 * One query token per sequence (PagedAttention, Kwon et al. 2023, decode phase).
 *   query  [num_seqs, num_heads, head_dim], row stride q_stride (heads contiguous)
 *   caches [num_blocks, block_size, num_kv_heads, head_dim] contiguous
 *   block_table [num_seqs, bt_stride] int64; seq_lens [num_seqs] int64 (context incl. the
 *   query token, whose K/V are already in the cache)
 *   out    [num_seqs, num_heads, head_dim] contiguous
 * Query head h reads KV head h / (num_heads / num_kv_heads). window > 0: keys at
 * positions > seq_len - 1 - window only. Scores, softmax and the weighted sum in float32.
 * Work items (sequence, KV head) are split over num_threads pthreads when large.
 */
typedef struct {
    int dtype;
    void *out;
    const void *query;
    const void *key_cache, *value_cache;
    const int64_t *block_table, *seq_lens;
    int64_t num_seqs, num_heads, num_kv_heads, head_dim, block_size, bt_stride, q_stride;
    int64_t window;
    float scale;
    int64_t item_begin, item_end;
    int status;
} attn_args;

/* D and dtype are compile-time constants in the common cases (see attend_item), so the
 * head_dim loops unroll into a few vector instructions. */
static inline __attribute__((always_inline)) void attend_core(
    const attn_args *a, int64_t item, float *scores, float *qbuf, float *kv, float *acc,
    const int64_t D, const int dtype) {
    const size_t es = elem_size(dtype);
    const int64_t G = a->num_heads / a->num_kv_heads, bs = a->block_size;
    const int64_t seq = item / a->num_kv_heads, kvh = item % a->num_kv_heads;
    const int64_t L = a->seq_lens[seq];
    const int64_t start = (a->window > 0 && L > a->window) ? L - a->window : 0;
    const int64_t n = L - start;
    const int64_t *table = a->block_table + seq * a->bt_stride;
    const int64_t row = a->num_kv_heads * D;  /* elements per cache slot */
    const float scale = a->scale;
    for (int64_t g = 0; g < G; g++)
        load_row(dtype, qbuf + g * D,
                 (const char *)a->query + (seq * a->q_stride + (kvh * G + g) * D) * es, D);
    /* scores[g][j] = scale * q_g . k_j */
    int64_t blk = start / bs, off = start % bs;
    for (int64_t j = 0; j < n; j++) {
        int64_t slot = table[blk] * bs + off;
        if (++off == bs) {
            off = 0;
            blk++;
        }
        load_row(dtype, kv, (const char *)a->key_cache + (slot * row + kvh * D) * es, D);
        for (int64_t g = 0; g < G; g++) {
            scores[g * n + j] = dot_f32(qbuf + g * D, kv, D) * scale;
        }
    }
    for (int64_t g = 0; g < G; g++) {
        float *sc = scores + g * n;
        float mx = max_f32(sc, n);
#pragma omp simd
        for (int64_t j = 0; j < n; j++) sc[j] = exp_approx(sc[j] - mx);
        float inv = 1.0f / sum_f32(sc, n);
#pragma omp simd
        for (int64_t j = 0; j < n; j++) sc[j] *= inv;
    }
    for (int64_t i = 0; i < G * D; i++) acc[i] = 0.f;
    blk = start / bs;
    off = start % bs;
    for (int64_t j = 0; j < n; j++) {
        int64_t slot = table[blk] * bs + off;
        if (++off == bs) {
            off = 0;
            blk++;
        }
        load_row(dtype, kv, (const char *)a->value_cache + (slot * row + kvh * D) * es, D);
        for (int64_t g = 0; g < G; g++) {
            float p = scores[g * n + j];
            float *o = acc + g * D;
#pragma omp simd
            for (int64_t d = 0; d < D; d++) o[d] += p * kv[d];
        }
    }
    for (int64_t g = 0; g < G; g++)
        store_row(dtype, (char *)a->out + (seq * a->num_heads + kvh * G + g) * D * es,
                  acc + g * D, D);
}

#if defined(__AVX512F__)
/* 16 float32 lanes from 16 elements of the storage dtype */
static inline __m512 load16(int dtype, const void *p) {
    if (dtype == DT_BF16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
    return _mm512_loadu_ps((const float *)p);
}

/* attend_core with AVX-512 (head_dim a multiple of 16, at most 256): q and the output
 * accumulators stay in registers for each query head of the group. */
static inline __attribute__((always_inline)) void attend_core_avx512(
    const attn_args *a, int64_t item, float *scores, float *qbuf, float *acc,
    const int64_t D, const int dtype) {
    const size_t es = elem_size(dtype);
    const int64_t G = a->num_heads / a->num_kv_heads, bs = a->block_size;
    const int64_t seq = item / a->num_kv_heads, kvh = item % a->num_kv_heads;
    const int64_t L = a->seq_lens[seq];
    const int64_t start = (a->window > 0 && L > a->window) ? L - a->window : 0;
    const int64_t n = L - start;
    const int64_t *table = a->block_table + seq * a->bt_stride;
    const int64_t row = a->num_kv_heads * D;
    const int64_t V = D / 16;
    const float scale = a->scale;
    const char *kbase = (const char *)a->key_cache + kvh * D * es;
    const char *vbase = (const char *)a->value_cache + kvh * D * es;
    for (int64_t g = 0; g < G; g++)
        load_row(dtype, qbuf + g * D,
                 (const char *)a->query + (seq * a->q_stride + (kvh * G + g) * D) * es, D);
    int64_t blk = start / bs, off = start % bs;
    for (int64_t j = 0; j < n; j++) {
        const char *kp = kbase + ((table[blk] * bs + off) * row) * es;
        if (++off == bs) {
            off = 0;
            blk++;
        }
        __m512 k[16];
        for (int64_t v = 0; v < V; v++) k[v] = load16(dtype, kp + v * 16 * es);
        for (int64_t g = 0; g < G; g++) {
            __m512 s = _mm512_mul_ps(_mm512_loadu_ps(qbuf + g * D), k[0]);
            for (int64_t v = 1; v < V; v++)
                s = _mm512_fmadd_ps(_mm512_loadu_ps(qbuf + g * D + v * 16), k[v], s);
            scores[g * n + j] = _mm512_reduce_add_ps(s) * scale;
        }
    }
    for (int64_t g = 0; g < G; g++) {
        float *sc = scores + g * n;
        float mx = max_f32(sc, n);
#pragma omp simd
        for (int64_t j = 0; j < n; j++) sc[j] = exp_approx(sc[j] - mx);
        float inv = 1.0f / sum_f32(sc, n);
#pragma omp simd
        for (int64_t j = 0; j < n; j++) sc[j] *= inv;
    }
    for (int64_t i = 0; i < G * D; i++) acc[i] = 0.f;
    blk = start / bs;
    off = start % bs;
    for (int64_t j = 0; j < n; j++) {
        const char *vp = vbase + ((table[blk] * bs + off) * row) * es;
        if (++off == bs) {
            off = 0;
            blk++;
        }
        __m512 val[16];
        for (int64_t v = 0; v < V; v++) val[v] = load16(dtype, vp + v * 16 * es);
        for (int64_t g = 0; g < G; g++) {
            __m512 p = _mm512_set1_ps(scores[g * n + j]);
            float *o = acc + g * D;
            for (int64_t v = 0; v < V; v++)
                _mm512_storeu_ps(o + v * 16,
                                 _mm512_fmadd_ps(p, val[v], _mm512_loadu_ps(o + v * 16)));
        }
    }
    for (int64_t g = 0; g < G; g++)
        store_row(dtype, (char *)a->out + (seq * a->num_heads + kvh * G + g) * D * es,
                  acc + g * D, D);
}
#endif

static void attend_item(const attn_args *a, int64_t item, float *scores, float *qbuf,
                        float *kv, float *acc) {
    const int64_t D = a->head_dim;
#if defined(__AVX512F__)
    if (a->dtype == DT_BF16 && D == 64)
        return attend_core_avx512(a, item, scores, qbuf, acc, 64, DT_BF16);
    if (a->dtype == DT_BF16 && D == 128)
        return attend_core_avx512(a, item, scores, qbuf, acc, 128, DT_BF16);
    if (D % 16 == 0 && D <= 256)
        return attend_core_avx512(a, item, scores, qbuf, acc, D, a->dtype);
#endif
    if (a->dtype == DT_BF16) {
        if (D == 64)
            attend_core(a, item, scores, qbuf, kv, acc, 64, DT_BF16);
        else if (D == 128)
            attend_core(a, item, scores, qbuf, kv, acc, 128, DT_BF16);
        else
            attend_core(a, item, scores, qbuf, kv, acc, D, DT_BF16);
    } else {
        if (D == 64)
            attend_core(a, item, scores, qbuf, kv, acc, 64, DT_F32);
        else if (D == 128)
            attend_core(a, item, scores, qbuf, kv, acc, 128, DT_F32);
        else
            attend_core(a, item, scores, qbuf, kv, acc, D, DT_F32);
    }
}

static void *attend_range(void *arg) {
    attn_args *a = (attn_args *)arg;
    const int64_t D = a->head_dim, G = a->num_heads / a->num_kv_heads;
    int64_t max_len = 0;
    for (int64_t s = 0; s < a->num_seqs; s++)
        if (a->seq_lens[s] > max_len) max_len = a->seq_lens[s];
    float *buf = malloc(((size_t)(G * max_len) + (size_t)(2 * G * D + D)) * sizeof(float));
    if (!buf) {
        a->status = -2;
        return NULL;
    }
    float *scores = buf, *qbuf = buf + G * max_len, *acc = qbuf + G * D, *kv = acc + G * D;
    for (int64_t item = a->item_begin; item < a->item_end; item++)
        attend_item(a, item, scores, qbuf, kv, acc);
    free(buf);
    a->status = 0;
    return NULL;
}

#define MAX_THREADS 64

int paged_attention_decode(int dtype, void *out, const void *query, int64_t q_stride,
                           const void *key_cache, const void *value_cache, int64_t num_blocks,
                           const int64_t *block_table, int64_t bt_stride,
                           const int64_t *seq_lens, int64_t num_seqs, int64_t num_heads,
                           int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                           float scale, int64_t window, int num_threads) {
    if (num_kv_heads <= 0 || num_heads % num_kv_heads || head_dim <= 0 || block_size <= 0)
        return -1;
    int64_t total = 0;
    for (int64_t s = 0; s < num_seqs; s++) {
        int64_t L = seq_lens[s];
        if (L < 1 || (L + block_size - 1) / block_size > bt_stride) return -4;
        for (int64_t b = 0; b < (L + block_size - 1) / block_size; b++) {
            int64_t blk = block_table[s * bt_stride + b];
            if (blk < 0 || blk >= num_blocks) return -3;
        }
        total += L;
    }
    attn_args base = {dtype, out, query, key_cache, value_cache, block_table, seq_lens,
                      num_seqs, num_heads, num_kv_heads, head_dim, block_size, bt_stride,
                      q_stride, window, scale, 0, 0, 0};
    int64_t items = num_seqs * num_kv_heads;
    /* a thread start costs ~20-50 us: only split work of at least ~1M K/V elements */
    int64_t work = total * num_kv_heads * head_dim;
    int nt = num_threads;
    if (nt > MAX_THREADS) nt = MAX_THREADS;
    if (nt > items) nt = (int)items;
    if (work < (1 << 20) || nt < 2) nt = 1;
    attn_args args[MAX_THREADS];
    pthread_t threads[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    for (int i = 0; i < nt; i++) {
        args[i] = base;
        args[i].item_begin = items * i / nt;
        args[i].item_end = items * (i + 1) / nt;
    }
    for (int i = 1; i < nt; i++)
        started[i] = pthread_create(&threads[i], NULL, attend_range, &args[i]) == 0;
    attend_range(&args[0]);
    int status = args[0].status;
    for (int i = 1; i < nt; i++) {
        if (started[i]) {
            pthread_join(threads[i], NULL);
        } else {
            attend_range(&args[i]);  /* could not start a thread: do it here */
        }
        if (args[i].status) status = args[i].status;
    }
    return status;
}
