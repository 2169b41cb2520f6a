/* Batch-1 decode kernels for the CPU: dot products of one activation vector with all or
 * with selected rows of a weight matrix, and weighted sums of selected rows.
 *
 * Built at run time by kernels.py (cc -O3 -march=native -fopenmp) and called through
 * ctypes. Threads come from torch's OpenMP runtime (the same libgomp.so.1), so
 * torch.set_num_threads governs them.
 *
 * dt 0: f32 weights, f32 activations. dt 1: bf16 weights, bf16 activations (a bf16 model
 * keeps its activations in bf16, so nothing is rounded here), multiplied with AVX512_BF16
 * dot-product instructions and summed in fp32. Results are always f32. Decode attention
 * (pi_attend_one/many) takes an f32 query and reads the KV cache in its own types (f32, bf16, f16, q8_0).
 *
 * Gathers visit the active rows in index order and prefetch the row `pfd` positions ahead
 * while reading the current one: scattered 8 KB rows then keep enough memory requests in
 * flight to run near streaming speed (the hardware prefetcher alone stops at each row).
 */
#include <math.h>
#include <stdint.h>
#include <stddef.h>
#include <omp.h>
#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

/* Below this many weights a call runs on the calling thread: waking the team costs more. */
#define PAR_MIN (1 << 18)

static inline float bf16_to_f32(uint16_t h) {
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)h << 16;
    return v.f;
}

static inline float load1(const void *p, int64_t i, int dt) {
    return dt == 1 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

#ifdef __AVX512F__
static inline __m512 load16(const void *p, int64_t i, int dt) {  /* 16 values as f32 */
    if (dt == 1) {
        __m256i v = _mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
    }
    return _mm512_loadu_ps((const float *)p + i);
}
#endif

static inline void prefetch_span(const char *p, int64_t nbytes) {
    for (int64_t b = 0; b < nbytes; b += 64) __builtin_prefetch(p + b, 0, 3);
}

/* row . x over K elements (both of type dt); prefetches the same span of `next` (or NULL). */
static inline float dot(const void *row, const void *x, int64_t K, int dt, const char *next) {
    const int es = dt == 1 ? 2 : 4;
    int64_t i = 0;
    float acc = 0.f;
#if defined(__AVX512BF16__)
    if (dt == 1) {
        __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
        const uint16_t *w = (const uint16_t *)row, *xv = (const uint16_t *)x;
        for (; i + 64 <= K; i += 64) {
            if (next) prefetch_span(next + 2 * i, 128);
            a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(w + i), (__m512bh)_mm512_loadu_si512(xv + i));
            a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_loadu_si512(w + i + 32), (__m512bh)_mm512_loadu_si512(xv + i + 32));
        }
        acc = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
    } else
#endif
    {
#ifdef __AVX512F__
        __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
        for (; i + 64 <= K; i += 64) {
            if (next) prefetch_span(next + es * i, 64 * es);
            a0 = _mm512_fmadd_ps(load16(row, i, dt), load16(x, i, dt), a0);
            a1 = _mm512_fmadd_ps(load16(row, i + 16, dt), load16(x, i + 16, dt), a1);
            a2 = _mm512_fmadd_ps(load16(row, i + 32, dt), load16(x, i + 32, dt), a2);
            a3 = _mm512_fmadd_ps(load16(row, i + 48, dt), load16(x, i + 48, dt), a3);
        }
        acc = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
#else
        float a[16] = {0};
        for (; i + 16 <= K; i += 16) {
            if (next) prefetch_span(next + es * i, 16 * es);
            for (int l = 0; l < 16; l++) a[l] += load1(row, i + l, dt) * load1(x, i + l, dt);
        }
        for (int l = 0; l < 16; l++) acc += a[l];
#endif
    }
    for (; i < K; i++) acc += load1(row, i, dt) * load1(x, i, dt);
    return acc;
}

