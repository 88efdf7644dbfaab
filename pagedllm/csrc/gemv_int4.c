/* Weight-only int4 GEMV for decode (the LM head's few-rows copy). */
#include "gemv.h"

/* ---------- weight-only int4 linear, groups of g inputs: w = (q - 8) * s + z ----------
 * Packed per row in 128-input blocks of 64 bytes: byte i holds input i (low nibble) and
 * input 64 + i (high nibble). sz: [n, k / g, 2] float32 (s, z - 8 s), so w = q * s + sz[1]. Needs k % 128 == 0 and
 * g % 128 == 0.
 * The activations, quantized to |xq| <= 127 * 256 - 128, are split as xq = 256 * x1 + x2 with
 * x1 in [-127, 127] and x2 in [-128, 127], so both halves run as u8 (nibble) x s8 dot
 * products: VNNI's vpdpbusd, or without VNNI vpmaddubsw (pairs of products, at most
 * 2 * 15 * 128, so it never saturates) then vpmaddwd with ones. */

static void split_rows_i8(const int16_t *xq, int64_t m, int64_t kp, int8_t *x1, int8_t *x2) {
    for (int64_t i = 0; i < m * kp; i++) {
        int v = xq[i], hi = (v + 128) >> 8;  /* floor((v + 128) / 256) */
        x1[i] = (int8_t)hi;
        x2[i] = (int8_t)(v - 256 * hi);
    }
}

#if defined(PL_AVX512) || defined(PL_AVX2)
#if defined(PL_AVX512)
#define W4_BYTES 64
typedef __m512i wvec;
#define W4_LOAD(p) _mm512_loadu_si512((const void *)(p))
#define W4_AND _mm512_and_si512
#define W4_SRLI16 _mm512_srli_epi16
#define W4_SET1_8 _mm512_set1_epi8
#define W4_ZERO _mm512_setzero_si512
#define W4_ADD32 _mm512_add_epi32
#define W4_SLLI32 _mm512_slli_epi32
#ifdef __AVX512VNNI__
#define DPBUSD(acc, u, s) _mm512_dpbusd_epi32(acc, u, s)
#else
#define DPBUSD(acc, u, s) _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1)))
#endif
#define W4_CVT _mm512_cvtepi32_ps
#else
#define W4_BYTES 32
typedef __m256i wvec;
#define W4_LOAD(p) _mm256_loadu_si256((const __m256i *)(p))
#define W4_AND _mm256_and_si256
#define W4_SRLI16 _mm256_srli_epi16
#define W4_SET1_8 _mm256_set1_epi8
#define W4_ZERO _mm256_setzero_si256
#define W4_ADD32 _mm256_add_epi32
#define W4_SLLI32 _mm256_slli_epi32
#ifdef __AVXVNNI__
#define DPBUSD(acc, u, s) _mm256_dpbusd_avx_epi32(acc, u, s)
#else
/* u8 nibbles x s8: pairs of products (at most 2 * 15 * 128) fit int16 without saturating */
#define DPBUSD(acc, u, s) _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)))
#endif
#define W4_CVT _mm256_cvtepi32_ps
#endif

/* A 128-input block is 64 bytes; a vector of W4_BYTES of it holds, in its low nibbles, inputs
 * [j, j + W4_BYTES) and in its high ones inputs [64 + j, 64 + j + W4_BYTES), j = its offset. */
#if defined(PL_AVX2) && !defined(__AVXVNNI__)
/* A 128-input block's 64 bytes as its 4 vectors of nibbles: l0 / h0 inputs [0, 32) / [64, 96),
 * l1 / h1 inputs [32, 64) / [96, 128) */
INLINE void w4_unpack(const uint8_t *wb, __m256i lo_mask, __m256i *l0, __m256i *h0, __m256i *l1, __m256i *h1) {
    __m256i v0 = _mm256_loadu_si256((const __m256i *)wb), v1 = _mm256_loadu_si256((const __m256i *)(wb + 32));
    *l0 = _mm256_and_si256(v0, lo_mask), *h0 = _mm256_and_si256(_mm256_srli_epi16(v0, 4), lo_mask);
    *l1 = _mm256_and_si256(v1, lo_mask), *h1 = _mm256_and_si256(_mm256_srli_epi16(v1, 4), lo_mask);
}

