/* GGUF Q8_0 / Q5_0 repacked 16 rows to a tile, x int8 activations quantized per 32 values
 * (included by cpu_kernels.c after cpu_kernels_x16.c, whose tile idea and second pass it
 * shares). llama.cpp's ggml_vec_dot_q8_0_q8_0 / q5_0_q8_0 scheme: each row of x is
 * quantized per 32 values (d = amax / 127, float32 here, fp16 in llama.cpp), so K need
 * only be a multiple of 32 (Qwen2.5-0.5B's hidden size 896 is not one of 256).
 *
 * One unit = 16 weight rows x one 32-weight block, units [N / 16][K / 32]. Codes are
 * stored unsigned, u = code + o, so that VPDPBUSD (u8 x s8) takes them, and the offset
 * comes back through the activations' block sums: sum (u - o) q8 = sum u q8 - o bsum.
 *
 *   Q8_0 unit, 544 bytes (34 a row-block, as the file): d[16] fp16
 *     | u[8 quads][16 r][4 t] = q(4 quad + t) + 128                           (o = 128)
 *   Q5_0 unit, 352 bytes (22 a row-block, as the file): d[16] fp16
 *     | nib[4 p][16 r][4 t] = low 4 bits of u(8 p + t) | of u(8 p + 4 + t) << 4
 *     | hi[16 r][4 t]: bit 2 p + h = bit 4 of u(8 p + 4 h + t)               (o = 16)
 *
 *   y_r += d_r dx_g (sum_i u_i q8_i - o bsum_g)   (|sum| < 32 * 255 * 127: exact int32)
 */
#define X16_Q8_0_UNIT 544
#define X16_Q5_0_UNIT 352

static inline int x16_q32_unit_bytes(int qtype) {
    return qtype == GGML_Q8_0 ? X16_Q8_0_UNIT : qtype == GGML_Q5_0 ? X16_Q5_0_UNIT : 0;
}

static int x16_q32_repack(int qtype, const uint8_t *w, int64_t N, int64_t K, uint8_t *out) {
    const int ub = x16_q32_unit_bytes(qtype), bb = gguf_block_bytes(qtype);
    const int64_t nb = K / 32, groups = (N + 15) / 16;
#pragma omp parallel for schedule(static)
    for (int64_t gi = 0; gi < groups; gi++)
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *t = out + (gi * nb + b) * ub;
            memset(t, 0, (size_t)ub);
            for (int r = 0; r < 16 && gi * 16 + r < N; r++) {
                const uint8_t *blk = w + ((gi * 16 + r) * nb + b) * bb;
                uint8_t u[32];
                memcpy(t + 2 * r, blk, 2);
                if (qtype == GGML_Q8_0) {
                    for (int i = 0; i < 32; i++) u[i] = (uint8_t)(blk[2 + i] ^ 0x80);
                    for (int i = 0; i < 32; i++) t[32 + 64 * (i / 4) + 4 * r + i % 4] = u[i];
                } else {
                    const uint32_t qh = (uint32_t)blk[2] | ((uint32_t)blk[3] << 8) |
                                        ((uint32_t)blk[4] << 16) | ((uint32_t)blk[5] << 24);
                    for (int l = 0; l < 16; l++) {
                        u[l] = (uint8_t)((blk[6 + l] & 0xF) | (((qh >> l) & 1) << 4));
                        u[l + 16] = (uint8_t)((blk[6 + l] >> 4) | (((qh >> (l + 16)) & 1) << 4));
                    }
                    for (int p = 0; p < 4; p++)
                        for (int i = 0; i < 4; i++) {
                            t[32 + 64 * p + 4 * r + i] =
                                (uint8_t)((u[8 * p + i] & 0xF) | ((u[8 * p + 4 + i] & 0xF) << 4));
                            for (int h = 0; h < 2; h++)
                                t[288 + 4 * r + i] |= (uint8_t)(((u[8 * p + 4 * h + i] >> 4) & 1) << (2 * p + h));
                        }
                }
            }
        }
    return 0;
}

/* per 32 values of each row: q int8, d float32, ob = o * sum(q) int32 */
static void x16_q32_quantize_rows(int dtype, const void *x, int64_t x_stride, int64_t M,
                                  int64_t K, int offset, int8_t *q, float *d, int32_t *ob) {
    const size_t es = elem_size(dtype);
    float xf[32];
    for (int64_t m = 0; m < M; m++)
        for (int64_t b = 0; b < K / 32; b++) {
            load_row(dtype, xf, (const char *)x + (m * x_stride + b * 32) * es, 32);
            float amax = 0.f;
            for (int i = 0; i < 32; i++) amax = fabsf(xf[i]) > amax ? fabsf(xf[i]) : amax;
            int8_t *qb = q + m * K + b * 32;
            int s = 0;
            if (amax == 0.f) {
                memset(qb, 0, 32);
                d[m * (K / 32) + b] = 0.f;
            } else {
                const float iscale = 127.f / amax;
                for (int i = 0; i < 32; i++) {
                    const float v = rintf(xf[i] * iscale);
                    qb[i] = (int8_t)(v > 127.f ? 127.f : v < -127.f ? -127.f : v);
                    s += qb[i];
                }
                d[m * (K / 32) + b] = 1.f / iscale;
            }
            ob[m * (K / 32) + b] = offset * s;
        }
}

