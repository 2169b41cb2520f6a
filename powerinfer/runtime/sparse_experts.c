/* Sparse ReLU-gated experts for one token: only the rows of the neurons that fire.
 *
 * Built with kernels.c and qkernels.c. For each routed expert i (ascending), with normed input x [D]:
 *
 *   1. gate, up   g = gate_i . x over all F rows (pi_x8_gemm or pi_q_gemm), then u = up_i[j] . x only
 *                 where g[j] > 0 (pi_q_dot_rows)
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
int pi_x8_gemm(int qt, const void *W, int64_t N, int64_t K, const float *x, int64_t T, float *y);
int pi_q_dot_rows(int qt, const void *W1, const void *W2, const int64_t *idx, int64_t n, int64_t K,
                  const float *x, float *y1, float *y2, float gmin);
int pi_q_axpy_rows(int qt, const void *W, const int64_t *idx, const float *coef, int64_t n, int64_t D, float *out);
void pi_quantize_q8(const float *x, int64_t K, int8_t *qs, float *d);

enum { QT_Q4_0 = 10, QT_Q8_0 = 11 };     /* kernels.py's _QT codes */
enum { DOWN_COLS = 0, DOWN_ROWS = 1, DOWN_DENSE = 2 };
enum { FFN_REGLU = 0, FFN_DREGLU = 1 };
#define QK 32
#define CHUNK 2048 /* values of D summed per pass: an int32 and a float accumulator of this many in L1, each
                      * fired row and scale row read in one sequential run (256, the rows in pieces: 2.3 against
                      * 1.9 ms per SmallThinker-21B-shaped layer and token, 1 thread, one noisy measurement) */
#define PAR_MIN_D 512

static inline float f16_to_f32(uint16_t h) {
    _Float16 v;
    memcpy(&v, &h, 2);
    return (float)v;
}

#if defined(__AVX2__) && defined(__F16C__)
#define PI_AVX2 1
#include <immintrin.h>
#endif

/* acc[0 .. n) += q * (neuron row r's values), n a multiple of 32: Q4_0 into int16 (|sum| <= 32 * 8 * 127
 * over a block's 32 neurons: no overflow), Q8_0 into int32 */
static inline void add_row_q4(const uint8_t *r, int32_t q, int64_t n, int16_t *acc) {
#ifdef PI_AVX2
    const __m256i qv = _mm256_set1_epi16((int16_t)q), eight = _mm256_set1_epi16(8);
    const __m128i m4 = _mm_set1_epi8(0x0f);
    for (int64_t c = 0; c < n; c += QK, r += 16) {
        const __m128i t = _mm_loadu_si128((const __m128i *)r);
        const __m256i lo = _mm256_sub_epi16(_mm256_cvtepu8_epi16(_mm_and_si128(t, m4)), eight);
        const __m256i hi = _mm256_sub_epi16(_mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(t, 4), m4)), eight);
        __m256i *a = (__m256i *)(acc + c);
        _mm256_storeu_si256(a, _mm256_add_epi16(_mm256_loadu_si256(a), _mm256_mullo_epi16(lo, qv)));
        _mm256_storeu_si256(a + 1, _mm256_add_epi16(_mm256_loadu_si256(a + 1), _mm256_mullo_epi16(hi, qv)));
    }
#else
    for (int64_t c = 0; c < n; c += QK, r += 16)
        for (int i = 0; i < 16; i++) {
            acc[c + i] += (int16_t)(((int32_t)(r[i] & 15) - 8) * q);
            acc[c + i + 16] += (int16_t)(((int32_t)(r[i] >> 4) - 8) * q);
        }
#endif
}

