/* GGUF Q4_K / Q6_K weights repacked 16 rows to a tile, x int8 (Q8_K) activations: the
 * int8-activation matmul (included by cpu_kernels.c after cpu_kernels_vnni.c, whose Q8_K
 * quantization and arithmetic it uses: exact integer block sums, one float32 FMA per
 * block, llama.cpp's ggml_vec_dot_q4_K_q8_K scheme).
 *
 * Walking the file's rows one at a time costs a horizontal sum per weight row and lane
 * shuffles of each block's scales. The x16 layout interleaves 16 weight rows instead, so
 * that one VPDPBUSD multiplies 4 consecutive codes of each of the 16 rows by the same 4
 * activation bytes (broadcast from memory): the 16 int32 lanes are the 16 rows' sums, no
 * shuffles, no per-row reduction, each scale applied to 16 rows by one instruction. The
 * idea is llama.cpp's repacked CPU weights (ggml-cpu repack.cpp, "q4_K_8x8"); this
 * layout is our own, sized for AVX-512. Measured (Qwen2.5-Coder-1.5B shapes, 2 threads,
 * weights out of cache): gate_up 17920 x 1536 Q4_K at 1 row 0.81 ms vs 1.20 for torch's
 * int4 kernel, 1.33 vs 2.77 ms at 8 rows; the Q6_K LM head 8.6 ms vs 14.4 (gguf_matmul).
 *
 * One tile = 16 weight rows x one 256-weight super-block, tiles [N / 16][K / 256]
 * (a group's tiles contiguous; N padded to 16 with zero rows). Byte t of row r's 4-byte
 * lane holds code k = base + t (low nibble) and base + 4 + t (high nibble):
 *
 *   Q4_K tile, 2368 bytes (148 a row-block; the file's 144):
 *     d[16] fp16 | dmin[16] fp16 | sc[8 j][16 r] u8 | m[4 p][16 r][2] u8 (m_2p, m_2p+1)
 *     | qs[8 j][4 p][16 r][4 t]   code(32 j + 8 p + t) | code(32 j + 8 p + 4 + t) << 4
 *   Q6_K tile, 3360 bytes (210 a row-block, as the file):
 *     d[16] fp16 | sc[16 g][16 r] s8 | ql[16 g][2 p][16 r][4 t] low 4 bits of
 *     code(16 g + 8 p + t) | code(16 g + 8 p + 4 + t) << 4 | qh[16 g][16 r][4 t]: bits
 *     2 q, 2 q + 1 = code(16 g + 4 q + t) >> 4, q = 0..3
 *
 *   Q4_K: y_r += d_r dx sum_j sc_jr sum_i q4 q8  -  dmin_r dx sum_j m_jr bsum32_j
 *   Q6_K: y_r += d_r dx sum_g sc_gr (sum_i q6 q8 - 32 bsum16_g)        (q6 in 0..63)
 *
 * Integer sums are exact (|Q4_K block| < 8 * 63 * 32 * 15 * 127 < 2^31; Q6_K
 * 16 * 127 * (16 * 63 * 127 + 32 * 2032) < 2^31). Every row of x runs the same
 * operations in the same order whatever M is (batch invariance).
 */
#define X16_Q4K_TILE 2368
#define X16_Q6K_TILE 3360

static inline int x16_tile_bytes(int qtype) {
    return qtype == GGML_Q4_K ? X16_Q4K_TILE : qtype == GGML_Q6_K ? X16_Q6K_TILE : 0;
}

/* codes[256] (Q4_K 0..15, Q6_K 0..63), scales (Q4_K sc[8], m[8]; Q6_K sc[16]) of a block */
static void x16_unpack_block(int qtype, const uint8_t *b, uint8_t *codes, int *sc, int *m) {
    if (qtype == GGML_Q4_K) {
        for (int j = 0; j < 8; j++) {
            k_scale_min(b + 4, j, &sc[j], &m[j]);
            for (int l = 0; l < 32; l++) {
                const uint8_t v = b[16 + 32 * (j / 2) + l];
                codes[32 * j + l] = (j & 1) ? v >> 4 : v & 0xF;
            }
        }
    } else {
        for (int n = 0; n < 2; n++) {
            const uint8_t *ql = b + 64 * n, *qh = b + 128 + 32 * n;
            for (int l = 0; l < 32; l++) {
                codes[128 * n + l] = (uint8_t)((ql[l] & 0xF) | ((qh[l] & 3) << 4));
                codes[128 * n + l + 32] = (uint8_t)((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4));
                codes[128 * n + l + 64] = (uint8_t)((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4));
                codes[128 * n + l + 96] = (uint8_t)((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4));
            }
        }
        for (int g = 0; g < 16; g++) sc[g] = (int8_t)b[192 + g];
    }
}

