/* GGUF weights multiplied straight from their quantized blocks, so the engine can memory-map a
 * GGUF file and run its tensors with no float copy of them.
 *
 * Types (ggml ids): Q4_0 (2), Q4_1 (3), Q5_0 (6), Q5_1 (7), Q8_0 (8): blocks of 32 values with
 * an f16 scale (and min); Q4_K (12), Q5_K (13), Q6_K (14): super-blocks of 256 values in 8 (16
 * for Q6_K) sub-blocks with small integer scales under an f16 one; F32 (0), F16 (1), BF16 (30).
 * Byte layouts as gguf-py's quants.py reads them (summarised next to gg_decode32 below).
 *
 * The linear runs integer dot products: each activation row is quantized once per call to int8
 * with a float scale per 32 values for the legacy types and per 256 for the K types, as llama.cpp
 * quantizes activations (Q8_0 / Q8_K), and the sums of each 16 of its int8 values (for the
 * formats whose values carry an offset or a min). A weight block's quants meet the int8
 * activations as u8 x s8 multiply-adds (vpmaddubsw + vpmaddwd, or VNNI vpdpbusd where built
 * with it). A legacy block's int32 sum is scaled in float by (weight scale x activation scale);
 * a K sub-block's small integer scale multiplies in as vpmaddwd's operand, so the int32 sums of
 * a super-block add up and are scaled once (GG_INT_SCALED: two instructions a block and row,
 * where the float scaling took four).
 * The offsets (Q4_0's -8, Q5_0's -16, Q6_K's -32) and mins (Q4_1, Q5_1, Q4_K, Q5_K) come in
 * once per 8 blocks through the activation sums. vpmaddubsw adds product pairs in int16 with
 * saturation: the unsigned quants are at most 63, so a pair is at most 2 * 63 * 127; Q8_0's
 * signed weights run as |w| x (x * sign w), at most 2 * 128 * 127. Times a sub-block scale
 * (|sc| <= 127) and summed over a super-block, an int32 lane stays under 2^26. The AVX-512 build
 * runs the same 256-bit code (with VNNI where it has it); the portable C build decodes each
 * block to integers and runs plain loops.
 *
 * Threads take blocks of 16 weight rows (one sequential stream each at one activation row);
 * activation rows go in passes that fit L2, each a pass over W.
 *
 * Batch independence: activation rows go through in tiles of up to 4, each weight block decoded
 * once per tile, but each row has its own accumulators and every (row, output) takes the same
 * operations in the same order whatever the tile: a row's result does not depend on m or on
 * where it falls in the batch (the engine promises a request's output does not depend on its
 * batch). The float accumulation order is fixed per build; builds differ from each other. */
#include "common.h"

enum {
    GG_F32 = 0, GG_F16 = 1, GG_Q4_0 = 2, GG_Q4_1 = 3, GG_Q5_0 = 6, GG_Q5_1 = 7, GG_Q8_0 = 8,
    GG_Q4_K = 12, GG_Q5_K = 13, GG_Q6_K = 14, GG_BF16 = 30,
};

/* values per block: 32 (legacy), 256 (K super-blocks), 1 (float types), 0 (not supported) */
static int gg_block_values(int type) {
    switch (type) {
        case GG_Q4_0: case GG_Q4_1: case GG_Q5_0: case GG_Q5_1: case GG_Q8_0: return 32;
        case GG_Q4_K: case GG_Q5_K: case GG_Q6_K: return 256;
        case GG_F32: case GG_F16: case GG_BF16: return 1;
        default: return 0;
    }
}

static int gg_quantized(int type) { return gg_block_values(type) > 1; }

/* IEEE half to float, exact (subnormals, inf and NaN included): F16C where built with it, the
 * same values in plain C elsewhere */
INLINE float gg_half(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#ifdef __F16C__
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 31u, mant = h & 1023u, u;
    if (e == 0) {
        float f = (float)mant * 5.9604644775390625e-8f; /* mant * 2^-24, exact */
        return sign ? -f : f;
    }
    u = e == 31 ? sign | 0x7F800000u | (mant << 13) : sign | ((e + 112u) << 23) | (mant << 13);
    float f;
    memcpy(&f, &u, 4);
    return f;
#endif
}

INLINE uint32_t gg_u32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* Q4_K / Q5_K: the 12 scale bytes hold 8 six-bit scales and 8 six-bit mins. Bytes 0-3: scales
 * 0-3 in bits 0-5, bits 6-7 the top of scales 4-7; bytes 4-7: mins 0-3, bits 6-7 the top of
 * mins 4-7; bytes 8-11: low nibble the bottom of scales 4-7, high nibble of mins 4-7. Worked
 * on 4 bytes at once: sc[0..3], sc[4..7], mn[0..3], mn[4..7] as little-endian words. */
INLINE void gg_k_scales(const uint8_t *s12, uint32_t *sc_lo, uint32_t *sc_hi, uint32_t *mn_lo, uint32_t *mn_hi) {
    uint32_t u0 = gg_u32(s12), u1 = gg_u32(s12 + 4), u2 = gg_u32(s12 + 8);
    *sc_lo = u0 & 0x3F3F3F3Fu;
    *mn_lo = u1 & 0x3F3F3F3Fu;
    *sc_hi = (u2 & 0x0F0F0F0Fu) | ((u0 >> 2) & 0x30303030u); /* a byte's bits 6-7 to bits 4-5 */
    *mn_hi = ((u2 >> 4) & 0x0F0F0F0Fu) | ((u1 >> 2) & 0x30303030u);
}

