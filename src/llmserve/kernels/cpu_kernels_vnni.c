/* GGUF Q4_K / Q6_K x int8-activation matmul for decode rows (included by cpu_kernels.c).
 *
 * The scheme of llama.cpp's ggml_vec_dot_q4_K_q8_K / ggml_vec_dot_q6_K_q8_K
 * (ggml-cpu/arch/x86/quants.c): each row of x is quantized once per call to Q8_K,
 *
 *   per 256 values: d = amax / 127 (float32: 1 / (127 / amax)),
 *                   q[i] = rint(x[i] * (127 / amax)) in -127..127 (int8),
 *                   bsum16[g] = sum of q over each 16 (int16), bsum32[j] over each 32
 *
 * and each weight block is multiplied by it in integers, exactly:
 *
 *   Q4_K: y += (d_w d) sum_j sc_j sum_i q4_i q8_i  -  (dmin_w d) sum_j m_j bsum32_j
 *   Q6_K: y += (d_w d) sum_g sc_g (sum_i q6_i q8_i - 32 bsum16_g)      (q6 in 0..63)
 *
 * (weight layouts: the comment above gguf_matmul in cpu_kernels.c). AVX-512: u8 x s8
 * VPMADDUBSW pairs (no saturation: 63 * 128 * 2 < 2^15), then VNNI VPDPWSSD with the
 * group scales as int16; each int32 lane sums 16 products (< 2^24, so its float32
 * conversion is exact). Per block, two float32 FMAs per row; at the row's end a fixed
 * lane reduction. Every row of x runs the same operations in the same order whatever M
 * is, and its quantization is its own: the result of a row does not depend on the other
 * rows of the call (batch invariance).
 */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512VNNI__)
#define GGUF_Q8K_DOT 1
#endif

typedef struct {
    int8_t *q;        /* [M, K] */
    float *d;         /* [M, K / 256] */
    int16_t *bsum16;  /* [M, K / 16] */
    int16_t *bsum32;  /* [M, K / 32] */
} q8k_act;

/* Q8_K of the rows of x [M, K] (row stride x_stride elements, K % 256 == 0). */
static void q8k_quantize_rows(int dtype, const void *x, int64_t x_stride, int64_t M, int64_t K,
                              q8k_act a) {
    const size_t es = elem_size(dtype);
    float xf[256];
    for (int64_t m = 0; m < M; m++)
        for (int64_t b = 0; b < K / 256; b++) {
            load_row(dtype, xf, (const char *)x + (m * x_stride + b * 256) * es, 256);
            float amax = 0.f;
            for (int i = 0; i < 256; i++) amax = fabsf(xf[i]) > amax ? fabsf(xf[i]) : amax;
            int8_t *q = a.q + m * K + b * 256;
            if (amax == 0.f) {
                memset(q, 0, 256);
                a.d[m * (K / 256) + b] = 0.f;
            } else {
                const float iscale = 127.f / amax;
                for (int i = 0; i < 256; i++) {
                    float v = rintf(xf[i] * iscale);
                    q[i] = (int8_t)(v > 127.f ? 127.f : v < -127.f ? -127.f : v);
                }
                a.d[m * (K / 256) + b] = 1.f / iscale;
            }
            for (int g = 0; g < 16; g++) {
                int s = 0;
                for (int i = 0; i < 16; i++) s += q[16 * g + i];
                a.bsum16[m * (K / 16) + b * 16 + g] = (int16_t)s;
            }
            for (int j = 0; j < 8; j++)
                a.bsum32[m * (K / 32) + b * 8 + j] = (int16_t)(a.bsum16[m * (K / 16) + b * 16 + 2 * j] +
                                                              a.bsum16[m * (K / 16) + b * 16 + 2 * j + 1]);
        }
}

/* For tests: Q8_K codes q [M, K] int8, scales d [M, K / 256] float32 of x. */
int q8k_quantize(int dtype, const void *x, int64_t x_stride, int64_t M, int64_t K, int8_t *q,
                 float *d) {
    if (K % 256 || M < 1) return -1;
    int16_t *bs = malloc((size_t)(M * (K / 16 + K / 32)) * sizeof(int16_t));
    if (!bs) return -2;
    q8k_act a = {q, d, bs, bs + M * (K / 16)};
    q8k_quantize_rows(dtype, x, x_stride, M, K, a);
    free(bs);
    return 0;
}

#ifdef GGUF_Q8K_DOT
int gguf_q8k_available(void) { return __builtin_cpu_supports("avx512vnni") ? 1 : 0; }

/* permutexvar indices: the int16 scale of each 16-bit lane of a 64-weight chunk */
typedef struct { __m512i c[4]; } q8k_idx;

static inline q8k_idx q8k_make_idx(int qtype) {
    q8k_idx r;
    for (int c = 0; c < 4; c++) {
        int16_t t[32];  /* Q4_K: 2 groups of 32 a chunk; Q6_K: 4 groups of 16 */
        for (int l = 0; l < 32; l++)
            t[l] = (int16_t)(qtype == GGML_Q4_K ? 2 * c + l / 16 : 4 * c + l / 8);
        r.c[c] = _mm512_loadu_si512(t);
    }
    return r;
}