static inline void add_row_q8(const int8_t *r, int32_t q, int64_t n, int32_t *acc) {
#ifdef PI_AVX2
    const __m256i qv = _mm256_set1_epi16((int16_t)q);
    for (int64_t c = 0; c < n; c += 16) {
        const __m256i p = _mm256_mullo_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(r + c))), qv);
        __m256i *a = (__m256i *)(acc + c);
        _mm256_storeu_si256(a, _mm256_add_epi32(_mm256_loadu_si256(a), _mm256_cvtepi16_epi32(_mm256_castsi256_si128(p))));
        _mm256_storeu_si256(a + 1, _mm256_add_epi32(_mm256_loadu_si256(a + 1),
                                                    _mm256_cvtepi16_epi32(_mm256_extracti128_si256(p, 1))));
    }
#else
    for (int64_t i = 0; i < n; i++) acc[i] += (int32_t)r[i] * q;
#endif
}

/* ys[0 .. n) += (scale[i] * db) * acc[i] (acc int16 for Q4_0, int32 for Q8_0), n a multiple of 16 */
static inline void fold(const uint16_t *s, float db, const void *acc, int q4, int64_t n, float *ys) {
#ifdef PI_AVX2
    const __m256 dv = _mm256_set1_ps(db);
    for (int64_t i = 0; i < n; i += 8) {
        const __m256i a = q4 ? _mm256_cvtepi16_epi32(_mm_loadu_si128((const __m128i *)((const int16_t *)acc + i)))
                             : _mm256_loadu_si256((const __m256i *)((const int32_t *)acc + i));
        const __m256 sc = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + i))), dv);
        _mm256_storeu_ps(ys + i, _mm256_fmadd_ps(sc, _mm256_cvtepi32_ps(a), _mm256_loadu_ps(ys + i)));
    }
#else
    for (int64_t i = 0; i < n; i++)
        ys[i] += f16_to_f32(s[i]) * db * (float)(q4 ? ((const int16_t *)acc)[i] : ((const int32_t *)acc)[i]);
#endif
}