/* ---------- one block of 32 values, in scalar C ----------
 * Layouts (offsets in bytes; f16 = IEEE half; 32 values a block, value i):
 *   Q4_0 [18]: d f16, qs[16]; q = nibble (i < 16: low of qs[i], else high of qs[i - 16]); d (q - 8)
 *   Q4_1 [20]: d, m, qs[16]; d q + m
 *   Q5_0 [22]: d, qh u32, qs[16]; q = nibble | bit i of qh << 4; d (q - 16)
 *   Q5_1 [24]: d, m, qh u32, qs[16]; d q + m
 *   Q8_0 [34]: d, qs[32] int8; d q
 * K super-blocks of 256, sub-block s (values 32 s + i):
 *   Q4_K [144]: d, dmin, scales[12], qs[128]; q = qs[32 (s / 2) + i], low nibble for even s;
 *               (d sc[s]) q - dmin mn[s]
 *   Q5_K [176]: d, dmin, scales[12], qh[32], qs[128]; as Q4_K, | (bit s of qh[i]) << 4
 *   Q6_K [210]: ql[128], qh[64], sc[16] int8, d; half h = s / 4, t = s % 4: q = nibble t / 2 of
 *               ql[64 h + 32 (t % 2) + i] | (bits 2t, 2t+1 of qh[32 h + i]) << 4;
 *               (d sc[2 s + i / 16]) (q - 32)
 * gg_blk holds a block as value i = (ds * sub[i / 16]) * q[i] (+ mc where has_min), the float
 * operations gguf-py's dequantize does, so pl_gguf_dequantize matches it exactly. */
typedef struct {
    int8_t q[32];
    int32_t sub[2];
    float ds, mc;
    int has_min;
} gg_blk;

static void gg_decode32(int type, const uint8_t *row, int64_t b, gg_blk *o) {
    o->sub[0] = o->sub[1] = 1;
    o->ds = o->mc = 0.0f;
    o->has_min = 0;
    switch (type) {
        case GG_Q4_0: case GG_Q4_1: case GG_Q5_0: case GG_Q5_1: {
            static const int size[8] = {0, 0, 18, 20, 0, 0, 22, 24};
            const uint8_t *blk = row + b * size[type];
            int has_min = type == GG_Q4_1 || type == GG_Q5_1, five = type == GG_Q5_0 || type == GG_Q5_1;
            const uint8_t *qs = blk + 2 + 2 * has_min + 4 * five;
            uint32_t qh = five ? gg_u32(blk + 2 + 2 * has_min) : 0;
            int off = has_min ? 0 : five ? 16 : 8;
            for (int i = 0; i < 16; i++) {
                o->q[i] = (int8_t)(((qs[i] & 15) | (((qh >> i) & 1) << 4)) - off);
                o->q[i + 16] = (int8_t)(((qs[i] >> 4) | (((qh >> (i + 16)) & 1) << 4)) - off);
            }
            o->ds = gg_half(blk);
            if (has_min) o->mc = gg_half(blk + 2), o->has_min = 1;
            return;
        }
        case GG_Q8_0: {
            const uint8_t *blk = row + b * 34;
            memcpy(o->q, blk + 2, 32);
            o->ds = gg_half(blk);
            return;
        }
        case GG_Q4_K: case GG_Q5_K: {
            int s = (int)(b % 8), five = type == GG_Q5_K;
            const uint8_t *blk = row + (b / 8) * (five ? 176 : 144);
            const uint8_t *qs = blk + (five ? 48 : 16) + 32 * (s / 2), *qh = blk + 16;
            for (int i = 0; i < 32; i++)
                o->q[i] = (int8_t)(((qs[i] >> (4 * (s % 2))) & 15) | (five ? ((qh[i] >> s) & 1) << 4 : 0));
            uint32_t w[4];
            gg_k_scales(blk + 4, &w[0], &w[1], &w[2], &w[3]);
            uint8_t sc[8], mn[8];
            memcpy(sc, &w[0], 4), memcpy(sc + 4, &w[1], 4), memcpy(mn, &w[2], 4), memcpy(mn + 4, &w[3], 4);
            o->ds = gg_half(blk) * (float)sc[s];
            o->mc = -(gg_half(blk + 2) * (float)mn[s]);
            o->has_min = 1;
            return;
        }
        case GG_Q6_K: {
            int s = (int)(b % 8), h = s / 4, t = s % 4;
            const uint8_t *blk = row + (b / 8) * 210;
            const uint8_t *ql = blk + 64 * h + 32 * (t % 2), *qh = blk + 128 + 32 * h;
            for (int i = 0; i < 32; i++)
                o->q[i] = (int8_t)((((ql[i] >> (4 * (t / 2))) & 15) | (((qh[i] >> (2 * t)) & 3) << 4)) - 32);
            o->sub[0] = (int8_t)blk[192 + 2 * s];
            o->sub[1] = (int8_t)blk[192 + 2 * s + 1];
            o->ds = gg_half(blk + 208);
            return;
        }
        default: return;
    }
}