/* Without VNNI: a block's dot product with one activation row (p) in 8 int32 lanes, its 4
 * vpmaddubsw results (each pair at most 2 * 15 * 128 = 3840) added in int16 (at most 15360)
 * before one vpmaddwd widens them: half the multiplies. */
INLINE __m256i w4_dot(__m256i l0, __m256i h0, __m256i l1, __m256i h1, const int8_t *p, __m256i ones) {
    __m256i s16 = _mm256_add_epi16(
        _mm256_add_epi16(_mm256_maddubs_epi16(l0, _mm256_loadu_si256((const __m256i *)p)),
                         _mm256_maddubs_epi16(h0, _mm256_loadu_si256((const __m256i *)(p + 64)))),
        _mm256_add_epi16(_mm256_maddubs_epi16(l1, _mm256_loadu_si256((const __m256i *)(p + 32))),
                         _mm256_maddubs_epi16(h1, _mm256_loadu_si256((const __m256i *)(p + 96)))));
    return _mm256_madd_epi16(s16, ones);
}

INLINE void w4_block(__m256i *a, __m256i *b, int M, const uint8_t *wb, const int8_t *x1, const int8_t *x2, int64_t kp,
                     __m256i lo_mask) {
    __m256i l0, h0, l1, h1;
    w4_unpack(wb, lo_mask, &l0, &h0, &l1, &h1);
    const __m256i ones = _mm256_set1_epi16(1);
    for (int r = 0; r < M; r++) {
        a[r] = _mm256_add_epi32(a[r], w4_dot(l0, h0, l1, h1, x1 + r * kp, ones));
        if (x2) b[r] = _mm256_add_epi32(b[r], w4_dot(l0, h0, l1, h1, x2 + r * kp, ones));
    }
}
#else
INLINE void w4_block(wvec *a, wvec *b, int M, const uint8_t *wb, const int8_t *x1, const int8_t *x2, int64_t kp,
                     wvec lo_mask) {
    for (int j = 0; j < 64; j += W4_BYTES) {
        wvec v = W4_LOAD(wb + j);
        wvec lo = W4_AND(v, lo_mask), hi = W4_AND(W4_SRLI16(v, 4), lo_mask);
        for (int r = 0; r < M; r++) {
            const int8_t *p1 = x1 + r * kp + j;
            a[r] = DPBUSD(a[r], lo, W4_LOAD(p1));
            a[r] = DPBUSD(a[r], hi, W4_LOAD(p1 + 64));
            if (x2) {
                const int8_t *p2 = x2 + r * kp + j;
                b[r] = DPBUSD(b[r], lo, W4_LOAD(p2));
                b[r] = DPBUSD(b[r], hi, W4_LOAD(p2 + 64));
            }
        }
    }
}
#endif

/* facc[r]'s lanes sum to row r's dot product, less the zero point's term fz[r]. x2 NULL: the
 * activations are x1 alone (8-bit). */
INLINE void w4_row_parts(const int8_t *x1, const int8_t *x2, int64_t kp, int M, const uint8_t *wrow, const float *sz,
                         int64_t g, const float *xsum, int64_t groups, vf *facc, float *fz) {
    for (int r = 0; r < M; r++) facc[r] = vzero(), fz[r] = 0.0f;
    const wvec lo_mask = W4_SET1_8(0x0F);
    for (int64_t gi = 0; gi < groups; gi++) {
        wvec a[4], b[4];
        for (int r = 0; r < M; r++) a[r] = b[r] = W4_ZERO();
        for (int64_t k0 = gi * g; k0 < (gi + 1) * g; k0 += 128)
            w4_block(a, b, M, wrow + k0 / 2, x1 + k0, x2 ? x2 + k0 : NULL, kp, lo_mask);
        vf sv = vset1(sz[2 * gi]);
        float zb = sz[2 * gi + 1];
        for (int r = 0; r < M; r++) {  /* d = 256 * (x1 . q) + (x2 . q), lane by lane */
            facc[r] = vfmadd(W4_CVT(x2 ? W4_ADD32(W4_SLLI32(a[r], 8), b[r]) : a[r]), sv, facc[r]);
            fz[r] += zb * xsum[r * groups + gi];
        }
    }
}

INLINE void w4_row(const int8_t *x1, const int8_t *x2, int64_t kp, int M, const uint8_t *wrow, const float *sz,
                   int64_t g, const float *xsum, int64_t groups, float *out) {
    vf facc[4];
    float fz[4];
    w4_row_parts(x1, x2, kp, M, wrow, sz, g, xsum, groups, facc, fz);
    for (int r = 0; r < M; r++) out[r] = vhsum(facc[r]) + fz[r];
}

