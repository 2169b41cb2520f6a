/* Decode and prompt kernels on GGML block-quantized weights, read in place from the file's map.
 *
 * Built together with kernels.c (same flags, same OpenMP runtime). Weight types (`qt`):
 *   QT_F16  2   IEEE half rows (f16 files: every matrix; predictors of quantized files)
 *   QT_BF16 30  bfloat16 rows (bf16 files on CPUs without bf16 dot products)
 *   QT_Q4_0 10  32 values in 18 bytes: half d, 16 bytes of nibbles (value j: low nibble of
 *               byte j, value j+16: high nibble), value = d * (q - 8)
 *   QT_Q8_0 11  32 values in 34 bytes: half d, 32 int8, value = d * q
 *   QT_Q4_K 12  256 values in 144 bytes (ggml's block_q4_K)
 *   QT_Q6_K 13  256 values in 210 bytes (ggml's block_q6_K)
 *   QT_Q5_0 14  32 values in 22 bytes: half d, 4 bytes qh (bit j: the 5th bit of value j),
 *               16 bytes of nibbles as Q4_0, value = d * ((nibble | bit << 4) - 16)
 *   QT_Q5_1 15  32 values in 24 bytes: half d, half m, qh, nibbles as Q5_0, value = d * q + m
 *   QT_Q5_K 16  256 values in 176 bytes (ggml's block_q5_K: Q4_K's scales, 32 bytes qh, 128 qs)
 *   (Q5_0, Q5_1: what llama.cpp's quantizer writes for Q4_K, Q5_K targets whose rows are not a
 *   multiple of 256 values; Q8_0 stands for Q6_K there)
 *
 * Block-quantized products (every type above but F16, BF16) follow ggml: the activation vector is quantized once
 * per product to 8-bit blocks, each block or sub-block product is an exact integer sum scaled by
 * the block scales, and block results are summed in fp32. Q4_0, Q8_0, Q5_0, Q5_1: blocks of 32
 * (scale amax/127 kept in fp32, round to nearest even; Q5_0/Q5_1 also take the sums of each 16
 * values). Q4_K, Q5_K, Q6_K: ggml's q8_K, blocks of 256 (iscale = 127/amax, scale 1/iscale in fp32,
 * q = round-to-nearest-even(x iscale), as ggml's quantize_row_q8_K_ref up to a sign that cancels
 * in every product; the sums of each 16 values), and a super-block's products are summed in int32
 * with the sub-block scales and mins, then scaled once in fp32 (d dy), as ggml's vec_dot_q*_K_q8_K.
 * F16 rows are converted to fp32 in registers (F16C) and BF16 rows by a 16-bit shift, then
 * dotted with the fp32 activation, so a 16-bit file is read at 2 bytes a weight.
 *
 * Sparse FFN rows: pi_q_dot_rows computes the gate row of each active neuron first and
 * reads its up row only when the gate passes `gmin` (a ReLU-family neuron whose gate does
 * not fire contributes exactly zero, so its up row need not be read); pi_q_axpy_rows skips
 * neurons whose coefficient is exactly zero. Both prefetch the next active row.
 *
 * AVX2 paths (with F16C) where the compiler targets them, scalar C elsewhere.
 */
#include <math.h>
#include <stdint.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PI_AVX2 1
#include <immintrin.h>
#endif

enum { QT_F16 = 2, QT_BF16 = 30, QT_Q4_0 = 10, QT_Q8_0 = 11, QT_Q4_K = 12, QT_Q6_K = 13, QT_Q5_0 = 14, QT_Q5_1 = 15,
       QT_Q5_K = 16 };
#define QK 32
#define QKK 256
#define PAR_MIN_BYTES (1 << 17) /* below this many weight bytes a call runs on the calling thread */
#define X8_AHEAD 4096 /* bytes ahead prefetched in the 8-row kernel's stream */
#define X8K_TW 32 /* K-quant prompts: tiles of up to 32 tokens (their sums in L1, each sub-block unpacked once for
                   * them); 256x4096 in cache, 64 tokens, 1 thread, against tiles of 4: Q4_K 1.18x, Q5_K 1.34x, Q6_K
                   * 1.40x (16: 1.14x, 1.34x, 1.32x; 8 less) */
#ifndef ROWS_AHEAD
#define ROWS_AHEAD 4 /* rows prefetched ahead in the sparse row passes (2, 4, 8 measured: 4) */
#endif

static inline float h2f(uint16_t h) {
#ifdef PI_AVX2
    return _cvtsh_ss(h);
#else
    const uint32_t s = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff;
    union { uint32_t u; float f; } v;
    if (e == 0) {
        v.f = ldexpf((float)m, -24);
        v.u |= s;
        return v.f;
    }
    v.u = e == 31 ? (s | 0x7f800000u | (m << 13)) : (s | ((e + 112) << 23) | (m << 13));
    return v.f;
#endif
}

static inline uint16_t rd16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }

static inline float b2f(uint16_t b) {
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)b << 16;
    return v.f;
}
static inline int is_16bit(int qt) { return qt == QT_F16 || qt == QT_BF16; }

static inline int is_k(int qt) { return qt == QT_Q4_K || qt == QT_Q5_K || qt == QT_Q6_K; }
static int64_t block_values(int qt) { return is_16bit(qt) ? 1 : is_k(qt) ? QKK : QK; }
static int64_t block_bytes(int qt) {
    switch (qt) {
        case QT_F16:
        case QT_BF16: return 2;
        case QT_Q4_0: return 18;
        case QT_Q8_0: return 34;
        case QT_Q4_K: return 144;
        case QT_Q6_K: return 210;
        case QT_Q5_0: return 22;
        case QT_Q5_1: return 24;
        case QT_Q5_K: return 176;
    }
    return 0;
}
static inline int64_t row_bytes(int qt, int64_t K) { return K / block_values(qt) * block_bytes(qt); }
static inline int is_q0(int qt) { return qt == QT_Q4_0 || qt == QT_Q8_0; }
static inline int is_q5(int qt) { return qt == QT_Q5_0 || qt == QT_Q5_1; }
/* types whose products quantize the activation to q8 blocks (K-quants and Q5_0/Q5_1 also need its 16-sums) */
static inline int uses_q8(int qt) { return is_q0(qt) || is_k(qt) || is_q5(qt); }
static inline int needs_sums(int qt) { return is_k(qt) || is_q5(qt); }

#ifdef PI_AVX2
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
/* 16 bytes of nibbles -> 32 int8 in block order (low nibbles, then high), minus 8 */
static inline __m256i q4_0_bytes(const uint8_t *qs) {
    const __m128i t = _mm_loadu_si128((const __m128i *)qs);
    const __m256i v = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(t, 4), t), _mm256_set1_epi8(0x0f));
    return _mm256_sub_epi8(v, _mm256_set1_epi8(8));
}
/* sum of products of 32 signed bytes as 8 int32 lanes, converted to float */
static inline __m256 dot_i8(__m256i a, __m256i b) {
    const __m256i ax = _mm256_sign_epi8(a, a), sb = _mm256_sign_epi8(b, a);
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(ax, sb), _mm256_set1_epi16(1)));
}

/* The 32 signed quants of a Q4_0 or Q8_0 block (after its fp16 scale). */
static inline __m256i q0_quants(int qt, const uint8_t *blk) {
    return qt == QT_Q4_0 ? q4_0_bytes(blk + 2) : _mm256_loadu_si256((const __m256i *)(blk + 2));
}

/* One Q4_0 or Q8_0 row . the q8 activation (inlined with a constant qt: one loop per type). */
static inline float dot_q0(int qt, const uint8_t *row, const int8_t *xq, const float *xd, int64_t nb) {
    const int64_t bb = qt == QT_Q4_0 ? 18 : 34;
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = row + b * bb;
        const __m256 s = _mm256_set1_ps(h2f(rd16(blk)) * xd[b]);
        acc = _mm256_fmadd_ps(s, dot_i8(q0_quants(qt, blk), _mm256_loadu_si256((const __m256i *)(xq + b * QK))), acc);
    }
    return hsum8(acc);
}

/* Four rows . the same activation, each row's sum in exactly dot_q0's order (so the numbers
 * equal four dot_q0 calls bit for bit): four independent FMA chains instead of one, and the
 * activation block loaded once for the four (one chain waits on the FMA latency). */
static inline void dot4_q0(int qt, const uint8_t *const *rows, const int8_t *xq, const float *xd, int64_t nb,
                           float *out) {
    const int64_t bb = qt == QT_Q4_0 ? 18 : 34;
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t b = 0; b < nb; b++) {
        const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + b * QK));
        for (int i = 0; i < 4; i++) {
            const uint8_t *blk = rows[i] + b * bb;
            const __m256 s = _mm256_set1_ps(h2f(rd16(blk)) * xd[b]);
            acc[i] = _mm256_fmadd_ps(s, dot_i8(q0_quants(qt, blk), xv), acc[i]);
        }
    }
    for (int i = 0; i < 4; i++) out[i] = hsum8(acc[i]);
}
#endif

/* ------------------------------------------------------------------ activation quantization */
/* x [K] f32 -> qs [K] int8, d [K/32] f32 (K a multiple of 32). The AVX2 path gives the
 * scalar path's bytes: the block maximum is exact, the scale is the same fp32 division, and
 * vroundps rounds half to even as nearbyintf does in the default rounding mode. */
static void quantize_q8(const float *x, int64_t K, int8_t *qs, float *d) {
    for (int64_t b = 0; b < K / QK; b++) {
        const float *xb = x + b * QK;
#ifdef PI_AVX2
        const __m256 sign = _mm256_set1_ps(-0.f);
        __m256 v[4], m = _mm256_setzero_ps();
        for (int j = 0; j < 4; j++) {
            v[j] = _mm256_loadu_ps(xb + 8 * j);
            m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[j]));
        }
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        h = _mm_max_ss(h, _mm_movehdup_ps(h));
        const float amax = _mm_cvtss_f32(h);
        const float db = amax / 127.f, id = db != 0.f ? 1.f / db : 0.f;
        d[b] = db;
        const __m256 vid = _mm256_set1_ps(id);
        __m256i i32[4];
        for (int j = 0; j < 4; j++)
            i32[j] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[j], vid), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        /* int32 -> int8 (|q| <= 127: the packs do not saturate); packs work per 128-bit lane */
        const __m256i p16 = _mm256_packs_epi32(i32[0], i32[1]), q16 = _mm256_packs_epi32(i32[2], i32[3]);
        const __m256i p8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p16, q16),
                                                        _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)(qs + b * QK), p8);
#else
        float amax = 0.f;
        for (int j = 0; j < QK; j++) amax = fmaxf(amax, fabsf(xb[j]));
        const float db = amax / 127.f, id = db != 0.f ? 1.f / db : 0.f;
        d[b] = db;
        for (int j = 0; j < QK; j++) qs[b * QK + j] = (int8_t)nearbyintf(xb[j] * id);
#endif
    }
}

/* x [K] f32 -> ggml's q8_K (K a multiple of 256): qs [K] int8, d [K/256] f32, s [K/16] the sums of
 * each 16 qs. Per block of 256: iscale = 127/amax, d = 1/iscale (both fp32 divisions, as ggml's
 * quantize_row_q8_K_ref; ggml takes the sign of the largest-magnitude value into iscale, which
 * negates both q and d: every product d q is the same), q = round half to even of x iscale
 * (|x iscale| <= 127 up to one rounding: no clamp needed); amax 0 gives d 0, q 0. */
static void quantize_q8K(const float *x, int64_t K, int8_t *qs, float *d, int32_t *s) {
    for (int64_t b = 0; b < K / QKK; b++) {
        const float *xb = x + b * QKK;
        int8_t *q = qs + b * QKK;
        float amax = 0.f;
#ifdef PI_AVX2
        const __m256 sign = _mm256_set1_ps(-0.f);
        __m256 m = _mm256_setzero_ps();
        for (int j = 0; j < QKK; j += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(xb + j)));
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        h = _mm_max_ss(h, _mm_movehdup_ps(h));
        amax = _mm_cvtss_f32(h);
#else
        for (int j = 0; j < QKK; j++) amax = fmaxf(amax, fabsf(xb[j]));
#endif
        const float iscale = amax != 0.f ? 127.f / amax : 0.f;
        d[b] = amax != 0.f ? 1.f / iscale : 0.f;
#ifdef PI_AVX2
        const __m256 vi = _mm256_set1_ps(iscale);
        for (int j = 0; j < QKK; j += 32) {
            __m256i i32[4];
            for (int e = 0; e < 4; e++)
                i32[e] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(xb + j + 8 * e), vi),
                                                            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
            const __m256i p16 = _mm256_packs_epi32(i32[0], i32[1]), q16 = _mm256_packs_epi32(i32[2], i32[3]);
            _mm256_storeu_si256((__m256i *)(q + j), _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p16, q16),
                                                                           _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
        }
#else
        for (int j = 0; j < QKK; j++) q[j] = (int8_t)nearbyintf(xb[j] * iscale);
#endif
        for (int g = 0; g < QKK / 16; g++) {
            int32_t v = 0;
            for (int e = 0; e < 16; e++) v += q[16 * g + e];
            s[b * (QKK / 16) + g] = v;
        }
    }
}
/* quantize_q8 for the other sources (sparse_experts.c rounds an expert's hidden vector as the dense
 * down product would) */
void pi_quantize_q8(const float *x, int64_t K, int8_t *qs, float *d) { quantize_q8(x, K, qs, d); }

/* ------------------------------------------------------------------ one row . x */
static inline float dot_q4_0(const uint8_t *row, const int8_t *xq, const float *xd, int64_t nb) {
#ifdef PI_AVX2
    return dot_q0(QT_Q4_0, row, xq, xd, nb);
#else
    float acc = 0.f;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = row + b * 18, *qs = blk + 2;
        const int8_t *y = xq + b * QK;
        int32_t s = 0;
        for (int j = 0; j < 16; j++) s += ((qs[j] & 15) - 8) * y[j] + ((qs[j] >> 4) - 8) * y[j + 16];
        acc += h2f(rd16(blk)) * xd[b] * (float)s;
    }
    return acc;
#endif
}

static inline float dot_q8_0(const uint8_t *row, const int8_t *xq, const float *xd, int64_t nb) {
#ifdef PI_AVX2
    return dot_q0(QT_Q8_0, row, xq, xd, nb);
#else
    float acc = 0.f;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = row + b * 34;
        const int8_t *q = (const int8_t *)(blk + 2), *y = xq + b * QK;
        int32_t s = 0;
        for (int j = 0; j < QK; j++) s += q[j] * y[j];
        acc += h2f(rd16(blk)) * xd[b] * (float)s;
    }
    return acc;
#endif
}