/* Rows [r0, r1) of a team's work when `nt` threads split n rows (contiguous blocks). */
static inline void split(int64_t n, int nt, int t, int64_t *r0, int64_t *r1) {
    const int64_t blk = (n + nt - 1) / nt;
    *r0 = t * blk < n ? t * blk : n;
    *r1 = *r0 + blk < n ? *r0 + blk : n;
}

/* The loops live in plain functions called with constant dt, so each dtype gets its own
 * specialised code and nothing is reloaded from an OpenMP closure inside the loop. */
static inline void gemv_range(int dt, const char *w, int64_t r0, int64_t r1, int64_t K, const void *x, float *y) {
    const int64_t rb = K * (dt == 1 ? 2 : 4);
    for (int64_t r = r0; r < r1; r++) y[r] = dot(w + r * rb, x, K, dt, NULL);
}

static void gemv_any(int dt, const char *w, int64_t r0, int64_t r1, int64_t K, const void *x, float *y) {
    if (dt == 1) gemv_range(1, w, r0, r1, K, x, y);
    else gemv_range(0, w, r0, r1, K, x, y);
}

/* y[r] = W[r] . x for r < n (W [n, K]): a dense matrix-vector product. */
void pi_gemv(int dt, const void *W, int64_t n, int64_t K, const void *x, float *y) {
    if (n * K < PAR_MIN || omp_get_max_threads() == 1) {
        gemv_any(dt, (const char *)W, 0, n, K, x, y);
        return;
    }
    #pragma omp parallel
    {
        int64_t r0, r1;
        split(n, omp_get_num_threads(), omp_get_thread_num(), &r0, &r1);
        gemv_any(dt, (const char *)W, r0, r1, K, x, y);
    }
}

static inline void rows_range(int dt, const char *w1, const char *w2, const int64_t *idx, int64_t r0, int64_t r1,
                              int64_t n, int64_t K, const void *x, float *y1, float *y2, int pfd, float gmin) {
    const int64_t rb = K * (dt == 1 ? 2 : 4);
    for (int64_t r = r0; r < r1; r++) {
        const int64_t j = idx[r], jn = (pfd > 0 && r + pfd < n) ? idx[r + pfd] : -1;
        y1[r] = dot(w1 + j * rb, x, K, dt, jn >= 0 ? w1 + jn * rb : NULL);
        /* without a gate threshold every up row is read: prefetch it as the gate row is */
        if (w2) y2[r] = (gmin == -INFINITY || y1[r] > gmin)
                            ? dot(w2 + j * rb, x, K, dt, (jn >= 0 && gmin == -INFINITY) ? w2 + jn * rb : NULL) : 0.f;
    }
}

static void rows_any(int dt, const char *w1, const char *w2, const int64_t *idx, int64_t r0, int64_t r1,
                     int64_t n, int64_t K, const void *x, float *y1, float *y2, int pfd, float gmin) {
    if (dt == 1) rows_range(1, w1, w2, idx, r0, r1, n, K, x, y1, y2, pfd, gmin);
    else rows_range(0, w1, w2, idx, r0, r1, n, K, x, y1, y2, pfd, gmin);
}

/* y1[r] = W1[idx[r]] . x and, if W2, y2[r] = W2[idx[r]] . x where y1[r] > gmin (else 0, the
 * W2 row unread: a gated ReLU neuron whose gate is silent), for r < n (idx ascending).
 * While neuron idx[r] is read, the gate row of idx[r + pfd] is prefetched (and its W2 row when
 * gmin is -inf, every W2 row then being read). */
void pi_dot_rows(int dt, const void *W1, const void *W2, const int64_t *idx, int64_t n, int64_t K,
                 const void *x, float *y1, float *y2, int pfd, float gmin) {
    if (n * K < PAR_MIN || omp_get_max_threads() == 1) {
        rows_any(dt, (const char *)W1, (const char *)W2, idx, 0, n, n, K, x, y1, y2, pfd, gmin);
        return;
    }
    #pragma omp parallel
    {
        int64_t r0, r1;
        split(n, omp_get_num_threads(), omp_get_thread_num(), &r0, &r1);
        rows_any(dt, (const char *)W1, (const char *)W2, idx, r0, r1, n, K, x, y1, y2, pfd, gmin);
    }
}

