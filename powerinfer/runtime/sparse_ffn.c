/* One token's sparse FFN in one call: PowerInfer's decode step for a layer (SOSP'24, section 5).
 *
 * Built with kernels.c and qkernels.c. The same kernels, in the same order and with the same
 * rounding, as the Python path (ffn.FFN.rows after kernels.predict), so both give the same
 * numbers; the one call saves the ~20 torch operations and 5 ctypes calls per layer and token
 * that the Python path spends around them:
 *
 *   1. predictor  z = relu(fc1 h), logits = fc2 z          (pi_x8_gemm or pi_q_gemm)
 *   2. selection  idx = { j : logits[j] >= threshold }     (ascending)
 *   3. rows       g, u = gate[idx] . x, up[idx] . x        (pi_q_dot_rows; up rows of gates <= gmin unread)
 *   4. combine    hidden = act(g) * u  (reglu), act(g) * act(u) (dreglu), act(u) (relu FFN)
 *   5. down       out = sum_i hidden[i] down_t[idx[i]]     (pi_q_axpy_rows; zero coefficients unread)
 *
 * act: 0 relu (v > 0 ? v : 0), 1 fatrelu (v >= act_thr ? v : 0).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>

/* qkernels.c: 0, or a negative error code (an allocation failed) */
int pi_q_gemm(int qt, const void *W, int64_t N, int64_t K, const float *x, int64_t T, float *y);
int pi_x8_gemm(int qt, const void *W, int64_t N, int64_t K, const float *x, int64_t T, float *y);
int pi_q_dot_rows(int qt, const void *W1, const void *W2, const int64_t *idx, int64_t n, int64_t K,
                  const float *x, float *y1, float *y2, float gmin);
int pi_q_axpy_rows(int qt, const void *W, const int64_t *idx, const float *coef, int64_t n, int64_t D, float *out);

enum { FFN_REGLU = 0, FFN_DREGLU = 1, FFN_RELU = 2 };

static inline float act_apply(int act, float thr, float v) {
    return act == 0 ? (v > 0.f ? v : 0.f) : (v >= thr ? v : 0.f);
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static int gemv(int qt, int x8, const void *W, int64_t N, int64_t K, const float *x, float *y) {
    return x8 ? pi_x8_gemm(qt, W, N, K, x, 1, y) : pi_q_gemm(qt, W, N, K, x, 1, y);
}

/* h, x [D] f32 (predictor input, normed FFN input); fc1 [H, D], fc2 [F, H]; gate (NULL for a
 * relu FFN), up, down_t [F, D] of type qt; out [D] f32. idx [F] int64 and buf [H + 3 F] f32
 * are scratch. Returns the number of predicted-active neurons (a negative error code of
 * qkernels.c when a kernel's allocation failed); *n_fired gets the number whose hidden value is
 * not 0, *t_predict the seconds the predictor took. */
int64_t pi_q_sparse_ffn(int qt1, int x8_1, const void *fc1, int64_t H, int qt2, int x8_2, const void *fc2,
                        float threshold, int qt, int ffn_kind, const void *gate, const void *up, const void *down_t,
                        int64_t F, int64_t D, int act, float act_thr, float gmin, const float *h, const float *x,
                        float *out, int64_t *idx, float *buf, int64_t *n_fired, double *t_predict) {
    float *z = buf, *logits = buf + H, *g = logits + F, *u = g + F;
    const double t0 = now();
    int rc = gemv(qt1, x8_1, fc1, H, D, h, z);
    if (rc) return rc;
    for (int64_t i = 0; i < H; i++) z[i] = z[i] > 0.f ? z[i] : 0.f;
    if ((rc = gemv(qt2, x8_2, fc2, F, H, z, logits))) return rc;
    int64_t k = 0;
    for (int64_t j = 0; j < F; j++)
        if (logits[j] >= threshold) idx[k++] = j;
    *t_predict = now() - t0;
    rc = ffn_kind == FFN_RELU ? pi_q_dot_rows(qt, up, NULL, idx, k, D, x, u, NULL, -INFINITY)
                              : pi_q_dot_rows(qt, gate, up, idx, k, D, x, g, u, gmin);
    if (rc) return rc;
    int64_t fired = 0;
    for (int64_t i = 0; i < k; i++) {
        float v;
        if (ffn_kind == FFN_REGLU) v = act_apply(act, act_thr, g[i]) * u[i];
        else if (ffn_kind == FFN_DREGLU) v = act_apply(act, act_thr, g[i]) * act_apply(act, act_thr, u[i]);
        else v = act_apply(act, act_thr, u[i]);
        g[i] = v;  /* the hidden values, in place of the gate products */
        fired += v != 0.f;
    }
    if ((rc = pi_q_axpy_rows(qt, down_t, idx, g, k, D, out))) return rc;
    *n_fired = fired;
    return k;
}