/* 8 lanes of partial sums: the vector itself, or on AVX-512 its two halves added. */
INLINE __m256 w4_lanes8(vf v) {
#if defined(PL_AVX512)
    return _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
#else
    return v;
#endif
}

/* Weight rows [nn, nn + 8) for M activation rows, each activation row's 8 sums reduced as one
 * vector (as w8_m1): one reduction per 8 outputs rather than one per output, which at the LM
 * head's short rows (640 inputs at the default model) costs as much as the dot products. Called
 * with M and x2's NULL-ness as constants, so each case compiles apart. */
INLINE void w4_8rows(const int8_t *x1, const int8_t *x2, int64_t kp, int M, const uint8_t *w, const float *sz,
                     int64_t g, const float *xsum, int64_t k, const float *sx, const void *bias, int64_t n, int64_t nn,
                     void *y, int y_bf16) {
    int64_t groups = k / g;
    __m256 acc[4][8];
    vf parts[4];
    float fz[4][8], fzr[4], out[8];
    for (int j = 0; j < 8; j++) {
        w4_row_parts(x1, x2, kp, M, w + (nn + j) * (k / 2), sz + (nn + j) * groups * 2, g, xsum, groups, parts, fzr);
        for (int r = 0; r < M; r++) acc[r][j] = w4_lanes8(parts[r]), fz[r][j] = fzr[r];
    }
    for (int r = 0; r < M; r++) {
        __m256 v = _mm256_mul_ps(_mm256_add_ps(hsum8(acc[r]), _mm256_loadu_ps(fz[r])), _mm256_set1_ps(sx[r]));
        _mm256_storeu_ps(out, v);
        for (int j = 0; j < 8; j++)
            store1(y, y_bf16, r * n + nn + j, out[j] + (bias ? load1(bias, y_bf16, nn + j) : 0.0f));
    }
}

#if defined(PL_AVX2) && !defined(__AVXVNNI__)
/* w4_8rows for 8-bit activations (x2 NULL) on AVX2 without VNNI, the LM head's ranking: a
 * block's int16 sums widen straight into its group's float sum (no int32 accumulator to zero and
 * keep when a group is one block), and the zero points' terms of the 8 weight rows go as one
 * vector per group instead of a scalar per row, so the 4 rows' sums stay in registers. The
 * same integer sums and the same float operations in the same order as w4_8rows: the same bits. */
INLINE void w4a8_8rows(const int8_t *x1, int64_t kp, const int M, const uint8_t *w, const float *sz, int64_t g,
                       const float *xsum, int64_t k, const float *sx, int64_t n, int64_t nn, void *y, int y_bf16) {
    const int64_t groups = k / g;
    const __m256i lo_mask = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    __m256 acc[4][8], fz[4];
    float out[8];
    for (int j = 0; j < 8; j++) {
        const uint8_t *wrow = w + (nn + j) * (k / 2);
        const float *s = sz + (nn + j) * groups * 2;
        if (nn + 16 <= n) /* the next tile's row: the stream alone lags the arithmetic */
            for (int64_t off = 0; off < k / 2; off += 64) _mm_prefetch((const char *)wrow + 8 * (k / 2) + off, _MM_HINT_T0);
        __m256 f[4];
        for (int r = 0; r < M; r++) f[r] = _mm256_setzero_ps();
        for (int64_t gi = 0; gi < groups; gi++) {
            __m256i a[4], l0, h0, l1, h1;
            int64_t k0 = gi * g; /* the group's first block sets a[r], the rest add */
            w4_unpack(wrow + k0 / 2, lo_mask, &l0, &h0, &l1, &h1);
            for (int r = 0; r < M; r++) a[r] = w4_dot(l0, h0, l1, h1, x1 + r * kp + k0, ones);
            for (k0 += 128; k0 < (gi + 1) * g; k0 += 128) {
                w4_unpack(wrow + k0 / 2, lo_mask, &l0, &h0, &l1, &h1);
                for (int r = 0; r < M; r++) a[r] = _mm256_add_epi32(a[r], w4_dot(l0, h0, l1, h1, x1 + r * kp + k0, ones));
            }
            const __m256 sv = _mm256_set1_ps(s[2 * gi]);
            for (int r = 0; r < M; r++) f[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a[r]), sv, f[r]);
        }
        for (int r = 0; r < M; r++) acc[r][j] = f[r];
    }
    for (int r = 0; r < M; r++) fz[r] = _mm256_setzero_ps();
    const int64_t rs = groups * 2; /* one weight row's scale pairs */
    for (int64_t gi = 0; gi < groups; gi++) {
        const float *z = sz + nn * rs + 2 * gi + 1;
        const __m256 zv = _mm256_setr_ps(z[0], z[rs], z[2 * rs], z[3 * rs], z[4 * rs], z[5 * rs], z[6 * rs], z[7 * rs]);
        for (int r = 0; r < M; r++)
            fz[r] = _mm256_add_ps(fz[r], _mm256_mul_ps(zv, _mm256_set1_ps(xsum[r * groups + gi])));
    }
    for (int r = 0; r < M; r++) {
        _mm256_storeu_ps(out, _mm256_mul_ps(_mm256_add_ps(hsum8(acc[r]), fz[r]), _mm256_set1_ps(sx[r])));
        for (int j = 0; j < 8; j++) store1(y, y_bf16, r * n + nn + j, out[j]);
    }
}
#define W4A8_8(MM) \
    w4a8_8rows(x1 + r0 * kp, kp, MM, w, sz, g, xsum + r0 * groups, k, sx + r0, n, nb * 8, (char *)y + r0 * n * ybytes, y_bf16)
