/* Paged decode attention with split-K (included by cpu_kernels.c after its helpers:
 * load_row, store_row, dot_f32, max_f32, sum_f32, exp_approx, elem_size).
 *
 * One query token per sequence (PagedAttention, Kwon et al. 2023, decode phase).
 *   query  [num_seqs, num_heads, head_dim], row stride q_stride (heads contiguous)
 *   caches [num_blocks, block_size, num_kv_heads, head_dim] contiguous
 *   block_table [num_seqs, >= bt_width] int64, row stride bt_stride; seq_lens [num_seqs] int64 (context incl. the
 *   query token, whose K/V are already in the cache)
 *   out    [num_seqs, num_heads, head_dim] contiguous
 * Query head h reads KV head h / (num_heads / num_kv_heads). window > 0: keys at
 * positions > seq_len - 1 - window only. Scores, softmax and the weighted sum in float32.
 *
 * Split-K (flash-decoding: Dao, Haziza, Massa, Sizov 2023, "Flash-Decoding for
 * long-context inference"): a sequence's attended positions [start, L) are cut into spans
 * of ATTN_SPLIT_LEN positions, and the spans of all sequences are the work items that the
 * OpenMP threads share, so one long sequence uses every core. Each span computes, per head,
 *
 *   m_i = max score,  l_i = sum_j exp(s_j - m_i),  o_i = sum_j (exp(s_j - m_i) / l_i) v_j
 *
 * and a second pass combines a sequence's spans in span order:
 *
 *   M = max_i m_i,   w_i = l_i exp(m_i - M),   out = (sum_i w_i o_i) / (sum_i w_i)
 *
 *   positions  | span 0: 512 | span 1: 512 | span 2: 512 | span 3: L - 1536 |
 *   threads      t0            t1            t0            t1   (dynamic)
 *
 * The cut depends only on the sequence's own length (never on the batch or the number
 * of threads), so a sequence's output is the same whatever it is batched with: the
 * kernel is batch-invariant. A sequence of one span writes its output directly, exactly
 * as the kernel did before spans existed. The threads are PyTorch's: the library links
 * libgomp by its soname, so in a process that loaded PyTorch it binds to PyTorch's copy
 * and shares its (already spinning) thread pool.
 */
#define ATTN_SPLIT_LEN 512

/* A sequence's cache slots, position by position (no division per position). */
typedef struct {
    const int64_t *table;
    int64_t block_size, blk, off;
} slot_cursor;

static inline slot_cursor slots_from(const int64_t *table, int64_t block_size, int64_t pos) {
    slot_cursor c = {table, block_size, pos / block_size, pos % block_size};
    return c;
}

static inline int64_t next_slot(slot_cursor *c) {
    int64_t slot = c->table[c->blk] * c->block_size + c->off;
    if (++c->off == c->block_size) {
        c->off = 0;
        c->blk++;
    }
    return slot;
}

typedef struct {
    int dtype;
    void *out;
    const void *query;
    const void *key_cache, *value_cache;
    const int64_t *block_table, *seq_lens;
    int64_t num_seqs, num_heads, num_kv_heads, head_dim, block_size, bt_stride, q_stride;
    int64_t window;
    float scale;
    /* block score accumulators (cpu_kernels_attn_scores.c): NULL, or per sequence a
     * float32 array's address (0: not scored) and its length */
    const int64_t *score_ptrs, *score_lens;
} attn_args;

/* One work item: positions [start, start + n) of sequence seq. part: NULL when the span
 * is its sequence's only one (the output is written directly), else the span's
 * [num_heads][2 + head_dim] floats (m, l, o) for the combine pass. blk: a split span of a
 * scored sequence, its per head block sums [num_heads][blocks of the span]; else NULL. */
typedef struct {
    int64_t seq, start, n;
    float *part, *blk;
} attn_span;

/* Per-thread scratch of a span function: scores [H, n], qbuf [H * D], acc [H * D] (the
 * span's o, head after head), kv [D], stats [H][2] (m, l). */
