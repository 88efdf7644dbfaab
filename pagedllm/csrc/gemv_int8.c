/* Weight-only int8 GEMV for decode: activations as int16 per row, the int8 weight streamed
 * once through int16 dot products (VNNI vpdpwssd, or vpmaddwd). */
#include "gemv.h"

/* ---------- weight-only int8 linear: y = x @ (q * scale)^T + bias ----------
 * The general path: one weight row at a time, for all activation rows, a single sequential
 * stream per thread. (Tiles of 4 weight rows, read side by side, ran at a third of the
 * bandwidth here: the hardware prefetchers follow 4 short interleaved streams poorly.) Where
 * the arithmetic, not the stream, sets the time (AVX2, 16+ rows), w8_tiles below. */

/* Inputs per chunk for a dot-product instruction taking `per_op` inputs: each int32 lane then
 * sums at most 256 products of 127 * 32767 (~1.07e9 < 2^31) before the chunk's sum moves to
 * float32. */
#define I8_CHUNK(per_op) (128 * (per_op))

#if defined(PL_AVX512) || defined(PL_AVX2)
/* Per level: W8_STEP weights per step, sign-extended to int16 (w8_load, which never reads past
 * the row's end), times the int16 activations in pairwise int32 sums (W8_DOT), exact. */
#if defined(PL_AVX512)
#define W8_STEP 32
typedef __m512i w8vec;
#define W8_ZERO _mm512_setzero_si512
#define W8_LOADX(p) _mm512_load_si512((const void *)(p))
#define W8_SUM(acc) _mm512_reduce_add_ps(_mm512_cvtepi32_ps(acc))
#ifdef __AVX512VNNI__
#define W8_DOT(acc, a, b) _mm512_dpwssd_epi32(acc, a, b)
#else
#define W8_DOT(acc, a, b) _mm512_add_epi32(acc, _mm512_madd_epi16(a, b))
#endif
INLINE __m512i w8_load(const int8_t *p, int64_t left) {
    __mmask32 m = left >= 32 ? (__mmask32)0xFFFFFFFFu : (__mmask32)((1u << left) - 1);
    return _mm512_cvtepi8_epi16(_mm256_maskz_loadu_epi8(m, p));
}
#else
#define W8_STEP 16
typedef __m256i w8vec;
#define W8_ZERO _mm256_setzero_si256
#define W8_LOADX(p) _mm256_load_si256((const __m256i *)(p))
#define W8_SUM(acc) vhsum(_mm256_cvtepi32_ps(acc))
#ifdef __AVXVNNI__
#define W8_DOT(acc, a, b) _mm256_dpwssd_avx_epi32(acc, a, b)
#else
#define W8_DOT(acc, a, b) _mm256_add_epi32(acc, _mm256_madd_epi16(a, b))
#endif
INLINE __m256i w8_load(const int8_t *p, int64_t left) {
    if (left >= 16) return _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p));
    int8_t buf[16] = {0};
    memcpy(buf, p, (size_t)left);
    return _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)buf));
}
#endif

/* out[r] = xq[r] . wrow for M <= 4 activation rows, int32 sums moved to float32 per chunk. */
INLINE void w8_row(const int16_t *xq, int64_t kp, int M, const int8_t *wrow, int64_t k, float *out) {
    for (int r = 0; r < M; r++) out[r] = 0.0f;
    for (int64_t k0 = 0; k0 < k; k0 += I8_CHUNK(W8_STEP)) {
        int64_t k1 = k0 + I8_CHUNK(W8_STEP) < k ? k0 + I8_CHUNK(W8_STEP) : k;
        w8vec acc[4];
        for (int r = 0; r < M; r++) acc[r] = W8_ZERO();
        int64_t kk = k0;
        for (; kk + 2 * W8_STEP <= k1; kk += 2 * W8_STEP) {  /* two full steps a turn, no tail test */
            w8vec w0 = w8_load(wrow + kk, W8_STEP), w1 = w8_load(wrow + kk + W8_STEP, W8_STEP);
            for (int r = 0; r < M; r++) {
                acc[r] = W8_DOT(acc[r], W8_LOADX(xq + r * kp + kk), w0);
                acc[r] = W8_DOT(acc[r], W8_LOADX(xq + r * kp + kk + W8_STEP), w1);
            }
        }
        for (; kk < k1; kk += W8_STEP) {
            w8vec wv = w8_load(wrow + kk, k1 - kk);
            for (int r = 0; r < M; r++) acc[r] = W8_DOT(acc[r], W8_LOADX(xq + r * kp + kk), wv);
        }
        for (int r = 0; r < M; r++) out[r] += W8_SUM(acc[r]);
    }
}
#else
INLINE void w8_row(const int16_t *xq, int64_t kp, int M, const int8_t *wrow, int64_t k, float *out) {
    for (int r = 0; r < M; r++) {
        int64_t acc = 0;
        for (int64_t kk = 0; kk < k; kk++) acc += (int32_t)xq[r * kp + kk] * wrow[kk];
        out[r] = (float)acc;
    }
}
#endif