static inline void get_scale_min_k4(int j, const uint8_t *q, uint8_t *d, uint8_t *m) {
    if (j < 4) {
        *d = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *d = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* one 256-value super-block -> f32 (ggml's dequantize_row_q4_K / _q6_K) */
static void deq_q4_K(const uint8_t *blk, float *y) {
    const float d = h2f(rd16(blk)), dmin = h2f(rd16(blk + 2));
    const uint8_t *sc = blk + 4, *q = blk + 16;
    for (int j = 0, is = 0; j < QKK; j += 64, is += 2, q += 32) {
        uint8_t s, m;
        get_scale_min_k4(is, sc, &s, &m);
        const float d1 = d * s, m1 = dmin * m;
        get_scale_min_k4(is + 1, sc, &s, &m);
        const float d2 = d * s, m2 = dmin * m;
        for (int l = 0; l < 32; l++) y[j + l] = d1 * (q[l] & 0xF) - m1;
        for (int l = 0; l < 32; l++) y[j + 32 + l] = d2 * (q[l] >> 4) - m2;
    }
}

static void deq_q6_K(const uint8_t *blk, float *y) {
    const uint8_t *ql = blk, *qh = blk + 128;
    const int8_t *sc = (const int8_t *)(blk + 192);
    const float d = h2f(rd16(blk + 208));
    for (int n = 0; n < QKK; n += 128, y += 128, ql += 64, qh += 32, sc += 8)
        for (int l = 0; l < 32; l++) {
            const int is = l / 16;
            const int q1 = (int)((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
            const int q2 = (int)((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
            const int q3 = (int)((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
            const int q4 = (int)((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
            y[l] = d * sc[is] * q1;
            y[l + 32] = d * sc[is + 2] * q2;
            y[l + 64] = d * sc[is + 4] * q3;
            y[l + 96] = d * sc[is + 6] * q4;
        }
}

/* one 256-value Q5_K super-block -> f32 (ggml's dequantize_row_q5_K): Q4_K's 6-bit scales and
 * mins, 4-bit low parts in qs, and the 5th bit of value 64 c + 32 h + l in bit 2 c + h of qh[l] */
static void deq_q5_K(const uint8_t *blk, float *y) {
    const float d = h2f(rd16(blk)), dmin = h2f(rd16(blk + 2));
    const uint8_t *sc = blk + 4, *qh = blk + 16, *q = blk + 48;
    for (int c = 0; c < 4; c++, q += 32)
        for (int h = 0; h < 2; h++) {
            uint8_t s, m;
            get_scale_min_k4(2 * c + h, sc, &s, &m);
            const float ds = d * s, dm = dmin * m;
            for (int l = 0; l < 32; l++) {
                const int v = (h ? q[l] >> 4 : q[l] & 15) | (((qh[l] >> (2 * c + h)) & 1) << 4);
                y[64 * c + 32 * h + l] = ds * v - dm;
            }
        }
}

/* one 32-value Q5_0 or Q5_1 block -> f32 (ggml's dequantize_row_q5_0 / _q5_1) */
static void deq_q5(int qt, const uint8_t *blk, float *y) {
    const float d = h2f(rd16(blk)), m = qt == QT_Q5_1 ? h2f(rd16(blk + 2)) : 0.f;
    const uint8_t *qh = blk + (qt == QT_Q5_1 ? 4 : 2), *qs = qh + 4;
    uint32_t h;
    memcpy(&h, qh, 4);
    for (int j = 0; j < 16; j++) {
        const int lo = (qs[j] & 15) | (((h >> j) & 1) << 4), hi = (qs[j] >> 4) | (((h >> (j + 16)) & 1) << 4);
        if (qt == QT_Q5_1) {
            y[j] = d * lo + m;
            y[j + 16] = d * hi + m;
        } else {
            y[j] = d * (lo - 16);
            y[j + 16] = d * (hi - 16);
        }
    }
}

static inline float dot_f32(const float *a, const float *b, int64_t n) {
    int64_t i = 0;
    float acc = 0.f;
#ifdef PI_AVX2
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    for (; i + 16 <= n; i += 16) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), a1);
    }
    acc = hsum8(_mm256_add_ps(a0, a1));
#endif
    for (; i < n; i++) acc += a[i] * b[i];
    return acc;
}

#ifdef PI_AVX2
/* 8 bfloat16 -> 8 fp32: the 16 bits become the high half of each fp32 */
static inline __m256 bf16x8(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
/* 8 f16 or bf16 values -> 8 fp32 */
static inline __m256 load16x8(int qt, const uint16_t *p) {
    return qt == QT_BF16 ? bf16x8(p) : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}
#endif

/* One f16 or bf16 row . x: converted in registers (F16C, or the 16-bit shift), fp32 sums. */
static inline float dot_16(int qt, const uint8_t *row, const float *x, int64_t K) {
    const uint16_t *h = (const uint16_t *)row;
    int64_t i = 0;
    float acc = 0.f;
#ifdef PI_AVX2
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    for (; i + 16 <= K; i += 16) {
        a0 = _mm256_fmadd_ps(load16x8(qt, h + i), _mm256_loadu_ps(x + i), a0);
        a1 = _mm256_fmadd_ps(load16x8(qt, h + i + 8), _mm256_loadu_ps(x + i + 8), a1);
    }
    acc = hsum8(_mm256_add_ps(a0, a1));
#endif
    for (; i < K; i++) acc += (qt == QT_BF16 ? b2f(h[i]) : h2f(h[i])) * x[i];
    return acc;
}

#ifdef PI_AVX2
/* out[i] = row_i . x for 4 f16/bf16 rows (K a multiple of 8): one pass over x for 4 rows,
 * 4 independent FMA chains (a GEMV is then bound by reading the rows, not by one chain) */
static inline void dot4_16(int qt, const uint8_t *const *rows, const float *x, int64_t K, float *out) {
    const uint16_t *h0 = (const uint16_t *)rows[0], *h1 = (const uint16_t *)rows[1];
    const uint16_t *h2 = (const uint16_t *)rows[2], *h3 = (const uint16_t *)rows[3];
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
    for (int64_t i = 0; i < K; i += 8) {
        const __m256 xv = _mm256_loadu_ps(x + i);
        a0 = _mm256_fmadd_ps(load16x8(qt, h0 + i), xv, a0);
        a1 = _mm256_fmadd_ps(load16x8(qt, h1 + i), xv, a1);
        a2 = _mm256_fmadd_ps(load16x8(qt, h2 + i), xv, a2);
        a3 = _mm256_fmadd_ps(load16x8(qt, h3 + i), xv, a3);
    }
    out[0] = hsum8(a0);
    out[1] = hsum8(a1);
    out[2] = hsum8(a2);
    out[3] = hsum8(a3);
}
#endif

#ifdef PI_AVX2
/* Register tile: out[i * RN + j] = row_i . x_j for RM Q4_0/Q8_0 rows and RN q8 activations,
 * with RM * RN independent accumulators (one FMA chain per pair instead of one per row) and
 * each block's unpacked weights reused for every activation. RM, RN are compile-time
 * constants at every call, so the loops unroll and the accumulators stay in registers. */
static inline __attribute__((always_inline)) void tile_q8(
        int qt, const uint8_t *const *rows, const int8_t *const *xq, const float *const *xd, int64_t nb,
        const int RM, const int RN, float *out) {
    const int64_t bb = qt == QT_Q4_0 ? 18 : 34;
    __m256 acc[4][4];
    for (int i = 0; i < RM; i++)
        for (int j = 0; j < RN; j++) acc[i][j] = _mm256_setzero_ps();
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t b = 0; b < nb; b++) {
        __m256i qy[4];
        float dy[4];
        for (int j = 0; j < RN; j++) {
            qy[j] = _mm256_loadu_si256((const __m256i *)(xq[j] + b * QK));
            dy[j] = xd[j][b];
        }
        for (int i = 0; i < RM; i++) {
            const uint8_t *blk = rows[i] + b * bb;
            const float dx = h2f(rd16(blk));
            const __m256i qx = q0_quants(qt, blk);
            const __m256i ax = _mm256_sign_epi8(qx, qx);
            for (int j = 0; j < RN; j++) {
                const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(ax, _mm256_sign_epi8(qy[j], qx)), ones);
                acc[i][j] = _mm256_fmadd_ps(_mm256_set1_ps(dx * dy[j]), _mm256_cvtepi32_ps(p), acc[i][j]);
            }
        }
    }
    for (int i = 0; i < RM; i++)
        for (int j = 0; j < RN; j++) out[i * RN + j] = hsum8(acc[i][j]);
}
#endif

/* The activation as every kernel needs it: f32, plus its 8-bit blocks for the block-quantized
 * types (Q4_0/Q8_0/Q5_0/Q5_1: one scale per 32 values; Q4_K/Q5_K/Q6_K: q8_K, one per 256). */
typedef struct {
    const float *x;
    const int8_t *xq;
    const float *xd;
    const int32_t *xs;  /* sums of xq over each 16 values (K-quants, Q5_0/Q5_1) */
} act_t;

#ifdef PI_AVX2
/* [sum of v[0]'s 8 lanes, ..., sum of v[7]'s] for eight int32 vectors */
static inline __m256i hsum8x8_i32(const __m256i *v) {
    const __m256i t0 = _mm256_hadd_epi32(v[0], v[1]), t1 = _mm256_hadd_epi32(v[2], v[3]);
    const __m256i t2 = _mm256_hadd_epi32(v[4], v[5]), t3 = _mm256_hadd_epi32(v[6], v[7]);
    /* u0: [v0..v3 summed over lanes 0-3 | the same over lanes 4-7], u1 the same for v4..v7 */
    const __m256i u0 = _mm256_hadd_epi32(t0, t1), u1 = _mm256_hadd_epi32(t2, t3);
    return _mm256_add_epi32(_mm256_permute2x128_si256(u0, u1, 0x20), _mm256_permute2x128_si256(u0, u1, 0x31));
}
/* the 8 sums of adjacent pairs of 16 int32 (the activation's 32-value sums from its 16-value sums) */
static inline __m256i pair_sums(const int32_t *s16) {
    const __m256i h = _mm256_hadd_epi32(_mm256_loadu_si256((const __m256i *)s16),
                                        _mm256_loadu_si256((const __m256i *)(s16 + 8)));
    return _mm256_permute4x64_epi64(h, 0xD8);
}
/* Q4_K/Q5_K's 12 scale bytes -> the 8 6-bit scales and the 8 6-bit mins as int32 lanes */
static inline void k4_scales(const uint8_t *sc, __m256i *s8, __m256i *m8) {
    uint32_t u0, u1, u2;
    memcpy(&u0, sc, 4);
    memcpy(&u1, sc + 4, 4);
    memcpy(&u2, sc + 8, 4);
    const uint32_t slo = u0 & 0x3f3f3f3fu, mlo = u1 & 0x3f3f3f3fu;
    const uint32_t shi = (u2 & 0x0f0f0f0fu) | (((u0 >> 6) & 0x03030303u) << 4);
    const uint32_t mhi = ((u2 >> 4) & 0x0f0f0f0fu) | (((u1 >> 6) & 0x03030303u) << 4);
    *s8 = _mm256_cvtepu8_epi32(_mm_set_epi32(0, 0, (int)shi, (int)slo));
    *m8 = _mm256_cvtepu8_epi32(_mm_set_epi32(0, 0, (int)mhi, (int)mlo));
}
/* 32 bytes of 0x10 where bit j of the 32-bit qh is set, else 0 (Q5_0/Q5_1's 5th bits) */
static inline __m256i q5_high_bits(const uint8_t *qh) {
    uint32_t h;
    memcpy(&h, qh, 4);
    const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                            2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ull);
    const __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)h), spread);
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit), _mm256_set1_epi8(0x10));
}
/* 16 bytes of nibbles -> 32 unsigned bytes 0..15 (low nibbles, then high) */
static inline __m256i nibbles32(const uint8_t *qs) {
    const __m128i t = _mm_loadu_si128((const __m128i *)qs);
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(t, 4), t), _mm256_set1_epi8(0x0f));
}
/* 32 unsigned bytes . 32 signed activation bytes as 8 int32 lanes */
static inline __m256i dot_u8i8(__m256i u, const int8_t *x) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, _mm256_loadu_si256((const __m256i *)x)), _mm256_set1_epi16(1));
}
#endif

#ifdef PI_AVX2
/* 8 int16 in each 128-bit half of v -> 16 copies of int16 number k (both halves hold the same 8) */
static inline __m256i bcast16(__m256i v, const int k) { return _mm256_shuffle_epi8(v, _mm256_set1_epi16((short)((2 * k + 1) << 8 | 2 * k))); }
#endif

/* Q4_K (h5 0) and Q5_K (h5 1) row . q8_K activation: super-block sb (scale d, min scale dmin, 8
 * sub-blocks of 32 with 6-bit scale s_k, min m_k, 4- or 5-bit q) against the activation's block
 * (scale dy, 16-value sums xs): d dy sum_k s_k sum(q qy) - dmin dy sum_k m_k sum_k(qy), both sums
 * over k exact in int32 (|.| <= 8 * 63 * 31 * 127 * 32), scaled once per super-block, as ggml's
 * vec_dot_q4_K_q8_K. AVX2: vpmaddubsw pairs (|q qy + q qy| <= 7874) meet the scale s_k in
 * vpmaddwd, one int32 vector per super-block. */
static inline __attribute__((always_inline)) float dot_q45_K(const uint8_t *row, act_t a, int64_t nsb, const int h5) {
    const int64_t bb = h5 ? 176 : 144, qoff = h5 ? 48 : 16;
#ifdef PI_AVX2
    __m256 vacc = _mm256_setzero_ps(), vmin = _mm256_setzero_ps();
    const __m256i m4 = _mm256_set1_epi8(0x0f), one8 = _mm256_set1_epi8(1);
    for (int64_t sb = 0; sb < nsb; sb++) {
        const uint8_t *blk = row + sb * bb, *qs = blk + qoff;
        const int8_t *xq = a.xq + sb * QKK;
        __m256i s8, m8;
        k4_scales(blk + 4, &s8, &m8);
        /* the 8 scales as int16 in each half: 2 x [s0..s7] */
        const __m256i s16 = _mm256_broadcastsi128_si256(_mm_packs_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1)));
        __m256i hv = h5 ? _mm256_loadu_si256((const __m256i *)(blk + 16)) : _mm256_setzero_si256();
        __m256i isum = _mm256_setzero_si256();
        for (int c = 0; c < 4; c++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
            __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
            if (h5) {  /* bit 2c (low half) and 2c + 1 (high half) of each qh byte, to bit 4 */
                lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(hv, one8), 4));
                hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hv, 1), one8), 4));
                hv = _mm256_srli_epi16(hv, 2);
            }
            const __m256i plo = _mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)(xq + 64 * c)));
            const __m256i phi = _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(xq + 64 * c + 32)));
            isum = _mm256_add_epi32(isum, _mm256_add_epi32(_mm256_madd_epi16(plo, bcast16(s16, 2 * c)),
                                                           _mm256_madd_epi16(phi, bcast16(s16, 2 * c + 1))));
        }
        const float dy = a.xd[sb];
        vacc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(h2f(rd16(blk)) * dy), vacc);
        const __m256i ms = _mm256_mullo_epi32(pair_sums(a.xs + 16 * sb), m8);
        vmin = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ms), _mm256_set1_ps(h2f(rd16(blk + 2)) * dy), vmin);
    }
    return hsum8(_mm256_sub_ps(vacc, vmin));
#else
    float acc = 0.f, mins = 0.f;
    for (int64_t sb = 0; sb < nsb; sb++) {
        const uint8_t *blk = row + sb * bb, *sc = blk + 4, *qs = blk + qoff, *qh = blk + 16;
        const int8_t *xq = a.xq + sb * QKK;
        const int32_t *xs = a.xs + 16 * sb;
        int32_t isum = 0, imin = 0;
        for (int k = 0; k < 8; k++) {
            const int c = k / 2, h = k % 2;
            uint8_t s, m;
            get_scale_min_k4(k, sc, &s, &m);
            imin += m * (xs[2 * k] + xs[2 * k + 1]);
            int32_t t = 0;
            for (int l = 0; l < 32; l++) {
                int q = h ? qs[32 * c + l] >> 4 : qs[32 * c + l] & 15;
                if (h5) q |= ((qh[l] >> k) & 1) << 4;
                t += q * xq[32 * k + l];
            }
            isum += s * t;
        }
        acc += h2f(rd16(blk)) * a.xd[sb] * (float)isum;
        mins += h2f(rd16(blk + 2)) * a.xd[sb] * (float)imin;
    }
    return acc - mins;
#endif
}
static inline float dot_q4_K(const uint8_t *row, act_t a, int64_t nsb) { return dot_q45_K(row, a, nsb, 0); }
static inline float dot_q5_K(const uint8_t *row, act_t a, int64_t nsb) { return dot_q45_K(row, a, nsb, 1); }

/* Q6_K row . q8_K activation: 6-bit q (0..63, offset 32), an int8 scale s_g per 16 values:
 * d dy sum_g s_g (sum(q qy) - 32 sum(qy)) over the super-block's 16 groups, exact in int32
 * (|.| <= 16 * 128 * 63 * 127 * 16), scaled once per super-block, as ggml's vec_dot_q6_K_q8_K.
 * AVX2: vpmaddubsw pairs (|.| <= 16002) meet each 16-value group's scale in vpmaddwd (a vector of
 * 32 values spans two groups, one per 128-bit half); the offset as 32 sum_g s_g xs_g. */