/* ---------- dequantize: rows of W to float32 / bf16 ---------- */

static void gg_dequantize_row(int type, const uint8_t *row, int64_t k, void *out, int out_bf16, int64_t o) {
    if (type == GG_F32) {
        for (int64_t c = 0; c < k; c++) {
            float v;
            memcpy(&v, row + 4 * c, 4);
            store1(out, out_bf16, o + c, v);
        }
    } else if (type == GG_F16) {
        for (int64_t c = 0; c < k; c++) store1(out, out_bf16, o + c, gg_half(row + 2 * c));
    } else if (type == GG_BF16) {
        for (int64_t c = 0; c < k; c++) {
            uint16_t v;
            memcpy(&v, row + 2 * c, 2);
            if (out_bf16) ((uint16_t *)out)[o + c] = v;
            else ((float *)out)[o + c] = bf16_scalar(v);
        }
    } else if (gg_quantized(type)) {
        gg_blk blk;
        for (int64_t b = 0; b < k / 32; b++) {
            gg_decode32(type, row, b, &blk);
            for (int e = 0; e < 32; e++) {
                float v = (blk.ds * (float)blk.sub[e / 16]) * (float)blk.q[e];
                if (blk.has_min) v = v + blk.mc;
                store1(out, out_bf16, o + 32 * b + e, v);
            }
        }
    }
}

void pl_gguf_dequantize(int type, const uint8_t *w, int64_t row_bytes, int64_t k, const int64_t *rows, int64_t count,
                        void *out, int out_bf16, int64_t ldo, int nthreads) {
    if (!gg_block_values(type) || k % gg_block_values(type)) return; /* gguf_ops checks these */
#pragma omp parallel for schedule(static) num_threads(nthreads) if (count * k >= (1 << 16))
    for (int64_t i = 0; i < count; i++)
        gg_dequantize_row(type, w + (rows ? rows[i] : i) * row_bytes, k, out, out_bf16, i * ldo);
}

/* ---------- activations: int8 blocks of 32 ----------
 * Per row, padded to whole groups of 8 blocks (256 values) with zeros: q (int8), d (each
 * block's scale, max |x| / 127 over the block, or over its group of 8 for the K types, then
 * the same in all 8), ds (d * the block's sum of q, for the mins), s16 (the sums of each 16 q,
 * for Q6_K's offset under its 16-value scales). Values under a scale that include inf or NaN
 * get d = NaN and q = 0: every output of the row is then NaN, as its float product would not
 * be finite either; quantizing them would hide that. */
typedef struct {
    int8_t *q;
    float *d, *ds;
    int16_t *s16;
    int64_t kq, nb8; /* per row: kq = groups * 256 values, nb8 = groups * 8 blocks */
    int group;       /* values under one scale: 32, or 256 for the K types (d repeated per block) */
} gg_act;

#if defined(PL_AVX512) || defined(PL_AVX2)
INLINE __m256 gg_load8(const void *x, int bf16, int64_t i) {
    if (bf16)
        return _mm256_castsi256_ps(
            _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)x + i))), 16));
    return _mm256_loadu_ps((const float *)x + i);
}

INLINE int32_t gg_hsum_i32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
}

static void gg_quantize_row(const void *x, int bf16, int64_t k, int group, int8_t *q, float *d, float *ds,
                            int16_t *s16) {
    const __m256 sign = _mm256_set1_ps(-0.0f), inf = _mm256_set1_ps(INFINITY);
    const int64_t per = group / 32; /* blocks under one scale */
    for (int64_t g = 0; g < k / 32; g += per) {
        __m256 amax = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
        for (int64_t b = g; b < g + per; b++)
            for (int j = 0; j < 4; j++) {
                __m256 a = _mm256_andnot_ps(sign, gg_load8(x, bf16, 32 * b + 8 * j));
                bad = _mm256_or_ps(bad, _mm256_cmp_ps(a, inf, _CMP_NLT_UQ)); /* inf or NaN */
                amax = _mm256_max_ps(amax, a);
            }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        float a = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
        int nonfinite = _mm256_movemask_ps(bad) != 0;
        float inv = !nonfinite && a > 0.0f ? 127.0f / a : 0.0f;
        inv = inv <= 1e30f ? inv : 0.0f; /* values under ~1e-28: zeros (not an inf scale) */
        __m256 vinv = _mm256_set1_ps(inv);
        for (int64_t b = g; b < g + per; b++) {
            __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(gg_load8(x, bf16, 32 * b), vinv));
            __m256i i1 = _mm256_cvtps_epi32(_mm256_mul_ps(gg_load8(x, bf16, 32 * b + 8), vinv));
            __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(gg_load8(x, bf16, 32 * b + 16), vinv));
            __m256i i3 = _mm256_cvtps_epi32(_mm256_mul_ps(gg_load8(x, bf16, 32 * b + 24), vinv));
            /* packs work per 128-bit half: dwords come out as values 0-3, 8-11, 16-19, 24-27, 4-7, ... */
            __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
            p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            _mm256_storeu_si256((__m256i *)(q + 32 * b), p);
            int32_t s0 = gg_hsum_i32(_mm256_add_epi32(i0, i1)), s1 = gg_hsum_i32(_mm256_add_epi32(i2, i3));
            s16[2 * b] = (int16_t)s0, s16[2 * b + 1] = (int16_t)s1;
            d[b] = nonfinite ? NAN : a / 127.0f;
            ds[b] = d[b] * (float)(s0 + s1);
        }
    }
}
#else
static void gg_quantize_row(const void *x, int bf16, int64_t k, int group, int8_t *q, float *d, float *ds,
                            int16_t *s16) {
    const int64_t per = group / 32;
    for (int64_t g = 0; g < k / 32; g += per) {
        float a = 0.0f;
        int nonfinite = 0;
        for (int64_t i = 32 * g; i < 32 * (g + per); i++) {
            float v = fabsf(load1(x, bf16, i));
            nonfinite |= !(v < INFINITY);
            a = v > a ? v : a;
        }
        float inv = !nonfinite && a > 0.0f ? 127.0f / a : 0.0f;
        inv = inv <= 1e30f ? inv : 0.0f; /* values under ~1e-28: zeros (not an inf scale) */
        for (int64_t b = g; b < g + per; b++) {
            int32_t s[2] = {0, 0};
            for (int i = 0; i < 32; i++) {
                float r = nearbyintf(load1(x, bf16, 32 * b + i) * inv);
                int v = (int)(r > 127.0f ? 127.0f : r < -127.0f ? -127.0f : r);
                q[32 * b + i] = (int8_t)v;
                s[i / 16] += v;
            }
            s16[2 * b] = (int16_t)s[0], s16[2 * b + 1] = (int16_t)s[1];
            d[b] = nonfinite ? NAN : a / 127.0f;
            ds[b] = d[b] * (float)(s[0] + s[1]);
        }
    }
}
#endif