/* w: GGUF blocks [N, K / 256] -> out: x16 tiles [ceil(N / 16)][K / 256] (Q8_0 / Q5_0:
 * units [ceil(N / 16)][K / 32], cpu_kernels_x16_q32.c). 0, or -1. */
static int x16_q32_repack(int qtype, const uint8_t *w, int64_t N, int64_t K, uint8_t *out);

int gguf_repack_x16(int qtype, const uint8_t *w, int64_t N, int64_t K, uint8_t *out) {
    if ((qtype == GGML_Q8_0 || qtype == GGML_Q5_0) && K % 32 == 0 && N >= 1)
        return x16_q32_repack(qtype, w, N, K, out);
    const int tb = x16_tile_bytes(qtype);
    if (!tb || K % 256 || N < 1) return -1;
    const int64_t nb = K / 256, bb = gguf_block_bytes(qtype), groups = (N + 15) / 16;
#pragma omp parallel for schedule(static)
    for (int64_t gi = 0; gi < groups; gi++)
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *t = out + (gi * nb + b) * tb;
            memset(t, 0, (size_t)tb);
            for (int r = 0; r < 16 && gi * 16 + r < N; r++) {
                const uint8_t *blk = w + (gi * 16 + r) * nb * bb + b * bb;
                uint8_t c[256];
                int sc[16], m[8];
                x16_unpack_block(qtype, blk, c, sc, m);
                if (qtype == GGML_Q4_K) {
                    memcpy(t + 2 * r, blk, 2);
                    memcpy(t + 32 + 2 * r, blk + 2, 2);
                    for (int j = 0; j < 8; j++) t[64 + 16 * j + r] = (uint8_t)sc[j];
                    for (int p = 0; p < 4; p++) {
                        t[192 + 32 * p + 2 * r] = (uint8_t)m[2 * p];
                        t[192 + 32 * p + 2 * r + 1] = (uint8_t)m[2 * p + 1];
                    }
                    for (int j = 0; j < 8; j++)
                        for (int p = 0; p < 4; p++)
                            for (int i = 0; i < 4; i++) {
                                const int k = 32 * j + 8 * p + i;
                                t[320 + 256 * j + 64 * p + 4 * r + i] =
                                    (uint8_t)(c[k] | (c[k + 4] << 4));
                            }
                } else {
                    memcpy(t + 2 * r, blk + 208, 2);
                    for (int g = 0; g < 16; g++) t[32 + 16 * g + r] = (uint8_t)(int8_t)sc[g];
                    for (int g = 0; g < 16; g++)
                        for (int i = 0; i < 4; i++) {
                            for (int p = 0; p < 2; p++) {
                                const int k = 16 * g + 8 * p + i;
                                t[288 + 128 * g + 64 * p + 4 * r + i] =
                                    (uint8_t)((c[k] & 0xF) | ((c[k + 4] & 0xF) << 4));
                            }
                            uint8_t h = 0;
                            for (int q = 0; q < 4; q++) h |= (uint8_t)((c[16 * g + 4 * q + i] >> 4) << (2 * q));
                            t[2336 + 64 * g + 4 * r + i] = h;
                        }
                }
            }
        }
    return 0;
}

#ifdef GGUF_Q8K_DOT
#define X16_MAXM 8
#define X16_PREFETCH 2  /* tiles ahead */

