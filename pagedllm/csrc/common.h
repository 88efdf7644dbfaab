/* What every pagedllm CPU kernel file shares: the instruction-set check, float32 / bfloat16
 * loads and stores of 16 lanes, and a vectorised exp.
 *
 * The *.c files next to this one are compiled together into one library at first use by
 * pagedllm/model_executor/layers/cpu_kernels.py (`gcc -O3 -march=native -fopenmp`) and
 * loaded with ctypes. They need AVX-512 F/BW/VL and VNNI; where those are missing the build
 * fails and the Python side keeps its torch paths. OpenMP: the library links libgomp.so.1,
 * which resolves to the copy torch has already loaded, so both share one thread pool.
 *
 * Tensors are passed as raw pointers; `bf16` flags say whether a float tensor is bfloat16
 * (1) or float32 (0). Accumulation is always float32 (int32 for the integer dot products).
 */
#ifndef PAGEDLLM_COMMON_H
#define PAGEDLLM_COMMON_H

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if !defined(__AVX512F__) || !defined(__AVX512BW__) || !defined(__AVX512VL__) || !defined(__AVX512VNNI__)
#error "pagedllm CPU kernels need AVX-512 F, BW, VL and VNNI"
#endif

#define INLINE static inline __attribute__((always_inline))

/* ---------- float32 / bfloat16 loads and stores, 16 lanes ---------- */

INLINE __m512 bf16_to_f32(__m256i v) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16)); }

INLINE __m256i f32_to_bf16(__m512 v) {
    /* round to nearest even, as torch's .to(torch.bfloat16) does */
    __m512i x = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(x, 16), _mm512_set1_epi32(1));
    x = _mm512_add_epi32(x, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(x, 16));
}

INLINE __m512 load16(const void *p, int bf16, int64_t i, __mmask16 m) {
    if (bf16) return bf16_to_f32(_mm256_maskz_loadu_epi16(m, (const uint16_t *)p + i));
    return _mm512_maskz_loadu_ps(m, (const float *)p + i);
}

INLINE void store16(void *p, int bf16, int64_t i, __m512 v, __mmask16 m) {
    if (bf16) _mm256_mask_storeu_epi16((uint16_t *)p + i, m, f32_to_bf16(v));
    else _mm512_mask_storeu_ps((float *)p + i, m, v);
}

INLINE __mmask16 tail16(int64_t left) { return left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1); }

INLINE float bf16_scalar(uint16_t v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

INLINE uint16_t bf16_round(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7FFF + ((u >> 16) & 1);
    return (uint16_t)(u >> 16);
}

INLINE void store1(void *p, int bf16, int64_t i, float v) {
    if (bf16) ((uint16_t *)p)[i] = bf16_round(v);
    else ((float *)p)[i] = v;
}

INLINE float load1(const void *p, int bf16, int64_t i) {
    return bf16 ? bf16_scalar(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* e^x as 2^n * e^r with |r| <= ln2 / 2 and a degree-7 Taylor polynomial, within ~2 ulp of
 * expf; 0 below -103, inf above ~88.7 (scalef saturates). */
INLINE __m512 exp512(__m512 x) {
    x = _mm512_max_ps(_mm512_set1_ps(-103.0f), x);  /* this order keeps NaN (max returns its 2nd operand) */
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504089f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
    __m512 p = _mm512_set1_ps(1.0f / 5040);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

#endif  /* PAGEDLLM_COMMON_H */