/* Row r of x into a (called inside pl_gguf_linear's parallel region, or before it) */
static void gg_quantize(const void *x, int bf16, int64_t r, int64_t k, const gg_act *a) {
    int8_t *q = a->q + r * a->kq;
    float *d = a->d + r * a->nb8, *ds = a->ds + r * a->nb8;
    int16_t *s16 = a->s16 + r * 2 * a->nb8;
    gg_quantize_row(row_ptr(x, bf16, r * k), bf16, k, a->group, q, d, ds, s16);
    memset(q + k, 0, (size_t)(a->kq - k));
    for (int64_t b = k / 32; b < a->nb8; b++) d[b] = ds[b] = 0.0f, s16[2 * b] = s16[2 * b + 1] = 0;
}

/* ---------- one weight row against M <= 4 activation rows ---------- */

#define GG_TILE 4
#define GG_PREFETCH_BYTES 2048 /* how far ahead of the group in hand its row is prefetched */

#if defined(PL_AVX512) || defined(PL_AVX2)
/* 32 u8 x s8 products in 8 int32 lanes (each the sum of 4 neighbours) */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define GG_DOT(u, s) _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s)
#elif defined(__AVXVNNI__)
#define GG_DOT(u, s) _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s)
#else
#define GG_DOT(u, s) _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1))
#endif
/* The K types whose sub-block scales multiply in as vpmaddwd's int16 operand: their blocks' int32
 * sums add up over the super-block (whose activation scale is one), and one float scaling per
 * super-block follows. Q6_K on every build; Q4_K and Q5_K where vpdpbusd is not there to take
 * the products in one instruction (then scaled per block in float, as the legacy types are). */
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
#define GG_INT_SCALED(type) ((type) == GG_Q6_K)
#else
#define GG_INT_SCALED(type) ((type) == GG_Q4_K || (type) == GG_Q5_K || (type) == GG_Q6_K)
#endif

INLINE float gg_hsum(__m256 a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* 16 bytes of nibbles as values 0-15 (low nibbles) then 16-31 (high), one byte each: the bytes
 * loaded into both halves, the upper half shifted by 4 */
INLINE __m256i gg_nibbles16(const uint8_t *p) {
    __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)p));
    return _mm256_and_si256(_mm256_srlv_epi32(v, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4)), _mm256_set1_epi8(15));
}

/* bit i of qh as 0x10 in byte i */
INLINE __m256i gg_bits_to_16(uint32_t qh) {
    const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2,
                                            3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    __m256i v = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int)qh), spread), bit);
    return _mm256_and_si256(_mm256_cmpeq_epi8(v, bit), _mm256_set1_epi8(16));
}

/* The 8 f16 values at p, p + stride, ...: each loaded with the two bytes after it (still inside
 * its block) and merged in a tree of unpacks, not a serial chain of inserts. A short group (a
 * legacy row's last, nb < 8 blocks) reads only its own blocks; the rest are 0. */
INLINE __m256 gg_halves8(const uint8_t *p, int64_t stride, const int nb) {
    if (nb < 8) {
        uint16_t h[8] = {0};
        for (int i = 0; i < nb; i++) memcpy(&h[i], p + i * stride, 2);
        return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)h));
    }
    __m128i v[8];
    for (int i = 0; i < 8; i++) v[i] = _mm_cvtsi32_si128((int)gg_u32(p + i * stride));
    __m128i a = _mm_unpacklo_epi32(_mm_unpacklo_epi16(v[0], v[1]), _mm_unpacklo_epi16(v[2], v[3]));
    __m128i b = _mm_unpacklo_epi32(_mm_unpacklo_epi16(v[4], v[5]), _mm_unpacklo_epi16(v[6], v[7]));
    return _mm256_cvtph_ps(_mm_unpacklo_epi64(a, b));
}