static inline void axpy_range(int dt, const char *w, const int64_t *idx, const float *coef, int64_t n, int64_t D,
                              int64_t d0, int64_t d1, float *out, int pfd) {
    const int es = dt == 1 ? 2 : 4;
    const int64_t rb = D * es;
    for (int64_t d = d0; d < d1; d++) out[d] = 0.f;
    for (int64_t r = 0; r < n && d0 < d1; r++) {
        const float c = coef[r];
        if (c == 0.f) continue;  /* a neuron that did not fire adds nothing: its row is not read */
        const char *row = w + idx[r] * rb;
        const char *next = (pfd > 0 && r + pfd < n) ? w + idx[r + pfd] * rb : NULL;
        int64_t d = d0;
#ifdef __AVX512F__
        const __m512 cv = _mm512_set1_ps(c);
        for (; d + 32 <= d1; d += 32) {
            if (next) prefetch_span(next + d * es, 32 * es);
            _mm512_storeu_ps(out + d, _mm512_fmadd_ps(cv, load16(row, d, dt), _mm512_loadu_ps(out + d)));
            _mm512_storeu_ps(out + d + 16, _mm512_fmadd_ps(cv, load16(row, d + 16, dt), _mm512_loadu_ps(out + d + 16)));
        }
#endif
        for (; d < d1; d++) {
            if (next && (d - d0) % 32 == 0) prefetch_span(next + d * es, 32 * es);
            out[d] += c * load1(row, d, dt);
        }
    }
}

static void axpy_any(int dt, const char *w, const int64_t *idx, const float *coef, int64_t n, int64_t D,
                     int64_t d0, int64_t d1, float *out, int pfd) {
    if (dt == 1) axpy_range(1, w, idx, coef, n, D, d0, d1, out, pfd);
    else axpy_range(0, w, idx, coef, n, D, d0, d1, out, pfd);
}

/* out[d] = sum_r coef[r] * W[idx[r], d] for d < D (W [*, D] of type dt; coef, out f32);
 * rows with coef exactly 0 are skipped.
 * Each thread owns a slice of d (whole cache lines) and walks every selected row. */
void pi_axpy_rows(int dt, const void *W, const int64_t *idx, const float *coef, int64_t n, int64_t D,
                  float *out, int pfd) {
    if (n * D < PAR_MIN || omp_get_max_threads() == 1) {
        axpy_any(dt, (const char *)W, idx, coef, n, D, 0, D, out, pfd);
        return;
    }
    #pragma omp parallel
    {
        const int nt = omp_get_num_threads(), t = omp_get_thread_num();
        const int64_t blk = ((D + nt - 1) / nt + 31) / 32 * 32;
        const int64_t d0 = t * blk < D ? t * blk : D, d1 = d0 + blk < D ? d0 + blk : D;
        axpy_any(dt, (const char *)W, idx, coef, n, D, d0, d1, out, pfd);
    }
}

/* ---------------------------------------------------------------- decode attention
 * The KV cache is kept in its own type (runtime/kv_cache.py, llama.cpp's -ctk/-ctv), keys and
 * values each one of: 0 f32, 1 bf16, 2 f16, 3 q8_0 (per 32 values an f16 scale then 32 int8, 34
 * bytes: ggml's block_q8_0). The query is f32; cache values are converted to f32 in registers as
 * they are read (f16: VCVTPH2PS, AVX512F or F16C; bf16: a 16-bit shift; q8_0: int8 -> f32 times
 * the block's scale) and every product is summed in f32. Nothing is copied out of the cache. */