/* One weight block as 4 chunks of 64 unsigned codes (natural order) and their scales. */
typedef struct {
    __m512i w[4], s[4];
    __m128i mins;   /* Q4_K: 8 int16 m_j */
    __m256i sc16;   /* Q6_K: 16 int16 sc_g */
    float d, dmin;
} q8k_block;

static inline __attribute__((always_inline)) void q8k_load_block(
        const int qtype, const uint8_t *blk, const q8k_idx *idx, q8k_block *o) {
    if (qtype == GGML_Q4_K) {
        uint32_t u[4];
        memcpy(u, blk + 4, 12);  /* llama.cpp's 6-bit scale / min unpacking */
        u[3] = ((u[2] >> 4) & 0x0f0f0f0fu) | (((u[1] >> 6) & 0x03030303u) << 4);
        const uint32_t aux = u[1] & 0x3f3f3f3fu;
        u[1] = (u[2] & 0x0f0f0f0fu) | (((u[0] >> 6) & 0x03030303u) << 4);
        u[2] = aux;
        u[0] &= 0x3f3f3f3fu;
        const __m256i sm = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)u));
        const __m512i sm512 = _mm512_zextsi256_si512(sm);
        o->mins = _mm256_extracti128_si256(sm, 1);
        const __m256i m4 = _mm256_set1_epi8(0x0F);
        for (int c = 0; c < 4; c++) {
            o->s[c] = _mm512_permutexvar_epi16(idx->c[c], sm512);
            const __m256i v = _mm256_loadu_si256((const __m256i *)(blk + 16 + 32 * c));
            o->w[c] = _mm512_inserti64x4(
                _mm512_castsi256_si512(_mm256_and_si256(v, m4)),
                _mm256_and_si256(_mm256_srli_epi16(v, 4), m4), 1);
        }
        o->d = fp16_to_f32(blk);
        o->dmin = fp16_to_f32(blk + 2);
    } else {  /* Q6_K: | ql[128] | qh[64] | sc[16] | d | */
        o->sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 192)));
        const __m512i sc512 = _mm512_zextsi256_si512(o->sc16);
        const __m512i m4 = _mm512_set1_epi8(0x0F), m2 = _mm512_set1_epi8(0x03);
        for (int h = 0; h < 2; h++) {
            const __m512i ql = _mm512_loadu_si512(blk + 64 * h);
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h));
            const __m512i ha = _mm512_inserti64x4(_mm512_castsi256_si512(qh),
                                                  _mm256_srli_epi16(qh, 2), 1);
            const __m512i hb = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_srli_epi16(qh, 4)),
                                                  _mm256_srli_epi16(qh, 6), 1);
            o->w[2 * h] = _mm512_or_si512(_mm512_and_si512(ql, m4),
                                          _mm512_slli_epi16(_mm512_and_si512(ha, m2), 4));
            o->w[2 * h + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), m4),
                                              _mm512_slli_epi16(_mm512_and_si512(hb, m2), 4));
        }
        for (int c = 0; c < 4; c++) o->s[c] = _mm512_permutexvar_epi16(idx->c[c], sc512);
        o->d = fp16_to_f32(blk + 208);
        o->dmin = 0.f;
    }
}

/* x rows per pass over a weight row: up to 6 (a speculative verification's k + 1 rows
 * for k <= 5) share one unpacking of each block; more spill registers (measured on
 * gate_up 17920 x 1536, one thread: 5 rows 1.44 -> 1.23 ms, 6 rows 1.60 -> 1.48 ms as one
 * tile instead of 4 + rest; 8 rows as one tile 2.17 ms against 1.86 as 4 + 4). Each row's
 * sums run in the same order whatever the tile. */
#define Q8K_TILE 6