static inline __m512i x16_bcast(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

/* y[m][16] += the 16 rows of one Q4_K tile against MM rows of the Q8_K x, block b */
static inline __attribute__((always_inline)) void x16_q4k_tile(
        const int MM, const uint8_t *restrict t, q8k_act a, int64_t K, int64_t nb, int64_t b,
        int64_t m0, __m512 *acc) {
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    __m512i isum[X16_MAXM], msum[X16_MAXM];
    for (int m = 0; m < MM; m++) isum[m] = msum[m] = _mm512_setzero_si512();
    for (int j = 0; j < 8; j++) {
        __m512i s[X16_MAXM];
        for (int m = 0; m < MM; m++) s[m] = _mm512_setzero_si512();
        for (int p = 0; p < 4; p++) {
            const __m512i v = _mm512_loadu_si512(t + 320 + 256 * j + 64 * p);
            _mm_prefetch((const char *)t + X16_PREFETCH * X16_Q4K_TILE + 74 * (4 * j + p), _MM_HINT_T0);
            const __m512i lo = _mm512_and_si512(v, m4);
            const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
            for (int m = 0; m < MM; m++) {
                const int8_t *q = a.q + (m0 + m) * K + b * 256 + 32 * j + 8 * p;
                s[m] = _mm512_dpbusd_epi32(s[m], lo, x16_bcast(q));
                s[m] = _mm512_dpbusd_epi32(s[m], hi, x16_bcast(q + 4));
            }
        }
        const __m512i sc = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(t + 64 + 16 * j)));
        for (int m = 0; m < MM; m++) isum[m] = _mm512_add_epi32(isum[m], _mm512_mullo_epi32(s[m], sc));
    }
    for (int p = 0; p < 4; p++) {
        const __m512i mins = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(t + 192 + 32 * p)));
        for (int m = 0; m < MM; m++) {
            const int16_t *bs = a.bsum32 + (m0 + m) * (K / 32) + b * 8 + 2 * p;
            msum[m] = _mm512_dpwssd_epi32(msum[m], mins, x16_bcast((const int8_t *)bs));
        }
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)t));
    const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(t + 32)));
    for (int m = 0; m < MM; m++) {
        const __m512 dx = _mm512_set1_ps(a.d[(m0 + m) * nb + b]);
        acc[2 * m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[m]), _mm512_mul_ps(d, dx), acc[2 * m]);
        acc[2 * m + 1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(msum[m]), _mm512_mul_ps(dmin, dx),
                                         acc[2 * m + 1]);
    }
}

/* the same for a Q6_K tile; bs32 holds 32 * bsum16 as int32 [M][K / 16] */
static inline __attribute__((always_inline)) void x16_q6k_tile(
        const int MM, const uint8_t *restrict t, q8k_act a, const int32_t *bs32, int64_t K,
        int64_t nb, int64_t b, int64_t m0, __m512 *acc) {
    const __m512i m0f = _mm512_set1_epi8(0x0F), m33 = _mm512_set1_epi8(0x33);
    __m512i isum[X16_MAXM];
    for (int m = 0; m < MM; m++) isum[m] = _mm512_setzero_si512();
    for (int g = 0; g < 16; g++) {
        const __m512i ql0 = _mm512_loadu_si512(t + 288 + 128 * g);
        const __m512i ql1 = _mm512_loadu_si512(t + 288 + 128 * g + 64);
        const __m512i h = _mm512_loadu_si512(t + 2336 + 64 * g);
        const __m512i h03 = _mm512_and_si512(h, m33);                        /* quads 0, 2 */
        const __m512i h47 = _mm512_and_si512(_mm512_srli_epi16(h, 2), m33);  /* quads 1, 3 */
        /* 0xAC: per bit, the third operand where the first (mask 0x0F) is set, else the second */
        const __m512i c0 = _mm512_ternarylogic_epi32(m0f, _mm512_slli_epi16(h03, 4), ql0, 0xAC);
        const __m512i c1 = _mm512_ternarylogic_epi32(m0f, _mm512_slli_epi16(h47, 4),
                                                     _mm512_srli_epi16(ql0, 4), 0xAC);
        const __m512i c2 = _mm512_ternarylogic_epi32(m0f, h03, ql1, 0xAC);
        const __m512i c3 = _mm512_ternarylogic_epi32(m0f, h47, _mm512_srli_epi16(ql1, 4), 0xAC);
        const __m512i sc = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(t + 32 + 16 * g)));
        _mm_prefetch((const char *)t + X16_PREFETCH * X16_Q6K_TILE + 210 * g, _MM_HINT_T0);
        _mm_prefetch((const char *)t + X16_PREFETCH * X16_Q6K_TILE + 210 * g + 128, _MM_HINT_T0);
        for (int m = 0; m < MM; m++) {
            const int8_t *q = a.q + (m0 + m) * K + b * 256 + 16 * g;
            /* two chains of two (latency), then minus 32 bsum16 (broadcast int32) */
            __m512i s = _mm512_dpbusd_epi32(_mm512_set1_epi32(-bs32[(m0 + m) * (K / 16) + b * 16 + g]),
                                            c0, x16_bcast(q));
            __m512i u = _mm512_dpbusd_epi32(_mm512_setzero_si512(), c2, x16_bcast(q + 8));
            s = _mm512_dpbusd_epi32(s, c1, x16_bcast(q + 4));
            u = _mm512_dpbusd_epi32(u, c3, x16_bcast(q + 12));
            isum[m] = _mm512_add_epi32(isum[m], _mm512_mullo_epi32(_mm512_add_epi32(s, u), sc));
        }
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)t));
    for (int m = 0; m < MM; m++)
        acc[2 * m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[m]),
                                     _mm512_mul_ps(d, _mm512_set1_ps(a.d[(m0 + m) * nb + b])),
                                     acc[2 * m]);
}