static inline float f16_to_f32(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    uint32_t s = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff, u;
    if (e == 0) {
        if (m == 0) u = s;  /* +-0 */
        else {  /* subnormal: m * 2^-24, normalised */
            e = 113;
            while (!(m & 0x400)) { m <<= 1; e--; }
            u = s | (e << 23) | ((m & 0x3ff) << 13);
        }
    } else if (e == 31) u = s | 0x7f800000u | (m << 13);  /* inf, nan */
    else u = s | ((e + 112) << 23) | (m << 13);
    union { uint32_t u; float f; } v;
    v.u = u;
    return v.f;
#endif
}

static inline float kv1(const void *p, int64_t i, int t) {
    if (t == 2) return f16_to_f32(((const uint16_t *)p)[i]);
    if (t == 1) return bf16_to_f32(((const uint16_t *)p)[i]);
    return ((const float *)p)[i];
}

#if defined(__AVX512F__)
static inline __m512 kv16(const void *p, int64_t i, int t) {  /* 16 cache values as f32 */
    if (t == 2) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i)));
    return load16(p, i, t);
}
#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#define KV_AVX2 1
static inline __m256 kv8(const void *p, int64_t i, int t) {  /* 8 cache values as f32 */
    if (t == 2) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i)));
    if (t == 1)
        return _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i))), 16));
    return _mm256_loadu_ps((const float *)p + i);
}
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

/* Bytes of one head's row of d values in cache type t. */
static inline int64_t kv_row_bytes(int t, int64_t d) { return t == 3 ? d / 32 * 34 : d * (t == 0 ? 4 : 2); }

static inline float q8_scale(const uint8_t *blk) { return f16_to_f32((uint16_t)(blk[0] | (blk[1] << 8))); }

/* q . row over d values (d a multiple of 32) of a q8_0 row: per block, scale * sum q[e] * int8[e] */
static inline float kv_dot_q8(const float *q, const uint8_t *row, int64_t d) {
    float acc = 0.f;
    for (int64_t b = 0; b < d / 32; b++, q += 32, row += 34) {
        const int8_t *qs = (const int8_t *)(row + 2);
        float bs = 0.f;
#if defined(__AVX512F__)
        __m512 a = _mm512_mul_ps(_mm512_loadu_ps(q), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)qs))));
        a = _mm512_fmadd_ps(_mm512_loadu_ps(q + 16),
                            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(qs + 16)))), a);
        bs = _mm512_reduce_add_ps(a);
#elif defined(KV_AVX2)
        __m256 a = _mm256_setzero_ps();
        for (int j = 0; j < 32; j += 8)
            a = _mm256_fmadd_ps(_mm256_loadu_ps(q + j),
                                _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(qs + j)))), a);
        bs = hsum8(a);
#else
        for (int j = 0; j < 32; j++) bs += q[j] * (float)qs[j];
#endif
        acc += q8_scale(row) * bs;
    }
    return acc;
}

/* o[e] += p * row[e] for e < d of a q8_0 row */
static inline void kv_axpy_q8(float *o, float p, const uint8_t *row, int64_t d) {
    for (int64_t b = 0; b < d / 32; b++, o += 32, row += 34) {
        const int8_t *qs = (const int8_t *)(row + 2);
        const float c = p * q8_scale(row);
#if defined(__AVX512F__)
        const __m512 cv = _mm512_set1_ps(c);
        for (int j = 0; j < 32; j += 16)
            _mm512_storeu_ps(o + j, _mm512_fmadd_ps(cv, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                _mm_loadu_si128((const __m128i *)(qs + j)))), _mm512_loadu_ps(o + j)));
#elif defined(KV_AVX2)
        const __m256 cv = _mm256_set1_ps(c);
        for (int j = 0; j < 32; j += 8)
            _mm256_storeu_ps(o + j, _mm256_fmadd_ps(cv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                _mm_loadl_epi64((const __m128i *)(qs + j)))), _mm256_loadu_ps(o + j)));