static inline float dot_q6_K(const uint8_t *row, act_t a, int64_t nsb) {
#ifdef PI_AVX2
    __m256 vacc = _mm256_setzero_ps();
    const __m256i m4 = _mm256_set1_epi8(0x0f), m2 = _mm256_set1_epi8(0x03);
    for (int64_t sb = 0; sb < nsb; sb++) {
        const uint8_t *blk = row + sb * 210;
        const int8_t *xq = a.xq + sb * QKK;
        const int32_t *xs = a.xs + 16 * sb;
        const __m128i sc8 = _mm_loadu_si128((const __m128i *)(blk + 192));
        /* the offset: 32 sum_g s_g xs_g, as 8 int32 lanes */
        const __m256i off = _mm256_add_epi32(
            _mm256_mullo_epi32(_mm256_cvtepi8_epi32(sc8), _mm256_loadu_si256((const __m256i *)xs)),
            _mm256_mullo_epi32(_mm256_cvtepi8_epi32(_mm_srli_si128(sc8, 8)), _mm256_loadu_si256((const __m256i *)(xs + 8))));
        __m256i isum = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(off, 5));
        for (int n = 0; n < 2; n++) {
            const uint8_t *ql = blk + 64 * n, *qh = blk + 128 + 32 * n;
            /* this half's 8 scales as int16, both 128-bit halves: [s0..s7 | s0..s7] */
            const __m256i s16 = _mm256_broadcastsi128_si256(_mm_cvtepi8_epi16(_mm_srli_si128(sc8, 8 * n)));
            const __m256i la = _mm256_loadu_si256((const __m256i *)ql), lb = _mm256_loadu_si256((const __m256i *)(ql + 32));
            const __m256i hv = _mm256_loadu_si256((const __m256i *)qh);
            __m256i q[4];
            q[0] = _mm256_or_si256(_mm256_and_si256(la, m4), _mm256_slli_epi16(_mm256_and_si256(hv, m2), 4));
            q[1] = _mm256_or_si256(_mm256_and_si256(lb, m4), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hv, 2), m2), 4));
            q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(la, 4), m4), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hv, 4), m2), 4));
            q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(lb, 4), m4), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hv, 6), m2), 4));
            for (int g = 0; g < 4; g++) {
                /* values 0-15 of this vector: group 2g of the half (scale s_2g), 16-31: group 2g + 1 */
                const __m256i sg = _mm256_shuffle_epi8(s16, _mm256_setr_epi8(
                    4 * g, 4 * g + 1, 4 * g, 4 * g + 1, 4 * g, 4 * g + 1, 4 * g, 4 * g + 1,
                    4 * g, 4 * g + 1, 4 * g, 4 * g + 1, 4 * g, 4 * g + 1, 4 * g, 4 * g + 1,
                    4 * g + 2, 4 * g + 3, 4 * g + 2, 4 * g + 3, 4 * g + 2, 4 * g + 3, 4 * g + 2, 4 * g + 3,
                    4 * g + 2, 4 * g + 3, 4 * g + 2, 4 * g + 3, 4 * g + 2, 4 * g + 3, 4 * g + 2, 4 * g + 3));
                const __m256i p = _mm256_maddubs_epi16(q[g], _mm256_loadu_si256((const __m256i *)(xq + 128 * n + 32 * g)));
                isum = _mm256_add_epi32(isum, _mm256_madd_epi16(p, sg));
            }
        }
        vacc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(h2f(rd16(blk + 208)) * a.xd[sb]), vacc);
    }
    return hsum8(vacc);
#else
    float acc = 0.f;
    for (int64_t sb = 0; sb < nsb; sb++) {
        const uint8_t *blk = row + sb * 210;
        const int8_t *sc = (const int8_t *)(blk + 192), *xq = a.xq + sb * QKK;
        const int32_t *xs = a.xs + 16 * sb;
        int32_t isum = 0;
        for (int n = 0; n < 2; n++) {
            const uint8_t *ql = blk + 64 * n, *qh = blk + 128 + 32 * n;
            for (int g = 0; g < 4; g++)
                for (int hf = 0; hf < 2; hf++) {  /* group 8n + 2g + hf: values 128n + 32g + 16hf .. + 15 */
                    const int gi = 8 * n + 2 * g + hf;
                    int32_t t = -32 * xs[gi];
                    for (int l = 16 * hf; l < 16 * hf + 16; l++) {
                        const int hi = (qh[l] >> (2 * g)) & 3;
                        const int lo = g == 0 ? ql[l] & 15 : g == 1 ? ql[l + 32] & 15 : g == 2 ? ql[l] >> 4 : ql[l + 32] >> 4;
                        t += (lo | (hi << 4)) * xq[128 * n + 32 * g + l];
                    }
                    isum += sc[gi] * t;
                }
        }
        acc += h2f(rd16(blk + 208)) * a.xd[sb] * (float)isum;
    }
    return acc;
#endif
}

/* Q5_0 / Q5_1 row . q8 activation, block by block as Q4_0: Q5_0's q - 16 signed meets qx as
 * Q4_0's does; Q5_1's unsigned q gives d dx sum(q qx) + m dx sum(qx). */
static inline __attribute__((always_inline)) float dot_q5(const uint8_t *row, act_t a, int64_t nb, const int q51) {
    const int64_t bb = q51 ? 24 : 22, hoff = q51 ? 4 : 2;
    float macc = 0.f;
#ifdef PI_AVX2
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = row + b * bb;
        const __m256i q = _mm256_or_si256(nibbles32(blk + hoff + 4), q5_high_bits(blk + hoff));
        const float s = h2f(rd16(blk)) * a.xd[b];
        __m256 p;
        if (q51) {
            p = _mm256_cvtepi32_ps(dot_u8i8(q, a.xq + b * QK));
            macc += h2f(rd16(blk + 2)) * a.xd[b] * (float)(a.xs[2 * b] + a.xs[2 * b + 1]);
        } else {
            p = dot_i8(_mm256_sub_epi8(q, _mm256_set1_epi8(16)), _mm256_loadu_si256((const __m256i *)(a.xq + b * QK)));
        }
        if (b & 1) acc1 = _mm256_fmadd_ps(_mm256_set1_ps(s), p, acc1);
        else acc0 = _mm256_fmadd_ps(_mm256_set1_ps(s), p, acc0);
    }
    return hsum8(_mm256_add_ps(acc0, acc1)) + macc;
#else
    float acc = 0.f;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = row + b * bb, *qs = blk + hoff + 4;
        uint32_t h;
        memcpy(&h, blk + hoff, 4);
        const int8_t *y = a.xq + b * QK;
        const int off = q51 ? 0 : 16;
        int32_t t = 0;
        for (int j = 0; j < 16; j++)
            t += (((qs[j] & 15) | (((h >> j) & 1) << 4)) - off) * y[j]
               + (((qs[j] >> 4) | (((h >> (j + 16)) & 1) << 4)) - off) * y[j + 16];
        acc += h2f(rd16(blk)) * a.xd[b] * (float)t;
        if (q51) macc += h2f(rd16(blk + 2)) * a.xd[b] * (float)(a.xs[2 * b] + a.xs[2 * b + 1]);
    }
    return acc + macc;
#endif
}
static inline float dot_q5_0(const uint8_t *row, act_t a, int64_t nb) { return dot_q5(row, a, nb, 0); }
static inline float dot_q5_1(const uint8_t *row, act_t a, int64_t nb) { return dot_q5(row, a, nb, 1); }

static inline float row_dot(int qt, const uint8_t *row, act_t a, int64_t K) {
    switch (qt) {
        case QT_Q4_0: return dot_q4_0(row, a.xq, a.xd, K / QK);
        case QT_Q8_0: return dot_q8_0(row, a.xq, a.xd, K / QK);
        case QT_Q4_K: return dot_q4_K(row, a, K / QKK);
        case QT_Q6_K: return dot_q6_K(row, a, K / QKK);
        case QT_Q5_K: return dot_q5_K(row, a, K / QKK);
        case QT_Q5_0: return dot_q5_0(row, a, K / QK);
        case QT_Q5_1: return dot_q5_1(row, a, K / QK);
        default: return dot_16(qt, row, a.x, K);
    }
}

static inline void prefetch_row(const uint8_t *p, int64_t nbytes) {
    for (int64_t b = 0; b < nbytes; b += 64) __builtin_prefetch(p + b, 0, 3);
}

static inline void split(int64_t n, int nt, int t, int64_t *r0, int64_t *r1) {
    const int64_t blk = (n + nt - 1) / nt;
    *r0 = t * blk < n ? t * blk : n;
    *r1 = *r0 + blk < n ? *r0 + blk : n;
}

/* What the public kernels that allocate return: 0, or one of these (kernels.py raises for them). */
#define PI_ENOMEM (-1) /* an allocation failed: nothing was computed */
#define PI_EINVAL (-2) /* an argument out of range (more tokens than MULTI_MAX_T) */

/* The T activations as the type's products read them: 8-bit blocks (+ their 16-value sums). */
typedef struct {
    int8_t *q;
    float *d;   /* dn scales per token: K/32, or K/256 for the K-quants (q8_K) */
    int32_t *s; /* K-quants, Q5_0/Q5_1: the sums of each 16 values */
    int32_t *o; /* Q4_0: 8 x the sum of each block (the nibbles' offset 8, taken off in the x8 kernel) */
    int32_t *p; /* K-quants: per token and super-block, 8 pairs of 16-value sums packed as int16 pairs for
                 * the x8 kernels' vpmaddwd (kpairs) */
    int64_t dn;
} acts_t;

/* lo | hi << 16: two int16 (|v| <= 32 * 127) as one int32 lane for vpmaddwd */
static inline int32_t pack16(int32_t lo, int32_t hi) { return (int32_t)(((uint32_t)hi << 16) | ((uint32_t)lo & 0xffffu)); }

/* One super-block's 16-value sums s[16] -> the 8 int32 the x8 kernels broadcast: Q6_K (s[2k], s[2k+1])
 * for sub-block k (its two groups' offsets); Q4_K/Q5_K the 32-value sums b_k = s[2k] + s[2k+1] as
 * (b0, b2), (b1, b3), (b4, b6), (b5, b7) (against the rows' mins in those pairs), then 4 zeros. */
static inline void kpairs(int qt, const int32_t *s, int32_t *out) {
    if (qt == QT_Q6_K) {
        for (int k = 0; k < 8; k++) out[k] = pack16(s[2 * k], s[2 * k + 1]);
        return;
    }
    int32_t b[8];
    for (int k = 0; k < 8; k++) b[k] = s[2 * k] + s[2 * k + 1];
    const int32_t v[8] = {pack16(b[0], b[2]), pack16(b[1], b[3]), pack16(b[4], b[6]), pack16(b[5], b[7]), 0, 0, 0, 0};
    memcpy(out, v, sizeof(v));
}

/* *ok = 0 when an allocation failed (nothing is left allocated then) */
static void release(acts_t a);
static acts_t prepare(int qt, const float *x, int64_t T, int64_t K, int *ok) {
    acts_t a = {NULL, NULL, NULL, NULL, NULL, 0};
    *ok = 1;
    if (!uses_q8(qt)) return a;
    const int64_t nb = K / QK;
    a.dn = is_k(qt) ? K / QKK : nb;
    a.q = malloc((size_t)(T * K) + 1);
    a.d = malloc((size_t)(T * a.dn) * sizeof(float) + 1);
    if (needs_sums(qt)) a.s = malloc((size_t)(T * (K / 16)) * sizeof(int32_t) + 1);
    else if (qt == QT_Q4_0) a.o = malloc((size_t)(T * nb) * sizeof(int32_t) + 1);
    if (is_k(qt)) a.p = malloc((size_t)(T * a.dn * 8) * sizeof(int32_t) + 1);
    if (!a.q || !a.d || (needs_sums(qt) && !a.s) || (qt == QT_Q4_0 && !a.o) || (is_k(qt) && !a.p)) {
        release(a);
        acts_t none = {NULL, NULL, NULL, NULL, NULL, 0};
        *ok = 0;
        return none;
    }
    if (is_k(qt)) {
        for (int64_t t = 0; t < T; t++) quantize_q8K(x + t * K, K, a.q + t * K, a.d + t * a.dn, a.s + t * (K / 16));
        for (int64_t i = 0; i < T * a.dn; i++) kpairs(qt, a.s + 16 * i, a.p + 8 * i);
        return a;
    }
    for (int64_t t = 0; t < T; t++) quantize_q8(x + t * K, K, a.q + t * K, a.d + t * nb);
    if (needs_sums(qt)) {
        for (int64_t i = 0; i < T * (K / 16); i++) {
            int32_t v = 0;
            for (int e = 0; e < 16; e++) v += a.q[i * 16 + e];
            a.s[i] = v;
        }
    } else if (qt == QT_Q4_0) {
        for (int64_t i = 0; i < T * nb; i++) {
            int32_t v = 0;
            for (int e = 0; e < QK; e++) v += a.q[i * QK + e];
            a.o[i] = 8 * v;
        }
    }
    return a;
}

static void release(acts_t a) {
    free(a.q);
    free(a.d);
    free(a.s);
    free(a.o);
    free(a.p);
}

static inline act_t act_of(const float *x, acts_t b, int64_t t, int64_t K) {
    act_t a = {x + t * K, b.q ? b.q + t * K : NULL, b.d ? b.d + t * b.dn : NULL, b.s ? b.s + t * (K / 16) : NULL};
    return a;
}

/* ------------------------------------------------------------------ public kernels */
#ifdef PI_AVX2
/* rows [r0, r1) of y [T, N] for Q4_0/Q8_0: tiles of 4 rows x up to 3 tokens */
static void gemm_q8_range(int qt, const uint8_t *W, int64_t rb, int64_t N, int64_t K, const int8_t *qbuf,
                          const float *dbuf, int64_t T, float *y, int64_t r0, int64_t r1) {
    const int64_t nb = K / QK;
    for (int64_t t = 0; t < T; t += 3) {
        const int rn = T - t >= 3 ? 3 : (int)(T - t);
        const int8_t *xq[3];
        const float *xd[3];
        for (int j = 0; j < rn; j++) {
            xq[j] = qbuf + (t + j) * K;
            xd[j] = dbuf + (t + j) * nb;
        }
        float o[12];
        int64_t r = r0;
        for (; r + 4 <= r1; r += 4) {
            const uint8_t *rows[4] = {W + r * rb, W + (r + 1) * rb, W + (r + 2) * rb, W + (r + 3) * rb};
            if (rn == 3) tile_q8(qt, rows, xq, xd, nb, 4, 3, o);
            else if (rn == 2) tile_q8(qt, rows, xq, xd, nb, 4, 2, o);
            else tile_q8(qt, rows, xq, xd, nb, 4, 1, o);
            for (int i = 0; i < 4; i++)
                for (int j = 0; j < rn; j++) y[(t + j) * N + r + i] = o[i * rn + j];
        }
        for (; r < r1; r++) {
            const uint8_t *rows[1] = {W + r * rb};
            if (rn == 3) tile_q8(qt, rows, xq, xd, nb, 1, 3, o);
            else if (rn == 2) tile_q8(qt, rows, xq, xd, nb, 1, 2, o);
            else tile_q8(qt, rows, xq, xd, nb, 1, 1, o);
            for (int j = 0; j < rn; j++) y[(t + j) * N + r] = o[j];
        }
    }
}
#endif

/* y[t, r] = W[r] . x[t] for r < N, t < T: W [N, K] of type qt, x [T, K] f32, y [T, N] f32.
 * Q4_0/Q8_0 (AVX2): register tiles of 4 rows x 3 tokens; otherwise one row at a time,
 * dotted with every token while it is in cache. */
int pi_q_gemm(int qt, const void *W, int64_t N, int64_t K, const float *x, int64_t T, float *y) {
    const int64_t rb = row_bytes(qt, K);
    int ok;
    const acts_t acts = prepare(qt, x, T, K, &ok);
    if (!ok) return PI_ENOMEM;
    const int par = N * rb * (T > 1 ? 4 : 1) >= PAR_MIN_BYTES && omp_get_max_threads() > 1;
    #pragma omp parallel if (par)
    {
        int64_t r0, r1;
        const int nt = omp_get_num_threads();
        const int64_t per = ((N + nt - 1) / nt + 3) / 4 * 4;  /* whole tiles per thread */
        r0 = omp_get_thread_num() * per < N ? omp_get_thread_num() * per : N;
        r1 = r0 + per < N ? r0 + per : N;
#ifdef PI_AVX2
        if (is_q0(qt)) {
            gemm_q8_range(qt, (const uint8_t *)W, rb, N, K, acts.q, acts.d, T, y, r0, r1);
            r0 = r1;
        } else if (is_16bit(qt) && K % 8 == 0) {
            for (; r0 + 4 <= r1; r0 += 4) {
                const uint8_t *rows[4] = {(const uint8_t *)W + r0 * rb, (const uint8_t *)W + (r0 + 1) * rb,
                                          (const uint8_t *)W + (r0 + 2) * rb, (const uint8_t *)W + (r0 + 3) * rb};
                float o[4];
                for (int64_t t = 0; t < T; t++) {
                    dot4_16(qt, rows, x + t * K, K, o);
                    for (int i = 0; i < 4; i++) y[t * N + r0 + i] = o[i];
                }
            }
        }
#endif
        for (int64_t r = r0; r < r1; r++) {
            const uint8_t *row = (const uint8_t *)W + r * rb;
            if (r + 1 < r1) prefetch_row(row + rb, rb);  /* the next row (Q5_0 rows: 0.4 -> x GB/s) */
            for (int64_t t = 0; t < T; t++) y[t * N + r] = row_dot(qt, row, act_of(x, acts, t, K), K);
        }
    }
    release(acts);
    return 0;
}