#ifdef PL_AVX2
/* One activation row (a batch-1 decode), 8 weight rows after one another (still one stream):
 * their 8 sums are reduced together, a transpose of adds instead of 8 horizontal sums, and
 * scaled and stored as one vector. Needs k <= I8_CHUNK(16). Every rounding is the general
 * path's (one chunk, vhsum's order, the same scaling), so a row's result does not depend on
 * its batch. */
INLINE __m256 w8_rows8_m1(const int16_t *xq, const int8_t *w, int64_t k) {
    __m256 acc[8];
    for (int j = 0; j < 8; j++) {
        const int8_t *wrow = w + j * k;
        __m256i a = _mm256_setzero_si256(), b = _mm256_setzero_si256();
        int64_t kk = 0;
        for (; kk + 32 <= k; kk += 32) {
            a = W8_DOT(a, W8_LOADX(xq + kk), w8_load(wrow + kk, 16));
            b = W8_DOT(b, W8_LOADX(xq + kk + 16), w8_load(wrow + kk + 16, 16));
        }
        for (; kk < k; kk += 16) a = W8_DOT(a, W8_LOADX(xq + kk), w8_load(wrow + kk, k - kk));
        acc[j] = _mm256_cvtepi32_ps(_mm256_add_epi32(a, b));  /* exact: 256 products a lane at most */
    }
    return hsum8(acc);
}

static void w8_m1(const int16_t *xq, float sx, int64_t k, const int8_t *w, const uint16_t *w_scale, const void *bias,
                  int64_t n, void *y, int y_bf16, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t nb = 0; nb < n / 8; nb++) {
        int64_t nn = nb * 8;
        __m256 ws = bf16x8_to_f32(_mm_loadu_si128((const __m128i *)(w_scale + nn)));
        /* (sum * sx) * ws + b, rounded as the general path's scalar expression */
        __m256 v = _mm256_mul_ps(_mm256_mul_ps(w8_rows8_m1(xq, w + nn * k, k), _mm256_set1_ps(sx)), ws);
        if (bias) v = _mm256_add_ps(v, vload(bias, y_bf16, nn, 8));
        vstore(y, y_bf16, nn, v, 8);
    }
    for (int64_t nn = n / 8 * 8; nn < n; nn++) {
        float out;
        w8_row(xq, KPAD(k), 1, w + nn * k, k, &out);
        store1(y, y_bf16, nn, out * sx * bf16_scalar(w_scale[nn]) + (bias ? load1(bias, y_bf16, nn) : 0.0f));
    }
}
#endif

#ifdef PL_AVX2
/* Batches of W8_TILES_MIN_ROWS+ rows: tiles of 2 weight rows x 4 activation rows, one pass
 * over the weight. A thread takes W8_WEIGHT_BLOCK weight rows (in L1 up to k = 2048; the
 * decoder's shapes) and meets them with every activation row,
 * W8_TILE_ROWS at a time; each activation vector loaded serves both weight rows, and a tile's
 * 8 sums are reduced together (hsum8, vhsum's order) and scaled in one vector. Each sum is the
 * general path's: exact int32 per chunk, converted, reduced and scaled in the same order. */
#define W8_WEIGHT_BLOCK 16
#define W8_TILE_ROWS 16
/* Below this many rows the weight's stream, not the arithmetic, sets the time, and one
 * sequential stream per thread (the general path) reads it fastest. */
#define W8_TILES_MIN_ROWS 16