/* gg_k_scales on vectors: bytes 0-7 the 8 scales, 8-15 the 8 mins. Reads 16 bytes (the 12
 * scale bytes and 4 after them, still in the super-block). */
INLINE __m128i gg_k_scales_vec(const uint8_t *s12) {
    __m128i u = _mm_loadu_si128((const __m128i *)s12);                                       /* u0, u1, u2, - */
    __m128i lo = _mm_and_si128(u, _mm_set1_epi8(0x3F));                                      /* sc 0-3, mn 0-3 */
    __m128i u2 = _mm_srlv_epi32(_mm_shuffle_epi32(u, 0xAA), _mm_setr_epi32(0, 4, 0, 4));      /* u2, u2 >> 4 */
    __m128i hi = _mm_or_si128(_mm_and_si128(u2, _mm_set1_epi8(0x0F)),
                              _mm_and_si128(_mm_srli_epi32(u, 2), _mm_set1_epi8(0x30)));      /* sc 4-7, mn 4-7 */
    return _mm_unpacklo_epi32(lo, hi);
}

/* Block b (0-7) of a group's quants as bytes: unsigned 0-63 (Q8_0: signed). grp: the group's
 * first byte (8 blocks of a legacy type, one K super-block). */
INLINE __m256i gg_quants(const int type, const uint8_t *grp, int b) {
    switch (type) {
        case GG_Q4_0: return gg_nibbles16(grp + b * 18 + 2);
        case GG_Q4_1: return gg_nibbles16(grp + b * 20 + 4);
        case GG_Q5_0: return _mm256_or_si256(gg_nibbles16(grp + b * 22 + 6), gg_bits_to_16(gg_u32(grp + b * 22 + 2)));
        case GG_Q5_1: return _mm256_or_si256(gg_nibbles16(grp + b * 24 + 8), gg_bits_to_16(gg_u32(grp + b * 24 + 4)));
        case GG_Q8_0: return _mm256_loadu_si256((const __m256i *)(grp + b * 34 + 2));
        case GG_Q4_K: case GG_Q5_K: {
            int five = type == GG_Q5_K;
            __m256i v = _mm256_loadu_si256((const __m256i *)(grp + (five ? 48 : 16) + 32 * (b / 2)));
            if (b % 2) v = _mm256_srli_epi16(v, 4);
            v = _mm256_and_si256(v, _mm256_set1_epi8(15));
            if (five) {
                __m256i h = _mm256_loadu_si256((const __m256i *)(grp + 16));
                h = _mm256_and_si256(_mm256_srli_epi16(h, b), _mm256_set1_epi8(1));
                v = _mm256_or_si256(v, _mm256_slli_epi16(h, 4));
            }
            return v;
        }
        default: { /* GG_Q6_K */
            int h = b / 4, t = b % 4;
            __m256i v = _mm256_loadu_si256((const __m256i *)(grp + 64 * h + 32 * (t % 2)));
            if (t / 2) v = _mm256_srli_epi16(v, 4);
            v = _mm256_and_si256(v, _mm256_set1_epi8(15));
            __m256i hb = _mm256_loadu_si256((const __m256i *)(grp + 128 + 32 * h));
            /* bits 2t, 2t + 1 to bits 4, 5: a shift by 4 - 2t (16-bit lanes: what crosses into the
             * neighbouring byte lands outside the mask) */
            hb = t < 2 ? _mm256_slli_epi16(hb, 4 - 2 * t) : t == 3 ? _mm256_srli_epi16(hb, 2) : hb;
            return _mm256_or_si256(v, _mm256_and_si256(hb, _mm256_set1_epi8(0x30)));
        }
    }
}

/* One group (256 values; nb < 8 blocks for a legacy row's short last group) of a weight row
 * against M activation rows (their group's int8 values at xq, kq apart; block scales at xd and
 * d * sums at xds, nb8 apart; 16-value sums at xs16, 2 nb8 apart). D = each block's weight scale, S[r] = D * the row's block scales (stored, then
 * broadcast per block), and the offset/min term Mn * the row's ds (Q6_K: its 16-value scales
 * times the row's 16-value sums, times -32 d xd). Per block: the int32 lanes of its 32
 * products, converted and multiplied by S[r][b] into acc[2 r + b % 2]. */