/* y[r] = W[idx[r]] . a for the n rows r in sel (sel NULL: r = 0 .. n-1), in that order: a stream
 * of independent rows, the next ones prefetched (no read waits on a dot product); Q4_0/Q8_0
 * rows go four at a time through dot4_q0 (same numbers as one at a time). */
static void dot_rows(int qt, const uint8_t *W, int64_t rb, const int64_t *idx, const int64_t *sel, int64_t n,
                     act_t a, int64_t K, float *y) {
#define ROW_AT(j) (W + idx[sel ? sel[j] : (j)] * rb)
#define Y_AT(j) y[sel ? sel[j] : (j)]
    for (int64_t p = 0; p < ROWS_AHEAD && p < n; p++) prefetch_row(ROW_AT(p), rb);
    int64_t j = 0;
#ifdef PI_AVX2
    if (is_q0(qt))
        for (; j + 4 <= n; j += 4) {
            for (int64_t p = j + ROWS_AHEAD; p < j + ROWS_AHEAD + 4 && p < n; p++) prefetch_row(ROW_AT(p), rb);
            const uint8_t *rows[4] = {ROW_AT(j), ROW_AT(j + 1), ROW_AT(j + 2), ROW_AT(j + 3)};
            float o[4];
            dot4_q0(qt, rows, a.xq, a.xd, K / QK, o);
            for (int i = 0; i < 4; i++) Y_AT(j + i) = o[i];
        }
#endif
    for (; j < n; j++) {
        if (j + ROWS_AHEAD < n) prefetch_row(ROW_AT(j + ROWS_AHEAD), rb);
        Y_AT(j) = row_dot(qt, ROW_AT(j), a, K);
    }
#undef ROW_AT
#undef Y_AT
}

/* For r < n: y1[r] = W1[idx[r]] . x, and if W2, y2[r] = W2[idx[r]] . x when y1[r] > gmin
 * (else y2[r] = 0 and the row is not read). W1, W2 [*, K] of type qt; x [K] f32. */
int pi_q_dot_rows(int qt, const void *W1, const void *W2, const int64_t *idx, int64_t n, int64_t K,
                  const float *x, float *y1, float *y2, float gmin) {
    const int64_t rb = row_bytes(qt, K);
    int ok;
    const acts_t acts = prepare(qt, x, 1, K, &ok);
    if (!ok) return PI_ENOMEM;
    const act_t a = act_of(x, acts, 0, K);
    const int par = n * rb * (W2 ? 2 : 1) >= PAR_MIN_BYTES && omp_get_max_threads() > 1;
    int64_t *pass = W2 ? malloc((size_t)(n + 1) * sizeof(int64_t)) : NULL;
    if (W2 && !pass) {
        release(acts);
        return PI_ENOMEM;
    }
    #pragma omp parallel if (par)
    {
        int64_t r0, r1;
        split(n, omp_get_num_threads(), omp_get_thread_num(), &r0, &r1);
        /* two passes: every W1 row, then the W2 rows of the rows that passed */
        dot_rows(qt, (const uint8_t *)W1, rb, idx + r0, NULL, r1 - r0, a, K, y1 + r0);
        if (W2) {
            int64_t m = 0;
            for (int64_t r = r0; r < r1; r++) {
                if (gmin == -INFINITY || y1[r] > gmin) pass[r0 + m++] = r - r0;
                else y2[r] = 0.f;
            }
            dot_rows(qt, (const uint8_t *)W2, rb, idx + r0, pass + r0, m, a, K, y2 + r0);
        }
    }
    free(pass);
    release(acts);
    return 0;
}

/* out[d0 .. d1) += c * W[row][d0 .. d1) for one row of type qt; d0, d1 multiples of the block */
static inline void axpy_row(int qt, const uint8_t *row, float c, int64_t d0, int64_t d1, float *out) {
    if (qt == QT_Q4_0) {
        for (int64_t b = d0 / QK; b < d1 / QK; b++) {
            const uint8_t *blk = row + b * 18;
            const float s = c * h2f(rd16(blk));
            float *o = out + b * QK;
#ifdef PI_AVX2
            const __m256 sv = _mm256_set1_ps(s);
            const __m256i q = q4_0_bytes(blk + 2);
            const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
            _mm256_storeu_ps(o, _mm256_fmadd_ps(sv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo)), _mm256_loadu_ps(o)));
            _mm256_storeu_ps(o + 8, _mm256_fmadd_ps(sv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8))), _mm256_loadu_ps(o + 8)));
            _mm256_storeu_ps(o + 16, _mm256_fmadd_ps(sv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi)), _mm256_loadu_ps(o + 16)));
            _mm256_storeu_ps(o + 24, _mm256_fmadd_ps(sv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8))), _mm256_loadu_ps(o + 24)));
#else
            const uint8_t *qs = blk + 2;
            for (int j = 0; j < 16; j++) {
                o[j] += s * (float)((qs[j] & 15) - 8);
                o[j + 16] += s * (float)((qs[j] >> 4) - 8);
            }
#endif
        }
    } else if (qt == QT_Q8_0) {
        for (int64_t b = d0 / QK; b < d1 / QK; b++) {
            const uint8_t *blk = row + b * 34;
            const float s = c * h2f(rd16(blk));
            const int8_t *q = (const int8_t *)(blk + 2);
            float *o = out + b * QK;
#ifdef PI_AVX2
            const __m256 sv = _mm256_set1_ps(s);
            for (int j = 0; j < QK; j += 8) {
                const __m128i v = _mm_loadl_epi64((const __m128i *)(q + j));
                _mm256_storeu_ps(o + j, _mm256_fmadd_ps(sv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)), _mm256_loadu_ps(o + j)));
            }
#else
            for (int j = 0; j < QK; j++) o[j] += s * (float)q[j];
#endif
        }
    } else if (qt == QT_F16) {
        const uint16_t *h = (const uint16_t *)row;
        int64_t d = d0;
#ifdef PI_AVX2
        const __m256 cv = _mm256_set1_ps(c);
        for (; d + 8 <= d1; d += 8)
            _mm256_storeu_ps(out + d, _mm256_fmadd_ps(cv, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + d))), _mm256_loadu_ps(out + d)));
#endif
        for (; d < d1; d++) out[d] += c * h2f(h[d]);
    } else if (qt == QT_BF16) {
        const uint16_t *h = (const uint16_t *)row;
        int64_t d = d0;
#ifdef PI_AVX2
        const __m256 cv = _mm256_set1_ps(c);
        for (; d + 8 <= d1; d += 8)
            _mm256_storeu_ps(out + d, _mm256_fmadd_ps(cv, bf16x8(h + d), _mm256_loadu_ps(out + d)));
#endif
        for (; d < d1; d++) out[d] += c * b2f(h[d]);
    } else if (is_q5(qt)) {
        const int64_t bb = block_bytes(qt);
        float buf[QK];
        for (int64_t b = d0 / QK; b < d1 / QK; b++) {
            deq_q5(qt, row + b * bb, buf);
            for (int j = 0; j < QK; j++) out[b * QK + j] += c * buf[j];
        }
    } else {
        const int64_t bb = block_bytes(qt);
        float buf[QKK];
        for (int64_t b = d0 / QKK; b < d1 / QKK; b++) {
            if (qt == QT_Q4_K) deq_q4_K(row + b * bb, buf);
            else if (qt == QT_Q5_K) deq_q5_K(row + b * bb, buf);
            else deq_q6_K(row + b * bb, buf);
            for (int j = 0; j < QKK; j++) out[b * QKK + j] += c * buf[j];
        }
    }
}

#ifdef PI_AVX2
/* 32 int8 (two 16-byte halves) -> four fp32 vectors: o[0..32) += s * v for each of 4 rows */
static inline void fma_i8x32(__m256 sv, __m256i q, __m256 *a) {
    const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
    a[0] = _mm256_fmadd_ps(sv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo)), a[0]);
    a[1] = _mm256_fmadd_ps(sv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8))), a[1]);
    a[2] = _mm256_fmadd_ps(sv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi)), a[2]);
    a[3] = _mm256_fmadd_ps(sv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8))), a[3]);
}

/* out[d0 .. d1) += sum of c[i] * row_i[d0 .. d1) over 4 Q4_0/Q8_0 rows: out is loaded and
 * stored once per 4 rows instead of once per row */
static inline void axpy4_q(int qt, const uint8_t *const *rows, const float *c, int64_t d0, int64_t d1, float *out) {
    const int64_t bb = qt == QT_Q4_0 ? 18 : 34;
    for (int64_t b = d0 / QK; b < d1 / QK; b++) {
        float *o = out + b * QK;
        __m256 a[4] = {_mm256_loadu_ps(o), _mm256_loadu_ps(o + 8), _mm256_loadu_ps(o + 16), _mm256_loadu_ps(o + 24)};
        for (int i = 0; i < 4; i++) {
            const uint8_t *blk = rows[i] + b * bb;
            const __m256 sv = _mm256_set1_ps(c[i] * h2f(rd16(blk)));
            fma_i8x32(sv, q0_quants(qt, blk), a);
        }
        _mm256_storeu_ps(o, a[0]);
        _mm256_storeu_ps(o + 8, a[1]);
        _mm256_storeu_ps(o + 16, a[2]);
        _mm256_storeu_ps(o + 24, a[3]);
    }
}
#endif

#ifdef PI_AVX2
/* out[d0 .. d1) += sum of c[i] * row_i[d0 .. d1) over 4 f16/bf16 rows (d0, d1 multiples of 8) */
static inline void axpy4_16(int qt, const uint8_t *const *rows, const float *c, int64_t d0, int64_t d1, float *out) {
    const uint16_t *h0 = (const uint16_t *)rows[0], *h1 = (const uint16_t *)rows[1];
    const uint16_t *h2 = (const uint16_t *)rows[2], *h3 = (const uint16_t *)rows[3];
    const __m256 c0 = _mm256_set1_ps(c[0]), c1 = _mm256_set1_ps(c[1]), c2 = _mm256_set1_ps(c[2]),
                 c3 = _mm256_set1_ps(c[3]);
    for (int64_t d = d0; d < d1; d += 8) {
        __m256 o = _mm256_loadu_ps(out + d);
        o = _mm256_fmadd_ps(c0, load16x8(qt, h0 + d), o);
        o = _mm256_fmadd_ps(c1, load16x8(qt, h1 + d), o);
        o = _mm256_fmadd_ps(c2, load16x8(qt, h2 + d), o);
        o = _mm256_fmadd_ps(c3, load16x8(qt, h3 + d), o);
        _mm256_storeu_ps(out + d, o);
    }
}
#endif

/* the values of D a thread's slice is made of whole multiples of (blocks, and whole cache lines) */
static inline int64_t slice_values(int qt) { return block_values(qt) < 16 ? 16 : block_values(qt); }

/* thread t of nt's slice [d0, d1) of D, in whole multiples of bv values */
static inline void d_slice(int64_t D, int64_t bv, int nt, int t, int64_t *d0, int64_t *d1) {
    const int64_t nblk = (D + bv - 1) / bv, per = (nblk + nt - 1) / nt;
    *d0 = t * per * bv < D ? t * per * bv : D;
    *d1 = *d0 + per * bv < D ? *d0 + per * bv : D;
}

/* rows[k] = W's row idx[r] and cs[k] = coef[r] for the rows r < n with a non-zero coefficient, in
 * order; returns k (a row whose coefficient is exactly 0 adds nothing and is not read) */
static int64_t nonzero_rows(const uint8_t *W, int64_t rb, const int64_t *idx, const float *coef, int64_t n,
                            const uint8_t **rows, float *cs) {
    int64_t k = 0;
    for (int64_t r = 0; r < n; r++)
        if (coef[r] != 0.f) {
            rows[k] = W + idx[r] * rb;
            cs[k++] = coef[r];
        }
    return k;
}

/* out[d0 .. d1) += sum_k cs[k] * rows[k][d0 .. d1) over the m rows in order, four at a time where a
 * kernel for that exists (each output value's FMAs in the same row order either way), the next
 * rows prefetched */
static void axpy_slice(int qt, const uint8_t *const *rows, const float *cs, int64_t m, int64_t d0, int64_t d1,
                       float *out) {
    const int64_t pb0 = d0 / block_values(qt) * block_bytes(qt), pbn = (d1 - d0) / block_values(qt) * block_bytes(qt);
    int64_t r = 0;
#ifdef PI_AVX2
    if (is_q0(qt) || (is_16bit(qt) && d0 % 8 == 0 && d1 % 8 == 0))
        for (; r + 4 <= m && d0 < d1; r += 4) {
            for (int64_t s = r + 4; s < r + 8 && s < m; s++) prefetch_row(rows[s] + pb0, pbn);
            if (is_q0(qt)) axpy4_q(qt, rows + r, cs + r, d0, d1, out);
            else axpy4_16(qt, rows + r, cs + r, d0, d1, out);
        }
#endif
    for (; r < m && d0 < d1; r++) {
        if (r + 1 < m) prefetch_row(rows[r + 1] + pb0, pbn);
        axpy_row(qt, rows[r], cs[r], d0, d1, out);
    }
}

/* out[d] = sum_r coef[r] * W[idx[r], d] for d < D: W [*, D] of type qt, coef [n], out [D] f32.
 * Rows with coef exactly 0 are skipped. Each thread owns a slice of d (whole blocks) and
 * walks the used rows, four at a time where a kernel for that exists. */
int pi_q_axpy_rows(int qt, const void *W, const int64_t *idx, const float *coef, int64_t n, int64_t D, float *out) {
    const int64_t rb = row_bytes(qt, D), bv = slice_values(qt);
    const uint8_t **rows = malloc((size_t)(n + 1) * sizeof(*rows));
    float *cs = malloc((size_t)(n + 1) * sizeof(float));
    if (!rows || !cs) {
        free(rows);
        free(cs);
        return PI_ENOMEM;
    }
    memset(out, 0, (size_t)D * sizeof(float));
    const int64_t m = nonzero_rows((const uint8_t *)W, rb, idx, coef, n, rows, cs);
    const int par = m * rb >= PAR_MIN_BYTES && omp_get_max_threads() > 1 && D >= 2 * bv;
    #pragma omp parallel if (par)
    {
        int64_t d0, d1;
        d_slice(D, bv, omp_get_num_threads(), omp_get_thread_num(), &d0, &d1);
        axpy_slice(qt, rows, cs, m, d0, d1, out);
    }
    free(rows);
    free(cs);
    return 0;
}