typedef void (*attn_span_fn)(const attn_args *a, int fmt, const attn_span *sp, float *scores,
                             float *qbuf, float *kv, float *acc, float *stats);

/* softmax over n scores in place (float32, max-subtracted); keeps the max and the sum */
static inline void softmax_stats(float *sc, int64_t n, float *stats) {
    float mx = max_f32(sc, n);
#pragma omp simd
    for (int64_t j = 0; j < n; j++) sc[j] = exp_approx(sc[j] - mx);
    float sum = sum_f32(sc, n);
    float inv = 1.0f / sum;
#pragma omp simd
    for (int64_t j = 0; j < n; j++) sc[j] *= inv;
    stats[0] = mx;
    stats[1] = sum;
}

/* D and dtype are compile-time constants in the common cases (see attend_span), so the
 * head_dim loops unroll into a few vector instructions. One KV head's group of queries. */
static inline __attribute__((always_inline)) void attend_core(
    const attn_args *a, const attn_span *sp, int64_t kvh, float *scores, float *qbuf,
    float *kv, float *acc, float *stats, const int64_t D, const int dtype) {
    const size_t es = elem_size(dtype);
    const int64_t G = a->num_heads / a->num_kv_heads, bs = a->block_size, n = sp->n;
    const int64_t *table = a->block_table + sp->seq * a->bt_stride;
    const int64_t row = a->num_kv_heads * D;  /* elements per cache slot */
    const float scale = a->scale;
    acc += kvh * G * D;
    stats += kvh * G * 2;
    scores += kvh * G * n;  /* (all heads' probabilities stay for the block scores) */
    for (int64_t g = 0; g < G; g++)
        load_row(dtype, qbuf + g * D,
                 (const char *)a->query + (sp->seq * a->q_stride + (kvh * G + g) * D) * es, D);
    /* scores[g][j] = scale * q_g . k_j */
    slot_cursor cur = slots_from(table, bs, sp->start);
    for (int64_t j = 0; j < n; j++) {
        int64_t slot = next_slot(&cur);
        load_row(dtype, kv, (const char *)a->key_cache + (slot * row + kvh * D) * es, D);
        for (int64_t g = 0; g < G; g++) {
            scores[g * n + j] = dot_f32(qbuf + g * D, kv, D) * scale;
        }
    }
    for (int64_t g = 0; g < G; g++) softmax_stats(scores + g * n, n, stats + 2 * g);
    for (int64_t i = 0; i < G * D; i++) acc[i] = 0.f;
    cur = slots_from(table, bs, sp->start);
    for (int64_t j = 0; j < n; j++) {
        int64_t slot = next_slot(&cur);
        load_row(dtype, kv, (const char *)a->value_cache + (slot * row + kvh * D) * es, D);
        for (int64_t g = 0; g < G; g++) {
            float p = scores[g * n + j];
            float *o = acc + g * D;
#pragma omp simd
            for (int64_t d = 0; d < D; d++) o[d] += p * kv[d];
        }
    }
}

