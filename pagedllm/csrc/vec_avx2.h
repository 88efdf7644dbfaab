/* vec.h's vocabulary on AVX2 + FMA: 8 lanes, masks as all-ones lanes, tails through a small
 * stack buffer (only a row's last partial vector takes that path). */
#include <immintrin.h>

#define PL_AVX2 1
#define VL 8
typedef __m256 vf;
typedef __m256 vm;
typedef __m256i vi;

INLINE vf bf16x8_to_f32(__m128i v) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16)); }

INLINE __m128i f32_to_bf16x8(vf v) { /* round to nearest even */
    __m256i x = _mm256_castps_si256(v);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(1));
    x = _mm256_srli_epi32(_mm256_add_epi32(x, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
    /* values are < 2^16, so the unsigned pack is exact; packus works per 128-bit half */
    return _mm_packus_epi32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1));
}

INLINE vf vzero(void) { return _mm256_setzero_ps(); }
INLINE vf vset1(float f) { return _mm256_set1_ps(f); }
INLINE vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
INLINE vf vsub(vf a, vf b) { return _mm256_sub_ps(a, b); }
INLINE vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
INLINE vf vmax(vf a, vf b) { return _mm256_max_ps(a, b); }
INLINE vf vabs(vf a) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), a); }
INLINE vf vfmadd(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
INLINE vf vfnmadd(vf a, vf b, vf c) { return _mm256_fnmadd_ps(a, b, c); }

/* ((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7)): the order gemv.c's hsum8 adds 8 rows'
 * lanes in, so a row's sum does not depend on which of the two computed it. */
INLINE float vhsum(vf a) {
    __m256 h = _mm256_hadd_ps(a, a);
    h = _mm256_hadd_ps(h, h);
    return _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
}

INLINE float vhmax(vf a) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

INLINE vf vload_full(const void *p, int bf16, int64_t i) {
    if (bf16) return bf16x8_to_f32(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i)));
    return _mm256_loadu_ps((const float *)p + i);
}

INLINE vf vload(const void *p, int bf16, int64_t i, int64_t left) {
    if (left >= 8) return vload_full(p, bf16, i);
    float buf[8];
    for (int j = 0; j < 8; j++) buf[j] = j < left ? load1(p, bf16, i + j) : 0.0f;
    return _mm256_loadu_ps(buf);
}

INLINE void vstore(void *p, int bf16, int64_t i, vf v, int64_t left) {
    if (left >= 8) {
        if (bf16) _mm_storeu_si128((__m128i *)((uint16_t *)p + i), f32_to_bf16x8(v));
        else _mm256_storeu_ps((float *)p + i, v);
        return;
    }
    float buf[8];
    _mm256_storeu_ps(buf, v);
    for (int j = 0; j < left; j++) store1(p, bf16, i + j, buf[j]);
}

INLINE vf vloadf(const float *p, int64_t left) { return vload(p, 0, 0, left); }
INLINE void vstoref(float *p, vf v, int64_t left) { vstore(p, 0, 0, v, left); }
INLINE vf vround_bf16(vf v) { return bf16x8_to_f32(f32_to_bf16x8(v)); }

INLINE vf vround(vf x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
INLINE vf vclamp_keep_nan(vf x, float lo, float hi) { return _mm256_min_ps(_mm256_set1_ps(hi), _mm256_max_ps(_mm256_set1_ps(lo), x)); }
/* p * 2^n for integral n in [-150, 129]: two factors 2^(n/2), each a normal float, so
 * results that are subnormal, 0 or inf come out of the multiplies themselves. */
INLINE vf vscale2(vf p, vf n) {
    __m256i ni = _mm256_cvtps_epi32(n);
    __m256i n1 = _mm256_srai_epi32(ni, 1), n2 = _mm256_sub_epi32(ni, n1);
    vf f1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, _mm256_set1_epi32(127)), 23));
    vf f2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, _mm256_set1_epi32(127)), 23));
    return _mm256_mul_ps(_mm256_mul_ps(p, f1), f2);
}
INLINE vf vrcp(vf d) { return _mm256_div_ps(_mm256_set1_ps(1.0f), d); }