/* ------------------------------------------------------------------ integer AXPY (TEAL decode)
 * out[n] = sum over the kept rows j (|x[j]| >= thr and x[j] != 0) of x[j] * W[j][n],
 * W [K, D] Q4_0 or Q8_0 rows (input-major), computed with integer products as ggml computes a
 * dense Q4_0/Q8_0 dot product, with the coefficients in the role of its quantized activation:
 *
 *   the kept rows, ordered by the octave of |x[j]| (o = min(e_max - e_j, 15), e the fp32 exponent
 *   field, e_max the largest over the kept rows; ties in index order), are cut into groups of
 *   AXG (32) (the last one shorter), so a group's x[j] are within a factor 2-4 of each other
 *   (the rounding error of the small ones is then not set by a large one); for group g
 *   and output block b (32 values), c_j = x[j] * d_{j,b} (the row's fp16 block scale, in fp32),
 *   s = max_j |c_j| / QMAX, qc_j = round-half-even(c_j * (1 / s)) (0 when s = 0), and
 *   out[b] += s * isum with isum = sum_j qc_j * q_{j,n} exact in integers (Q4_0: q = nibble - 8).
 *
 * QMAX: 127 for Q4_0 (int8 coefficients: vpmaddubsw of two rows' interleaved nibbles against
 * their two coefficients, int16 sums; |isum| <= 32 * 8 * 127 = 32512 fits, the offset 8 taken
 * off as 8 * sum(qc)); 32767 for Q8_0 (int16 coefficients: vpmaddwd of two rows' interleaved
 * int16 values, int32 sums). Error of one group's term against the exact sum_j c_j q_{j,n}:
 * at most (s / 2) * sum_j |q_{j,n}|, s = max_j |c_j| / QMAX (plus the fp32 roundings), i.e.
 * |error| <= max_j |c_j| * |g| * 8 / 254 for Q4_0 (|q| <= 8); llama.cpp's activation rounding
 * gives a dense dot product the same form of bound over its 32-value blocks.
 * The groups do not depend on the threads (each owns whole output blocks), so neither do the
 * numbers. AVX2 paths and the scalar code compute the same integers; their fp32 accumulation
 * of s * isum differs only in fused or separate rounding. */
#define AXG 32  /* kept rows per coefficient group */
#ifndef AXCB
#define AXCB 32 /* output blocks per chunk: one chunk's scales, coefficients and out stay in L1 (16, 32, 64,
                   128, 256 measured on the 8B shape's 4-layer TEAL 50% decode: 32 and 64 best) */
#endif
#ifndef AXQ_PF
#define AXQ_PF 1
#endif
#ifndef AXQ_LOCALITY
#define AXQ_LOCALITY 1 /* __builtin_prefetch locality of the next group's lines (1, prefetcht2: +5-8% decode
                          against 3, into L1, which stalls on the fill buffers; 0, non-temporal: -30%) */
#endif

static inline int axq_qmax(int qt) { return qt == QT_Q4_0 ? 127 : 32767; }

#ifndef AXQ_OCT
#define AXQ_OCT 16 /* octaves of |x| the kept rows are ordered by (the last one takes all smaller) */
#endif
static inline uint32_t axq_exp(float v) {
    uint32_t u;
    memcpy(&u, &v, 4);
    return (u >> 23) & 0xff;
}
static inline int axq_oct(float v, uint32_t emax) {
    const uint32_t e = axq_exp(v);
    return emax - e < AXQ_OCT - 1 ? (int)(emax - e) : AXQ_OCT - 1;
}

/* One group's coefficients for blocks [b0, b0 + nb): sc[k] = s, sum8[k] = 8 * sum(qc) (Q4_0), and
 * tab[p * AXCB + k] (uint32) the pair p's two coefficients (Q4_0: bytes row 2p, row 2p+1, twice;
 * Q8_0: the two int16), a 32-bit broadcast in axq_mac. n rows (even), rows[j] at row starts. */
static void axq_coefs(int qt, const uint8_t *const *rows, const float *xs, int n, int64_t b0, int nb, float *sc,
                      int16_t *sum8, void *tab, float *cbuf) {
    const int64_t bb = block_bytes(qt);
    const float qmax = (float)axq_qmax(qt);
    float amax[AXCB];
    for (int k = 0; k < nb; k++) amax[k] = 0.f;
    for (int j = 0; j < n; j++) {
        const uint8_t *r = rows[j] + b0 * bb;
        float *c = cbuf + j * AXCB;
        int k = 0;
#ifdef PI_AVX2
        const __m256 xv = _mm256_set1_ps(xs[j]);
        for (; k + 8 <= nb; k += 8) {
            const uint8_t *q = r + k * bb;  /* 8 scales, bb bytes apart (word inserts: no gather) */
            __m128i h = _mm_cvtsi32_si128(rd16(q));
            h = _mm_insert_epi16(h, rd16(q + bb), 1);
            h = _mm_insert_epi16(h, rd16(q + 2 * bb), 2);
            h = _mm_insert_epi16(h, rd16(q + 3 * bb), 3);
            h = _mm_insert_epi16(h, rd16(q + 4 * bb), 4);
            h = _mm_insert_epi16(h, rd16(q + 5 * bb), 5);
            h = _mm_insert_epi16(h, rd16(q + 6 * bb), 6);
            h = _mm_insert_epi16(h, rd16(q + 7 * bb), 7);
            const __m256 cv = _mm256_mul_ps(xv, _mm256_cvtph_ps(h));
            _mm256_storeu_ps(c + k, cv);
            const __m256 av = _mm256_andnot_ps(_mm256_set1_ps(-0.f), cv);
            _mm256_storeu_ps(amax + k, _mm256_max_ps(_mm256_loadu_ps(amax + k), av));
        }
#endif
        for (; k < nb; k++) {
            c[k] = xs[j] * h2f(rd16(r + k * bb));
            const float a = fabsf(c[k]);
            amax[k] = a > amax[k] ? a : amax[k];
        }
    }
    float inv[AXCB];
    for (int k = 0; k < nb; k++) {
        sc[k] = amax[k] / qmax;
        inv[k] = sc[k] > 0.f ? 1.f / sc[k] : 0.f;
    }
    if (qt == QT_Q4_0) {
        uint32_t *t = tab;
        int32_t sum[AXCB];
        for (int k = 0; k < nb; k++) sum[k] = 0;
        for (int p = 0; p < n / 2; p++) {
            const float *c1 = cbuf + 2 * p * AXCB, *c2 = c1 + AXCB;
            int k = 0;
#ifdef PI_AVX2
            for (; k + 8 <= nb; k += 8) {
                const __m256 iv = _mm256_loadu_ps(inv + k);
                const __m256i q1 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(c1 + k), iv));
                const __m256i q2 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(c2 + k), iv));
                const __m256i w = _mm256_or_si256(_mm256_and_si256(q1, _mm256_set1_epi32(0xff)),
                                                  _mm256_slli_epi32(_mm256_and_si256(q2, _mm256_set1_epi32(0xff)), 8));
                _mm256_storeu_si256((__m256i *)(t + p * AXCB + k), _mm256_or_si256(w, _mm256_slli_epi32(w, 16)));
                _mm256_storeu_si256((__m256i *)(sum + k),
                                    _mm256_add_epi32(_mm256_loadu_si256((const __m256i *)(sum + k)), _mm256_add_epi32(q1, q2)));
            }
#endif
            for (; k < nb; k++) {
                const int32_t q1 = (int32_t)nearbyintf(c1[k] * inv[k]), q2 = (int32_t)nearbyintf(c2[k] * inv[k]);
                const uint32_t w = (uint32_t)((q1 & 0xff) | (q2 & 0xff) << 8);
                t[p * AXCB + k] = w | w << 16;
                sum[k] += q1 + q2;
            }
        }
        for (int k = 0; k < nb; k++) sum8[k] = (int16_t)(8 * sum[k]);
    } else {
        uint32_t *t = tab;
        for (int p = 0; p < n / 2; p++) {
            const float *c1 = cbuf + 2 * p * AXCB, *c2 = c1 + AXCB;
            int k = 0;
#ifdef PI_AVX2
            for (; k + 8 <= nb; k += 8) {
                const __m256 iv = _mm256_loadu_ps(inv + k);
                const __m256i q1 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(c1 + k), iv));
                const __m256i q2 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(c2 + k), iv));
                _mm256_storeu_si256((__m256i *)(t + p * AXCB + k),
                                    _mm256_or_si256(_mm256_and_si256(q1, _mm256_set1_epi32(0xffff)), _mm256_slli_epi32(q2, 16)));
            }
#endif
            for (; k < nb; k++) {
                const int32_t q1 = (int32_t)nearbyintf(c1[k] * inv[k]), q2 = (int32_t)nearbyintf(c2[k] * inv[k]);
                t[p * AXCB + k] = (uint32_t)(q1 & 0xffff) | (uint32_t)q2 << 16;
            }
        }
    }
}

/* The cache lines the next group reads (rows[j] + p0 .. p1 for j < n), prefetched a few at a
 * time between the current group's blocks: a burst of them would stall on the fill buffers. */
typedef struct {
    const uint8_t *const *rows;
    int n, j;             /* rows, the row being issued */
    int64_t p0, p1, off;  /* byte range of each row; the next offset in row j */
    int per;              /* lines per block step */
} axq_ahead;

static inline void axq_prefetch(axq_ahead *a) {
    for (int e = 0; AXQ_PF && e < a->per && a->j < a->n; e++) {
        __builtin_prefetch(a->rows[a->j] + a->off, 0, AXQ_LOCALITY);
        if ((a->off += 64) >= a->p1) {
            a->off = a->p0;
            a->j++;
        }
    }
}

/* out[32 k .. 32 k + 32) += sc[k] * sum_j qc_j q_j for the group's n rows (even) and blocks [b0, b0 + nb) */
static void axq_mac(int qt, const uint8_t *const *rows, int n, int64_t b0, int nb, const float *sc, const int16_t *sum8,
                    const void *tab, float *out, axq_ahead *ahead) {
    const int64_t bb = block_bytes(qt);
    int k = 0;
#ifdef PI_AVX2
    if (qt == QT_Q4_0) {
        const uint32_t *t = tab;
        const __m256i m4 = _mm256_set1_epi8(0x0f);
        for (; k < nb; k += 2) {  /* two blocks at a time (the second skipped past nb): rows loaded once */
            axq_prefetch(ahead);
            const int two = k + 1 < nb;
            const int64_t off = (b0 + k) * 18 + 2, off1 = two ? off + 18 : off;
            __m256i acc[4];
            __m256i l0 = _mm256_setzero_si256(), h0 = l0, l1 = l0, h1 = l0;  /* registers, not acc[] */
            for (int p = 0; p < n / 2; p++) {
                const uint8_t *r1 = rows[2 * p], *r2 = rows[2 * p + 1];
                const uint32_t *tp = t + p * AXCB + k;
#define AXQ_PAIR4(o, c, lo, hi)                                                                                        \
    do {                                                                                                               \
        const __m256i t1 = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(r1 + (o))));                 \
        const __m256i t2 = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(r2 + (o))));                 \
        /* word i = (row 1 byte i, row 2 byte i): both rows' value i (low nibble), i + 16 (high) */                    \
        const __m256i w = _mm256_blend_epi32(_mm256_unpacklo_epi8(t1, t2), _mm256_unpackhi_epi8(t1, t2), 0xF0);       \
        const __m256i cp = _mm256_set1_epi32((int)(c));                                                                \
        lo = _mm256_add_epi16(lo, _mm256_maddubs_epi16(_mm256_and_si256(w, m4), cp));                                  \
        hi = _mm256_add_epi16(hi, _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(w, 4), m4), cp));            \
    } while (0)
                AXQ_PAIR4(off, tp[0], l0, h0);
                AXQ_PAIR4(off1, tp[1], l1, h1);
#undef AXQ_PAIR4
            }
            acc[0] = l0, acc[1] = h0, acc[2] = l1, acc[3] = h1;
            for (int e = 0; e <= two; e++) {
                const __m256i o8 = _mm256_set1_epi16(sum8[k + e]);
                const __m256i lo = _mm256_sub_epi16(acc[2 * e], o8), hi = _mm256_sub_epi16(acc[2 * e + 1], o8);
                const __m256 s = _mm256_set1_ps(sc[k + e]);
                float *o = out + (k + e) * QK;
                const __m256i v[4] = {_mm256_cvtepi16_epi32(_mm256_castsi256_si128(lo)),
                                      _mm256_cvtepi16_epi32(_mm256_extracti128_si256(lo, 1)),
                                      _mm256_cvtepi16_epi32(_mm256_castsi256_si128(hi)),
                                      _mm256_cvtepi16_epi32(_mm256_extracti128_si256(hi, 1))};
                for (int i = 0; i < 4; i++)
                    _mm256_storeu_ps(o + 8 * i, _mm256_fmadd_ps(s, _mm256_cvtepi32_ps(v[i]), _mm256_loadu_ps(o + 8 * i)));
            }
        }
        k = nb;
    } else {
        const uint32_t *t = tab;
        for (; k < nb; k++) {
            axq_prefetch(ahead);
            const int64_t off = (b0 + k) * 34 + 2;
            __m256i acc[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(),
                              _mm256_setzero_si256()};
            for (int p = 0; p < n / 2; p++) {
                const __m256i cp = _mm256_set1_epi32((int)t[p * AXCB + k]);
                for (int h = 0; h < 2; h++) {
                    const __m256i a = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(rows[2 * p] + off + 16 * h)));
                    const __m256i b = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(rows[2 * p + 1] + off + 16 * h)));
                    acc[2 * h] = _mm256_add_epi32(acc[2 * h], _mm256_madd_epi16(_mm256_unpacklo_epi16(a, b), cp));
                    acc[2 * h + 1] = _mm256_add_epi32(acc[2 * h + 1], _mm256_madd_epi16(_mm256_unpackhi_epi16(a, b), cp));
                }
            }
            /* acc[2h]: values 16h + {0..3, 8..11}, acc[2h+1]: 16h + {4..7, 12..15} */
            const __m256 s = _mm256_set1_ps(sc[k]);
            float *o = out + k * QK;
            for (int h = 0; h < 2; h++) {
                const __m256i v0 = _mm256_permute2x128_si256(acc[2 * h], acc[2 * h + 1], 0x20);
                const __m256i v1 = _mm256_permute2x128_si256(acc[2 * h], acc[2 * h + 1], 0x31);
                float *oh = o + 16 * h;
                _mm256_storeu_ps(oh, _mm256_fmadd_ps(s, _mm256_cvtepi32_ps(v0), _mm256_loadu_ps(oh)));
                _mm256_storeu_ps(oh + 8, _mm256_fmadd_ps(s, _mm256_cvtepi32_ps(v1), _mm256_loadu_ps(oh + 8)));
            }
        }
    }
#endif
    for (; k < nb; k++) {
        axq_prefetch(ahead);
        const int64_t off = (b0 + k) * bb + 2;
        int32_t isum[QK] = {0};
        for (int p = 0; p < n / 2; p++)
            for (int e = 0; e < 2; e++) {
                const uint8_t *q = rows[2 * p + e] + off;
                int32_t c;
                if (qt == QT_Q4_0) {
                    const uint16_t w = (uint16_t)((const uint32_t *)tab)[p * AXCB + k];
                    c = (int8_t)(e ? w >> 8 : w & 0xff);
                    for (int i = 0; i < 16; i++) {
                        isum[i] += c * ((q[i] & 15) - 8);
                        isum[i + 16] += c * ((q[i] >> 4) - 8);
                    }
                } else {
                    const uint32_t w = ((const uint32_t *)tab)[p * AXCB + k];
                    c = (int16_t)(e ? w >> 16 : w & 0xffff);
                    for (int i = 0; i < QK; i++) isum[i] += c * (int8_t)q[i];
                }
            }
        (void)sum8;
        for (int i = 0; i < QK; i++) out[k * QK + i] += sc[k] * (float)isum[i];
    }
}

/* out[b0 * 32 .. b1 * 32) of pi_q_axpy_sparse: the m kept rows (rows, xs) in groups of AXG, in
 * chunks of AXCB blocks; each group's chunk lines are prefetched while the group before computes */
static void axq_slice(int qt, const uint8_t *const *rows, const float *xs, int64_t m, int64_t b0, int64_t b1,
                      float *out) {
    const int64_t bb = block_bytes(qt);
    float cbuf[AXG * AXCB], sc[AXCB];
    int16_t sum8[AXCB];
    uint32_t tab[AXG / 2 * AXCB];
    for (int64_t c0 = b0; c0 < b1; c0 += AXCB) {
        const int nb = (int)(b1 - c0 < AXCB ? b1 - c0 : AXCB);
        for (int64_t g0 = 0; g0 < m; g0 += AXG) {
            int n = (int)(m - g0 < AXG ? m - g0 : AXG);
            const uint8_t *gr[AXG];
            float gx[AXG];
            for (int j = 0; j < n; j++) {
                gr[j] = rows[g0 + j];
                gx[j] = xs[g0 + j];
            }
            if (n & 1) {  /* a zero coefficient pads the last pair (its row is read, adds 0) */
                gr[n] = gr[0];
                gx[n++] = 0.f;
            }
            /* the next group's rows in this chunk (or the first group's in the next chunk) */
            const int64_t ng0 = g0 + AXG < m ? g0 + AXG : 0, nc0 = g0 + AXG < m ? c0 : c0 + AXCB;
            axq_ahead ahead = {rows + ng0, 0, 0, 0, 0, 0, 0};
            if (nc0 < b1) {
                const int64_t nnb = b1 - nc0 < AXCB ? b1 - nc0 : AXCB;
                ahead.n = (int)(m - ng0 < AXG ? m - ng0 : AXG);
                ahead.off = ahead.p0 = nc0 * bb;
                ahead.p1 = (nc0 + nnb) * bb;
                const int steps = qt == QT_Q4_0 ? (nb + 1) / 2 : nb;  /* axq_mac's block steps */
                ahead.per = (int)(((ahead.p1 - ahead.p0 + 63) / 64 * ahead.n + steps - 1) / steps);
            }
            axq_coefs(qt, gr, gx, n, c0, nb, sc, sum8, tab, cbuf);
            axq_mac(qt, gr, n, c0, nb, sc, sum8, tab, out + (c0 - b0) * QK, &ahead);
        }
    }
}