/* Lane j * 4 + r: sum over [k0, k1) of xq[r] . w_j (4 activation rows kp apart). The empty
 * asm statements only pin values to registers: without them gcc folded each activation load
 * into both of its dot products (loading it twice) and copied every accumulator to another
 * register each step; with them the step is its 4 loads, 8 dot products and 8 adds
 * (64 rows through the decoder's shapes: 94 GMAC/s against 86 on a 2-vCPU Zen 4). */
#define W8_PIN(v) __asm__("" : "+x"(v))
#define W8_TILE_ROW(acc_a, acc_b, xp, wa, wb) \
    do {                                      \
        __m256i xv_ = W8_LOADX(xp);           \
        W8_PIN(xv_);                          \
        acc_a = W8_DOT(acc_a, xv_, wa);       \
        acc_b = W8_DOT(acc_b, xv_, wb);       \
    } while (0)

INLINE __m256 w8_tile(const int16_t *xq, int64_t kp, const int8_t *w0, const int8_t *w1, int64_t k0, int64_t k1) {
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    const int16_t *x0 = xq, *x1 = xq + kp, *x2 = xq + 2 * kp, *x3 = xq + 3 * kp;
    for (int64_t kk = k0; kk < k1; kk += 16) {  /* w8_load's tail test: taken once, at the end */
        __m256i wa = w8_load(w0 + kk, k1 - kk), wb = w8_load(w1 + kk, k1 - kk);
        W8_TILE_ROW(a0, a4, x0 + kk, wa, wb);
        W8_TILE_ROW(a1, a5, x1 + kk, wa, wb);
        W8_TILE_ROW(a2, a6, x2 + kk, wa, wb);
        W8_TILE_ROW(a3, a7, x3 + kk, wa, wb);
        W8_PIN(a0); W8_PIN(a1); W8_PIN(a2); W8_PIN(a3); W8_PIN(a4); W8_PIN(a5); W8_PIN(a6); W8_PIN(a7);
    }
    __m256 f[8] = {_mm256_cvtepi32_ps(a0), _mm256_cvtepi32_ps(a1), _mm256_cvtepi32_ps(a2), _mm256_cvtepi32_ps(a3),
                   _mm256_cvtepi32_ps(a4), _mm256_cvtepi32_ps(a5), _mm256_cvtepi32_ps(a6), _mm256_cvtepi32_ps(a7)};
    return hsum8(f);
}

/* y for m >= W8_TILES_MIN_ROWS rows; xq and sx padded to a multiple of 4 rows (zeros, not stored). */
static void w8_tiles(const int16_t *xq, const float *sx, int64_t m, int64_t k, const int8_t *w,
                     const uint16_t *w_scale, const void *bias, int64_t n, void *y, int y_bf16, int nthreads) {
    int64_t kp = KPAD(k);
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t nb = 0; nb < n; nb += W8_WEIGHT_BLOCK) {
        int64_t nw = n - nb < W8_WEIGHT_BLOCK ? n - nb : W8_WEIGHT_BLOCK;
        float tile[W8_WEIGHT_BLOCK][W8_TILE_ROWS];  /* [weight row][activation row] */
        for (int64_t rb = 0; rb < m; rb += W8_TILE_ROWS) {
            int64_t re = rb + W8_TILE_ROWS < m ? rb + W8_TILE_ROWS : m;
            for (int64_t j = 0; j < nw; j += 2) {
                int64_t j1 = j + 1 < nw ? j + 1 : j;  /* an odd last row pairs with itself */
                const int8_t *w0 = w + (nb + j) * k, *w1 = w + (nb + j1) * k;
                float ws0 = bf16_scalar(w_scale[nb + j]), ws1 = bf16_scalar(w_scale[nb + j1]);
                float b0 = bias ? load1(bias, y_bf16, nb + j) : 0.0f, b1 = bias ? load1(bias, y_bf16, nb + j1) : 0.0f;
                __m256 ws = _mm256_setr_ps(ws0, ws0, ws0, ws0, ws1, ws1, ws1, ws1);
                __m256 bv = _mm256_setr_ps(b0, b0, b0, b0, b1, b1, b1, b1);
                for (int64_t r0 = rb; r0 < re; r0 += 4) {
                    __m256 sum = _mm256_setzero_ps();
                    for (int64_t k0 = 0; k0 < k; k0 += I8_CHUNK(W8_STEP))
                        sum = _mm256_add_ps(sum, w8_tile(xq + r0 * kp, kp, w0, w1, k0,
                                                         k0 + I8_CHUNK(W8_STEP) < k ? k0 + I8_CHUNK(W8_STEP) : k));
                    __m128 sx4 = _mm_loadu_ps(sx + r0);
                    /* (sum * sx) * ws + b, as the general path's scalar expression */
                    __m256 v = _mm256_add_ps(_mm256_mul_ps(_mm256_mul_ps(sum, _mm256_set_m128(sx4, sx4)), ws), bv);
                    _mm_storeu_ps(&tile[j][r0 - rb], _mm256_castps256_ps128(v));
                    _mm_storeu_ps(&tile[j1][r0 - rb], _mm256_extractf128_ps(v, 1));
                }
            }
            for (int64_t r = rb; r < re; r++)
                for (int64_t j = 0; j < nw; j++) store1(y, y_bf16, r * n + nb + j, tile[j][r - rb]);
        }
    }
}
#endif