/* y[m] for rows m0 .. m0 + MM - 1 of x against one weight row of nb blocks. */
static inline __attribute__((always_inline)) void q8k_row_tile(
        const int qtype, const int MM, const uint8_t *restrict row, int64_t nb,
        const q8k_idx *idx, q8k_act a, int64_t K, int64_t m0, float *y) {
    const int bb = gguf_block_bytes(qtype);
    __m512 acc[Q8K_TILE];
    __m256 aux[Q8K_TILE];  /* Q4_K: sum of m_j bsum32 terms (4 lanes); Q6_K: sc_g bsum16 (8 lanes) */
    for (int m = 0; m < MM; m++) {
        acc[m] = _mm512_setzero_ps();
        aux[m] = _mm256_setzero_ps();
    }
    for (int64_t b = 0; b < nb; b++) {
        q8k_block blk;
        q8k_load_block(qtype, row + b * bb, idx, &blk);
        for (int m = 0; m < MM; m++) {
            const int8_t *q = a.q + (m0 + m) * K + b * 256;
            const float dx = a.d[(m0 + m) * nb + b];
            __m512i s = _mm512_setzero_si512();
            for (int c = 0; c < 4; c++) {
                const __m512i p = _mm512_maddubs_epi16(blk.w[c], _mm512_loadu_si512(q + 64 * c));
                s = _mm512_dpwssd_epi32(s, p, blk.s[c]);
            }
            acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_set1_ps(blk.d * dx), acc[m]);
            __m256i o;
            float f;
            if (qtype == GGML_Q4_K) {
                const __m128i bs = _mm_loadu_si128((const __m128i *)(a.bsum32 + (m0 + m) * (K / 32) + b * 8));
                o = _mm256_zextsi128_si256(_mm_madd_epi16(blk.mins, bs));
                f = blk.dmin * dx;
            } else {
                const __m256i bs = _mm256_loadu_si256((const __m256i *)(a.bsum16 + (m0 + m) * (K / 16) + b * 16));
                o = _mm256_madd_epi16(blk.sc16, bs);
                f = blk.d * dx;
            }
            aux[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(o), _mm256_set1_ps(f), aux[m]);
        }
    }
    for (int m = 0; m < MM; m++) {
        __m128 t = _mm_add_ps(_mm256_castps256_ps128(aux[m]), _mm256_extractf128_ps(aux[m], 1));
        t = _mm_add_ps(t, _mm_movehl_ps(t, t));
        t = _mm_add_ss(t, _mm_movehdup_ps(t));
        const float off = _mm_cvtss_f32(t) * (qtype == GGML_Q4_K ? 1.f : 32.f);
        y[m] = _mm512_reduce_add_ps(acc[m]) - off;
    }
}

static inline __attribute__((always_inline)) void q8k_row(
        const int qtype, const uint8_t *restrict row, int64_t nb, const q8k_idx *idx, q8k_act a,
        int64_t M, int64_t K, float *y) {
    for (int64_t m0 = 0; m0 < M;) {
        const int64_t left = M - m0, mm = left <= Q8K_TILE ? left : 4;
        switch (mm) {
        case 1: q8k_row_tile(qtype, 1, row, nb, idx, a, K, m0, y + m0); break;
        case 2: q8k_row_tile(qtype, 2, row, nb, idx, a, K, m0, y + m0); break;
        case 3: q8k_row_tile(qtype, 3, row, nb, idx, a, K, m0, y + m0); break;
        case 4: q8k_row_tile(qtype, 4, row, nb, idx, a, K, m0, y + m0); break;
        case 5: q8k_row_tile(qtype, 5, row, nb, idx, a, K, m0, y + m0); break;
        default: q8k_row_tile(qtype, 6, row, nb, idx, a, K, m0, y + m0); break;
        }
        m0 += mm;
    }
}
#else
int gguf_q8k_available(void) { return 0; }
#endif

/* out[m, n] (row stride out_stride elements) = x[m] . W[n] with x[m] quantized to Q8_K;
 * W Q4_K or Q6_K blocks [N, K / 256]. M in 1..16. -5: no AVX512-VNNI in this build/CPU. */
int gguf_matmul_q8k(int qtype, int dtype, void *out, int64_t out_stride, const void *x,
                    int64_t x_stride, const uint8_t *w, int64_t M, int64_t N, int64_t K,
                    int num_threads) {
    if ((qtype != GGML_Q4_K && qtype != GGML_Q6_K) || K % 256 || M < 1 || M > 16 || N < 1 ||
        out_stride < N)
        return -1;
#ifndef GGUF_Q8K_DOT
    (void)dtype; (void)out; (void)x; (void)x_stride; (void)w; (void)num_threads;
    return -5;
#else
    if (!gguf_q8k_available()) return -5;
    const int64_t nb = K / 256, row_bytes = nb * gguf_block_bytes(qtype);
    char *buf = aligned_alloc(64, ((size_t)(M * K) + (size_t)(M * nb) * 4 +
                                   (size_t)(M * (K / 16 + K / 32)) * 2 + 63) / 64 * 64);
    if (!buf) return -2;
    q8k_act a = {(int8_t *)buf, (float *)(buf + M * K), NULL, NULL};
    a.bsum16 = (int16_t *)(a.d + M * nb);
    a.bsum32 = a.bsum16 + M * (K / 16);
    q8k_quantize_rows(dtype, x, x_stride, M, K, a);
    const q8k_idx idx = q8k_make_idx(qtype);
    int nt = num_threads < 1 ? 1 : num_threads;
    (void)nt;
#pragma omp parallel for schedule(static) num_threads(nt) if (nt > 1 && N * K >= 65536)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *row = w + n * row_bytes;
        float y[16];
        if (n + PREFETCH_ROWS < N)
            for (int64_t off = 0; off < row_bytes; off += 64)
                __builtin_prefetch(row + PREFETCH_ROWS * row_bytes + off, 0, 3);
        if (qtype == GGML_Q4_K)
            q8k_row(GGML_Q4_K, row, nb, &idx, a, M, K, y);
        else
            q8k_row(GGML_Q6_K, row, nb, &idx, a, M, K, y);
        for (int64_t m = 0; m < M; m++) store(dtype, out, m * out_stride + n, y[m]);
    }
    free(buf);
    return 0;
#endif
}