/* out[d] = sum over j < K with |x[j]| >= thr of x[j] * W[j][d], d < D, with integer products
 * (see above): W [K, D] Q4_0 or Q8_0 rows, x [K] f32, out [D] f32. *n_kept = the number of j with
 * |x[j]| >= thr (rows whose x[j] is exactly 0 are counted there but not read). Returns 0,
 * PI_ENOMEM, or PI_EINVAL for another type or D not a multiple of 32. */
int pi_q_axpy_sparse(int qt, const void *W, const float *x, int64_t K, float thr, int64_t D, float *out,
                     int64_t *n_kept) {
    if (!is_q0(qt) || D % QK) return PI_EINVAL;
    const int64_t rb = row_bytes(qt, D);
    const uint8_t **rows = malloc((size_t)(K + 1) * sizeof(*rows));
    float *xs = malloc((size_t)(K + 1) * sizeof(float));
    if (!rows || !xs) {
        free(rows);
        free(xs);
        return PI_ENOMEM;
    }
    /* kept rows in order of |x| octave (largest first; index order within one): a group's
     * coefficients then share a range, so its scale fits all of them */
    int64_t cnt[AXQ_OCT + 1] = {0}, kept = 0;
    uint32_t emax = 0;
    for (int64_t j = 0; j < K; j++)
        if (fabsf(x[j]) >= thr) {
            kept++;
            const uint32_t e = axq_exp(x[j]);
            if (x[j] != 0.f && e > emax) emax = e;
        }
    for (int64_t j = 0; j < K; j++)
        if (fabsf(x[j]) >= thr && x[j] != 0.f) cnt[axq_oct(x[j], emax) + 1]++;
    for (int o = 0; o < AXQ_OCT; o++) cnt[o + 1] += cnt[o];
    const int64_t m = cnt[AXQ_OCT];
    for (int64_t j = 0; j < K; j++)
        if (fabsf(x[j]) >= thr && x[j] != 0.f) {
            const int64_t at = cnt[axq_oct(x[j], emax)]++;
            rows[at] = (const uint8_t *)W + j * rb;
            xs[at] = x[j];
        }
    *n_kept = kept;
    memset(out, 0, (size_t)D * sizeof(float));
    const int64_t nblk = D / QK;
    const int par = m * rb >= PAR_MIN_BYTES && omp_get_max_threads() > 1 && nblk >= 2;
    #pragma omp parallel if (par)
    {
        int64_t d0, d1;
        d_slice(D, QK, omp_get_num_threads(), omp_get_thread_num(), &d0, &d1);
        if (d0 < d1) axq_slice(qt, rows, xs, m, d0 / QK, d1 / QK, out + d0);
    }
    free(rows);
    free(xs);
    return 0;
}

/* ------------------------------------------------------------------ 8-row groups
 * Dense products (attention, output, predictors, dense FFNs) read Q4_0/Q8_0 matrices re-laid
 * out at load in groups of 8 rows ("x8", same bytes per row): for group g and block b,
 * 8 * bb bytes at (g * nb + b) * 8 * bb hold the 8 rows' fp16 scales, then chunks of 32
 * bytes; chunk c holds bytes 4c..4c+3 of each row's quant bytes (row i at offset 4i).
 * Q4_0 (4 chunks): values 4c..4c+3 in the low nibbles, 16+4c.. in the high ones; the
 *   unsigned nibbles (0..15) meet the broadcast activation bytes in vpmaddubsw and the
 *   offset 8 is taken off once per block as 8 * sum(x block) (acts_t.o, from prepare).
 * Q8_0 (8 chunks): |w| (taken once per block, shared by the tile's tokens) meets x * sign(w)
 *   in vpmaddubsw, exact for every int8 w including -128; each chunk's int16 pairs are
 *   widened to int32 at once (two chunks could overflow int16).
 * The eight accumulator lanes are the eight rows: no horizontal sums. */

/* sum over the block of row_i . x for the 8 rows of one x8 block (reference maths) */
static inline void x8_block_ref(int qt, const uint8_t *blk, const int8_t *xb, int32_t xo, int32_t *dot8) {
    for (int i = 0; i < 8; i++) {
        int32_t sdot = 0;
        if (qt == QT_Q4_0) {
            for (int c = 0; c < 4; c++)
                for (int e = 0; e < 4; e++) {
                    const uint8_t v = blk[16 + 32 * c + 4 * i + e];
                    sdot += (v & 15) * xb[4 * c + e] + (v >> 4) * xb[16 + 4 * c + e];
                }
            sdot -= xo;
        } else {
            for (int c = 0; c < 8; c++)
                for (int e = 0; e < 4; e++) sdot += (int8_t)blk[16 + 32 * c + 4 * i + e] * xb[4 * c + e];
        }
        dot8[i] = sdot;
    }
}

#ifdef PI_AVX2
/* One x8 block's 8 chunk vectors as 32 unsigned bytes each: Q4_0's 4 chunks give 8 vectors of
 * nibbles (low nibbles, then high), Q8_0's 8 chunks their magnitudes |w|. Vector k pairs with
 * activation bytes 4k..4k+3 in both cases. Unpacked once per block, reused for every token of
 * the tile. */
static inline __attribute__((always_inline)) void x8_unpack(int qt, const uint8_t *blk, __m256i *v) {
    if (qt == QT_Q4_0) {
        const __m256i m4 = _mm256_set1_epi8(0x0f);
        for (int c = 0; c < 4; c++) {
            const __m256i raw = _mm256_loadu_si256((const __m256i *)(blk + 16 + 32 * c));
            v[c] = _mm256_and_si256(raw, m4);
            v[4 + c] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
        }
    } else {
        for (int c = 0; c < 8; c++) v[c] = _mm256_abs_epi8(_mm256_loadu_si256((const __m256i *)(blk + 16 + 32 * c)));
    }
}

/* 4 activation bytes as one int32 (broadcast straight from the activation buffer: a copy
 * through the stack first cost a store-forward per token-block) */
static inline int32_t ld32(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* the eight rows' integer sums for one token's block, as int32 lanes (v: x8_unpack's vectors of
 * the block blk; xo: Q4_0's offset for this token's block) */
static inline __attribute__((always_inline)) __m256i x8_block_avx(int qt, const __m256i *v, const uint8_t *blk,
                                                                  const int8_t *xb, int32_t xo) {
    const __m256i ones = _mm256_set1_epi16(1);
    if (qt == QT_Q4_0) {  /* |each pair| <= 2 * 15 * 127, eight of them <= 30480: no int16 overflow */
        __m256i s16 = _mm256_maddubs_epi16(v[0], _mm256_set1_epi32(ld32(xb)));
        for (int k = 1; k < 8; k++)
            s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(v[k], _mm256_set1_epi32(ld32(xb + 4 * k))));
        return _mm256_sub_epi32(_mm256_madd_epi16(s16, ones), _mm256_set1_epi32(xo));
    }
    __m256i s32 = _mm256_setzero_si256();
    for (int k = 0; k < 8; k++) {  /* x * sign(w): |x| <= 127, no overflow */
        const __m256i xw = _mm256_sign_epi8(_mm256_set1_epi32(ld32(xb + 4 * k)),
                                            _mm256_loadu_si256((const __m256i *)(blk + 16 + 32 * k)));
        s32 = _mm256_add_epi32(s32, _mm256_madd_epi16(_mm256_maddubs_epi16(v[k], xw), ones));
    }
    return s32;
}

/* rn (1..4, a constant where inlined) tokens from t0 against one group of 8 rows: out [rn][8].
 * The accumulators stay in registers; each block is unpacked once for the rn tokens. */
static inline __attribute__((always_inline)) void x8_tile(int qt, const uint8_t *base, int64_t nb, acts_t a,
                                                          int64_t t0, const int rn, float *out) {
    const int64_t gb = 8 * block_bytes(qt);  /* bytes of one x8 block */
    __m256 vacc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = base + b * gb;
        /* the groups follow each other in memory: the stream X8_AHEAD bytes on is
         * requested now (the hardware prefetcher alone keeps 0.63-0.65 of the read
         * rate, this 0.86-0.97; 1, 2, 3, 4 and 8 KB measured, 1 thread, AVX2 EPYC) */
        for (int64_t o = 0; o < gb; o += 64) __builtin_prefetch(blk + X8_AHEAD + o, 0, 3);
        const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
        __m256i v[8];
        x8_unpack(qt, blk, v);
#pragma GCC unroll 4
        for (int j = 0; j < rn; j++) {
            const int64_t xb = (t0 + j) * nb + b;  /* the token's block */
            vacc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(x8_block_avx(qt, v, blk, a.q + xb * QK,
                                                                      qt == QT_Q4_0 ? a.o[xb] : 0)),
                                      _mm256_mul_ps(dw, _mm256_set1_ps(a.d[xb])), vacc[j]);
        }
    }
    for (int j = 0; j < rn; j++) _mm256_storeu_ps(out + 8 * j, vacc[j]);
}
#endif

/* groups [g0, g1) of y [T, N] for an x8 matrix; a: the T activations (q8 blocks, scales,
 * and for Q4_0 the block offsets). Called with a constant qt. Each group of 8 rows takes every
 * tile of 4 tokens while its bytes are in L1/L2 (group outer, tokens inner: with tokens outer a
 * batch of 8 read every weight from memory twice), so a step of several tokens reads each weight
 * from memory once. Per token and row the blocks are summed in order 0..nb-1, whatever T is:
 * a token's numbers do not depend on the others in the call. */
static inline __attribute__((always_inline)) void x8_range_t(int qt, const uint8_t *W, int64_t nb, int64_t N,
                                                             acts_t a, int64_t T, float *y, int64_t g0,
                                                             int64_t g1) {
    const int64_t gb = 8 * block_bytes(qt);  /* bytes of one x8 block */
    for (int64_t g = g0; g < g1; g++) {
        const uint8_t *base = W + g * nb * gb;
        for (int64_t t0 = 0; t0 < T; t0 += 4) {
            const int rn = T - t0 >= 4 ? 4 : (int)(T - t0);
            float acc[4][8];
#ifdef PI_AVX2
            if (rn == 4) x8_tile(qt, base, nb, a, t0, 4, acc[0]);
            else if (rn == 3) x8_tile(qt, base, nb, a, t0, 3, acc[0]);
            else if (rn == 2) x8_tile(qt, base, nb, a, t0, 2, acc[0]);
            else x8_tile(qt, base, nb, a, t0, 1, acc[0]);
#else
            for (int j = 0; j < rn; j++)
                for (int i = 0; i < 8; i++) acc[j][i] = 0;
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *blk = base + b * gb;
                for (int j = 0; j < rn; j++) {
                    const int64_t xb = (t0 + j) * nb + b;  /* the token's block */
                    int32_t d8[8];
                    x8_block_ref(qt, blk, a.q + xb * QK, qt == QT_Q4_0 ? a.o[xb] : 0, d8);
                    for (int i = 0; i < 8; i++) acc[j][i] += (float)d8[i] * (h2f(rd16(blk + 2 * i)) * a.d[xb]);
                }
            }
#endif
            for (int j = 0; j < rn; j++)
                for (int i = 0; i < 8; i++) y[(t0 + j) * N + 8 * g + i] = acc[j][i];
        }
    }
}

static void x8_range(int qt, const uint8_t *W, int64_t nb, int64_t N, acts_t a, int64_t T, float *y, int64_t g0,
                     int64_t g1) {
    if (qt == QT_Q4_0) x8_range_t(QT_Q4_0, W, nb, N, a, T, y, g0, g1);
    else x8_range_t(QT_Q8_0, W, nb, N, a, T, y, g0, g1);
}

/* ------------------------------------------------------------------ 8-row groups of K-quants
 * Q4_K, Q5_K and Q6_K dense matrices re-laid out at load in groups of 8 rows ("x8", same bytes
 * per row): for group g and super-block s, 8 * bb bytes at (g * nsb + s) * 8 * bb hold the first
 * 4 * (bb / 4) bytes of each row's block as chunks of 32 bytes (chunk c: bytes 4c..4c+3 of row i
 * at offset 4i), then the bb % 4 remaining bytes of each row (Q6_K's fp16 d), row after row.
 * Lane i of a chunk is row i, so each product sums 8 rows at once in the 8 int32 lanes against
 * 4 broadcast activation bytes (no horizontal sums), as the Q4_0/Q8_0 x8 kernel does.
 * Q4_K/Q5_K chunks: 0 (d, dmin), 1-3 (the packed 6-bit scales and mins), Q5_K 4-11 (qh), then
 * 32 of qs. Q6_K chunks: 0-31 ql, 32-47 qh, 48-51 the int8 scales, then the 8 d.
 * Per row the super-block's integer sums are those of dot_q4_K/_q5_K/_q6_K (exact, over the whole
 * super-block with the scales and mins, on the q8_K activation), scaled by d dy once per super-block
 * and summed in another float order: equal within float32 rounding. */

/* row i of an x8 block of type qt (head: the leading bytes per row) back into ggml's block bytes */
static inline void x8_row_bytes(int qt, const uint8_t *blk, int i, uint8_t *out) {
    const int64_t head = qt == QT_Q5_0 ? 2 : qt == QT_Q5_1 ? 4 : 0, bb = block_bytes(qt);
    const int64_t nc = (bb - head) / 4, tail = (bb - head) % 4;
    memcpy(out, blk + head * i, (size_t)head);
    for (int64_t c = 0; c < nc; c++) memcpy(out + head + 4 * c, blk + 8 * head + 32 * c + 4 * i, 4);
    if (tail) memcpy(out + head + 4 * nc, blk + 8 * head + 32 * nc + tail * i, (size_t)tail);
}

#ifdef PI_AVX2
/* the stream X8_AHEAD bytes on, an eighth of a super-block group (gb bytes) per sub-block k: spread
 * over the compute (a burst of a whole group's lines stalls on the line-fill buffers: measured
 * 0.45 of the spread rate, Q6_K, 1 thread) */
static inline void x8k_prefetch(const uint8_t *blk, int64_t gb, int k) {
    for (int64_t o = k * gb / 8 / 64 * 64; o < (k + 1) * gb / 8; o += 64) __builtin_prefetch(blk + X8_AHEAD + o, 0, 3);
}

/* 8 fp16 in the low (hi = 0) or high (hi = 1) halves of 8 int32 lanes -> 8 fp32 */
static inline __m256 halves8(__m256i v, const int hi) {
    const __m256i h = hi ? _mm256_srli_epi32(v, 16) : _mm256_and_si256(v, _mm256_set1_epi32(0xffff));
    const __m256i p = _mm256_permute4x64_epi64(_mm256_packus_epi32(h, h), 0x08);
    return _mm256_cvtph_ps(_mm256_castsi256_si128(p));
}

/* (v << 16) | v in each int32 lane: the lane's value as both int16 of a vpmaddwd pair (v < 2^15) */
static inline __m256i pair16(__m256i v) { return _mm256_or_si256(v, _mm256_slli_epi32(v, 16)); }

/* sub-block k of one Q4_K/Q5_K x8 super-block against rn tokens: isum[j] += the 8 rows' int32 sums
 * s_k sum(q qy) (slo, shi: the rows' scales of sub-blocks 0-3 and 4-7, one per byte) */
