/* The second pass of gguf_matmul_x16 (included by cpu_kernels_x16.c).
 *
 * Rows of x whose 8-bit codes would be too coarse get a second pass. A 256-span whose
 * largest |x| is more than X16_OUTLIER_RATIO times its mean |x| (Qwen2's "massive
 * activations": up to 240x at a sequence's first token, where Q8_K alone moved the
 * 1.5B model's logits by up to 13) rounds most of its values to 0 or +-1. Such a row
 * is x = d q + r with |r| <= d / 2 per block; r is quantized to 8 bits too, and the
 * row's output is y(d q) + y(r) over the spans that fired: about 15 bits of those
 * spans' range instead of 8 (every other span keeps 8 bits, as in a row with no
 * outlier). Only the fired spans' weight blocks run again, so a row with one outlier
 * span in K = 8960 (35 spans) costs 1/35 of a row more, not a whole row: on
 * Qwen2.5-Coder-1.5B about half of all decode rows fire in ffn_down, almost always in
 * one or two spans. The decision reads only the row itself (batch invariance).
 *
 *   x16_second_pass     finds the fired spans, requantizes each firing row's residual
 *                       into the next free code row (second[m]), fired[m][span] = 1
 *   (driver)            y[second[m]] = the residual row over its fired spans only
 *   x16_store_group     out[m] = y[m] + y[second[m]]
 */
#define X16_OUTLIER_RATIO 32.f
#define X16_SPAN 256

/* fired[j] = 1 for each 256-span j of x[K] (the last may be shorter) whose largest |x| is
 * over X16_OUTLIER_RATIO times its mean |x|, else 0; returns how many fired */
static int x16_fired_spans(int dtype, const void *x, int64_t K, uint8_t *fired) {
    const size_t es = elem_size(dtype);
    float xf[X16_SPAN];
    int count = 0;
    for (int64_t b = 0, j = 0; b < K; b += X16_SPAN, j++) {
        const int n = K - b < X16_SPAN ? (int)(K - b) : X16_SPAN;
        load_row(dtype, xf, (const char *)x + b * es, n);
        float amax = 0.f, sum = 0.f;
        for (int i = 0; i < n; i++) {
            const float v = fabsf(xf[i]);
            amax = v > amax ? v : amax;
            sum += v;
        }
        fired[j] = amax > X16_OUTLIER_RATIO * (sum / (float)n);
        count += fired[j];
    }
    return count;
}

static inline int64_t x16_num_spans(int64_t K) { return (K + X16_SPAN - 1) / X16_SPAN; }

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

/* Each of the M rows with a fired span gets its residual x - d q (d one scale per
 * `block` codes, row m of q/d) requantized by `requant` into the next free code row;
 * second[m] = that row, else -1; fired + m * x16_num_spans(K) = row m's spans. Returns
 * the rows of codes in all (M plus the second passes). resid: K floats of scratch. */
static int64_t x16_second_pass(int dtype, const void *x, int64_t x_stride, int64_t M,
                               int64_t K, int64_t block, const float *d, const int8_t *q,
                               float *resid, int64_t *second, uint8_t *fired,
                               x16_requant_fn requant, void *ctx) {
    const int64_t nb = K / block, spans = x16_num_spans(K);
    const size_t es = elem_size(dtype);
    int64_t rows = M;
    for (int64_t m = 0; m < M; m++) {
        const char *xm = (const char *)x + m * x_stride * es;
        second[m] = -1;
        if (!x16_fired_spans(dtype, xm, K, fired + m * spans)) continue;
        load_row(dtype, resid, xm, K);
        for (int64_t i = 0; i < K; i++) resid[i] -= d[m * nb + i / block] * (float)q[m * K + i];
        requant(resid, K, rows, ctx);
        second[m] = rows++;
    }
    return rows;
}