#else
        for (int j = 0; j < 32; j++) o[j] += c * (float)qs[j];
#endif
    }
}

/* q . row over d values: q f32, row of cache type t; f32 sums */
static inline float kv_dot(const float *q, const void *row, int64_t d, int t) {
    if (t == 3) return kv_dot_q8(q, (const uint8_t *)row, d);
    int64_t e = 0;
    float acc = 0.f;
#if defined(__AVX512F__)
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
    for (; e + 32 <= d; e += 32) {
        a0 = _mm512_fmadd_ps(_mm512_loadu_ps(q + e), kv16(row, e, t), a0);
        a1 = _mm512_fmadd_ps(_mm512_loadu_ps(q + e + 16), kv16(row, e + 16, t), a1);
    }
    for (; e + 16 <= d; e += 16) a0 = _mm512_fmadd_ps(_mm512_loadu_ps(q + e), kv16(row, e, t), a0);
    acc = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
#elif defined(KV_AVX2)
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    for (; e + 16 <= d; e += 16) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + e), kv8(row, e, t), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + e + 8), kv8(row, e + 8, t), a1);
    }
    for (; e + 8 <= d; e += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + e), kv8(row, e, t), a0);
    acc = hsum8(_mm256_add_ps(a0, a1));
#endif
    for (; e < d; e++) acc += q[e] * kv1(row, e, t);
    return acc;
}

/* o[e] += p * row[e] for e < d: row of cache type t */
static inline void kv_axpy(float *o, float p, const void *row, int64_t d, int t) {
    if (t == 3) {
        kv_axpy_q8(o, p, (const uint8_t *)row, d);
        return;
    }
    int64_t e = 0;
#if defined(__AVX512F__)
    const __m512 pv = _mm512_set1_ps(p);
    for (; e + 16 <= d; e += 16) _mm512_storeu_ps(o + e, _mm512_fmadd_ps(pv, kv16(row, e, t), _mm512_loadu_ps(o + e)));
#elif defined(KV_AVX2)
    const __m256 pv = _mm256_set1_ps(p);
    for (; e + 8 <= d; e += 8) _mm256_storeu_ps(o + e, _mm256_fmadd_ps(pv, kv8(row, e, t), _mm256_loadu_ps(o + e)));
#endif
    for (; e < d; e++) o[e] += p * kv1(row, e, t);
}

/* One query token against the KV cache (decode attention), softmax(q k^T * scale) v per head,
 * heads [h0, h1). q [Hq, d] f32; K [S, Hkv, *] of type kt and V of type vt, each head's d values
 * one row (kv_row_bytes), positions `kps` / `vps` bytes apart; scores [Hq, S] and out [Hq, d] f32.
 * Query head h reads KV head h / (Hq / Hkv) (grouped-query attention). */
static inline void attend_heads(int kt, int vt, const float *q, const char *K, const char *V, int64_t S, int64_t Hq,
                                int64_t Hkv, int64_t d, int64_t kps, int64_t vps, float scale, float *scores,
                                float *out, int64_t h0, int64_t h1) {
    /* position-major loops: the cache is read in memory order, one position's heads at a time */
    const int64_t krb = kv_row_bytes(kt, d), vrb = kv_row_bytes(vt, d);
    const int64_t group = Hq / Hkv;
    for (int64_t s = 0; s < S; s++)
        for (int64_t h = h0; h < h1; h++)
            scores[h * S + s] = scale * kv_dot(q + h * d, K + s * kps + h / group * krb, d, kt);
    for (int64_t h = h0; h < h1; h++) {
        float *sc = scores + h * S, mx = -INFINITY, sum = 0.f;
        for (int64_t s = 0; s < S; s++) mx = sc[s] > mx ? sc[s] : mx;
        for (int64_t s = 0; s < S; s++) sum += (sc[s] = expf(sc[s] - mx));
        for (int64_t s = 0; s < S; s++) sc[s] /= sum;
        for (int64_t e = 0; e < d; e++) out[h * d + e] = 0.f;
    }
    for (int64_t s = 0; s < S; s++)
        for (int64_t h = h0; h < h1; h++)
            kv_axpy(out + h * d, scores[h * S + s], V + s * vps + h / group * vrb, d, vt);
}