#else
#define W4A8_8(MM) W4_8(MM, NULL)
#endif

/* m activation rows, 8 weight rows at a time: each 8-row block of the weight meets every
 * activation row, 4 at a time, while it is in L1, so the weight streams from memory once
 * whatever m is (a pass per 4 rows read the LM head's 84 MB copy again for a fifth row). */
static void w4_m8(const int8_t *x1, const int8_t *x2, int64_t kp, int64_t m, const uint8_t *w, const float *sz,
                  int64_t g, const float *xsum, int64_t k, const float *sx, const void *bias, int64_t n, void *y,
                  int y_bf16, int nthreads) {
    int64_t groups = k / g;
    const size_t ybytes = y_bf16 ? 2 : 4;
#define W4_8(MM, X2)                                                                                              \
    w4_8rows(x1 + r0 * kp, X2, kp, MM, w, sz, g, xsum + r0 * groups, k, sx + r0, bias, n, nb * 8,               \
             (char *)y + r0 * n * ybytes, y_bf16)
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t nb = 0; nb < n / 8; nb++) {
        for (int64_t r0 = 0; r0 < m; r0 += 4) {
            int M = m - r0 < 4 ? (int)(m - r0) : 4;
            const int8_t *x2r = x2 ? x2 + r0 * kp : NULL;
            switch (M + (x2 ? 4 : 0)) {
                case 1: W4A8_8(1); break;
                case 2: W4A8_8(2); break;
                case 3: W4A8_8(3); break;
                case 4: W4A8_8(4); break;
                case 5: W4_8(1, x2r); break;
                case 6: W4_8(2, x2r); break;
                case 7: W4_8(3, x2r); break;
                default: W4_8(4, x2r); break;
            }
        }
    }
#undef W4_8
    for (int64_t nn = n / 8 * 8; nn < n; nn++)
        for (int64_t r0 = 0; r0 < m; r0 += 4) {
            float out[4];
            int M = m - r0 < 4 ? (int)(m - r0) : 4;
            w4_row(x1 + r0 * kp, x2 ? x2 + r0 * kp : NULL, kp, M, w + nn * (k / 2), sz + nn * groups * 2, g,
                   xsum + r0 * groups, groups, out);
            for (int r = 0; r < M; r++)
                store1(y, y_bf16, (r0 + r) * n + nn, out[r] * sx[r0 + r] + (bias ? load1(bias, y_bf16, nn) : 0.0f));
        }
}
#else
INLINE void w4_row(const int8_t *x1, const int8_t *x2, int64_t kp, int M, const uint8_t *wrow, const float *sz,
                   int64_t g, const float *xsum, int64_t groups, float *out) {
    float facc[4], fz[4];
    int64_t d[4];
    for (int r = 0; r < M; r++) facc[r] = fz[r] = 0.0f;
    for (int64_t gi = 0; gi < groups; gi++) {
        for (int r = 0; r < M; r++) d[r] = 0;
        for (int64_t k0 = gi * g; k0 < (gi + 1) * g; k0 += 128)
            for (int i = 0; i < 64; i++) {
                int lo = wrow[k0 / 2 + i] & 0x0F, hi = wrow[k0 / 2 + i] >> 4;
                for (int r = 0; r < M; r++) {
                    const int8_t *p1 = x1 + r * kp + k0;
                    int d1 = lo * p1[i] + hi * p1[64 + i];
                    if (x2) {
                        const int8_t *p2 = x2 + r * kp + k0;
                        d[r] += 256 * d1 + lo * p2[i] + hi * p2[64 + i];
                    } else {
                        d[r] += d1;
                    }
                }
            }
        for (int r = 0; r < M; r++) {
            facc[r] += (float)d[r] * sz[2 * gi];
            fz[r] += sz[2 * gi + 1] * xsum[r * groups + gi];
        }
    }
    for (int r = 0; r < M; r++) out[r] = facc[r] + fz[r];
}
#endif

