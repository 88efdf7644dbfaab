/* Weight-only int8 / int4 GEMV for decode: activations quantized to ~15-bit integers per
 * row, weights streamed once through VNNI dot products. */
#include "common.h"

/* ---------- activations as int16, one scale per row ---------- */

#define KPAD(k) (((k) + 127) / 128 * 128)

/* xq[r] = round(x[r] / sx[r]) with sx[r] = max|x[r]| / qmax, zero-padded to KPAD(k).
 * ~15 bits per value: the dot products below lose far less than bf16 activations would. */
static void quantize_rows_i16(const void *x, int bf16, int64_t m, int64_t k, float qmax, int16_t *xq, float *sx) {
    int64_t kp = KPAD(k);
    for (int64_t r = 0; r < m; r++) {
        const void *row = bf16 ? (const void *)((const uint16_t *)x + r * k) : (const void *)((const float *)x + r * k);
        __m512 amax = _mm512_setzero_ps();
        __mmask16 nonfinite = 0;
        for (int64_t i = 0; i < k; i += 16) {
            __m512 v = _mm512_abs_ps(load16(row, bf16, i, tail16(k - i)));
            nonfinite |= _mm512_cmp_ps_mask(v, _mm512_set1_ps(INFINITY), _CMP_NLT_UQ);  /* inf or NaN */
            amax = _mm512_max_ps(amax, v);
        }
        float a = _mm512_reduce_max_ps(amax);
        /* A row holding inf or NaN gets NaN outputs, as its float product would have
         * inf/NaN in it; quantizing it would hide that. */
        sx[r] = nonfinite ? NAN : a > 0 ? a / qmax : 1.0f;
        __m512 inv = _mm512_set1_ps(!nonfinite && a > 0 ? qmax / a : 0.0f);
        int16_t *out = xq + r * kp;
        memset(out, 0, kp * sizeof(int16_t));
        for (int64_t i = 0; i < k; i += 16) {
            __mmask16 m16 = tail16(k - i);
            __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(load16(row, bf16, i, m16), inv));
            _mm256_mask_storeu_epi16(out + i, m16, _mm512_cvtsepi32_epi16(q));
        }
    }
}

/* ---------- weight-only int8 linear: y = x @ (q * scale)^T + bias ----------
 * One weight row at a time, for all activation rows: a single sequential stream per thread.
 * (Tiles of 4 weight rows, read side by side, ran at a third of the bandwidth here: the
 * hardware prefetchers follow 4 short interleaved streams poorly.) */

/* Within a 4096-wide chunk a lane sums 256 products of at most 127 * 32767: ~1.07e9 < 2^31. */
#define I8_CHUNK 4096

INLINE void w8_row(const int16_t *xq, int64_t kp, int M, const int8_t *wrow, int64_t k, float *out) {
    for (int r = 0; r < M; r++) out[r] = 0.0f;
    for (int64_t k0 = 0; k0 < k; k0 += I8_CHUNK) {
        int64_t k1 = k0 + I8_CHUNK < k ? k0 + I8_CHUNK : k;
        __m512i acc[4];
        for (int r = 0; r < M; r++) acc[r] = _mm512_setzero_si512();
        for (int64_t kk = k0; kk < k1; kk += 32) {
            __mmask32 m = k1 - kk >= 32 ? (__mmask32)0xFFFFFFFFu : (__mmask32)((1u << (k1 - kk)) - 1);
            __m512i wv = _mm512_cvtepi8_epi16(_mm256_maskz_loadu_epi8(m, wrow + kk));
            for (int r = 0; r < M; r++)
                acc[r] = _mm512_dpwssd_epi32(acc[r], _mm512_load_si512((const void *)(xq + r * kp + kk)), wv);
        }
        for (int r = 0; r < M; r++) out[r] += _mm512_reduce_add_ps(_mm512_cvtepi32_ps(acc[r]));
    }
}

#define W8_ROW_M(MM) w8_row(xq + r0 * kp, kp, MM, wrow, k, out)

void pl_w8a16_linear(const void *x, int x_bf16, int64_t m, int64_t k, const int8_t *w, const uint16_t *w_scale,
                     const void *bias, int64_t n, void *y, int y_bf16, int nthreads) {
    int64_t kp = KPAD(k);
    int16_t *xq = aligned_alloc(64, (size_t)(m * kp * sizeof(int16_t)));
    float *sx = malloc((size_t)m * sizeof(float));
    quantize_rows_i16(x, x_bf16, m, k, 32767.0f, xq, sx);
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t nn = 0; nn < n; nn++) {
        const int8_t *wrow = w + nn * k;
        float ws = bf16_scalar(w_scale[nn]), b = bias ? load1(bias, y_bf16, nn) : 0.0f;
        for (int64_t r0 = 0; r0 < m; r0 += 4) {
            float out[4];
            int M = m - r0 < 4 ? (int)(m - r0) : 4;
            switch (M) {  /* constant row counts, so the loops over rows unroll */
                case 1: W8_ROW_M(1); break;
                case 2: W8_ROW_M(2); break;
                case 3: W8_ROW_M(3); break;
                default: W8_ROW_M(4); break;
            }
            for (int r = 0; r < M; r++) store1(y, y_bf16, (r0 + r) * n + nn, out[r] * sx[r0 + r] * ws + b);
        }
    }
    free(sx);
    free(xq);
}

