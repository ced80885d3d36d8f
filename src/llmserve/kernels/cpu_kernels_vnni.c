/* Q8_K activations for the int8-activation GGUF matmul (included by cpu_kernels.c;
 * the matmul itself is gguf_matmul_x16, cpu_kernels_x16.c).
 *
 * llama.cpp's scheme (ggml_vec_dot_q4_K_q8_K / ggml_vec_dot_q6_K_q8_K,
 * ggml-cpu/arch/x86/quants.c): each row of x is quantized once per call to Q8_K,
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
 * A row's quantization is its own: its result never depends on the other rows.
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
#else
int gguf_q8k_available(void) { return 0; }
#endif
