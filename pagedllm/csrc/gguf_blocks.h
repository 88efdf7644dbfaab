/* GGUF blocks as pagedllm's kernels read them: the types and their scales, the activations'
 * int8 form, and (AVX2 / AVX-512 builds) a block's quants as bytes. Shared by gguf.c (dequantize;
 * the linear a weight row at a time) and gguf_panel.c (the linear for many activation rows). */
#ifndef PAGEDLLM_GGUF_BLOCKS_H
#define PAGEDLLM_GGUF_BLOCKS_H

#include "common.h"

enum {
    GG_F32 = 0, GG_F16 = 1, GG_Q4_0 = 2, GG_Q4_1 = 3, GG_Q5_0 = 6, GG_Q5_1 = 7, GG_Q8_0 = 8,
    GG_Q4_K = 12, GG_Q5_K = 13, GG_Q6_K = 14, GG_BF16 = 30,
    GG_X8 = 256, /* a flag on Q4_K / Q6_K / Q5_0 / Q4_0: the weight repacked 8 rows at a time (gguf_x8.c) */
};

/* values per block: 32 (legacy), 256 (K super-blocks), 1 (float types), 0 (not supported) */
INLINE int gg_block_values(int type) {
    switch (type) {
        case GG_Q4_0: case GG_Q4_1: case GG_Q5_0: case GG_Q5_1: case GG_Q8_0: return 32;
        case GG_Q4_K: case GG_Q5_K: case GG_Q6_K: return 256;
        case GG_F32: case GG_F16: case GG_BF16: return 1;
        default: return 0;
    }
}

INLINE int gg_quantized(int type) { return gg_block_values(type) > 1; }

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

/* ---------- activations: int8 blocks of 32 ----------
 * Per row, padded to whole groups of 8 blocks (256 values) with zeros: q (int8), d (each
 * block's scale, max |x| / 127 over the block, or over its group of 8 for the K types, then
 * the same in all 8), ds (d * the block's sum of q), s16 (the sums of each 16 q, for Q6_K's
 * offset under its 16-value scales), b32 (of each 32: the legacy offsets and mins, Q4_K / Q5_K's
 * mins). Values under a scale that include inf or NaN
 * get d = NaN and q = 0: every output of the row is then NaN, as its float product would not
 * be finite either; quantizing them would hide that. */
typedef struct {
    int8_t *q;
    float *d, *ds;
    int16_t *s16, *b32;
    int64_t kq, nb8; /* per row: kq = groups * 256 values, nb8 = groups * 8 blocks */
    int group;       /* values under one scale: 32, or 256 for the K types (d repeated per block) */
} gg_act;

#define GG_TILE 4              /* activation rows a kernel call takes at once */
#define GG_PANEL_ROWS 8        /* activation rows from which a call takes the panel path (where built) */
#define GG_X8_PANEL_ROWS 16    /* the same for a repacked weight (its x8 kernels run 4 rows a pass faster up to it) */
#define GG_PREFETCH_BYTES 2048 /* how far ahead of the group in hand a weight row is prefetched */
#define GG_OFFSET(type) ((type) == GG_Q4_0 ? 8 : (type) == GG_Q5_0 ? 16 : 0) /* the quants' offset */
#define GG_HAS_MIN(type) ((type) == GG_Q4_1 || (type) == GG_Q5_1 || (type) == GG_Q4_K || (type) == GG_Q5_K)
#define GG_KQUANT(type) ((type) == GG_Q4_K || (type) == GG_Q5_K || (type) == GG_Q6_K)
/* a legacy block's bytes, and a group's (8 legacy blocks, or one K super-block) */
#define GG_BYTES32(type) \
    ((type) == GG_Q4_0 ? 18 : (type) == GG_Q4_1 ? 20 : (type) == GG_Q5_0 ? 22 : (type) == GG_Q5_1 ? 24 : 34)