INLINE void gg_group(const int type, const int M, const uint8_t *grp, int64_t gbytes, const int nb,
                     const int8_t *xq, int64_t kq, const float *xd, const float *xds, const int16_t *xs16, int64_t nb8,
                     __m256 *acc) {
    float S[GG_TILE * 8];
    /* The weight stream runs ahead in software too: ~15% more of the bandwidth one thread gets
     * (11-12 GB/s without on an AVX2 EPYC, up to ~14 with), as a row is one sequential stream
     * that the hardware prefetchers alone follow too late. */
    for (int64_t off = 0; nb == 8 && off < gbytes; off += 64)
        _mm_prefetch((const char *)grp + GG_PREFETCH_BYTES + off, _MM_HINT_T0);
    __m256 D, Mn = _mm256_setzero_ps();
    __m128i sc6 = _mm_setzero_si128();
    __m256i sc16 = _mm256_setzero_si256(); /* Q4_K / Q5_K sub-block scales as int16, in both halves */
    float dsup = 0.0f;     /* a K super-block's own scale */
    switch (type) {
        case GG_Q4_0: D = gg_halves8(grp, 18, nb), Mn = _mm256_mul_ps(D, _mm256_set1_ps(-8.0f)); break;
        case GG_Q5_0: D = gg_halves8(grp, 22, nb), Mn = _mm256_mul_ps(D, _mm256_set1_ps(-16.0f)); break;
        case GG_Q4_1: D = gg_halves8(grp, 20, nb), Mn = gg_halves8(grp + 2, 20, nb); break;
        case GG_Q5_1: D = gg_halves8(grp, 24, nb), Mn = gg_halves8(grp + 2, 24, nb); break;
        case GG_Q8_0: D = gg_halves8(grp, 34, nb); break;
        case GG_Q4_K: case GG_Q5_K: {
            __m128i scmn = gg_k_scales_vec(grp + 4);
            sc16 = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(scmn));
            dsup = gg_half(grp);
            __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(scmn));
            __m256 mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(scmn, 8)));
            __m256 dm = _mm256_castps128_ps256(_mm_cvtph_ps(_mm_cvtsi32_si128((int)gg_u32(grp)))); /* d, dmin */
            D = _mm256_mul_ps(_mm256_permutevar8x32_ps(dm, _mm256_setzero_si256()), sc);
            Mn = _mm256_mul_ps(_mm256_permutevar8x32_ps(dm, _mm256_set1_epi32(1)), mn);
            Mn = _mm256_xor_ps(Mn, _mm256_set1_ps(-0.0f)); /* -(dmin mn), as gguf-py subtracts it */
            break;
        }
        default: /* GG_Q6_K */
            dsup = gg_half(grp + 208);
            D = _mm256_set1_ps(dsup);
            Mn = _mm256_mul_ps(D, _mm256_set1_ps(-32.0f));
            sc6 = _mm_loadu_si128((const __m128i *)(grp + 192));
            break;
    }
    for (int r = 0; r < M; r++) {
        __m256 xdv = _mm256_loadu_ps(xd + r * nb8);
        _mm256_storeu_ps(S + 8 * r, _mm256_mul_ps(D, xdv));
        if (type == GG_Q6_K) {
            __m256i xs = _mm256_loadu_si256((const __m256i *)(xs16 + r * 2 * nb8));
            __m256i o = _mm256_madd_epi16(_mm256_cvtepi8_epi16(sc6), xs); /* block b: sc . its two 16-value sums */
            acc[2 * r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(o), _mm256_mul_ps(Mn, xdv), acc[2 * r]);
        } else if (type != GG_Q8_0) {
            acc[2 * r] = _mm256_fmadd_ps(Mn, _mm256_loadu_ps(xds + r * nb8), acc[2 * r]);
        }
    }
    __m256i iacc[GG_TILE];
    for (int r = 0; r < M; r++) iacc[r] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int b = 0; b < 8; b++) {
        if (b >= nb) continue; /* only in a short group: a whole one has nb = 8, a constant */
        __m256i w = gg_quants(type, grp, b), wabs = w, scv = w;
        if (type == GG_Q8_0) wabs = _mm256_abs_epi8(w);
        if (type == GG_Q6_K) { /* sc[2b] for values 0-15, sc[2b+1] for 16-31, as int16 */
            const __m128i two = _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
            __m128i pick = _mm_add_epi8(two, _mm_set1_epi8((char)(2 * b)));
            scv = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(sc6, pick));
        } else if (GG_INT_SCALED(type)) { /* int16 lane b everywhere (a shuffle: no store and reload) */
            scv = _mm256_shuffle_epi8(sc16, _mm256_set1_epi16((short)(0x0100 + 0x0202 * b)));
        }
        if (GG_INT_SCALED(type)) {
            for (int r = 0; r < M; r++) {
                __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + r * kq + 32 * b));
                iacc[r] = _mm256_add_epi32(iacc[r], _mm256_madd_epi16(_mm256_maddubs_epi16(w, xv), scv));
            }
            continue;
        }
        for (int r = 0; r < M; r++) {
            __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + r * kq + 32 * b)), p;
            if (type == GG_Q8_0) p = GG_DOT(wabs, _mm256_sign_epi8(xv, w));
            else if (type == GG_Q6_K) p = _mm256_madd_epi16(_mm256_maddubs_epi16(w, xv), scv);
            else p = GG_DOT(w, xv);
            __m256 *ac = &acc[2 * r + b % 2];
            *ac = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_broadcast_ss(S + 8 * r + b), *ac);
        }
    }
    if (GG_INT_SCALED(type)) /* one activation scale per super-block: xd's 8 entries are equal */
        for (int r = 0; r < M; r++)
            acc[2 * r + 1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(iacc[r]), _mm256_set1_ps(dsup * xd[r * nb8]),
                                             acc[2 * r + 1]);
}

/* out[r] = activation row r0 + r . W row, for r < M. Two accumulators a row, for its even and
 * odd blocks (the min terms go into the first): two chains of dependent FMAs, so that one row
 * alone is not bound by their latency, and 4 rows' 8 accumulators, a decoded block and the
 * constants still fit the 16 registers. out = the sum of their lanes. A legacy row whose
 * blocks do not fill its last group runs it as a short group (reading nothing past the row). */