INLINE vm vlt(vf a, vf b) { return _mm256_cmp_ps(a, b, _CMP_LT_OQ); }
INLINE vm vgt(vf a, vf b) { return _mm256_cmp_ps(a, b, _CMP_GT_OQ); }
INLINE vm vge_or_nan(vf a, vf b) { return _mm256_cmp_ps(a, b, _CMP_NLT_UQ); }
INLINE vm visnan(vf a) { return _mm256_cmp_ps(a, a, _CMP_UNORD_Q); }
INLINE vm veq(vf a, vf b) { return _mm256_cmp_ps(a, b, _CMP_EQ_OQ); }
INLINE vm vm_and(vm a, vm b) { return _mm256_and_ps(a, b); }
INLINE vm vm_or(vm a, vm b) { return _mm256_or_ps(a, b); }
INLINE vm vm_tail(int64_t left) {
    __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32((int)(left < 8 ? left : 8)), lanes));
}
INLINE vm vm_none(void) { return _mm256_setzero_ps(); }
INLINE unsigned vm_bits(vm m) { return (unsigned)_mm256_movemask_ps(m); }
INLINE vf vsel(vm m, vf a, vf b) { return _mm256_blendv_ps(b, a, m); }

INLINE vi vi_iota(int32_t start) { return _mm256_add_epi32(_mm256_set1_epi32(start), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)); }
INLINE vi vi_zero(void) { return _mm256_setzero_si256(); }
INLINE vi vi_sel(vm m, vi a, vi b) { return _mm256_blendv_epi8(b, a, _mm256_castps_si256(m)); }
INLINE int32_t vi_min_where(vm m, vi v) {
    int32_t lanes[8], best = INT32_MAX;
    _mm256_storeu_si256((__m256i *)lanes, v);
    unsigned bits = vm_bits(m);
    for (int j = 0; j < 8; j++)
        if ((bits >> j) & 1 && lanes[j] < best) best = lanes[j];
    return best;
}
INLINE void vstore_i16(int16_t *p, vf v, int64_t left) {
    __m256i q = _mm256_cvtps_epi32(v);
    __m128i h = _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1)); /* saturating */
    if (left >= 8) {
        _mm_storeu_si128((__m128i *)p, h);
        return;
    }
    int16_t buf[8];
    _mm_storeu_si128((__m128i *)buf, h);
    memcpy(p, buf, (size_t)left * sizeof(int16_t));
}

/* VL stored KV bytes (vec.h's KV_INT8 / KV_FP8_*) as floats, before their scale. e4m3: the
 * magnitude bits shifted into a float's exponent and mantissa, rebiased; its subnormals
 * (exponent 0) are the mantissa times 2^-9. */
INLINE vf vload_kv8(const uint8_t *p, int kind) {
    __m128i b = _mm_loadl_epi64((const __m128i *)p);
    if (kind == KV_INT8) return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
    if (kind == KV_FP8_E5M2) return _mm256_cvtph_ps(_mm_unpacklo_epi8(_mm_setzero_si128(), b));
    __m256i x = _mm256_cvtepu8_epi32(b);
    __m256i mag = _mm256_and_si256(x, _mm256_set1_epi32(0x7F));
    __m256i sign = _mm256_slli_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x80)), 24);
    vf normal = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_slli_epi32(mag, 20), _mm256_set1_epi32(120 << 23)));
    vf sub = _mm256_mul_ps(_mm256_cvtepi32_ps(mag), _mm256_set1_ps(1.0f / 512));
    vf r = _mm256_blendv_ps(normal, sub, _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(8), mag)));
    return _mm256_or_ps(r, _mm256_castsi256_ps(sign));
}
