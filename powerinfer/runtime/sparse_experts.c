/* Sparse ReLU-gated experts for one token: only the rows of the neurons that fire.
 *
 * Built with kernels.c and qkernels.c. For each routed expert i (ascending), with normed input x [D]:
 *
 *   1. gate, up   g = gate_i . x over all F rows, u = up_i[j] . x only where g[j] > 0   (pi_q_dot_rows, gmin 0)
 *   2. hidden     h[j] = relu(g[j]) * u[j]  (reglu) or relu(g[j]) * relu(u[j])  (dreglu); 0 for the rest
 *   3. down       y = down_i h over the neurons with h[j] != 0 only (see the layouts below)
 *   4. out       += w[i] * y
 *
 * Down layouts (down_kind):
 *   0 COLS: Q4_0/Q8_0 ``down`` [D, F] (blocks of 32 along F) re-laid out by block column, the same
 *     bytes: scales [F/32][D] f16 (block b's scale of every row d), then per neuron j its D quants
 *     (Q8_0: D int8; Q4_0: per 32 values 16 bytes, byte i = value i in the low nibble, value i + 16
 *     in the high one, offset 8). h is rounded to q8 blocks of 32 exactly as the dense product rounds
 *     it (pi_quantize_q8), and y[d] = sum_b (scale[b][d] * dx[b]) * sum_j q[j][d] * qx[j] with integer
 *     inner sums over the neurons of block b whose qx is not 0: the dense product's numbers, summed in
 *     another order (float rounding apart); a block with no such neuron is not read.
 *   1 ROWS: ``down_t`` [F, D] rows of type qt (f16/bf16: the transpose, exact): pi_q_axpy_rows over the
 *     neurons with h != 0.
 *   2 DENSE: ``down`` [D, F] rows of type qt as in the file (K-quants, Q5_x): pi_q_gemm on h (every row).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

int pi_q_gemm(int qt, const void *W, int64_t N, int64_t K, const float *x, int64_t T, float *y);
int pi_q_dot_rows(int qt, const void *W1, const void *W2, const int64_t *idx, int64_t n, int64_t K,
                  const float *x, float *y1, float *y2, float gmin);
int pi_q_axpy_rows(int qt, const void *W, const int64_t *idx, const float *coef, int64_t n, int64_t D, float *out);
void pi_quantize_q8(const float *x, int64_t K, int8_t *qs, float *d);

enum { QT_Q4_0 = 10, QT_Q8_0 = 11 };     /* kernels.py's _QT codes */
enum { DOWN_COLS = 0, DOWN_ROWS = 1, DOWN_DENSE = 2 };
enum { FFN_REGLU = 0, FFN_DREGLU = 1 };
#define QK 32
#define CHUNK 256 /* values of D summed per pass (an int32 and a float accumulator of this many in L1) */
#define PAR_MIN_D 512

static inline float f16_to_f32(uint16_t h) {
    _Float16 v;
    memcpy(&v, &h, 2);
    return (float)v;
}

/* y[d0 .. d1) = sum over blocks of the column layout (down_kind COLS), d0, d1 multiples of 32 */
static void cols_range(int qt, const uint16_t *scales, const uint8_t *quants, int64_t D, const int8_t *qx,
                       const float *dx, const int64_t *blocks, const int64_t *first, const int64_t *nz,
                       int64_t nblk, int64_t d0, int64_t d1, float *y) {
    const int64_t rowb = qt == QT_Q4_0 ? D / 2 : D;
    int32_t acc[CHUNK];
    float ys[CHUNK];
    for (int64_t c0 = d0; c0 < d1; c0 += CHUNK) {
        const int64_t n = d1 - c0 < CHUNK ? d1 - c0 : CHUNK;
        for (int64_t i = 0; i < n; i++) ys[i] = 0.f;
        for (int64_t bi = 0; bi < nblk; bi++) {
            const int64_t b = blocks[bi];
            for (int64_t i = 0; i < n; i++) acc[i] = 0;
            for (int64_t p = first[bi]; p < first[bi + 1]; p++) {
                const int64_t j = nz[p];
                const int32_t q = qx[j];
                if (qt == QT_Q4_0) {
                    const uint8_t *r = quants + j * rowb + c0 / 2;
                    for (int64_t c = 0; c < n; c += QK, r += 16)
                        for (int i = 0; i < 16; i++) {
                            acc[c + i] += ((int32_t)(r[i] & 15) - 8) * q;
                            acc[c + i + 16] += ((int32_t)(r[i] >> 4) - 8) * q;
                        }
                } else {
                    const int8_t *r = (const int8_t *)quants + j * rowb + c0;
                    for (int64_t i = 0; i < n; i++) acc[i] += (int32_t)r[i] * q;
                }
            }
            const uint16_t *s = scales + b * D + c0;
            const float db = dx[b];
            for (int64_t i = 0; i < n; i++) ys[i] += f16_to_f32(s[i]) * db * (float)acc[i];
        }
        for (int64_t i = 0; i < n; i++) y[c0 - d0 + i] = ys[i];
    }
}

