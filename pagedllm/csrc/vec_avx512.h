/* vec.h's vocabulary on AVX-512: 16 lanes, tails through mask registers. */
#include <immintrin.h>

#define PL_AVX512 1
#define VL 16
typedef __m512 vf;
typedef __mmask16 vm;
typedef __m512i vi;

INLINE __mmask16 tail_mask(int64_t left) { return left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1); }

INLINE vf bf16x16_to_f32(__m256i v) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16)); }

INLINE __m256i f32_to_bf16x16(vf v) { /* round to nearest even */
    __m512i x = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(x, 16), _mm512_set1_epi32(1));
    x = _mm512_add_epi32(x, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(x, 16));
}

INLINE vf vzero(void) { return _mm512_setzero_ps(); }
INLINE vf vset1(float f) { return _mm512_set1_ps(f); }
INLINE vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
INLINE vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
INLINE vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
INLINE vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
INLINE vf vabs(vf a) { return _mm512_abs_ps(a); }
INLINE vf vfmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }  /* a * b + c */
INLINE vf vfnmadd(vf a, vf b, vf c) { return _mm512_fnmadd_ps(a, b, c); } /* c - a * b */
INLINE float vhsum(vf a) { return _mm512_reduce_add_ps(a); }
INLINE float vhmax(vf a) { return _mm512_reduce_max_ps(a); }

INLINE vf vload(const void *p, int bf16, int64_t i, int64_t left) {
    __mmask16 m = tail_mask(left);
    if (bf16) return bf16x16_to_f32(_mm256_maskz_loadu_epi16(m, (const uint16_t *)p + i));
    return _mm512_maskz_loadu_ps(m, (const float *)p + i);
}

INLINE void vstore(void *p, int bf16, int64_t i, vf v, int64_t left) {
    __mmask16 m = tail_mask(left);
    if (bf16) _mm256_mask_storeu_epi16((uint16_t *)p + i, m, f32_to_bf16x16(v));
    else _mm512_mask_storeu_ps((float *)p + i, m, v);
}

INLINE vf vloadf(const float *p, int64_t left) { return _mm512_maskz_loadu_ps(tail_mask(left), p); }
INLINE void vstoref(float *p, vf v, int64_t left) { _mm512_mask_storeu_ps(p, tail_mask(left), v); }

/* the value rounded to bf16 and back (torch's intermediate roundings) */
INLINE vf vround_bf16(vf v) { return bf16x16_to_f32(f32_to_bf16x16(v)); }

INLINE vf vround(vf x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
/* max(lo, x) then min(hi, x): NaN passes (both return their 2nd operand for NaN) */
INLINE vf vclamp_keep_nan(vf x, float lo, float hi) { return _mm512_min_ps(_mm512_set1_ps(hi), _mm512_max_ps(_mm512_set1_ps(lo), x)); }
INLINE vf vscale2(vf p, vf n) { return _mm512_scalef_ps(p, n); } /* p * 2^n */
INLINE vf vrcp(vf d) { /* estimate + one Newton step (~1 ulp) */
    vf r = _mm512_rcp14_ps(d);
    return _mm512_mul_ps(r, _mm512_fnmadd_ps(d, r, _mm512_set1_ps(2.0f)));
}

INLINE vm vlt(vf a, vf b) { return _mm512_cmp_ps_mask(a, b, _CMP_LT_OQ); }
INLINE vm vgt(vf a, vf b) { return _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ); }
INLINE vm vge_or_nan(vf a, vf b) { return _mm512_cmp_ps_mask(a, b, _CMP_NLT_UQ); }
INLINE vm visnan(vf a) { return _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q); }
INLINE vm veq(vf a, vf b) { return _mm512_cmp_ps_mask(a, b, _CMP_EQ_OQ); }
INLINE vm vm_and(vm a, vm b) { return a & b; }
INLINE vm vm_or(vm a, vm b) { return a | b; }
INLINE vm vm_tail(int64_t left) { return tail_mask(left); }
INLINE vm vm_none(void) { return 0; }
INLINE unsigned vm_bits(vm m) { return (unsigned)m; }
INLINE vf vsel(vm m, vf a, vf b) { return _mm512_mask_blend_ps(m, b, a); } /* m ? a : b */

INLINE vi vi_iota(int32_t start) {
    return _mm512_add_epi32(_mm512_set1_epi32(start), _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
}
INLINE vi vi_zero(void) { return _mm512_setzero_si512(); }
INLINE vi vi_sel(vm m, vi a, vi b) { return _mm512_mask_blend_epi32(m, b, a); }
INLINE int32_t vi_min_where(vm m, vi v) { return _mm512_mask_reduce_min_epi32(m, v); }
/* round-to-nearest int32, stored as saturated int16 in lanes [0, left) */
INLINE void vstore_i16(int16_t *p, vf v, int64_t left) {
    _mm256_mask_storeu_epi16(p, tail_mask(left), _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(v)));
}

/* VL stored KV bytes as floats, before their scale (as vec_avx2.h's). */
INLINE vf vload_kv8(const uint8_t *p, int kind) {
    __m128i b = _mm_loadu_si128((const __m128i *)p);
    if (kind == KV_INT8) return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
    if (kind == KV_FP8_E5M2) return _mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(b), 8));
    __m512i x = _mm512_cvtepu8_epi32(b);
    __m512i mag = _mm512_and_si512(x, _mm512_set1_epi32(0x7F));
    __m512i sign = _mm512_slli_epi32(_mm512_and_si512(x, _mm512_set1_epi32(0x80)), 24);
    vf normal = _mm512_castsi512_ps(_mm512_add_epi32(_mm512_slli_epi32(mag, 20), _mm512_set1_epi32(120 << 23)));
    vf sub = _mm512_mul_ps(_mm512_cvtepi32_ps(mag), _mm512_set1_ps(1.0f / 512));
    vf r = _mm512_mask_blend_ps(_mm512_cmplt_epi32_mask(mag, _mm512_set1_epi32(8)), normal, sub);
    return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(r), sign));
}