static inline __attribute__((always_inline)) void x8k45_sub(const uint8_t *blk, int64_t gb, const uint8_t *qs,
                                                            __m256i slo, __m256i shi, acts_t a, int64_t K, int64_t t0,
                                                            int64_t sb, const int rn, const int h5, const int k,
                                                            __m256i *isum) {
    const __m256i m4 = _mm256_set1_epi8(0x0f), b10 = _mm256_set1_epi8(0x10), lo8 = _mm256_set1_epi32(0xff);
    const uint8_t *qh = blk + 128;
    x8k_prefetch(blk, gb, k);
    const int c = k / 2, h = k % 2;
    const __m256i ss = pair16(_mm256_and_si256(_mm256_srli_epi32(k < 4 ? slo : shi, 8 * (k % 4)), lo8));
    __m256i w[8];
    for (int jj = 0; jj < 8; jj++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * (8 * c + jj)));
        w[jj] = h ? _mm256_and_si256(_mm256_srli_epi16(v, 4), m4) : _mm256_and_si256(v, m4);
        if (h5) {  /* bit k of each qh byte to bit 4: one shift and one mask (a 16-bit shift's carry between
                    * bytes lands outside bit 4 for shifts up to 4 left and 3 right) */
            const __m256i hb = _mm256_loadu_si256((const __m256i *)(qh + 32 * jj));
            const __m256i hs = k < 4 ? _mm256_slli_epi16(hb, 4 - k) : k == 4 ? hb : _mm256_srli_epi16(hb, k - 4);
            w[jj] = _mm256_or_si256(w[jj], _mm256_and_si256(hs, b10));
        }
    }
#pragma GCC unroll 4
    for (int j = 0; j < rn; j++) {
        const int8_t *xq = a.q + (t0 + j) * K + sb * QKK + 32 * k;
        __m256i s32;
        if (h5) {  /* 5-bit q: four pairs of products fit int16, eight may not */
            __m256i p = _mm256_maddubs_epi16(w[0], _mm256_set1_epi32(ld32(xq)));
            for (int jj = 1; jj < 4; jj++) p = _mm256_add_epi16(p, _mm256_maddubs_epi16(w[jj], _mm256_set1_epi32(ld32(xq + 4 * jj))));
            __m256i q = _mm256_maddubs_epi16(w[4], _mm256_set1_epi32(ld32(xq + 16)));
            for (int jj = 5; jj < 8; jj++) q = _mm256_add_epi16(q, _mm256_maddubs_epi16(w[jj], _mm256_set1_epi32(ld32(xq + 4 * jj))));
            s32 = _mm256_add_epi32(_mm256_madd_epi16(p, ss), _mm256_madd_epi16(q, ss));
        } else {  /* 4-bit q: |eight pairs| <= 8 * 2 * 15 * 127 = 30480 */
            __m256i p = _mm256_maddubs_epi16(w[0], _mm256_set1_epi32(ld32(xq)));
            for (int jj = 1; jj < 8; jj++) p = _mm256_add_epi16(p, _mm256_maddubs_epi16(w[jj], _mm256_set1_epi32(ld32(xq + 4 * jj))));
            s32 = _mm256_madd_epi16(p, ss);
        }
        isum[j] = _mm256_add_epi32(isum[j], s32);
    }
}

/* rn (1..4, or X8K_TW) tokens from t0 against one group of 8 Q4_K (h5 0) or Q5_K (h5 1) rows: out [rn][8].
 * Per row lane, as dot_q45_K: sum_k s_k sum(q qy) and sum_k m_k sum_k(qy) in int32 over the
 * super-block (the scale s_k in vpmaddwd with the vpmaddubsw pairs; the mins as pairs (m_a, m_b)
 * against the broadcast 32-value sums of the token), then d dy and dmin dy once. */
static inline __attribute__((always_inline)) void x8k45_tile(const uint8_t *base, int64_t nsb, acts_t a,
                                                             int64_t K, int64_t t0, const int rn,
                                                             const int h5, float *out) {
    const int64_t gb = 8 * (h5 ? 176 : 144);
    const __m256i m6 = _mm256_set1_epi32(0x3f3f3f3f), m2 = _mm256_set1_epi32(0x03030303), b4 = _mm256_set1_epi32(0x0f0f0f0f);
    const __m256i ev = _mm256_set1_epi32(0x00ff00ff);
    __m256 acc[X8K_TW];
    for (int j = 0; j < rn; j++) acc[j] = _mm256_setzero_ps();
    for (int64_t sb = 0; sb < nsb; sb++) {
        const uint8_t *blk = base + sb * gb;
        const __m256i dd = _mm256_loadu_si256((const __m256i *)blk);
        const __m256 d8 = halves8(dd, 0), dm8 = halves8(dd, 1);
        const __m256i u0 = _mm256_loadu_si256((const __m256i *)(blk + 32)), u1 = _mm256_loadu_si256((const __m256i *)(blk + 64)),
                      u2 = _mm256_loadu_si256((const __m256i *)(blk + 96));
        /* lane i: row i's scales (mins) of sub-blocks 0-3 and 4-7, one per byte */
        const __m256i slo = _mm256_and_si256(u0, m6), mlo = _mm256_and_si256(u1, m6);
        const __m256i shi = _mm256_or_si256(_mm256_and_si256(u2, b4), _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(u0, 6), m2), 4));
        const __m256i mhi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(u2, 4), b4), _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(u1, 6), m2), 4));
        /* the mins as int16 pairs (m0, m2), (m1, m3), (m4, m6), (m5, m7) */
        const __m256i mp[4] = {_mm256_and_si256(mlo, ev), _mm256_and_si256(_mm256_srli_epi32(mlo, 8), ev),
                               _mm256_and_si256(mhi, ev), _mm256_and_si256(_mm256_srli_epi32(mhi, 8), ev)};
        __m256i isum[X8K_TW];
        for (int j = 0; j < rn; j++) isum[j] = _mm256_setzero_si256();
        const uint8_t *qs = blk + 32 * (h5 ? 12 : 4);
        if (h5 && rn > 1) {  /* Q5_K: unrolled, this loop spills (measured 0.91x of the rolled one at 16-64 tokens) */
            for (int k = 0; k < 8; k++) x8k45_sub(blk, gb, qs, slo, shi, a, K, t0, sb, rn, 1, k, isum);
        } else {  /* Q4_K, and Q5_K at 1 token: unrolled, constant shifts and offsets (Q4_K 1.42x at 1 token, 1.14x at 64) */
#pragma GCC unroll 8
            for (int k = 0; k < 8; k++) x8k45_sub(blk, gb, qs, slo, shi, a, K, t0, sb, rn, h5, k, isum);
        }
#pragma GCC unroll 4
        for (int j = 0; j < rn; j++) {
            const int32_t *xp = a.p + ((t0 + j) * nsb + sb) * 8;  /* the token's 32-value sums in pairs (kpairs) */
            __m256i im = _mm256_madd_epi16(mp[0], _mm256_set1_epi32(xp[0]));
            im = _mm256_add_epi32(im, _mm256_madd_epi16(mp[1], _mm256_set1_epi32(xp[1])));
            im = _mm256_add_epi32(im, _mm256_madd_epi16(mp[2], _mm256_set1_epi32(xp[2])));
            im = _mm256_add_epi32(im, _mm256_madd_epi16(mp[3], _mm256_set1_epi32(xp[3])));
            const __m256 dy = _mm256_set1_ps(a.d[(t0 + j) * nsb + sb]);
            acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[j]), _mm256_mul_ps(d8, dy), acc[j]);
            acc[j] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(im), _mm256_mul_ps(dm8, dy), acc[j]);
        }
    }
    for (int j = 0; j < rn; j++) _mm256_storeu_ps(out + 8 * j, acc[j]);
}

/* the same for Q6_K: q 0..63 (offset 32), an int8 scale per 16 values; per row lane the int32 sum
 * of dot_q6_K over the super-block, then d dy once */
static inline __attribute__((always_inline)) void x8k6_tile(const uint8_t *base, int64_t nsb, acts_t a, int64_t K,
                                                            int64_t t0, const int rn, float *out) {
    const int64_t gb = 8 * 210;
    const __m256i m4 = _mm256_set1_epi8(0x0f), m30 = _mm256_set1_epi8(0x30), lo16 = _mm256_set1_epi32(0xffff);
    __m256 acc[X8K_TW];
    for (int j = 0; j < rn; j++) acc[j] = _mm256_setzero_ps();
    for (int64_t sb = 0; sb < nsb; sb++) {
        const uint8_t *blk = base + sb * gb;
        const __m256 d8 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 32 * 52)));
        __m256i isum[X8K_TW];
        for (int j = 0; j < rn; j++) isum[j] = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int k = 0; k < 8; k++) {
            x8k_prefetch(blk, gb, k);
            const int n = k / 4, b = k % 4;  /* half, and block within the half */
            /* the two groups' scales, sign-extended: lane i = row i */
            const __m256i sc = _mm256_loadu_si256((const __m256i *)(blk + 32 * (48 + k / 2)));
            const int e = 2 * (k % 2);  /* byte of group 2k in its chunk */
            const __m256i sa = _mm256_srai_epi32(_mm256_slli_epi32(sc, 24 - 8 * e), 24);
            const __m256i sb2 = _mm256_srai_epi32(_mm256_slli_epi32(sc, 16 - 8 * e), 24);
            const __m256i pa = _mm256_or_si256(_mm256_and_si256(sa, lo16), _mm256_slli_epi32(sa, 16));  /* (s, s) */
            const __m256i pb = _mm256_or_si256(_mm256_and_si256(sb2, lo16), _mm256_slli_epi32(sb2, 16));
            const __m256i pab = _mm256_or_si256(_mm256_and_si256(sa, lo16), _mm256_slli_epi32(sb2, 16));  /* (s_a, s_b) */
            __m256i w[8];
            for (int jj = 0; jj < 8; jj++) {
                const __m256i l = _mm256_loadu_si256((const __m256i *)(blk + 32 * (16 * n + 8 * (b % 2) + jj)));
                const __m256i hb = _mm256_loadu_si256((const __m256i *)(blk + 32 * (32 + 8 * n + jj)));
                const __m256i low = b < 2 ? _mm256_and_si256(l, m4) : _mm256_and_si256(_mm256_srli_epi16(l, 4), m4);
                /* bits 2b, 2b + 1 of each qh byte to bits 4, 5: one shift (none for b = 2) and one mask (a
                 * 16-bit shift's carry between bytes lands outside 0x30) */
                const __m256i hs = b == 0 ? _mm256_slli_epi16(hb, 4) : b == 1 ? _mm256_slli_epi16(hb, 2)
                                 : b == 2 ? hb : _mm256_srli_epi16(hb, 2);
                w[jj] = _mm256_or_si256(low, _mm256_and_si256(hs, m30));
            }
#pragma GCC unroll 4
            for (int j = 0; j < rn; j++) {
                const int8_t *xq = a.q + (t0 + j) * K + sb * QKK + 32 * k;
                const int32_t xs2 = a.p[((t0 + j) * nsb + sb) * 8 + k];  /* (s_2k, s_2k+1) of the token (kpairs) */
                __m256i p[4];
                for (int q = 0; q < 4; q++)  /* |two pairs| <= 2 * 2 * 63 * 127 = 32004 */
                    p[q] = _mm256_add_epi16(_mm256_maddubs_epi16(w[2 * q], _mm256_set1_epi32(ld32(xq + 8 * q))),
                                            _mm256_maddubs_epi16(w[2 * q + 1], _mm256_set1_epi32(ld32(xq + 8 * q + 4))));
                __m256i s32 = _mm256_add_epi32(_mm256_add_epi32(_mm256_madd_epi16(p[0], pa), _mm256_madd_epi16(p[1], pa)),
                                               _mm256_add_epi32(_mm256_madd_epi16(p[2], pb), _mm256_madd_epi16(p[3], pb)));
                s32 = _mm256_sub_epi32(s32, _mm256_slli_epi32(_mm256_madd_epi16(pab, _mm256_set1_epi32(xs2)), 5));
                isum[j] = _mm256_add_epi32(isum[j], s32);
            }
        }
#pragma GCC unroll 4
        for (int j = 0; j < rn; j++)
            acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[j]), _mm256_mul_ps(d8, _mm256_set1_ps(a.d[(t0 + j) * nsb + sb])), acc[j]);
    }
    for (int j = 0; j < rn; j++) _mm256_storeu_ps(out + 8 * j, acc[j]);
}
#endif

/* groups [g0, g1) of y [T, N] for an x8 K-quant matrix (called with a constant qt): each group of
 * 8 rows takes every tile of tokens (32, 16, then up to 4) while its bytes are in cache; a token's
 * numbers do not depend on the others in the call (each tile sums its blocks in order 0..nsb-1). */
static inline __attribute__((always_inline)) void x8k_range_t(int qt, const uint8_t *W, int64_t K, int64_t N,
                                                              acts_t a, int64_t T, float *y, int64_t g0, int64_t g1) {
    const int64_t nsb = K / QKK, gb = 8 * block_bytes(qt);
    for (int64_t g = g0; g < g1; g++) {
        const uint8_t *base = W + g * nsb * gb;
        for (int64_t t0 = 0, rn; t0 < T; t0 += rn) {
#ifdef PI_AVX2
            rn = T - t0 >= X8K_TW ? X8K_TW : T - t0 >= 16 ? 16 : T - t0 >= 4 ? 4 : T - t0;
#else
            rn = T - t0 >= 4 ? 4 : T - t0;
#endif
            float acc[X8K_TW][8];
#ifdef PI_AVX2
#define X8K_TILE(R) (qt == QT_Q6_K ? x8k6_tile(base, nsb, a, K, t0, R, acc[0]) \
                     : x8k45_tile(base, nsb, a, K, t0, R, qt == QT_Q5_K, acc[0]))
            if (rn == X8K_TW) X8K_TILE(X8K_TW);
            else if (rn == 16) X8K_TILE(16);
            else if (rn == 4) X8K_TILE(4);
            else if (rn == 3) X8K_TILE(3);
            else if (rn == 2) X8K_TILE(2);
            else X8K_TILE(1);
#undef X8K_TILE
#else
            uint8_t row[210];
            for (int i = 0; i < 8; i++) {
                for (int j = 0; j < rn; j++) acc[j][i] = 0.f;
                for (int64_t sb = 0; sb < nsb; sb++) {
                    x8_row_bytes(qt, base + sb * gb, i, row);
                    for (int j = 0; j < rn; j++) {
                        act_t x1 = {NULL, a.q + (t0 + j) * K + sb * QKK, a.d + (t0 + j) * nsb + sb,
                                    a.s + (t0 + j) * (K / 16) + sb * 16};
                        acc[j][i] += row_dot(qt, row, x1, QKK);
                    }
                }
            }
#endif
            for (int j = 0; j < rn; j++)
                for (int i = 0; i < 8; i++) y[(t0 + j) * N + 8 * g + i] = acc[j][i];
        }
    }
}

static void x8k_range(int qt, const uint8_t *W, int64_t K, int64_t N, acts_t a, int64_t T, float *y, int64_t g0,
                      int64_t g1) {
    if (qt == QT_Q4_K) x8k_range_t(QT_Q4_K, W, K, N, a, T, y, g0, g1);
    else if (qt == QT_Q5_K) x8k_range_t(QT_Q5_K, W, K, N, a, T, y, g0, g1);
    else x8k_range_t(QT_Q6_K, W, K, N, a, T, y, g0, g1);
}


/* ------------------------------------------------------------------ 8-row groups of Q5_0 / Q5_1
 * x8 as for the K-quants with the rows' fp16 d (Q5_1: d and m, 4 bytes) first: for group g and
 * block b, 8 * bb bytes hold the 8 rows' leading 2 (4) bytes, row after row, then 5 chunks of 32
 * bytes: chunk 0 the rows' 32-bit qh (lane i = row i), chunk 1 + c bytes 4c..4c+3 of each row's
 * nibbles (values 4c..4c+3 low, 16 + 4c.. high; their 5th bits are bits 4c.. and 16 + 4c.. of qh).
 * Per row the block sums are dot_q5's integers, scaled and summed in the same order. */