#define I8_ROW_BLOCK 16
#define W8_ROW_M(MM) w8_row(xq + r0 * kp, kp, MM, wrow, k, out)

/* The general path: any rows, any ISA. */
static void w8_rows(const int16_t *xq, const float *sx, int64_t m, int64_t k, const int8_t *w,
                    const uint16_t *w_scale, const void *bias, int64_t n, void *y, int y_bf16, int nthreads) {
    int64_t kp = KPAD(k);
    /* Activation rows in blocks of I8_ROW_BLOCK, each a pass over the weight: a block's int16
     * rows stay in L1 while every weight row meets them (32 rows of 640 do not fit: 32 rows through
     * the 262144 x 640 head took 146 ms in one block and 106 in two, on an AVX2 EPYC, before
     * w8_tiles took 16+ rows there). */
    for (int64_t rb = 0; rb < m; rb += I8_ROW_BLOCK) {
        int64_t re = rb + I8_ROW_BLOCK < m ? rb + I8_ROW_BLOCK : m;
#pragma omp parallel for schedule(static) num_threads(nthreads)
        for (int64_t nn = 0; nn < n; nn++) {
            const int8_t *wrow = w + nn * k;
            float ws = bf16_scalar(w_scale[nn]), b = bias ? load1(bias, y_bf16, nn) : 0.0f;
            for (int64_t r0 = rb; r0 < re; r0 += 4) {
                float out[4];
                int M = re - r0 < 4 ? (int)(re - r0) : 4;
                switch (M) {  /* constant row counts, so the loops over rows unroll */
                    case 1: W8_ROW_M(1); break;
                    case 2: W8_ROW_M(2); break;
                    case 3: W8_ROW_M(3); break;
                    default: W8_ROW_M(4); break;
                }
                for (int r = 0; r < M; r++) store1(y, y_bf16, (r0 + r) * n + nn, out[r] * sx[r0 + r] * ws + b);
            }
        }
    }
}

void pl_w8a16_linear(const void *x, int x_bf16, int64_t m, int64_t k, const int8_t *w, const uint16_t *w_scale,
                     const void *bias, int64_t n, void *y, int y_bf16, int nthreads) {
    int64_t kp = KPAD(k), m4 = (m + 3) / 4 * 4;  /* rows in fours for w8_tiles: the extra ones zeros */
    int16_t *xq = aligned_alloc(64, (size_t)(m4 * kp * sizeof(int16_t)));
    float *sx = calloc((size_t)m4, sizeof(float));
    quantize_rows_i16(x, x_bf16, m, k, 32767.0f, xq, sx);
    memset(xq + m * kp, 0, (size_t)((m4 - m) * kp * sizeof(int16_t)));
#ifdef PL_AVX2
    if (m >= W8_TILES_MIN_ROWS && n >= W8_WEIGHT_BLOCK * nthreads)  /* a weight block for every thread */
        w8_tiles(xq, sx, m, k, w, w_scale, bias, n, y, y_bf16, nthreads);
    else if (m == 1 && k <= I8_CHUNK(W8_STEP))
        w8_m1(xq, sx[0], k, w, w_scale, bias, n, y, y_bf16, nthreads);
    else
#endif
        w8_rows(xq, sx, m, k, w, w_scale, bias, n, y, y_bf16, nthreads);
    free(sx);
    free(xq);
}