INLINE void gg_row(const int type, const int M, const uint8_t *row, const gg_act *a, int64_t r0, int64_t nblk,
                   float *out) {
    const int kquant = type == GG_Q4_K || type == GG_Q5_K || type == GG_Q6_K;
    const int64_t bytes32 = type == GG_Q4_0   ? 18
                            : type == GG_Q4_1 ? 20
                            : type == GG_Q5_0 ? 22
                            : type == GG_Q5_1 ? 24
                                              : 34; /* a legacy block */
    const int64_t gbytes = type == GG_Q4_K ? 144 : type == GG_Q5_K ? 176 : type == GG_Q6_K ? 210 : 8 * bytes32;
    __m256 acc[2 * GG_TILE];
    for (int r = 0; r < 2 * M; r++) acc[r] = _mm256_setzero_ps();
    const int8_t *xq = a->q + r0 * a->kq;
    const float *xd = a->d + r0 * a->nb8, *xds = a->ds + r0 * a->nb8;
    const int16_t *xs16 = a->s16 + r0 * 2 * a->nb8;
    int64_t g = 0;
    for (; g < nblk / 8; g++)
        gg_group(type, M, row + g * gbytes, gbytes, 8, xq + 256 * g, a->kq, xd + 8 * g, xds + 8 * g, xs16 + 16 * g,
                 a->nb8, acc);
    if (!kquant && g * 8 < nblk) /* the activations' padding past the row is zeros (and its scales) */
        gg_group(type, M, row + g * gbytes, gbytes, (int)(nblk - 8 * g), xq + 256 * g, a->kq, xd + 8 * g, xds + 8 * g,
                 xs16 + 16 * g, a->nb8, acc);
    for (int r = 0; r < M; r++) out[r] = gg_hsum(_mm256_add_ps(acc[2 * r], acc[2 * r + 1]));
}
#else
/* Portable C: each block decoded to integers once (gg_decode32) and met by every row */
INLINE void gg_row(const int type, const int M, const uint8_t *row, const gg_act *a, int64_t r0, int64_t nblk,
                   float *out) {
    float acc[GG_TILE], macc[GG_TILE];
    for (int r = 0; r < M; r++) acc[r] = macc[r] = 0.0f;
    gg_blk blk;
    for (int64_t b = 0; b < nblk; b++) {
        gg_decode32(type, row, b, &blk);
        for (int r = 0; r < M; r++) {
            const int8_t *x = a->q + (r0 + r) * a->kq + 32 * b;
            int32_t s0 = 0, s1 = 0;
            for (int i = 0; i < 16; i++) s0 += blk.q[i] * x[i], s1 += blk.q[i + 16] * x[i + 16];
            float xd = a->d[(r0 + r) * a->nb8 + b];
            acc[r] += (blk.ds * xd) * (float)(blk.sub[0] * s0 + blk.sub[1] * s1);
            if (blk.has_min) macc[r] += blk.mc * a->ds[(r0 + r) * a->nb8 + b];
        }
    }
    for (int r = 0; r < M; r++) out[r] = acc[r] + macc[r];
}
#endif

/* The row functions, one per (type, M): the type and the row count constant in each. */
typedef void (*gg_row_fn)(const uint8_t *, const gg_act *, int64_t, int64_t, float *);
#define GG_ROW_FN(name, T, M)                                                                \
    static void name##_##M(const uint8_t *w, const gg_act *a, int64_t r0, int64_t nb, float *o) { \
        gg_row(T, M, w, a, r0, nb, o);                                                       \
    }
#define GG_ROW_FNS(name, T) GG_ROW_FN(name, T, 1) GG_ROW_FN(name, T, 2) GG_ROW_FN(name, T, 3) GG_ROW_FN(name, T, 4)
GG_ROW_FNS(gg_q4_0, GG_Q4_0)
GG_ROW_FNS(gg_q4_1, GG_Q4_1)
GG_ROW_FNS(gg_q5_0, GG_Q5_0)
GG_ROW_FNS(gg_q5_1, GG_Q5_1)
GG_ROW_FNS(gg_q8_0, GG_Q8_0)
GG_ROW_FNS(gg_q4_k, GG_Q4_K)
GG_ROW_FNS(gg_q5_k, GG_Q5_K)
GG_ROW_FNS(gg_q6_k, GG_Q6_K)
#define GG_FNS(name) {name##_1, name##_2, name##_3, name##_4}

static const gg_row_fn *gg_row_fns(int type) {
    static const gg_row_fn q4_0[4] = GG_FNS(gg_q4_0), q4_1[4] = GG_FNS(gg_q4_1), q5_0[4] = GG_FNS(gg_q5_0),
                           q5_1[4] = GG_FNS(gg_q5_1), q8_0[4] = GG_FNS(gg_q8_0), q4_k[4] = GG_FNS(gg_q4_k),
                           q5_k[4] = GG_FNS(gg_q5_k), q6_k[4] = GG_FNS(gg_q6_k);
    switch (type) {
        case GG_Q4_0: return q4_0;
        case GG_Q4_1: return q4_1;
        case GG_Q5_0: return q5_0;
        case GG_Q5_1: return q5_1;
        case GG_Q8_0: return q8_0;
        case GG_Q4_K: return q4_k;
        case GG_Q5_K: return q5_k;
        case GG_Q6_K: return q6_k;
        default: return NULL;
    }
}

