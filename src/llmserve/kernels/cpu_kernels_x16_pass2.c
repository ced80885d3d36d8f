/* The second pass of gguf_matmul_x16 (included by cpu_kernels_x16.c and used by both of
 * its drivers, the Q4_K / Q6_K one and the Q8_0 / Q5_0 one).
 *
 * A row that fires is computed twice over all of K, not only over the spans that fired:
 * a pass restricted to those spans (tried) left the other spans of such rows at 8 bits,
 * and on Qwen2.5-Coder-1.5B, where about half of all decode rows fire in ffn_down, that
 * moved perplexity against the float32 model from -0.28% to +1.05% (the bound is 0.5%,
 * tests/test_quant_gguf_models.py). */

/* Rows of x whose Q8_K codes would be too coarse get a second pass. A block whose
 * largest |x| is more than X16_OUTLIER_RATIO times its mean |x| (Qwen2's "massive
 * activations": up to 240x at a sequence's first token, where Q8_K alone moved the
 * 1.5B model's logits by up to 13) rounds most of its values to 0 or +-1. Such a row
 * is x = d q + r with |r| <= d / 2 per block; r is quantized to Q8_K too and computed
 * as one more row, and the row's output is y(d q) + y(r): about 15 bits of each block's
 * range instead of 8. The decision reads only the row itself (batch invariance). */
#define X16_OUTLIER_RATIO 32.f

static int x16_needs_second_pass(int dtype, const void *x, int64_t K) {
    const size_t es = elem_size(dtype);
    float xf[256];
    for (int64_t b = 0; b < K; b += 256) {  /* spans of 256 (the last may be shorter) */
        const int n = K - b < 256 ? (int)(K - b) : 256;
        load_row(dtype, xf, (const char *)x + b * es, n);
        float amax = 0.f, sum = 0.f;
        for (int i = 0; i < n; i++) {
            const float v = fabsf(xf[i]);
            amax = v > amax ? v : amax;
            sum += v;
        }
        if (amax > X16_OUTLIER_RATIO * (sum / (float)n)) return 1;
    }
    return 0;
}

/* out[m, 16 gi ..] = the group's y rows (y row m at y + 16 m), plus each row's second
 * pass (row second[m] of y, when >= 0); rows past N are not stored */
static inline void x16_store_group(int dtype, void *out, int64_t out_stride, const float *y,
                                   const int64_t *second, int64_t M, int64_t N, int64_t gi) {
    const int64_t nr = N - gi * 16 < 16 ? N - gi * 16 : 16;
    for (int64_t m = 0; m < M; m++)
        for (int64_t r = 0; r < nr; r++)
            store(dtype, out, m * out_stride + gi * 16 + r,
                  second[m] < 0 ? y[16 * m + r] : y[16 * m + r] + y[16 * second[m] + r]);
}

static inline q8k_act q8k_act_row(q8k_act a, int64_t row, int64_t K) {
    q8k_act r = {a.q + row * K, a.d + row * (K / 256), a.bsum16 + row * (K / 16),
                 a.bsum32 + row * (K / 32)};
    return r;
}

/* quantizes the residual resid[K] into code row `row` of the driver's activations */
typedef void (*x16_requant_fn)(const float *resid, int64_t K, int64_t row, void *ctx);

/* The second pass of both drivers: each of the M rows whose span check fires gets its
 * residual x - d q (d one scale per `block` codes, row m of q/d) requantized by
 * `requant` into the next free code row; second[m] = that row, else -1. Returns the
 * rows of codes in all (M plus the second passes). resid: K floats of scratch. */
static int64_t x16_second_pass(int dtype, const void *x, int64_t x_stride, int64_t M,
                               int64_t K, int64_t block, const float *d, const int8_t *q,
                               float *resid, int64_t *second, x16_requant_fn requant,
                               void *ctx) {
    const int64_t nb = K / block;
    const size_t es = elem_size(dtype);
    int64_t rows = M;
    for (int64_t m = 0; m < M; m++) {
        const char *xm = (const char *)x + m * x_stride * es;
        second[m] = -1;
        if (!x16_needs_second_pass(dtype, xm, K)) continue;
        load_row(dtype, resid, xm, K);
        for (int64_t i = 0; i < K; i++) resid[i] -= d[m * nb + i / block] * (float)q[m * K + i];
        requant(resid, K, rows, ctx);
        second[m] = rows++;
    }
    return rows;
}