#define GG_GROUP_BYTES(type) \
    ((type) == GG_Q4_K ? 144 : (type) == GG_Q5_K ? 176 : (type) == GG_Q6_K ? 210 : 8 * GG_BYTES32(type))

/* ---------- the repacked layout (gguf_x8.c): where each byte of a row's block goes ---------- */
/* A unit's bytes: 8 rows' blocks (a K super-block, or a legacy block of 32), Q6_K's padded to
 * whole cache lines (8 x 210 = 1680 would put most of its 32-byte loads across two lines) */
enum { GG_X8_Q4_K_UNIT = 1152, GG_X8_Q6_K_UNIT = 1728, GG_X8_Q5_0_UNIT = 176, GG_X8_Q4_0_UNIT = 144 };
#define GG_X8_UNIT(type)                                                          \
    ((type) == GG_Q4_K ? GG_X8_Q4_K_UNIT : (type) == GG_Q6_K ? GG_X8_Q6_K_UNIT \
     : (type) == GG_Q5_0 ? GG_X8_Q5_0_UNIT : GG_X8_Q4_0_UNIT)
/* The types with a repacked layout (their kernels: gguf_x8.c) */
INLINE int gg_x8_type(int type) {
    return type == GG_Q4_K || type == GG_Q6_K || type == GG_Q5_0 || type == GG_Q4_0;
}
/* a row's block in a unit, and the units of a row of nblk blocks of 32 */
#define GG_X8_BLOCK_BYTES(type) (GG_KQUANT(type) ? GG_GROUP_BYTES(type) : GG_BYTES32(type))
#define GG_X8_UNITS(type, nblk) (GG_KQUANT(type) ? (nblk) / 8 : (nblk))
/* One piece of a block: `len` bytes at `src` of row r's block, at `dst` of the unit */
typedef struct {
    int16_t src, dst, len;
} gg_piece;

/* The pieces of row r's block in a repacked unit (the layout: gguf_x8.c): up to 1 + 3 + 32 (Q4_K),
 * 1 + 16 + 32 + 16 (Q6_K), 1 + 1 + 4 (Q5_0) or 1 + 4 (Q4_0) */
INLINE int gg_x8_pieces(int type, int r, gg_piece *p) {
    int n = 0;
    if (type == GG_Q4_0) {
        p[n++] = (gg_piece){0, (int16_t)(2 * r), 2};
        for (int c = 0; c < 4; c++) p[n++] = (gg_piece){(int16_t)(2 + 4 * c), (int16_t)(16 + 32 * c + 4 * r), 4};
    } else if (type == GG_Q5_0) {
        p[n++] = (gg_piece){0, (int16_t)(2 * r), 2};
        p[n++] = (gg_piece){2, (int16_t)(16 + 4 * r), 4};
        for (int c = 0; c < 4; c++) p[n++] = (gg_piece){(int16_t)(6 + 4 * c), (int16_t)(48 + 32 * c + 4 * r), 4};
    } else if (type == GG_Q4_K) {
        p[n++] = (gg_piece){0, (int16_t)(4 * r), 4};
        for (int w = 0; w < 3; w++) p[n++] = (gg_piece){(int16_t)(4 + 4 * w), (int16_t)(32 + 32 * w + 4 * r), 4};
        for (int c = 0; c < 32; c++) p[n++] = (gg_piece){(int16_t)(16 + 4 * c), (int16_t)(128 + 32 * c + 4 * r), 4};
    } else {
        p[n++] = (gg_piece){208, (int16_t)(2 * r), 2};
        for (int i = 0; i < 16; i++) p[n++] = (gg_piece){(int16_t)(192 + i), (int16_t)(16 + 8 * i + r), 1};
        for (int c = 0; c < 32; c++) /* ql quad c: half c / 16, chunk c / 8 % 2, quad c % 8 */
            p[n++] = (gg_piece){(int16_t)(4 * c), (int16_t)(144 + 96 * (8 * (c / 16) + c % 8) + 32 + 32 * (c / 8 % 2) + 4 * r), 4};
        for (int c = 0; c < 16; c++) /* qh quad c: half c / 8, quad c % 8 */
            p[n++] = (gg_piece){(int16_t)(128 + 4 * c), (int16_t)(144 + 96 * c + 4 * r), 4};
    }
    return n;
}