#if defined(__AVX512F__)
/* 16 float32 lanes from 16 elements of the storage dtype */
static inline __m512 load16(int dtype, const void *p) {
    if (dtype == DT_BF16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
    return _mm512_loadu_ps((const float *)p);
}

/* One span, all heads, with AVX-512 (head_dim a multiple of 16, at most 256): each
 * position's K (then V) slot row [num_kv_heads, head_dim] is read once, sequentially. */
static inline __attribute__((always_inline)) void attend_span_avx512(
    const attn_args *a, const attn_span *sp, float *scores, float *qbuf, float *acc,
    float *stats, const int64_t D, const int dtype) {
    const size_t es = elem_size(dtype);
    const int64_t H = a->num_heads, Hkv = a->num_kv_heads, G = H / Hkv, bs = a->block_size;
    const int64_t n = sp->n;
    const int64_t *table = a->block_table + sp->seq * a->bt_stride;
    const int64_t row = Hkv * D;  /* elements per cache slot */
    const int64_t V = D / 16;
    const float scale = a->scale;
    load_row(dtype, qbuf, (const char *)a->query + sp->seq * a->q_stride * es, H * D);
    slot_cursor cur = slots_from(table, bs, sp->start);
    for (int64_t j = 0; j < n; j++) {
        const char *kp = (const char *)a->key_cache + next_slot(&cur) * row * es;
        for (int64_t kvh = 0; kvh < Hkv; kvh++) {
            __m512 k[16];
            for (int64_t v = 0; v < V; v++) k[v] = load16(dtype, kp + (kvh * D + v * 16) * es);
            for (int64_t g = 0; g < G; g++) {
                const float *q = qbuf + (kvh * G + g) * D;
                __m512 s = _mm512_mul_ps(_mm512_loadu_ps(q), k[0]);
                for (int64_t v = 1; v < V; v++)
                    s = _mm512_fmadd_ps(_mm512_loadu_ps(q + v * 16), k[v], s);
                scores[(kvh * G + g) * n + j] = _mm512_reduce_add_ps(s) * scale;
            }
        }
    }
    for (int64_t h = 0; h < H; h++) softmax_stats(scores + h * n, n, stats + 2 * h);
    for (int64_t i = 0; i < H * D; i++) acc[i] = 0.f;
    cur = slots_from(table, bs, sp->start);
    for (int64_t j = 0; j < n; j++) {
        const char *vp = (const char *)a->value_cache + next_slot(&cur) * row * es;
        for (int64_t kvh = 0; kvh < Hkv; kvh++) {
            __m512 val[16];
            for (int64_t v = 0; v < V; v++)
                val[v] = load16(dtype, vp + (kvh * D + v * 16) * es);
            for (int64_t g = 0; g < G; g++) {
                __m512 p = _mm512_set1_ps(scores[(kvh * G + g) * n + j]);
                float *o = acc + (kvh * G + g) * D;
                for (int64_t v = 0; v < V; v++)
                    _mm512_storeu_ps(o + v * 16,
                                     _mm512_fmadd_ps(p, val[v], _mm512_loadu_ps(o + v * 16)));
            }
        }
    }
}
#endif

/* one span: every head (fmt unused: the cache holds the storage dtype) */
static void attend_span(const attn_args *a, int fmt, const attn_span *sp, float *scores,
                        float *qbuf, float *kv, float *acc, float *stats) {
    (void)fmt;
    const int64_t D = a->head_dim;
#if defined(__AVX512F__)
    if (a->dtype == DT_BF16 && D == 64)
        return attend_span_avx512(a, sp, scores, qbuf, acc, stats, 64, DT_BF16);
    if (a->dtype == DT_BF16 && D == 128)
        return attend_span_avx512(a, sp, scores, qbuf, acc, stats, 128, DT_BF16);
    if (D % 16 == 0 && D <= 256)
        return attend_span_avx512(a, sp, scores, qbuf, acc, stats, D, a->dtype);
#endif
    for (int64_t kvh = 0; kvh < a->num_kv_heads; kvh++) {
        if (a->dtype == DT_BF16) {
            if (D == 64)
                attend_core(a, sp, kvh, scores, qbuf, kv, acc, stats, 64, DT_BF16);
            else if (D == 128)
                attend_core(a, sp, kvh, scores, qbuf, kv, acc, stats, 128, DT_BF16);
            else
                attend_core(a, sp, kvh, scores, qbuf, kv, acc, stats, D, DT_BF16);
        } else {
            if (D == 64)
                attend_core(a, sp, kvh, scores, qbuf, kv, acc, stats, 64, DT_F32);
            else if (D == 128)
                attend_core(a, sp, kvh, scores, qbuf, kv, acc, stats, 128, DT_F32);
            else
                attend_core(a, sp, kvh, scores, qbuf, kv, acc, stats, D, DT_F32);
        }
    }
}

#include "cpu_kernels_attn_scores.c"

/* The combine pass of one sequence's k > 1 spans (parts [k][H][2 + D]) -> out row;
 * final [H][2]: each head's overall max and softmax denominator. */
static void combine_spans(const attn_args *a, int64_t seq, const float *parts, int64_t k,
                          float *acc, float *final) {
    const int64_t H = a->num_heads, D = a->head_dim, stride = H * (2 + D);
    for (int64_t h = 0; h < H; h++) {
        float mx = -INFINITY, den = 0.f;
        float *o = acc + h * D;
        for (int64_t i = 0; i < k; i++) {
            float m = parts[i * stride + h * (2 + D)];
            mx = m > mx ? m : mx;
        }
        for (int64_t d = 0; d < D; d++) o[d] = 0.f;
        for (int64_t i = 0; i < k; i++) {
            const float *p = parts + i * stride + h * (2 + D);
            const float w = p[1] * exp_approx(p[0] - mx);
            den += w;
#pragma omp simd
            for (int64_t d = 0; d < D; d++) o[d] += w * p[2 + d];
        }
        const float inv = 1.0f / den;
#pragma omp simd
        for (int64_t d = 0; d < D; d++) o[d] *= inv;
        final[2 * h] = mx;
        final[2 * h + 1] = den;
    }
    store_row(a->dtype, (char *)a->out + seq * H * D * elem_size(a->dtype), acc, H * D);
}

static inline int64_t attn_first(const attn_args *a, int64_t L) {
    return (a->window > 0 && L > a->window) ? L - a->window : 0;
}

/* Checks the block table, cuts the spans, runs fn on every span over the threads, then
 * combines split sequences (and their block scores). 0, or -2 (no memory), -3 (a block
 * id outside the pool), -4 (a sequence longer than its block table), -6 (a score array
 * shorter than its sequence's blocks). */
static int run_paged_decode(const attn_args *a, int fmt, attn_span_fn fn, int64_t num_blocks,
                            int64_t bt_width, int num_threads) {
    const int64_t S = a->num_seqs, H = a->num_heads, D = a->head_dim, bs = a->block_size;
    int64_t total = 0, num_spans = 0, part_floats = 0, blk_floats = 0, max_n = 1;
    for (int64_t s = 0; s < S; s++) {
        int64_t L = a->seq_lens[s];
        if (L < 1 || (L + bs - 1) / bs > bt_width) return -4;
        const int scored = score_array(a, s) != NULL;
        if (scored && a->score_lens[s] < (L + bs - 1) / bs) return -6;
        for (int64_t b = 0; b < (L + bs - 1) / bs; b++) {
            int64_t blk = a->block_table[s * a->bt_stride + b];
            if (blk < 0 || blk >= num_blocks) return -3;
        }
        int64_t n = L - attn_first(a, L), k = (n + ATTN_SPLIT_LEN - 1) / ATTN_SPLIT_LEN;
        total += n;
        num_spans += k;
        if (k > 1) part_floats += k * H * (2 + D);
        if (k > 1 && scored)  /* a span of <= 512 positions touches <= 512 / bs + 2 blocks */
            blk_floats += k * H * (ATTN_SPLIT_LEN / bs + 2);
        if (n > max_n) max_n = n;
    }
    if (max_n > ATTN_SPLIT_LEN) max_n = ATTN_SPLIT_LEN;
    attn_span *spans = malloc((size_t)(num_spans > 0 ? num_spans : 1) * sizeof(attn_span));
    float *parts = part_floats ? malloc((size_t)part_floats * sizeof(float)) : NULL;
    float *blks = blk_floats ? malloc((size_t)blk_floats * sizeof(float)) : NULL;
    int status = (!spans || (part_floats && !parts) || (blk_floats && !blks)) ? -2 : 0;
    if (status) {
        free(spans);
        free(parts);
        free(blks);
        return status;
    }
    int64_t i = 0;
    float *p = parts, *pb = blks;
    for (int64_t s = 0; s < S; s++) {
        int64_t L = a->seq_lens[s], first = attn_first(a, L), n = L - first;
        int64_t k = (n + ATTN_SPLIT_LEN - 1) / ATTN_SPLIT_LEN;
        for (int64_t j = 0; j < k; j++, i++) {
            int64_t lo = j * ATTN_SPLIT_LEN, len = n - lo < ATTN_SPLIT_LEN ? n - lo : ATTN_SPLIT_LEN;
            spans[i].seq = s;
            spans[i].start = first + lo;
            spans[i].n = len;
            spans[i].part = k > 1 ? p + j * H * (2 + D) : NULL;
            spans[i].blk = NULL;
            if (k > 1 && score_array(a, s)) {
                spans[i].blk = pb;
                pb += H * span_num_blocks(a, spans + i);
            }
        }
        if (k > 1) p += k * H * (2 + D);
    }
    /* OpenMP dispatch to warm threads costs a few us: split work of >= 64K K/V elements */
    int nt = num_threads < 1 ? 1 : num_threads;
    if (nt > num_spans) nt = (int)num_spans;
    if (total * a->num_kv_heads * D < (1 << 16)) nt = 1;
    const size_t buf_floats = (size_t)(H * max_n + 2 * H * D + D + 2 * H);
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        float *buf = malloc(buf_floats * sizeof(float));
        if (!buf) status = -2;  /* (every writer writes the same value) */
        float *scores = buf, *qbuf = buf + H * max_n;
        float *acc = qbuf + H * D, *kv = acc + H * D, *stats = kv + D;
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < num_spans; t++) {
            if (!buf) continue;
            const attn_span *sp = spans + t;
            fn(a, fmt, sp, scores, qbuf, kv, acc, stats);
            if (a->score_ptrs && score_array(a, sp->seq)) span_block_scores(a, sp, scores);
            if (!sp->part) {
                store_row(a->dtype, (char *)a->out + sp->seq * H * D * elem_size(a->dtype),
                          acc, H * D);
                continue;
            }
            for (int64_t h = 0; h < H; h++) {
                sp->part[h * (2 + D)] = stats[2 * h];
                sp->part[h * (2 + D) + 1] = stats[2 * h + 1];
                memcpy(sp->part + h * (2 + D) + 2, acc + h * D, (size_t)D * sizeof(float));
            }
        }
        /* (the loop's implicit barrier: every part is written) */
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < num_spans; t++) {
            const attn_span *sp = spans + t;
            if (!buf || !sp->part || sp->start != attn_first(a, a->seq_lens[sp->seq])) continue;
            int64_t n = a->seq_lens[sp->seq] - sp->start;
            int64_t k = (n + ATTN_SPLIT_LEN - 1) / ATTN_SPLIT_LEN;
            combine_spans(a, sp->seq, sp->part, k, acc, stats);
            if (sp->blk) combine_block_scores(a, sp, k, sp->part, stats, acc);
        }
        free(buf);
    }
    free(spans);
    free(parts);
    free(blks);
    return status;
}

int paged_attention_decode(int dtype, void *out, const void *query, int64_t q_stride,
                           const void *key_cache, const void *value_cache, int64_t num_blocks,
                           const int64_t *block_table, int64_t bt_width, int64_t bt_stride,
                           const int64_t *seq_lens, int64_t num_seqs, int64_t num_heads,
                           int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                           float scale, int64_t window, int num_threads,
                           const int64_t *score_ptrs, const int64_t *score_lens) {
    if (num_kv_heads <= 0 || num_heads % num_kv_heads || head_dim <= 0 || block_size <= 0 ||
        (score_ptrs && !score_lens))
        return -1;
    attn_args a = {dtype, out, query, key_cache, value_cache, block_table, seq_lens,
                   num_seqs, num_heads, num_kv_heads, head_dim, block_size, bt_stride, q_stride,
                   window, scale, score_ptrs, score_lens};
    return run_paged_decode(&a, 0, attend_span, num_blocks, bt_width, num_threads);
}