#define W4_ROW_M(MM) w4_row(x1 + r0 * kp, x2 ? x2 + r0 * kp : NULL, kp, MM, wrow, sz + nn * groups * 2, g, xsum + r0 * groups, groups, out)

/* act8: activations quantized to 8 bits (|xq| <= 127), not 16: half the multiply-adds, for a
 * ranking whose top candidates are recomputed exactly. */
static void w4_linear(const void *x, int x_bf16, int64_t m, int64_t k, const uint8_t *w, const float *sz, int64_t g,
                      const void *bias, int64_t n, void *y, int y_bf16, int nthreads, int act8) {
    int64_t kp = KPAD(k), groups = k / g;
    int16_t *xq = aligned_alloc(64, (size_t)(m * kp * sizeof(int16_t)));
    int8_t *x1 = aligned_alloc(64, (size_t)(m * kp)), *x2 = act8 ? NULL : aligned_alloc(64, (size_t)(m * kp));
    float *sx = malloc((size_t)m * sizeof(float));
    float *xsum = malloc((size_t)(m * groups) * sizeof(float));
    quantize_rows_i16(x, x_bf16, m, k, act8 ? 127.0f : 127.0f * 256.0f - 128.0f, xq, sx);
    if (act8)
        for (int64_t i = 0; i < m * kp; i++) x1[i] = (int8_t)xq[i];
    else
        split_rows_i8(xq, m, kp, x1, x2);
    for (int64_t r = 0; r < m; r++)
        for (int64_t gi = 0; gi < groups; gi++) {
            int64_t s = 0;
            for (int64_t i = gi * g; i < (gi + 1) * g; i++) s += xq[r * kp + i];
            xsum[r * groups + gi] = (float)s;
        }
#if defined(PL_AVX2) || defined(PL_AVX512)
    w4_m8(x1, x2, kp, m, w, sz, g, xsum, k, sx, bias, n, y, y_bf16, nthreads);
    m = 0;  /* done: skip the general loop, free below */
#endif
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t nn = 0; nn < (m ? n : 0); nn++) {
        const uint8_t *wrow = w + nn * (k / 2);
        for (int64_t r0 = 0; r0 < m; r0 += 4) {
            float out[4];
            int M = m - r0 < 4 ? (int)(m - r0) : 4;
            switch (M) {
                case 1: W4_ROW_M(1); break;
                case 2: W4_ROW_M(2); break;
                case 3: W4_ROW_M(3); break;
                default: W4_ROW_M(4); break;
            }
            for (int r = 0; r < M; r++) {
                float v = out[r] * sx[r0 + r];
                if (bias) v += load1(bias, y_bf16, nn);
                store1(y, y_bf16, (r0 + r) * n + nn, v);
            }
        }
    }
    free(xsum);
    free(sx);
    free(x2);
    free(x1);
    free(xq);
}

void pl_w4a16_linear(const void *x, int x_bf16, int64_t m, int64_t k, const uint8_t *w, const float *sz,
                     int64_t g, const void *bias, int64_t n, void *y, int y_bf16, int nthreads) {
    w4_linear(x, x_bf16, m, k, w, sz, g, bias, n, y, y_bf16, nthreads, 0);
}

void pl_w4a8_rank(const void *x, int x_bf16, int64_t m, int64_t k, const uint8_t *w, const float *sz, int64_t g,
                  int64_t n, void *y, int y_bf16, int nthreads) {
    w4_linear(x, x_bf16, m, k, w, sz, g, NULL, n, y, y_bf16, nthreads, 1);
}