/* ---------- weight-only int4 linear, groups of g inputs: w = (q - 8) * s + z ----------
 * Packed per row in 128-input blocks of 64 bytes: byte i holds input i (low nibble) and
 * input 64 + i (high nibble). sz: [n, k / g, 2] float32 (s, z - 8 s), so w = q * s + sz[1]. Needs k % 128 == 0 and
 * g % 128 == 0.
 * The activations, quantized to |xq| <= 127 * 256 - 128, are split as xq = 256 * x1 + x2 with
 * x1 in [-127, 127] and x2 in [-128, 127],
 * so both halves run as u8 (nibble) x s8 VNNI dot products, 64 per instruction. */

static void split_rows_i8(const int16_t *xq, int64_t m, int64_t kp, int8_t *x1, int8_t *x2) {
    for (int64_t i = 0; i < m * kp; i++) {
        int v = xq[i], hi = (v + 128) >> 8;  /* floor((v + 128) / 256) */
        x1[i] = (int8_t)hi;
        x2[i] = (int8_t)(v - 256 * hi);
    }
}

INLINE void w4_row(const int8_t *x1, const int8_t *x2, int64_t kp, int M, const uint8_t *wrow, const float *sz,
                   int64_t g, const float *xsum, int64_t groups, float *out) {
    __m512 facc[4];
    float fz[4];
    for (int r = 0; r < M; r++) facc[r] = _mm512_setzero_ps(), fz[r] = 0.0f;
    const __m512i lo_mask = _mm512_set1_epi8(0x0F);
    for (int64_t gi = 0; gi < groups; gi++) {
        __m512i a[4], b[4];
        for (int r = 0; r < M; r++) a[r] = b[r] = _mm512_setzero_si512();
        for (int64_t k0 = gi * g; k0 < (gi + 1) * g; k0 += 128) {
            __m512i v = _mm512_loadu_si512((const void *)(wrow + k0 / 2));
            __m512i lo = _mm512_and_si512(v, lo_mask);
            __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), lo_mask);
            for (int r = 0; r < M; r++) {
                const int8_t *p1 = x1 + r * kp + k0, *p2 = x2 + r * kp + k0;
                a[r] = _mm512_dpbusd_epi32(a[r], lo, _mm512_load_si512((const void *)p1));
                a[r] = _mm512_dpbusd_epi32(a[r], hi, _mm512_load_si512((const void *)(p1 + 64)));
                b[r] = _mm512_dpbusd_epi32(b[r], lo, _mm512_load_si512((const void *)p2));
                b[r] = _mm512_dpbusd_epi32(b[r], hi, _mm512_load_si512((const void *)(p2 + 64)));
            }
        }
        float zb = sz[2 * gi + 1];
        __m512 sv = _mm512_set1_ps(sz[2 * gi]);
        for (int r = 0; r < M; r++) {
            __m512i d = _mm512_add_epi32(_mm512_slli_epi32(a[r], 8), b[r]);
            facc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), sv, facc[r]);
            fz[r] += zb * xsum[r * groups + gi];
        }
    }
    for (int r = 0; r < M; r++) out[r] = _mm512_reduce_add_ps(facc[r]) + fz[r];
}

#define W4_ROW_M(MM) w4_row(x1 + r0 * kp, x2 + r0 * kp, kp, MM, wrow, sz + nn * groups * 2, g, xsum + r0 * groups, groups, out)

void pl_w4a16_linear(const void *x, int x_bf16, int64_t m, int64_t k, const uint8_t *w, const float *sz,
                     int64_t g, const void *bias, int64_t n, void *y, int y_bf16, int nthreads) {
    int64_t kp = KPAD(k), groups = k / g;
    int16_t *xq = aligned_alloc(64, (size_t)(m * kp * sizeof(int16_t)));
    int8_t *x1 = aligned_alloc(64, (size_t)(m * kp)), *x2 = aligned_alloc(64, (size_t)(m * kp));
    float *sx = malloc((size_t)m * sizeof(float));
    float *xsum = malloc((size_t)(m * groups) * sizeof(float));
    quantize_rows_i16(x, x_bf16, m, k, 127.0f * 256.0f - 128.0f, xq, sx);
    split_rows_i8(xq, m, kp, x1, x2);
    for (int64_t r = 0; r < m; r++)
        for (int64_t gi = 0; gi < groups; gi++) {
            int64_t s = 0;
            for (int64_t i = gi * g; i < (gi + 1) * g; i++) s += xq[r * kp + i];
            xsum[r * groups + gi] = (float)s;
        }
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t nn = 0; nn < n; nn++) {
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