/* ---------- u8 x s8 ranking GEMM (the LM head's W8A8 copy): y = x @ (q * scale)^T ----------
 * Each activation row quantized to s8 with its own scale, stored as u8 (+128); the weight in
 * s8 within +-64, so a pair of u8 x s8 products (at most 2 * 255 * 64 = 32640) never
 * saturates vpmaddubsw's int16 sum: 32 products an instruction, where the int16 x int16 path
 * above takes 16. The +128 comes back out through each weight row's sum: dot = sum(u8 * w) -
 * 128 * sum(w). Tiles of 2 weight rows x 4 activation rows, their 8 sums reduced together
 * and scaled in one vector (the K loop has no tail test where K is a multiple of 32); a thread
 * takes 16 weight rows, meets them with every block of activation rows (L1), and writes each
 * output row's 16 values together. Integer sums are exact, and the scaling is the same float
 * operations in every build: every build and every batch gives a row the same values. */
#define U8_ROW_BLOCK 32
#define U8_WEIGHT_BLOCK 16

#if defined(PL_AVX512) || defined(PL_AVX2)
INLINE __m256i u8_wload(const int8_t *p, int64_t left) {
    if (left >= 32) return _mm256_loadu_si256((const __m256i *)p);
    int8_t buf[32] = {0};
    memcpy(buf, p, (size_t)left);
    return _mm256_loadu_si256((const __m256i *)buf);
}

/* Lane j * 4 + r = xu[r] . w_j for 4 activation rows (kp bytes apart) and weight rows w0, w1. */
INLINE __m256i u8_tile(const uint8_t *xu, int64_t kp, const int8_t *w0, const int8_t *w1, int64_t k) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i a[8];
    for (int i = 0; i < 8; i++) a[i] = _mm256_setzero_si256();
    int64_t kfull = k & ~(int64_t)31;
    for (int64_t kk = 0; kk < kfull; kk += 32) {
        __m256i wa = _mm256_loadu_si256((const __m256i *)(w0 + kk)), wb = _mm256_loadu_si256((const __m256i *)(w1 + kk));
        for (int r = 0; r < 4; r++) {
            __m256i xv = _mm256_load_si256((const __m256i *)(xu + r * kp + kk));
            a[r] = _mm256_add_epi32(a[r], _mm256_madd_epi16(_mm256_maddubs_epi16(xv, wa), ones));
            a[4 + r] = _mm256_add_epi32(a[4 + r], _mm256_madd_epi16(_mm256_maddubs_epi16(xv, wb), ones));
        }
    }
    for (int64_t kk = kfull; kk < k; kk += 32) {
        __m256i wa = u8_wload(w0 + kk, k - kk), wb = u8_wload(w1 + kk, k - kk);
        for (int r = 0; r < 4; r++) {
            __m256i xv = _mm256_load_si256((const __m256i *)(xu + r * kp + kk));
            a[r] = _mm256_add_epi32(a[r], _mm256_madd_epi16(_mm256_maddubs_epi16(xv, wa), ones));
            a[4 + r] = _mm256_add_epi32(a[4 + r], _mm256_madd_epi16(_mm256_maddubs_epi16(xv, wb), ones));
        }
    }
    __m256i h01 = _mm256_hadd_epi32(a[0], a[1]), h23 = _mm256_hadd_epi32(a[2], a[3]);
    __m256i h45 = _mm256_hadd_epi32(a[4], a[5]), h67 = _mm256_hadd_epi32(a[6], a[7]);
    __m256i lo = _mm256_hadd_epi32(h01, h23), hi = _mm256_hadd_epi32(h45, h67);
    return _mm256_add_epi32(_mm256_permute2x128_si256(lo, hi, 0x20), _mm256_permute2x128_si256(lo, hi, 0x31));
}