/* y[d0 .. d1) = sum over blocks of the column layout (down_kind COLS), d0, d1 multiples of 32 */
static void cols_range(int qt, const uint16_t *scales, const uint8_t *quants, int64_t D, const int8_t *qx,
                       const float *dx, const int64_t *blocks, const int64_t *first, const int64_t *nz,
                       int64_t nblk, int64_t d0, int64_t d1, float *y) {
    const int q4 = qt == QT_Q4_0;
    const int64_t rowb = q4 ? D / 2 : D;
    int32_t acc[CHUNK]; /* int16 [CHUNK] for Q4_0 */
    float ys[CHUNK];
    for (int64_t c0 = d0; c0 < d1; c0 += CHUNK) {
        const int64_t n = d1 - c0 < CHUNK ? d1 - c0 : CHUNK;
        for (int64_t i = 0; i < n; i++) ys[i] = 0.f;
        for (int64_t bi = 0; bi < nblk; bi++) {
            memset(acc, 0, sizeof acc);
            for (int64_t p = first[bi]; p < first[bi + 1]; p++) {
                const int64_t j = nz[p];
                if (q4) add_row_q4(quants + j * rowb + c0 / 2, qx[j], n, (int16_t *)acc);
                else add_row_q8((const int8_t *)quants + j * rowb + c0, qx[j], n, acc);
            }
            fold(scales + blocks[bi] * D + c0, dx[blocks[bi]], acc, q4, n, ys);
        }
        memcpy(y + c0 - d0, ys, (size_t)n * sizeof(float));
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

/* out [D] += w * (the expert on x) once its gate products g [F] are known: up rows where g > 0, the hidden
 * values, the down rows or columns of the neurons whose hidden value is not 0 (arguments as
 * pi_sparse_experts'). Returns that neuron count or a negative error code. */
static int64_t after_gate(int qt, int ffn_kind, int down_kind, const float *g, const void *up, const void *dscale,
                          const void *down, float w, int64_t F, int64_t D, const float *x, float *out, float *buf,
                          int64_t *ibuf, int8_t *qbuf) {
    float *u = buf, *h = u + F, *dxs = h + F, *y = dxs + F;
    int64_t *nz = ibuf, *blocks = nz + F, *first = blocks + F / QK + 1, *live = first + F / QK + 1;
    int64_t k = 0;
    for (int64_t j = 0; j < F; j++)
        if (g[j] > 0.f) live[k++] = j;  /* relu(g) = 0 for the others: their up rows are not read */
    int rc = pi_q_dot_rows(qt, up, NULL, live, k, D, x, u, NULL, -INFINITY);
    if (rc) return rc;
    memset(h, 0, (size_t)F * sizeof(float));
    int64_t m = 0;
    for (int64_t p = 0; p < k; p++) {
        const float v = ffn_kind == FFN_DREGLU ? g[live[p]] * (u[p] > 0.f ? u[p] : 0.f) : g[live[p]] * u[p];
        h[live[p]] = v;
        if (v != 0.f) live[m++] = live[p];  /* compacted in place: m <= p */
    }
    if (down_kind == DOWN_COLS) {
        cols_down(qt, (const uint16_t *)dscale, (const uint8_t *)down, F, D, h, qbuf, dxs, blocks, first, nz, y);
    } else if (down_kind == DOWN_ROWS) {
        for (int64_t p = 0; p < m; p++) u[p] = h[live[p]];
        if ((rc = pi_q_axpy_rows(qt, down, live, u, m, D, y))) return rc;
    } else if ((rc = pi_q_gemm(qt, down, D, F, h, 1, y))) {
        return rc;
    }
    for (int64_t d = 0; d < D; d++) out[d] += y[d] * w;
    return m;
}

/* out [D] += sum_i w[i] * expert_i(x) for n experts; gate[i]: [F, D] of type qt, in 8-row groups when
 * gate_x8 (the dense kernels' fastest layout; every gate row is read) else rows; up[i]: [F, D] rows; down
 * per down_kind: COLS (dscale[i] scales, down[i] quants), ROWS (down[i] = down_t [F, D]) or DENSE (down[i] =
 * down [D, F] rows). buf: 4 F + D floats, ibuf: 2 F + 2 F/32 + 2 int64, qbuf: F int8 (scratch). Returns
 * the number of neurons whose hidden value was not 0 (summed over the experts), or a negative error
 * code of qkernels.c. */
int64_t pi_sparse_experts(int qt, int ffn_kind, int down_kind, int gate_x8, int64_t n, const void *const *gate,
                          const void *const *up, const void *const *dscale, const void *const *down, const float *w,
                          int64_t F, int64_t D, const float *x, float *out, float *buf, int64_t *ibuf, int8_t *qbuf) {
    int64_t fired = 0;
    for (int64_t i = 0; i < n; i++) {
        int rc = gate_x8 ? pi_x8_gemm(qt, gate[i], F, D, x, 1, buf) : pi_q_gemm(qt, gate[i], F, D, x, 1, buf);
        if (rc) return rc;
        const int64_t m = after_gate(qt, ffn_kind, down_kind, buf, up[i], dscale[i], down[i], w[i], F, D, x, out,
                                     buf + F, ibuf, qbuf);
        if (m < 0) return m;
        fired += m;
    }
    return fired;
}

/* The same for T tokens of one expert whose gate products g [T, F] are known (a prompt's tokens routed to
 * it, the gate read once for all of them): out [T, D] += w[t] * expert(x[t]). */
int64_t pi_sparse_expert_tokens(int qt, int ffn_kind, int down_kind, int64_t T, const float *g, const void *up,
                                const void *dscale, const void *down, const float *w, int64_t F, int64_t D,
                                const float *x, float *out, float *buf, int64_t *ibuf, int8_t *qbuf) {
    int64_t fired = 0;
    for (int64_t t = 0; t < T; t++) {
        const int64_t m = after_gate(qt, ffn_kind, down_kind, g + t * F, up, dscale, down, w[t], F, D, x + t * D,
                                     out + t * D, buf + F, ibuf, qbuf);
        if (m < 0) return m;
        fired += m;
    }
    return fired;
}