/* A piece's bytes (its sizes spelled out, so the copies compile to moves, not memcpy calls) */
INLINE void gg_piece_copy(uint8_t *dst, const uint8_t *src, int len) {
    switch (len) {
        case 4: memcpy(dst, src, 4); break;
        case 2: memcpy(dst, src, 2); break;
        default: *dst = *src;
    }
}

/* Row c's scale bytes (Q4_K: block bytes 0-15; Q6_K: 192-209) from a repacked unit into blk, at
 * their offsets in the file's block: gg_x8_pieces' first 4 (Q4_K) or 17 (Q6_K) pieces */
INLINE void gg_x8_header(int type, const uint8_t *unit, int c, uint8_t *blk) {
    if (type == GG_Q4_K) {
        for (int w = 0; w < 4; w++) memcpy(blk + 4 * w, unit + (w ? 32 * w : 0) + 4 * c, 4);
    } else {
        for (int i = 0; i < 16; i++) blk[192 + i] = unit[16 + 8 * i + c];
        memcpy(blk + 208, unit + 2 * c, 2);
    }
}

#if defined(PL_AVX512) || defined(PL_AVX2)
/* 32 u8 x s8 products in 8 int32 lanes (each the sum of 4 neighbours) */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define GG_VNNI 1
#define GG_DPBUSD(acc, u, s) _mm256_dpbusd_epi32(acc, u, s)
#define GG_DPWSSD(acc, a, b) _mm256_dpwssd_epi32(acc, a, b)
#elif defined(__AVXVNNI__)
#define GG_VNNI 1
#define GG_DPBUSD(acc, u, s) _mm256_dpbusd_avx_epi32(acc, u, s)
#define GG_DPWSSD(acc, a, b) _mm256_dpwssd_avx_epi32(acc, a, b)
#else
#define GG_VNNI 0
#define GG_DPBUSD(acc, u, s) \
    _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)))
#define GG_DPWSSD(acc, a, b) _mm256_add_epi32(acc, _mm256_madd_epi16(a, b))
#endif
#define GG_DOT(u, s) GG_DPBUSD(_mm256_setzero_si256(), u, s)

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

/* The f16 values in the low (hi = 0) or high halves of 8 dwords, as floats */
INLINE __m256 gg_dword_halves(__m256i v, int hi) {
    const __m256i pick = hi ? _mm256_setr_epi8(2, 3, 6, 7, 10, 11, 14, 15, -1, -1, -1, -1, -1, -1, -1, -1, 2, 3, 6, 7,
                                               10, 11, 14, 15, -1, -1, -1, -1, -1, -1, -1, -1)
                            : _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1, 0, 1, 4, 5,
                                               8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1);
    return _mm256_cvtph_ps(_mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_shuffle_epi8(v, pick), 0x08)));
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

/* 8 vectors of 8 int32 transposed: dword s of vector c to dword c of out[s] */
INLINE void gg_transpose8(const __m256i *in, __m256i *out) {
    __m256i t[8], u[8];
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm256_unpacklo_epi32(in[2 * i], in[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_epi32(in[2 * i], in[2 * i + 1]);
    }
    for (int i = 0; i < 2; i++) {
        u[4 * i] = _mm256_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 1] = _mm256_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 2] = _mm256_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm256_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int i = 0; i < 4; i++) {
        out[i] = _mm256_permute2x128_si256(u[i], u[4 + i], 0x20);
        out[4 + i] = _mm256_permute2x128_si256(u[i], u[4 + i], 0x31);
    }
}

