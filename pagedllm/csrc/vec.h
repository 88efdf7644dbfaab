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

/* The KV cache's element types: a float tensor (the activations' dtype), or one byte per element
 * with a float32 scale per 32 elements of a (token, kv head): int8, or fp8 as e4m3 (no infinities, max 448) or e5m2
 * (fp16's top byte, max 57344). The ids are kv_quant.py's. */
enum { KV_F32 = 0, KV_BF16 = 1, KV_INT8 = 2, KV_FP8_E4M3 = 3, KV_FP8_E5M2 = 4 };

INLINE int kv8_mant_bits(int kind) { return kind == KV_FP8_E4M3 ? 3 : 2; }
INLINE int kv8_bias(int kind) { return kind == KV_FP8_E4M3 ? 7 : 15; }

/* One stored byte as a float (before its scale). */
INLINE float kv8_to_f32(uint8_t b, int kind) {
    if (kind == KV_INT8) return (float)(int8_t)b;
    int M = kv8_mant_bits(kind), bias = kv8_bias(kind), e = (b & 0x7F) >> M, m = b & ((1 << M) - 1);
    float v = e ? ldexpf(1.0f + (float)m / (float)(1 << M), e - bias) : ldexpf((float)m, 1 - bias - M);
    return (b & 0x80) ? -v : v;
}

/* x (already divided by its scale, so |x| <= the type's max) as a stored byte, rounded to nearest
 * even as torch's .round() and its float8 casts round. */
INLINE uint8_t f32_to_kv8(float x, int kind) {
    if (kind == KV_INT8) {
        float r = nearbyintf(x);
        return (uint8_t)(int8_t)(r > 127.0f ? 127.0f : r < -127.0f ? -127.0f : r);
    }
    int M = kv8_mant_bits(kind), bias = kv8_bias(kind), shift = 23 - M;
    uint32_t u;
    memcpy(&u, &x, 4);
    uint8_t sign = (uint8_t)((u >> 24) & 0x80);
    u &= 0x7FFFFFFFu;
    float a;
    memcpy(&a, &u, 4);
    if (a < ldexpf(1.0f, 1 - bias)) /* subnormal: a multiple of 2^(1 - bias - M) */
        return sign | (uint8_t)nearbyintf(ldexpf(a, bias - 1 + M));
    u += ((1u << (shift - 1)) - 1) + ((u >> shift) & 1);
    return sign | (uint8_t)((u >> shift) - ((uint32_t)(127 - bias) << M));
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

/* a[ao:ao + n] . b[bo:bo + n], each in either dtype: one vector accumulator, then vhsum (the
 * order the re-scoring and float-weight kernels share) */
INLINE float vdot(const void *a, int a_bf16, int64_t ao, const void *b, int b_bf16, int64_t bo, int64_t n) {
    vf acc = vzero();
    for (int64_t c = 0; c < n; c += VL)
        acc = vfmadd(vload(a, a_bf16, ao + c, n - c), vload(b, b_bf16, bo + c, n - c), acc);
    return vhsum(acc);
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