/* rows m0 .. m0 + MM - 1 of x against one group of 16 weight rows (all its tiles) */
static inline __attribute__((always_inline)) void x16_group(
        const int qtype, const int MM, const uint8_t *restrict tiles, q8k_act a,
        const int32_t *bs32, int64_t K, int64_t m0, float *y /* [MM][16] */) {
    const int64_t nb = K / 256;
    __m512 acc[2 * X16_MAXM];
    for (int m = 0; m < 2 * MM; m++) acc[m] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        if (qtype == GGML_Q4_K)
            x16_q4k_tile(MM, tiles + b * X16_Q4K_TILE, a, K, nb, b, m0, acc);
        else
            x16_q6k_tile(MM, tiles + b * X16_Q6K_TILE, a, bs32, K, nb, b, m0, acc);
    }
    for (int m = 0; m < MM; m++)
        _mm512_storeu_ps(y + 16 * m, qtype == GGML_Q4_K ? _mm512_sub_ps(acc[2 * m], acc[2 * m + 1])
                                                         : acc[2 * m]);
}

#define X16_GROUP_CASE(QT, n) \
    case n: x16_group(QT, n, tiles, a, bs32, K, m0, y + 16 * m0); break;

static inline __attribute__((always_inline)) void x16_rows(
        const int qtype, const uint8_t *restrict tiles, q8k_act a, const int32_t *bs32,
        int64_t M, int64_t K, float *y) {
    for (int64_t m0 = 0; m0 < M;) {
        const int64_t mm = M - m0 < X16_MAXM ? M - m0 : X16_MAXM;
        switch (mm) {
        X16_GROUP_CASE(qtype, 1)
        X16_GROUP_CASE(qtype, 2)
        X16_GROUP_CASE(qtype, 3)
        X16_GROUP_CASE(qtype, 4)
        X16_GROUP_CASE(qtype, 5)
        X16_GROUP_CASE(qtype, 6)
        X16_GROUP_CASE(qtype, 7)
        default: x16_group(qtype, X16_MAXM, tiles, a, bs32, K, m0, y + 16 * m0); break;
        }
        m0 += mm;
    }
}
#endif

#include "cpu_kernels_x16_pass2.c"

static void q8k_requant(const float *resid, int64_t K, int64_t row, void *ctx) {
    q8k_quantize_rows(DT_F32, resid, K, 1, K, q8k_act_row(*(q8k_act *)ctx, row, K));
}

/* out[m, n] (row stride out_stride elements) = x[m] . W[n], x[m] quantized to Q8_K (plus
 * a second pass for outlier rows, above), W the x16 tiles of gguf_repack_x16 (N rows).
 * M in 1..16. -5: no AVX512-VNNI here. */
static int x16_q32_matmul(int qtype, int dtype, void *out, int64_t out_stride, const void *x,
                          int64_t x_stride, const uint8_t *w, int64_t M, int64_t N, int64_t K,
                          int num_threads);