/* Step (sub-block b, quad j) of a repacked Q4_K / Q6_K unit: values 4j .. 4j + 3 of sub-block b
 * of rows 0-7, 4 bytes a row (what gg_quants gives a row at a time); a Q5_0 / Q4_0 unit is one
 * block (b = 0) */
INLINE __m256i gg_x8_step(const int type, const uint8_t *unit, int b, int j) {
    const __m256i m4 = _mm256_set1_epi8(15);
    if (type == GG_Q4_0 || type == GG_Q5_0) { /* nibbles: quad j % 4 of qs, low for j < 4 */
        __m256i v = _mm256_loadu_si256((const __m256i *)(unit + (type == GG_Q5_0 ? 48 : 16) + 32 * (j % 4)));
        v = _mm256_and_si256(j < 4 ? v : _mm256_srli_epi16(v, 4), m4);
        if (type == GG_Q4_0) return v;
        /* Q5_0's fifth bits: byte s of each row's reordered qh holds value 4j + s's at bit j;
         * moved to bit 4 (16-bit shifts: no other byte's bit lands there) */
        __m256i h = _mm256_loadu_si256((const __m256i *)(unit + 16));
        h = j <= 4 ? _mm256_slli_epi16(h, 4 - j) : _mm256_srli_epi16(h, j - 4);
        return _mm256_or_si256(v, _mm256_and_si256(h, _mm256_set1_epi8(16)));
    }
    if (type == GG_Q4_K) {
        __m256i v = _mm256_loadu_si256((const __m256i *)(unit + 128 + 32 * (8 * (b / 2) + j)));
        return _mm256_and_si256(b % 2 ? _mm256_srli_epi16(v, 4) : v, m4);
    }
    const int h = b / 4, t = b % 4;
    __m256i qh = _mm256_loadu_si256((const __m256i *)(unit + 144 + 96 * (8 * h + j)));
    __m256i v = _mm256_loadu_si256((const __m256i *)(unit + 144 + 96 * (8 * h + j) + 32 + 32 * (t % 2)));
    v = _mm256_and_si256(t / 2 ? _mm256_srli_epi16(v, 4) : v, m4);
    qh = t < 2 ? _mm256_slli_epi16(qh, 4 - 2 * t) : t == 3 ? _mm256_srli_epi16(qh, 2) : qh;
    return _mm256_or_si256(v, _mm256_and_si256(qh, _mm256_set1_epi8(0x30)));
}
#endif

#if defined(PL_AVX512) || defined(PL_AVX2)
#define GG_PANELS 1
/* gguf_panel.c: outputs [0, n) for m >= GG_PANEL_ROWS activation rows (quantized in a), run by
 * every thread of pl_gguf_linear's parallel region (an orphaned omp for over panels of W's rows);
 * x8: W repacked (gguf_x8.c), each panel read back in the file's layout first. */
void gg_panel_linear(int type, int x8, const uint8_t *w, int64_t row_bytes, int64_t n, int64_t nblk,
                     const gg_act *a, int64_t m, const void *bias, void *y, int y_bf16, int64_t ldy);
#else
#define GG_PANELS 0
#endif

/* gguf_x8.c: a group of 8 repacked rows (at grp, nsb units each) back in the file's
 * layout, row r at the result + r * row_bytes (a thread's buffer, valid until its next call) */
const uint8_t *gg_x8_file_rows(int type, const uint8_t *grp, int64_t row_bytes, int64_t nsb);
#if GG_PANELS
/* out[8 r + c] = activation row r0 + r . repacked row c of the group, r < M <= GG_TILE: the
 * same bits as gg_row on the row in the file's layout */
void gg_x8_rows(int type, int M, const uint8_t *grp, int64_t nsb, const gg_act *a, int64_t r0, float *out);
#endif

#endif /* PAGEDLLM_GGUF_BLOCKS_H */