/* y [D] = down h for the column layout. qx [F] int8, dx [F/32], blocks/first [F/32 + 1], nz [F] int64 scratch. */
static void cols_down(int qt, const uint16_t *scales, const uint8_t *quants, int64_t F, int64_t D, const float *h,
                      int8_t *qx, float *dx, int64_t *blocks, int64_t *first, int64_t *nz, float *y) {
    pi_quantize_q8(h, F, qx, dx);
    int64_t nblk = 0, m = 0;
    for (int64_t b = 0; b < F / QK; b++) {
        const int64_t m0 = m;
        for (int64_t j = b * QK; j < (b + 1) * QK; j++)
            if (qx[j] != 0) nz[m++] = j;
        if (m > m0) {
            blocks[nblk] = b;
            first[nblk++] = m0;
        }
    }
    first[nblk] = m;
    const int par = D >= PAR_MIN_D && nblk > 0 && omp_get_max_threads() > 1;
    #pragma omp parallel if (par)
    {
        const int nt = omp_get_num_threads(), t = omp_get_thread_num();
        const int64_t per = ((D / QK + nt - 1) / nt) * QK;
        const int64_t d0 = t * per < D ? t * per : D, d1 = d0 + per < D ? d0 + per : D;
        if (d1 > d0) cols_range(qt, scales, quants, D, qx, dx, blocks, first, nz, nblk, d0, d1, y + d0);
    }
}

/* out [D] += sum_i w[i] * expert_i(x) for n experts; gate[i], up[i]: [F, D] rows of type qt; down per
 * down_kind: COLS (dscale[i] scales, down[i] quants), ROWS (down[i] = down_t [F, D]) or DENSE (down[i] =
 * down [D, F]). idx [F] = 0 .. F-1; buf: 4 F + D floats, ibuf: 2 F + 2 F/32 + 2 int64, qbuf: F int8
 * (scratch). Returns the number of neurons whose hidden value was not 0 (summed over the experts), or a
 * negative error code of qkernels.c. */
int64_t pi_sparse_experts(int qt, int ffn_kind, int down_kind, int64_t n, const void *const *gate,
                          const void *const *up, const void *const *dscale, const void *const *down, const float *w,
                          int64_t F, int64_t D, const float *x, float *out, const int64_t *idx, float *buf,
                          int64_t *ibuf, int8_t *qbuf) {
    float *g = buf, *u = g + F, *h = u + F, *dxs = h + F, *y = dxs + F;
    int64_t *nz = ibuf, *blocks = nz + F, *first = blocks + F / QK + 1, *live = first + F / QK + 1;
    int64_t fired = 0;
    for (int64_t i = 0; i < n; i++) {
        int rc = pi_q_dot_rows(qt, gate[i], up[i], idx, F, D, x, g, u, 0.f);
        if (rc) return rc;
        int64_t k = 0;
        for (int64_t j = 0; j < F; j++) {
            const float a = g[j] > 0.f ? g[j] : 0.f;
            const float v = ffn_kind == FFN_DREGLU ? a * (u[j] > 0.f ? u[j] : 0.f) : a * u[j];
            h[j] = v;
            if (v != 0.f) live[k++] = j;
        }
        fired += k;
        if (down_kind == DOWN_COLS) {
            cols_down(qt, (const uint16_t *)dscale[i], (const uint8_t *)down[i], F, D, h, qbuf, dxs, blocks, first,
                      nz, y);
        } else if (down_kind == DOWN_ROWS) {
            for (int64_t p = 0; p < k; p++) g[p] = h[live[p]];
            if ((rc = pi_q_axpy_rows(qt, down[i], live, g, k, D, y))) return rc;
        } else if ((rc = pi_q_gemm(qt, down[i], D, F, h, 1, y))) {
            return rc;
        }
        const float wi = w[i];
        for (int64_t d = 0; d < D; d++) out[d] += y[d] * wi;
    }
    return fired;
}