int gguf_matmul_x16(int qtype, int dtype, void *out, int64_t out_stride, const void *x,
                    int64_t x_stride, const uint8_t *w, int64_t M, int64_t N, int64_t K,
                    int num_threads) {
    if ((qtype == GGML_Q8_0 || qtype == GGML_Q5_0) && K % 32 == 0 && M >= 1 && M <= 16 &&
        N >= 1 && out_stride >= N)
        return x16_q32_matmul(qtype, dtype, out, out_stride, x, x_stride, w, M, N, K, num_threads);
    if (!x16_tile_bytes(qtype) || K % 256 || M < 1 || M > 16 || N < 1 || out_stride < N)
        return -1;
#ifndef GGUF_Q8K_DOT
    (void)dtype; (void)out; (void)x; (void)x_stride; (void)w; (void)num_threads;
    return -5;
#else
    if (!gguf_q8k_available()) return -5;
    const int64_t nb = K / 256, groups = (N + 15) / 16, gbytes = nb * x16_tile_bytes(qtype);
    const int64_t R = 2 * M;  /* rows of codes at most: each row and its second pass */
    char *buf = aligned_alloc(64, ((size_t)(R * K) + (size_t)(R * nb) * 4 +
                                   (size_t)(R * (K / 16 + K / 32)) * 2 +
                                   (size_t)(R * (K / 16)) * 4 + (size_t)K * 4 + 127) / 64 * 64);
    if (!buf) return -2;
    q8k_act a = {(int8_t *)buf, (float *)(buf + R * K), NULL, NULL};
    a.bsum16 = (int16_t *)(a.d + R * nb);
    a.bsum32 = a.bsum16 + R * (K / 16);
    int32_t *bs32 = (int32_t *)(a.bsum32 + R * (K / 32));  /* 4-byte aligned: K % 256 == 0 */
    float *resid = (float *)(bs32 + R * (K / 16));
    q8k_quantize_rows(dtype, x, x_stride, M, K, a);
    int64_t second[16];
    const int64_t rows = x16_second_pass(dtype, x, x_stride, M, K, 256, a.d, a.q, resid,
                                         second, q8k_requant, &a);
    for (int64_t i = 0; i < rows * (K / 16); i++) bs32[i] = 32 * a.bsum16[i];
    const int nt = num_threads < 1 ? 1 : num_threads;
    (void)nt;
#pragma omp parallel for schedule(static) num_threads(nt) if (nt > 1 && N * K >= 65536)
    for (int64_t gi = 0; gi < groups; gi++) {
        float y[32 * 16];
        const uint8_t *tiles = w + gi * gbytes;
        if (qtype == GGML_Q4_K)
            x16_rows(GGML_Q4_K, tiles, a, bs32, rows, K, y);
        else
            x16_rows(GGML_Q6_K, tiles, a, bs32, rows, K, y);
        x16_store_group(dtype, out, out_stride, y, second, M, N, gi);
    }
    free(buf);
    return 0;
#endif
}

#include "cpu_kernels_x16_q32.c"

/* per-32 activations of x16_q32_matmul: codes (+offset), scales, offset sums per block */
typedef struct {
    int offset;
    int8_t *q;
    float *d;
    int32_t *ob;
} x16_q32_act;

static void x16_q32_requant(const float *resid, int64_t K, int64_t row, void *ctx) {
    const x16_q32_act *a = ctx;
    x16_q32_quantize_rows(DT_F32, resid, K, 1, K, a->offset, a->q + row * K,
                          a->d + row * (K / 32), a->ob + row * (K / 32));
}

/* gguf_matmul_x16 for Q8_0 / Q5_0 units: per-32 activations, the same second pass */
static int x16_q32_matmul(int qtype, int dtype, void *out, int64_t out_stride, const void *x,
                          int64_t x_stride, const uint8_t *w, int64_t M, int64_t N, int64_t K,
                          int num_threads) {
#ifndef GGUF_Q8K_DOT
    (void)qtype; (void)dtype; (void)out; (void)out_stride; (void)x; (void)x_stride; (void)w;
    (void)M; (void)N; (void)K; (void)num_threads;
    return -5;
#else
    if (!gguf_q8k_available()) return -5;
    const int64_t nb = K / 32, groups = (N + 15) / 16, gbytes = nb * x16_q32_unit_bytes(qtype);
    const int64_t R = 2 * M;
    const int offset = qtype == GGML_Q8_0 ? 128 : 16;
    char *buf = aligned_alloc(64, ((size_t)(R * K) + (size_t)(R * nb) * 8 + (size_t)K * 4 + 127)
                                  / 64 * 64);
    if (!buf) return -2;
    float *d = (float *)buf, *resid = d + R * nb;
    int32_t *ob = (int32_t *)(resid + K);
    int8_t *q = (int8_t *)(ob + R * nb);
    x16_q32_quantize_rows(dtype, x, x_stride, M, K, offset, q, d, ob);
    int64_t second[16];
    x16_q32_act act = {offset, q, d, ob};
    const int64_t rows = x16_second_pass(dtype, x, x_stride, M, K, 32, d, q, resid, second,
                                         x16_q32_requant, &act);
    const int nt = num_threads < 1 ? 1 : num_threads;
    (void)nt;
#pragma omp parallel for schedule(static) num_threads(nt) if (nt > 1 && N * K >= 65536)
    for (int64_t gi = 0; gi < groups; gi++) {
        float y[32 * 16];
        x16_q32_rows(qtype, w + gi * gbytes, q, d, ob, rows, K, y);
        x16_store_group(dtype, out, out_stride, y, second, M, N, gi);
    }
    free(buf);
    return 0;
#endif
}