/* ---------- float weights (F32 / F16 / BF16): each row widened once, then float dots ---------- */
static void gg_float_linear(int type, const uint8_t *w, int64_t row_bytes, int64_t n, int64_t k, const void *x,
                            int x_bf16, int64_t m, const void *bias, void *y, int y_bf16, int64_t ldy, int nthreads) {
#pragma omp parallel num_threads(nthreads)
    {
        float *wrow = aligned_alloc(64, (size_t)((k + 63) / 64 * 64) * sizeof(float));
#pragma omp for schedule(static)
        for (int64_t j = 0; j < n; j++) {
            gg_dequantize_row(type, w + j * row_bytes, k, wrow, 0, 0);
            float b = bias ? load1(bias, y_bf16, j) : 0.0f;
            for (int64_t r = 0; r < m; r++) {
                const void *xr = row_ptr(x, x_bf16, r * k);
                vf acc = vzero();
                for (int64_t i = 0; i < k; i += VL)
                    acc = vfmadd(vload(xr, x_bf16, i, k - i), vloadf(wrow + i, k - i), acc);
                store1(y, y_bf16, r * ldy + j, vhsum(acc) + b);
            }
        }
        free(wrow);
    }
}

/* ---------- the linear ---------- */

#define GG_WEIGHT_BLOCK 16                 /* weight rows a thread takes at a time */
#define GG_ACT_BYTES ((int64_t)256 * 1024) /* activation rows per pass over W: about this much int8 (L2) */

void pl_gguf_linear(int type, const uint8_t *w, int64_t row_bytes, int64_t n, int64_t k, const void *x, int x_bf16,
                    int64_t m, const void *bias, void *y, int y_bf16, int64_t ldy, int nthreads) {
    if (m <= 0 || n <= 0 || !gg_block_values(type) || k % gg_block_values(type)) return; /* gguf_ops checks */
    if (type == GG_F32 || type == GG_F16 || type == GG_BF16) {
        gg_float_linear(type, w, row_bytes, n, k, x, x_bf16, m, bias, y, y_bf16, ldy, nthreads);
        return;
    }
    const gg_row_fn *fns = gg_row_fns(type);
    if (!fns) return;
    int64_t nblk = k / 32, nb8 = (nblk + 7) / 8 * 8;
    int kquant = type == GG_Q4_K || type == GG_Q5_K || type == GG_Q6_K;
    gg_act a = {.kq = nb8 * 32, .nb8 = nb8, .group = kquant ? 256 : 32};
    a.q = aligned_alloc(64, (size_t)(m * a.kq));
    a.d = aligned_alloc(64, (size_t)((m * nb8 * sizeof(float) + 63) / 64 * 64));
    a.ds = aligned_alloc(64, (size_t)((m * nb8 * sizeof(float) + 63) / 64 * 64));
    a.s16 = aligned_alloc(64, (size_t)((m * nb8 * 2 * sizeof(int16_t) + 63) / 64 * 64));
    int64_t pass = GG_ACT_BYTES / a.kq / GG_TILE * GG_TILE;
    if (pass < GG_TILE) pass = GG_TILE;
    int64_t wblocks = (n + GG_WEIGHT_BLOCK - 1) / GG_WEIGHT_BLOCK;
    /* One parallel region for the call (on a shared machine every fork and join waits for
     * whichever thread another process holds): the activations quantized (a few rows, before
     * it), one barrier, then a pass over W per block of activation rows, with no barrier
     * between passes (each writes its own rows of y). */
    int quantize_in_region = m >= GG_TILE;
    if (!quantize_in_region)
        for (int64_t r = 0; r < m; r++) gg_quantize(x, x_bf16, r, k, &a);
#pragma omp parallel num_threads(nthreads)
    {
        if (quantize_in_region) {
#pragma omp for schedule(static)
            for (int64_t r = 0; r < m; r++) gg_quantize(x, x_bf16, r, k, &a);
        }
        for (int64_t rb = 0; rb < m; rb += pass) {
            int64_t re = rb + pass < m ? rb + pass : m;
#pragma omp for schedule(static) nowait
            for (int64_t wb = 0; wb < wblocks; wb++) {
                int64_t j0 = wb * GG_WEIGHT_BLOCK, j1 = j0 + GG_WEIGHT_BLOCK < n ? j0 + GG_WEIGHT_BLOCK : n;
                for (int64_t r0 = rb; r0 < re; r0 += GG_TILE) {
                    int M = re - r0 < GG_TILE ? (int)(re - r0) : GG_TILE;
                    for (int64_t j = j0; j < j1; j++) {
                        float out[GG_TILE];
                        fns[M - 1](w + j * row_bytes, &a, r0, nblk, out);
                        float b = bias ? load1(bias, y_bf16, j) : 0.0f;
                        for (int r = 0; r < M; r++) store1(y, y_bf16, (r0 + r) * ldy + j, out[r] + b);
                    }
                }
            }
        }
    }
    free(a.s16);
    free(a.ds);
    free(a.d);
    free(a.q);
}