/* each (key type, value type) pair gets its own specialised loops */
#define ATTEND_CASE(a, b) \
    case (a) * 4 + (b): attend_heads(a, b, q, K, V, S, Hq, Hkv, d, kps, vps, scale, scores, out, h0, h1); break;
static void attend_any(int kt, int vt, const float *q, const char *K, const char *V, int64_t S, int64_t Hq, int64_t Hkv,
                       int64_t d, int64_t kps, int64_t vps, float scale, float *scores, float *out, int64_t h0,
                       int64_t h1) {
    switch (kt * 4 + vt) {
        ATTEND_CASE(0, 0) ATTEND_CASE(0, 1) ATTEND_CASE(0, 2) ATTEND_CASE(0, 3)
        ATTEND_CASE(1, 0) ATTEND_CASE(1, 1) ATTEND_CASE(1, 2) ATTEND_CASE(1, 3)
        ATTEND_CASE(2, 0) ATTEND_CASE(2, 1) ATTEND_CASE(2, 2) ATTEND_CASE(2, 3)
        ATTEND_CASE(3, 0) ATTEND_CASE(3, 1) ATTEND_CASE(3, 2) ATTEND_CASE(3, 3)
        default: break;
    }
}

/* n queries of a batch, each against its own KV cache (decode attention of several sequences, or
 * of several positions of one): q [n, Hq, d] f32; Ks[i], Vs[i]: entry i's first visible position
 * (keys of type kt, values of type vt), S[i] positions from there, positions kps / vps bytes apart
 * (as pi_attend_one; d a multiple of 32 for q8_0); scores: scratch [n, Hq, Smax] f32; out [n, Hq, d] f32. Entry i gets exactly
 * pi_attend_one's numbers (each head is computed alone, whichever thread takes it); one call shares
 * the threads over every (entry, head) pair instead of one small parallel region per entry. */
void pi_attend_many(int kt, int vt, int64_t n, const float *q, const void *const *Ks, const void *const *Vs,
                    const int64_t *S, int64_t Smax, int64_t Hq, int64_t Hkv, int64_t d, int64_t kps, int64_t vps,
                    float scale, float *scores, float *out) {
    int64_t work = 0;
    for (int64_t i = 0; i < n; i++) work += S[i];
    const int par = work * Hq * d >= PAR_MIN / 4 && omp_get_max_threads() > 1;
    #pragma omp parallel if (par)
    {
        int64_t u0, u1;
        split(n * Hq, omp_get_num_threads(), omp_get_thread_num(), &u0, &u1);
        for (int64_t i = u0 / Hq; i < n && i * Hq < u1; i++) {
            const int64_t h0 = u0 > i * Hq ? u0 - i * Hq : 0, h1 = u1 < (i + 1) * Hq ? u1 - i * Hq : Hq;
            attend_any(kt, vt, q + i * Hq * d, (const char *)Ks[i], (const char *)Vs[i], S[i], Hq, Hkv,
                       d, kps, vps, scale, scores + i * Hq * Smax, out + i * Hq * d, h0, h1);
        }
    }
}

/* one query: pi_attend_many of one entry (the same threads over its heads) */
void pi_attend_one(int kt, int vt, const float *q, const void *K, const void *V, int64_t S, int64_t Hq, int64_t Hkv,
                   int64_t d, int64_t kps, int64_t vps, float scale, float *scores, float *out) {
    pi_attend_many(kt, vt, 1, q, &K, &V, &S, S, Hq, Hkv, d, kps, vps, scale, scores, out);
}