#ifdef PI_AVX2
/* 0x10 in byte e of lane i where bit (hi ? 16 : 0) + 4c + e of row i's qh is set */
static inline __m256i q5x8_bits(__m256i qh, const int c, const int hi) {
    const int bi = (hi ? 2 : 0) + c / 2, sh = 4 * (c % 2);
    const __m256i ctrl = _mm256_add_epi8(_mm256_setr_epi8(0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12,
                                                          0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12),
                                         _mm256_set1_epi8((char)bi));
    const __m256i mask = _mm256_set1_epi32((int)(0x08040201u << sh));
    const __m256i v = _mm256_and_si256(_mm256_shuffle_epi8(qh, ctrl), mask);
    return _mm256_and_si256(_mm256_cmpeq_epi8(v, mask), _mm256_set1_epi8(0x10));
}

static inline __attribute__((always_inline)) void x8q5_tile(const uint8_t *base, int64_t nb, acts_t a,
                                                            const float *xm, int64_t t0, const int rn, const int q51,
                                                            float *out) {
    const int64_t head = q51 ? 4 : 2, gb = 8 * (q51 ? 24 : 22);
    const __m256i m4 = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = base + b * gb;
        for (int64_t o = 0; o < gb; o += 64) __builtin_prefetch(blk + X8_AHEAD + o, 0, 3);
        __m256 d8, m8 = _mm256_setzero_ps();
        if (q51) {
            const __m256i dm = _mm256_loadu_si256((const __m256i *)blk);
            d8 = halves8(dm, 0);
            m8 = halves8(dm, 1);
        } else {
            d8 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
        }
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 8 * head));
        __m256i w[8];
        for (int c = 0; c < 4; c++) {
            const __m256i raw = _mm256_loadu_si256((const __m256i *)(blk + 8 * head + 32 * (1 + c)));
            w[c] = _mm256_or_si256(_mm256_and_si256(raw, m4), q5x8_bits(qh, c, 0));
            w[4 + c] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(raw, 4), m4), q5x8_bits(qh, c, 1));
        }
#pragma GCC unroll 4
        for (int j = 0; j < rn; j++) {
            const int64_t xb = (t0 + j) * nb + b;
            const int8_t *xq = a.q + xb * QK;
            __m256i p = _mm256_maddubs_epi16(w[0], _mm256_set1_epi32(ld32(xq)));  /* |four pairs| <= 31496 */
            __m256i q = _mm256_maddubs_epi16(w[4], _mm256_set1_epi32(ld32(xq + 16)));
            for (int c = 1; c < 4; c++) {
                p = _mm256_add_epi16(p, _mm256_maddubs_epi16(w[c], _mm256_set1_epi32(ld32(xq + 4 * c))));
                q = _mm256_add_epi16(q, _mm256_maddubs_epi16(w[4 + c], _mm256_set1_epi32(ld32(xq + 16 + 4 * c))));
            }
            __m256i s32 = _mm256_add_epi32(_mm256_madd_epi16(p, ones), _mm256_madd_epi16(q, ones));
            if (!q51) s32 = _mm256_sub_epi32(s32, _mm256_set1_epi32(16 * (a.s[2 * xb] + a.s[2 * xb + 1])));
            acc[j] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(s32), d8), _mm256_set1_ps(a.d[xb]), acc[j]);
            if (q51) acc[j] = _mm256_fmadd_ps(m8, _mm256_set1_ps(xm[xb]), acc[j]);
        }
    }
    for (int j = 0; j < rn; j++) _mm256_storeu_ps(out + 8 * j, acc[j]);
}
#endif

static inline __attribute__((always_inline)) void x8q5_range_t(int qt, const uint8_t *W, int64_t K, int64_t N,
                                                               acts_t a, const float *xm, int64_t T, float *y,
                                                               int64_t g0, int64_t g1) {
    const int64_t nb = K / QK, gb = 8 * block_bytes(qt);
    for (int64_t g = g0; g < g1; g++) {
        const uint8_t *base = W + g * nb * gb;
        for (int64_t t0 = 0; t0 < T; t0 += 4) {
            const int rn = T - t0 >= 4 ? 4 : (int)(T - t0);
            float acc[4][8];
#ifdef PI_AVX2
            const int q51 = qt == QT_Q5_1;
            if (rn == 4) x8q5_tile(base, nb, a, xm, t0, 4, q51, acc[0]);
            else if (rn == 3) x8q5_tile(base, nb, a, xm, t0, 3, q51, acc[0]);
            else if (rn == 2) x8q5_tile(base, nb, a, xm, t0, 2, q51, acc[0]);
            else x8q5_tile(base, nb, a, xm, t0, 1, q51, acc[0]);
#else
            (void)xm;
            uint8_t row[24];
            for (int i = 0; i < 8; i++)
                for (int j = 0; j < rn; j++) {
                    float s = 0.f;
                    for (int64_t b = 0; b < nb; b++) {
                        x8_row_bytes(qt, base + b * gb, i, row);
                        const int64_t xb = (t0 + j) * nb + b;
                        act_t x1 = {NULL, a.q + xb * QK, a.d + xb, a.s + 2 * xb};
                        s += row_dot(qt, row, x1, QK);
                    }
                    acc[j][i] = s;
                }
#endif
            for (int j = 0; j < rn; j++)
                for (int i = 0; i < 8; i++) y[(t0 + j) * N + 8 * g + i] = acc[j][i];
        }
    }
}

/* y [T, N] = x [T, K] @ W.T for an x8 Q4_K/Q5_K/Q6_K or Q5_0/Q5_1 matrix W (N a multiple of 8): the
 * activation's 8-bit blocks with their sums, and for Q5_1 dx * sum(qx) per q8 block (its m's factor) */
static int x8s_gemm(int qt, const void *W, int64_t N, int64_t K, const float *x, int64_t T, float *y) {
    const int64_t nb = K / QK, G = N / 8;
    int ok;
    const acts_t acts = prepare(qt, x, T, K, &ok);
    if (!ok) return PI_ENOMEM;
    float *xm = qt == QT_Q5_1 ? malloc((size_t)(T * nb + 1) * sizeof(float)) : NULL;
    if (qt == QT_Q5_1 && !xm) {
        release(acts);
        return PI_ENOMEM;
    }
    if (xm)
        for (int64_t i = 0; i < T * nb; i++) xm[i] = acts.d[i] * (float)(acts.s[2 * i] + acts.s[2 * i + 1]);
    const int par = G * (K / block_values(qt)) * 8 * block_bytes(qt) >= PAR_MIN_BYTES && omp_get_max_threads() > 1;
    #pragma omp parallel if (par)
    {
        int64_t g0, g1;
        split(G, omp_get_num_threads(), omp_get_thread_num(), &g0, &g1);
        if (is_k(qt)) x8k_range(qt, (const uint8_t *)W, K, N, acts, T, y, g0, g1);
        else if (qt == QT_Q5_0) x8q5_range_t(QT_Q5_0, (const uint8_t *)W, K, N, acts, xm, T, y, g0, g1);
        else x8q5_range_t(QT_Q5_1, (const uint8_t *)W, K, N, acts, xm, T, y, g0, g1);
    }
    free(xm);
    release(acts);
    return 0;
}

/* y [T, N] = x [T, K] @ W.T for an x8 Q4_0/Q8_0 (Q4_K/Q5_K/Q6_K, Q5_0/Q5_1: x8s_gemm)
 * matrix W (N a multiple of 8). */
int pi_x8_gemm(int qt, const void *W, int64_t N, int64_t K, const float *x, int64_t T, float *y) {
    if (is_k(qt) || is_q5(qt)) return x8s_gemm(qt, W, N, K, x, T, y);
    const int64_t nb = K / QK, G = N / 8;
    int ok;
    const acts_t acts = prepare(qt, x, T, K, &ok);
    if (!ok) return PI_ENOMEM;
    const int par = G * nb * 8 * block_bytes(qt) >= PAR_MIN_BYTES && omp_get_max_threads() > 1;
    #pragma omp parallel if (par)
    {
        int64_t g0, g1;
        split(G, omp_get_num_threads(), omp_get_thread_num(), &g0, &g1);
        x8_range(qt, (const uint8_t *)W, nb, N, acts, T, y, g0, g1);
    }
    release(acts);
    return 0;
}

/* out[r] = W[idx ? idx[r] : r] as f32 rows [n, K] (embedding lookups, tile dequantization). */
void pi_q_dequant_rows(int qt, const void *W, const int64_t *idx, int64_t n, int64_t K, float *out) {
    const int64_t rb = row_bytes(qt, K);
    const int par = n * rb >= 4 * PAR_MIN_BYTES && omp_get_max_threads() > 1;
    #pragma omp parallel for if (par)
    for (int64_t r = 0; r < n; r++) {
        float *o = out + r * K;
        memset(o, 0, (size_t)K * sizeof(float));
        axpy_row(qt, (const uint8_t *)W + (idx ? idx[r] : r) * rb, 1.0f, 0, K, o);
    }
}

/* ------------------------------------------------------------------ several tokens' sparse rows
 * Batched decoding (runtime/batch.py): the rows of the union of T tokens' predicted-active
 * neurons are read from memory once for all T. Each token's numbers are those the one-token
 * kernels give it (the same block products, sums and order), so a sequence decoded in a batch
 * gets bit for bit what it gets alone. */

/* y[ts[j] * n] = row . x[ts[j]] for the nts tokens ts (y already offset to the row's column):
 * Q4_0/Q8_0 rows meet up to 3 tokens per pass (the block unpacked once, tile_q8, whose per-token
 * sums are dot_q0's), other types one row_dot per token. */
static inline void dot_row_tokens(int qt, const uint8_t *row, const float *x, acts_t acts, int64_t K,
                                  const int64_t *ts, int nts, float *y, int64_t n) {
#ifdef PI_AVX2
    if (is_q0(qt)) {
        const int64_t nb = K / QK;
        for (int j0 = 0; j0 < nts; j0 += 3) {
            const int rn = nts - j0 >= 3 ? 3 : nts - j0;
            const int8_t *xq[3];
            const float *xd[3];
            for (int j = 0; j < rn; j++) {
                xq[j] = acts.q + ts[j0 + j] * K;
                xd[j] = acts.d + ts[j0 + j] * nb;
            }
            float o[3];
            const uint8_t *rows[1] = {row};
            if (rn == 3) tile_q8(qt, rows, xq, xd, nb, 1, 3, o);
            else if (rn == 2) tile_q8(qt, rows, xq, xd, nb, 1, 2, o);
            else tile_q8(qt, rows, xq, xd, nb, 1, 1, o);
            for (int j = 0; j < rn; j++) y[ts[j0 + j] * n] = o[j];
        }
        return;
    }
#endif
    for (int j = 0; j < nts; j++) y[ts[j] * n] = row_dot(qt, row, act_of(x, acts, ts[j], K), K);
}

#define MULTI_MAX_T 64 /* tokens per call of the several-token row kernels (kernels.QGEMM_MAX_T) */

/* For r < n and t < T with sel[t * n + r] != 0: y1[t * n + r] = W1[idx[r]] . x[t], and if W2,
 * y2[t * n + r] = W2[idx[r]] . x[t] when y1 > gmin (else 0, as pi_q_dot_rows); entries not
 * selected are 0. W1, W2 [*, K] of type qt; x [T, K] f32 (T <= 64); idx ascending. Two passes
 * per thread as pi_q_dot_rows: every W1 row, then the W2 rows some token needs. */
int pi_q_dot_rows_multi(int qt, const void *W1, const void *W2, const int64_t *idx, int64_t n, int64_t K,
                        const float *x, int64_t T, const uint8_t *sel, float *y1, float *y2, float gmin) {
    if (T < 0 || T > MULTI_MAX_T) return PI_EINVAL; /* ts[] below holds MULTI_MAX_T tokens */
    const int64_t rb = row_bytes(qt, K);
    int ok, failed = 0;
    const acts_t acts = prepare(qt, x, T, K, &ok);
    if (!ok) return PI_ENOMEM;
    memset(y1, 0, (size_t)(T * n) * sizeof(float));
    if (W2) memset(y2, 0, (size_t)(T * n) * sizeof(float));
    const int par = n * rb * (W2 ? 2 : 1) >= PAR_MIN_BYTES && omp_get_max_threads() > 1;
    #pragma omp parallel if (par)
    {
        int64_t r0, r1;
        split(n, omp_get_num_threads(), omp_get_thread_num(), &r0, &r1);
        int64_t ts[MULTI_MAX_T];
        for (int64_t p = r0; p < r0 + ROWS_AHEAD && p < r1; p++) prefetch_row((const uint8_t *)W1 + idx[p] * rb, rb);
        for (int64_t r = r0; r < r1; r++) {
            if (r + ROWS_AHEAD < r1) prefetch_row((const uint8_t *)W1 + idx[r + ROWS_AHEAD] * rb, rb);
            int nts = 0;
            for (int64_t t = 0; t < T; t++)
                if (sel[t * n + r]) ts[nts++] = t;
            dot_row_tokens(qt, (const uint8_t *)W1 + idx[r] * rb, x, acts, K, ts, nts, y1 + r, n);
        }
        if (W2) {
            int64_t *need = malloc((size_t)(r1 - r0 + 1) * sizeof(int64_t)), m = 0;
            if (!need) {
                #pragma omp atomic write
                failed = 1;
                r1 = r0; /* nothing to do: the call fails */
            }
            for (int64_t r = r0; r < r1; r++)
                for (int64_t t = 0; t < T; t++)
                    if (sel[t * n + r] && (gmin == -INFINITY || y1[t * n + r] > gmin)) {
                        need[m++] = r;
                        break;
                    }
            for (int64_t j = 0; j < ROWS_AHEAD && j < m; j++) prefetch_row((const uint8_t *)W2 + idx[need[j]] * rb, rb);
            for (int64_t j = 0; j < m; j++) {
                if (j + ROWS_AHEAD < m) prefetch_row((const uint8_t *)W2 + idx[need[j + ROWS_AHEAD]] * rb, rb);
                const int64_t r = need[j];
                int nts = 0;
                for (int64_t t = 0; t < T; t++)
                    if (sel[t * n + r] && (gmin == -INFINITY || y1[t * n + r] > gmin)) ts[nts++] = t;
                dot_row_tokens(qt, (const uint8_t *)W2 + idx[r] * rb, x, acts, K, ts, nts, y2 + r, n);
            }
            free(need);
        }
    }
    release(acts);
    return failed ? PI_ENOMEM : 0;
}

/* out[t, d] = sum_r coef[t * n + r] * W[idx[r], d] for t < T, d < D, rows with a zero
 * coefficient skipped: token t's sum is pi_q_axpy_rows over its own non-zero rows (same rows,
 * same groups of four, same order, so the same bits). Each thread owns a slice of d as there;
 * the slice is walked in chunks of `chunk` values (0: the whole slice), every token's rows for
 * one chunk before the next, so a row that several tokens use is read from memory once. */
int pi_q_axpy_rows_multi(int qt, const void *W, const int64_t *idx, const float *coef, int64_t n, int64_t D,
                         int64_t T, float *out, int64_t chunk) {
    const int64_t rb = row_bytes(qt, D), bv = slice_values(qt);
    const uint8_t **rows = malloc((size_t)(T * n + 1) * sizeof(*rows));
    float *cs = malloc((size_t)(T * n + 1) * sizeof(float));
    int64_t *m = malloc((size_t)(T + 1) * sizeof(int64_t)), used = 0;
    if (!rows || !cs || !m) {
        free(rows);
        free(cs);
        free(m);
        return PI_ENOMEM;
    }
    memset(out, 0, (size_t)(T * D) * sizeof(float));
    for (int64_t t = 0; t < T; t++) {
        m[t] = nonzero_rows((const uint8_t *)W, rb, idx, coef + t * n, n, rows + t * n, cs + t * n);
        used = m[t] > used ? m[t] : used;
    }
    const int par = (used > n ? used : n) * rb >= PAR_MIN_BYTES && omp_get_max_threads() > 1 && D >= 2 * bv;
    chunk = chunk <= 0 ? D : (chunk + bv - 1) / bv * bv;
    #pragma omp parallel if (par)
    {
        int64_t d0, d1;
        d_slice(D, bv, omp_get_num_threads(), omp_get_thread_num(), &d0, &d1);
        for (int64_t c0 = d0; c0 < d1; c0 += chunk) {
            const int64_t c1 = c0 + chunk < d1 ? c0 + chunk : d1;
            for (int64_t t = 0; t < T; t++) axpy_slice(qt, rows + t * n, cs + t * n, m[t], c0, c1, out + t * D);
        }
    }
    free(rows);
    free(cs);
    free(m);
    return 0;
}
