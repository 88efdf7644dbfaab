/* One small vector vocabulary over three instruction sets, so each kernel is written once:
 *   AVX-512 (F/BW/VL/DQ): 16 float lanes, mask registers;
 *   AVX2 + FMA:            8 float lanes, masks as all-ones lanes;
 *   portable C:            8 lanes of GCC vector extensions (SSE2 on x86-64, NEON on aarch64).
 * The level is the one the file is compiled for (cpu_kernels.py passes each level's -m flags).
 * Loads and stores take a float tensor that is bfloat16 (bf16 = 1) or float32 (0) and widen to
 * float32; `left` is how many lanes remain (a tail when < VL), and lanes past it read as 0. */
#ifndef PAGEDLLM_VEC_H
#define PAGEDLLM_VEC_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#define INLINE static inline __attribute__((always_inline))

INLINE float bf16_scalar(uint16_t v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

INLINE uint16_t bf16_round(float f) { /* round to nearest even, as torch's .to(torch.bfloat16) */
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7FFF + ((u >> 16) & 1);
    return (uint16_t)(u >> 16);
}

INLINE float load1(const void *p, int bf16, int64_t i) {
    return bf16 ? bf16_scalar(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

INLINE void store1(void *p, int bf16, int64_t i, float v) {
    if (bf16) ((uint16_t *)p)[i] = bf16_round(v);
    else ((float *)p)[i] = v;
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#include "vec_avx512.h"
#elif defined(__AVX2__) && defined(__FMA__)
#include "vec_avx2.h"
#else
#include "vec_generic.h"
#endif

/* ---------- shared on every level ---------- */

INLINE float load_scalar_or_zero(const void *p, int bf16, int64_t i, int64_t left, int j) {
    return j < left ? load1(p, bf16, i + j) : 0.0f;
}

/* Rows of a float tensor: row r of a [*, cols] tensor in either dtype. */
INLINE const void *row_ptr(const void *x, int bf16, int64_t offset) {
    return bf16 ? (const void *)((const uint16_t *)x + offset) : (const void *)((const float *)x + offset);
}

/* e^x as 2^n * e^r with |r| <= ln2 / 2 and a degree-7 Taylor polynomial (~2 ulp of expf);
 * 0 far below, inf above ~88.7, NaN stays NaN. */
INLINE vf vexp(vf x) {
    x = vclamp_keep_nan(x, -104.0f, 89.0f);
    vf n = vround(vmul(x, vset1(1.44269504089f)));
    vf r = vfnmadd(n, vset1(0.693145751953125f), x);
    r = vfnmadd(n, vset1(1.428606765330187e-06f), r);
    vf p = vset1(1.0f / 5040);
    p = vfmadd(p, r, vset1(1.0f / 720));
    p = vfmadd(p, r, vset1(1.0f / 120));
    p = vfmadd(p, r, vset1(1.0f / 24));
    p = vfmadd(p, r, vset1(1.0f / 6));
    p = vfmadd(p, r, vset1(0.5f));
    p = vfmadd(p, r, vset1(1.0f));
    p = vfmadd(p, r, vset1(1.0f));
    return vscale2(p, n);
}

/* 1 / (1 + e^-x); 0 where e^-x is inf. */
INLINE vf vsigmoid(vf x) {
    vf d = vadd(vset1(1.0f), vexp(vsub(vzero(), x)));
    return vsel(vlt(d, vset1(INFINITY)), vrcp(d), vzero());
}

#endif /* PAGEDLLM_VEC_H */
