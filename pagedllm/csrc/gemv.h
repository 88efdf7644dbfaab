/* What the int8 and int4 GEMVs share: activations quantized to ~15-bit integers per row, and
 * (AVX2) the horizontal sums of 8 rows at once. */
#ifndef PAGEDLLM_GEMV_H
#define PAGEDLLM_GEMV_H

#include "common.h"

/* ---------- activations as int16, one scale per row ---------- */

#define KPAD(k) (((k) + 127) / 128 * 128)

/* xq[r] = round(x[r] / sx[r]) with sx[r] = max|x[r]| / qmax, zero-padded to KPAD(k).
 * ~15 bits per value: the dot products below lose far less than bf16 activations would. */
static inline void quantize_rows_i16(const void *x, int bf16, int64_t m, int64_t k, float qmax, int16_t *xq, float *sx) {
    int64_t kp = KPAD(k);
    for (int64_t r = 0; r < m; r++) {
        const void *row = row_ptr(x, bf16, r * k);
        vf amax = vzero();
        vm nonfinite = vm_none();
        for (int64_t i = 0; i < k; i += VL) {
            vf v = vabs(vload(row, bf16, i, k - i));
            nonfinite = vm_or(nonfinite, vge_or_nan(v, vset1(INFINITY)));  /* inf or NaN */
            amax = vmax(amax, v);
        }
        float a = vhmax(amax);
        /* A row holding inf or NaN gets NaN outputs, as its float product would have
         * inf/NaN in it; quantizing it would hide that. */
        int bad = vm_bits(nonfinite) != 0;
        sx[r] = bad ? NAN : a > 0 ? a / qmax : 1.0f;
        vf inv = vset1(!bad && a > 0 ? qmax / a : 0.0f);
        int16_t *out = xq + r * kp;
        memset(out, 0, kp * sizeof(int16_t));
        for (int64_t i = 0; i < k; i += VL) vstore_i16(out + i, vmul(vload(row, bf16, i, k - i), inv), k - i);
    }
}

#if defined(PL_AVX2) || defined(PL_AVX512)
/* The horizontal sums of acc[0..7] as one vector: hadd within 128-bit halves, so after two
 * rounds half h of s0123 holds rows 0-3's sums of their lanes in half h. */
INLINE __m256 hsum8(const __m256 *acc) {
    __m256 s0123 = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
    __m256 s4567 = _mm256_hadd_ps(_mm256_hadd_ps(acc[4], acc[5]), _mm256_hadd_ps(acc[6], acc[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

#endif

#endif /* PAGEDLLM_GEMV_H */