#ifdef GGUF_Q8K_DOT
/* acc[m] (16 rows) += one unit against rows m0 .. m0 + MM - 1 of x, block b */
static inline __attribute__((always_inline)) void x16_q32_unit(
        const int qtype, const int MM, const uint8_t *restrict t, const int8_t *q,
        const float *d, const int32_t *ob, int64_t K, int64_t b, int64_t m0, __m512 *acc) {
    __m512i c[8];
    if (qtype == GGML_Q8_0) {
        for (int v = 0; v < 8; v++) c[v] = _mm512_loadu_si512(t + 32 + 64 * v);
    } else {
        const __m512i m4 = _mm512_set1_epi8(0x0F), b4 = _mm512_set1_epi8(0x10);
        const __m512i hi = _mm512_loadu_si512(t + 288);
        /* bit 2 p + h of hi -> bit 4: 0xF8 = first | (second & third) */
#define X16_Q5(v, nib, s) c[v] = _mm512_ternarylogic_epi32(nib, \
        (s) <= 4 ? _mm512_slli_epi16(hi, 4 - (s)) : _mm512_srli_epi16(hi, (s) - 4), b4, 0xF8)
        for (int p = 0; p < 4; p++) {
            const __m512i nv = _mm512_loadu_si512(t + 32 + 64 * p);
            const __m512i lo = _mm512_and_si512(nv, m4);
            const __m512i up = _mm512_and_si512(_mm512_srli_epi16(nv, 4), m4);
            switch (p) {  /* constant shift counts */
            case 0: X16_Q5(0, lo, 0); X16_Q5(1, up, 1); break;
            case 1: X16_Q5(2, lo, 2); X16_Q5(3, up, 3); break;
            case 2: X16_Q5(4, lo, 4); X16_Q5(5, up, 5); break;
            default: X16_Q5(6, lo, 6); X16_Q5(7, up, 7); break;
            }
        }
#undef X16_Q5
    }
    const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)t));
    for (int m = 0; m < MM; m++) {
        const int8_t *qm = q + (m0 + m) * K + b * 32;
        __m512i s0 = _mm512_set1_epi32(-ob[(m0 + m) * (K / 32) + b]), s1 = _mm512_setzero_si512();
        for (int v = 0; v < 8; v += 2) {
            s0 = _mm512_dpbusd_epi32(s0, c[v], x16_bcast(qm + 4 * v));
            s1 = _mm512_dpbusd_epi32(s1, c[v + 1], x16_bcast(qm + 4 * v + 4));
        }
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1)),
                                 _mm512_mul_ps(dw, _mm512_set1_ps(d[(m0 + m) * (K / 32) + b])),
                                 acc[m]);
    }
}

static inline __attribute__((always_inline)) void x16_q32_group(
        const int qtype, const int MM, const uint8_t *restrict units, const int8_t *q,
        const float *d, const int32_t *ob, int64_t K, int64_t m0, float *y) {
    __m512 acc[4];
    for (int m = 0; m < MM; m++) acc[m] = _mm512_setzero_ps();
    const int ub = qtype == GGML_Q8_0 ? X16_Q8_0_UNIT : X16_Q5_0_UNIT;
    for (int64_t b = 0; b < K / 32; b++) {
        _mm_prefetch((const char *)units + (b + 8) * ub, _MM_HINT_T0);
        _mm_prefetch((const char *)units + (b + 8) * ub + 256, _MM_HINT_T0);
        x16_q32_unit(qtype, MM, units + b * ub, q, d, ob, K, b, m0, acc);
    }
    for (int m = 0; m < MM; m++) _mm512_storeu_ps(y + 16 * m, acc[m]);
}

static void x16_q32_rows(int qtype, const uint8_t *units, const int8_t *q, const float *d,
                         const int32_t *ob, int64_t M, int64_t K, float *y) {
    for (int64_t m0 = 0; m0 < M;) {
        const int64_t mm = M - m0 < 4 ? M - m0 : 4;
#define X16_Q32_CASE(QT) \
        switch (mm) { \
        case 1: x16_q32_group(QT, 1, units, q, d, ob, K, m0, y + 16 * m0); break; \
        case 2: x16_q32_group(QT, 2, units, q, d, ob, K, m0, y + 16 * m0); break; \
        case 3: x16_q32_group(QT, 3, units, q, d, ob, K, m0, y + 16 * m0); break; \
        default: x16_q32_group(QT, 4, units, q, d, ob, K, m0, y + 16 * m0); break; \
        }
        if (qtype == GGML_Q8_0) {
            X16_Q32_CASE(GGML_Q8_0)
        } else {
            X16_Q32_CASE(GGML_Q5_0)
        }
#undef X16_Q32_CASE
        m0 += mm;
    }
}
#endif