/* tile[j][r0..r0+3] and tile[j1][..] = (sum - 128 * w_sum) * sx * ws for one u8_tile. */
INLINE void u8_tile_out(const uint8_t *xu, int64_t kp, const int8_t *w0, const int8_t *w1, int64_t k, int32_t off0,
                        int32_t off1, const float *sx, float ws0, float ws1, float *t0, float *t1) {
    __m256i s = _mm256_sub_epi32(u8_tile(xu, kp, w0, w1, k), _mm256_setr_epi32(off0, off0, off0, off0, off1, off1,
                                                                                 off1, off1));
    __m128 sx4 = _mm_loadu_ps(sx);
    __m256 f = _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(s), _mm256_set_m128(sx4, sx4)),
                             _mm256_setr_ps(ws0, ws0, ws0, ws0, ws1, ws1, ws1, ws1));
    _mm_storeu_ps(t0, _mm256_castps256_ps128(f));
    _mm_storeu_ps(t1, _mm256_extractf128_ps(f, 1));
}
#else
INLINE void u8_tile_out(const uint8_t *xu, int64_t kp, const int8_t *w0, const int8_t *w1, int64_t k, int32_t off0,
                        int32_t off1, const float *sx, float ws0, float ws1, float *t0, float *t1) {
    for (int r = 0; r < 4; r++) {
        int32_t s0 = 0, s1 = 0;
        for (int64_t kk = 0; kk < k; kk++) {
            s0 += (int32_t)xu[r * kp + kk] * w0[kk];
            s1 += (int32_t)xu[r * kp + kk] * w1[kk];
        }
        t0[r] = (float)(s0 - off0) * sx[r] * ws0;
        t1[r] = (float)(s1 - off1) * sx[r] * ws1;
    }
}
#endif

void pl_u8s8_rank(const void *x, int x_bf16, int64_t m, int64_t k, const int8_t *w, const uint16_t *w_scale,
                  const int32_t *w_sum, int64_t n, void *y, int y_bf16, int nthreads) {
    int64_t kp = KPAD(k), m4 = (m + 3) / 4 * 4;  /* rows in fours: the extra ones are zeros (u8 128) */
    int16_t *xq = aligned_alloc(64, (size_t)(m * kp * sizeof(int16_t)));
    uint8_t *xu = aligned_alloc(64, (size_t)(m4 * kp));
    float *sx = calloc((size_t)m4, sizeof(float));  /* the padding rows' scales are 0 */
    quantize_rows_i16(x, x_bf16, m, k, 127.0f, xq, sx);  /* s8 values in int16, zero-padded */
    for (int64_t i = 0; i < m * kp; i++) xu[i] = (uint8_t)(xq[i] + 128);
    memset(xu + m * kp, 128, (size_t)((m4 - m) * kp));
    free(xq);
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t nb = 0; nb < n; nb += U8_WEIGHT_BLOCK) {
        int64_t nw = n - nb < U8_WEIGHT_BLOCK ? n - nb : U8_WEIGHT_BLOCK;
        float tile[U8_WEIGHT_BLOCK][U8_ROW_BLOCK];  /* [weight row][activation row] */
        for (int64_t rb = 0; rb < m; rb += U8_ROW_BLOCK) {
            int64_t re = rb + U8_ROW_BLOCK < m ? rb + U8_ROW_BLOCK : m;
            for (int64_t j = 0; j < nw; j += 2) {
                int64_t j1 = j + 1 < nw ? j + 1 : j;  /* an odd last row pairs with itself */
                const int8_t *w0 = w + (nb + j) * k, *w1 = w + (nb + j1) * k;
                float ws0 = bf16_scalar(w_scale[nb + j]), ws1 = bf16_scalar(w_scale[nb + j1]);
                int32_t off0 = 128 * w_sum[nb + j], off1 = 128 * w_sum[nb + j1];
                for (int64_t r0 = rb; r0 < re; r0 += 4)  /* rows past m: padding, not stored */
                    u8_tile_out(xu + r0 * kp, kp, w0, w1, k, off0, off1, sx + r0, ws0, ws1, &tile[j][r0 - rb],
                                &tile[j1][r0 - rb]);
            }
            for (int64_t r = rb; r < re; r++)
                for (int64_t j = 0; j < nw; j++) store1(y, y_bf16, r * n + nb + j, tile[j][r - rb]);
        }
    }
    free(sx);
    free(xu);
}

/* ---------- int32 sums of int8 rows (pl_u8s8_rank's w_sum) ----------
 * Once per start for the head's 262144 x 640 copy: ~16 ms on a 2-vCPU EPYC, where torch's
 * widening sum takes ~0.3 s. */
void pl_i8_row_sums(const int8_t *w, int64_t n, int64_t k, int32_t *out, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t r = 0; r < n; r++) {
        const int8_t *row = w + r * k;
        int32_t s = 0;
        for (int64_t c = 0; c < k; c++) s += row[c];
        out[r] = s;
    }
}
