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
 * quantizes activations (Q8_0 / Q8_K), with the sums of each 16 and each 32 of its int8 values.
 * A weight block's quants meet the int8 activations as u8 x s8 multiply-adds (vpmaddubsw +
 * vpmaddwd, or VNNI vpdpbusd for the legacy types where built with it). Each unit of a row (a
 * legacy block of 32, a K super-block of 256) ends as exact integers first: the sum of its
 * products, a K sub-block's small scale multiplied in as vpmaddwd's int16 operand; an offset
 * (Q4_0's 8, Q5_0's 16, Q6_K's 32 under its sub-block scales) taken off as offset x the
 * activations' sums; for a min (Q4_1, Q5_1, Q4_K, Q5_K) the activations' sums (times Q4_K /
 * Q5_K's integer mins) as a second integer. Then floats, once per unit: float(sum) x (weight
 * scale x activation scale), and float(min sum) x (min x activation scale).
 *
 * vpmaddubsw adds product pairs in int16 with saturation: the unsigned quants are at most 63, so
 * a pair is at most 2 * 63 * 127; Q8_0's signed weights run as |w| x (x * sign w), at most 2 *
 * 128 * 127. The panels below add those int16 pairs over as many steps as stay under 2^15 (8
 * for 4-bit quants: 8 * 2 * 15 * 127 = 30,480; 4 for 5-bit; 2 for 6-bit; 1 for Q8_0) before one
 * vpmaddwd. A unit's integer sum stays under 2^29. The AVX-512 build runs the same 256-bit code
 * (with VNNI where it has it); the portable C build decodes each block to integers and runs
 * plain loops.
 *
 * Two ways through W. For a few activation rows, threads take blocks of 16 weight rows (one
 * sequential stream each), each weight row decoded once per 4 activation rows (gg_row); rows go
 * in passes that fit L2. From GG_PANEL_ROWS activation rows on (GG_X8_PANEL_ROWS for a repacked
 * weight, whose x8 kernels keep up longer), threads take panels of 8 weight
 * rows, decoded once into bytes interleaved 4 values a row, which every activation row then
 * meets (gg_panel_tile, gguf_panel.c): a decoded step serves 8 outputs, no horizontal sums.
 * A Q4_K / Q6_K / Q5_0 / Q4_0 weight repacked at load 8 rows side by side (gguf_x8.c; type | GG_X8)
 * takes the x8 kernels for a few rows and panels built straight from its units for many.
 *
 * Batch independence: both ways take the same float operations, in the same order, for every
 * (row, output): unit u's terms go into lane u % 8 of the row's accumulator, and the 8 lanes add
 * up in gg_hsum's order. A row's result does not depend on m or on where it falls in the batch
 * (the engine promises a request's output does not depend on its batch). The float
 * accumulation order is fixed per build; builds differ from each other. */
#include "gguf_blocks.h"

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

/* ---------- re-scoring an LM head's candidates from its blocks ----------
 * logits[r, idx[r, j]] = hidden[r] . row idx[r, j] of W for j < topk, in float32: each row
 * dequantized as pl_gguf_dequantize gives it in hidden's dtype (a bf16 model's weights are bf16
 * values), into a thread's buffer, then one dot product, as pl_rescore_logits takes a float
 * weight's. A task is one (row, candidate): its value depends on nothing else in the batch. */
void pl_gguf_rescore(int type, const uint8_t *w, int64_t row_bytes, int64_t k, const void *hidden, int h_bf16,
                     int64_t rows, const int64_t *idx, int64_t topk, void *logits, int l_bf16, int64_t vocab,
                     int nthreads) {
    if (!gg_block_values(type) || k % gg_block_values(type)) return; /* gguf_ops checks these */
#pragma omp parallel num_threads(nthreads) if (rows * topk * k >= (1 << 16))
    {
        void *buf = aligned_alloc(64, (size_t)(4 * k + 63) / 64 * 64);
#pragma omp for schedule(static)
        for (int64_t rj = 0; rj < rows * topk; rj++) {
            int64_t r = rj / topk, id = idx[rj];
            gg_dequantize_row(type, w + id * row_bytes, k, buf, h_bf16, 0);
            store1(logits, l_bf16, r * vocab + id, vdot(hidden, h_bf16, r * k, buf, h_bf16, 0, k));
        }
        free(buf);
    }
}

/* ---------- activations: int8 blocks of 32 (gg_act, gguf_blocks.h) ---------- */
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
    int16_t *s16 = a->s16 + r * 2 * a->nb8, *b32 = a->b32 + r * a->nb8;
    gg_quantize_row(row_ptr(x, bf16, r * k), bf16, k, a->group, q, d, ds, s16);
    memset(q + k, 0, (size_t)(a->kq - k));
    for (int64_t b = k / 32; b < a->nb8; b++) d[b] = ds[b] = 0.0f, s16[2 * b] = s16[2 * b + 1] = 0;
    for (int64_t b = 0; b < a->nb8; b++) b32[b] = (int16_t)(s16[2 * b] + s16[2 * b + 1]);
}

/* ---------- one weight row against M <= 4 activation rows ---------- */

#if GG_PANELS
/* Integer sums of 8 vectors, vector j's in lane j (exact, whatever the order). */
INLINE __m256i gg_reduce8(const __m256i *v) {
    __m256i p[4];
    for (int i = 0; i < 4; i++)
        p[i] = _mm256_add_epi32(_mm256_unpacklo_epi32(v[2 * i], v[2 * i + 1]),
                                _mm256_unpackhi_epi32(v[2 * i], v[2 * i + 1]));
    __m256i lo = _mm256_add_epi32(_mm256_unpacklo_epi64(p[0], p[1]), _mm256_unpackhi_epi64(p[0], p[1]));
    __m256i hi = _mm256_add_epi32(_mm256_unpacklo_epi64(p[2], p[3]), _mm256_unpackhi_epi64(p[2], p[3]));
    return _mm256_add_epi32(_mm256_permute2x128_si256(lo, hi, 0x20), _mm256_permute2x128_si256(lo, hi, 0x31));
}

/* The 8 int16 block sums at p as int32 */
INLINE __m256i gg_sums8(const int16_t *p) { return _mm256_cvtepi16_epi32(_mm_loadu_si128((const __m128i *)p)); }


/* A legacy group (nb <= 8 blocks of 32) of a weight row against M activation rows: per row, the
 * blocks' exact integer sums I[b] (the offset taken off as off * the block's activation sum),
 * then acc[b] += float(I[b]) * (d[b] * xd[b]) (+ float(sum[b]) * (m[b] * xd[b]) for a min). */
INLINE void gg_legacy_group(const int type, const int M, const uint8_t *grp, int64_t gbytes, const int nb,
                            const gg_act *a, int64_t r0, int64_t g, __m256 *acc) {
    const int64_t bytes32 = gbytes / 8;
    for (int64_t off = 0; nb == 8 && off < gbytes; off += 64)
        _mm_prefetch((const char *)grp + GG_PREFETCH_BYTES + off, _MM_HINT_T0);
    __m256i dots[GG_TILE][8];
#pragma GCC unroll 8
    for (int b = 0; b < 8; b++) {
        if (b >= nb) { /* a short group's missing blocks: nothing (their lanes add zeros) */
            for (int r = 0; r < M; r++) dots[r][b] = _mm256_setzero_si256();
            continue;
        }
        __m256i w = gg_quants(type, grp, b), wabs = w;
        if (type == GG_Q8_0) wabs = _mm256_abs_epi8(w);
        for (int r = 0; r < M; r++) {
            __m256i xv = _mm256_loadu_si256((const __m256i *)(a->q + (r0 + r) * a->kq + 256 * g + 32 * b));
            dots[r][b] = type == GG_Q8_0 ? GG_DOT(wabs, _mm256_sign_epi8(xv, w)) : GG_DOT(w, xv);
        }
    }
    __m256 D = gg_halves8(grp, bytes32, nb), Mw = _mm256_setzero_ps();
    if (GG_HAS_MIN(type)) Mw = gg_halves8(grp + 2, bytes32, nb);
    for (int r = 0; r < M; r++) {
        __m256i I = gg_reduce8(dots[r]), sums = gg_sums8(a->b32 + (r0 + r) * a->nb8 + 8 * g);
        if (GG_OFFSET(type)) I = _mm256_sub_epi32(I, _mm256_mullo_epi32(sums, _mm256_set1_epi32(GG_OFFSET(type))));
        __m256 xd = _mm256_loadu_ps(a->d + (r0 + r) * a->nb8 + 8 * g);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(I), _mm256_mul_ps(D, xd), acc[r]);
        if (GG_HAS_MIN(type)) acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_mul_ps(Mw, xd), acc[r]);
    }
}

/* A K super-block of a weight row against M activation rows: the integer sum of its sub-blocks,
 * each sub-block's scale as vpmaddwd's operand, into I[r] (Q6_K's offset, 32 * its scales times
 * the activations' 16-value sums, taken off), and for Q4_K / Q5_K the mins times the activations'
 * 32-value sums into Imin[r] (its f16 scales: gg_k_scales8). Lanes: not yet summed (gg_reduce8
 * sums them, 8 super-blocks at once). */
INLINE void gg_k_group(const int type, const int M, const uint8_t *grp, int64_t gbytes, const gg_act *a, int64_t r0,
                       int64_t g, __m256i *I, __m256i *Imin) {
    for (int64_t off = 0; off < gbytes; off += 64)
        _mm_prefetch((const char *)grp + GG_PREFETCH_BYTES + off, _MM_HINT_T0);
    __m128i sc6 = _mm_setzero_si128(), scmn = _mm_setzero_si128();
    __m256i sc16 = _mm256_setzero_si256(); /* Q4_K / Q5_K sub-block scales as int16, in both halves */
    if (type == GG_Q6_K) {
        sc6 = _mm_loadu_si128((const __m128i *)(grp + 192));
    } else {
        scmn = gg_k_scales_vec(grp + 4);
        sc16 = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(scmn));
    }
    for (int r = 0; r < M; r++) I[r] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int b = 0; b < 8; b++) {
        __m256i w = gg_quants(type, grp, b), scv;
        if (type == GG_Q6_K) { /* sc[2b] for values 0-15, sc[2b+1] for 16-31, as int16 */
            const __m128i two = _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
            scv = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(sc6, _mm_add_epi8(two, _mm_set1_epi8((char)(2 * b)))));
        } else { /* int16 lane b everywhere (a shuffle: no store and reload) */
            scv = _mm256_shuffle_epi8(sc16, _mm256_set1_epi16((short)(0x0100 + 0x0202 * b)));
        }
        for (int r = 0; r < M; r++) {
            __m256i xv = _mm256_loadu_si256((const __m256i *)(a->q + (r0 + r) * a->kq + 256 * g + 32 * b));
            I[r] = _mm256_add_epi32(I[r], _mm256_madd_epi16(_mm256_maddubs_epi16(w, xv), scv));
        }
    }
    for (int r = 0; r < M; r++) {
        if (type == GG_Q6_K) { /* lane b: sc[2b] s16[2b] + sc[2b+1] s16[2b+1] */
            __m256i xs = _mm256_loadu_si256((const __m256i *)(a->s16 + (r0 + r) * 2 * a->nb8 + 16 * g));
            I[r] = _mm256_sub_epi32(I[r], _mm256_slli_epi32(_mm256_madd_epi16(_mm256_cvtepi8_epi16(sc6), xs), 5));
        } else {
            Imin[r] = _mm256_mullo_epi32(_mm256_cvtepu8_epi32(_mm_srli_si128(scmn, 8)),
                                         gg_sums8(a->b32 + (r0 + r) * a->nb8 + 8 * g));
        }
    }
}

/* The f16 scales of cnt (<= 8) consecutive K super-blocks from base: *D their d, *Dmin their
 * dmin negated (Q4_K / Q5_K), as gg_k_group reads them; lanes from cnt on are 0. */
INLINE void gg_k_scales8(const int type, const uint8_t *base, int64_t gbytes, int cnt, __m256 *D, __m256 *Dmin) {
    uint32_t u[8]; /* Q6_K: bytes 206-209 (d in the upper half, inside the block); else d | dmin << 16 */
    for (int i = 0; i < 8; i++) u[i] = i < cnt ? gg_u32(base + i * gbytes + (type == GG_Q6_K ? 206 : 0)) : 0;
    __m256i v = _mm256_setr_epi32((int)u[0], (int)u[1], (int)u[2], (int)u[3], (int)u[4], (int)u[5], (int)u[6],
                                  (int)u[7]);
    if (type == GG_Q6_K) {
        *D = gg_dword_halves(v, 1);
        *Dmin = _mm256_setzero_ps();
    } else {
        /* dmin negated as C's unary minus does (the sign bit flipped), in the lanes of blocks */
        __m256i sign = _mm256_and_si256(_mm256_set1_epi32((int)0x80000000u),
                                        _mm256_cmpgt_epi32(_mm256_set1_epi32(cnt), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
        *D = gg_dword_halves(v, 0);
        *Dmin = _mm256_xor_ps(gg_dword_halves(v, 1), _mm256_castsi256_ps(sign));
    }
}

/* x[0], x[stride], ... for the first cnt lanes, 0 in the rest */
INLINE __m256 gg_strided8(const float *x, int64_t stride, int cnt) {
    float v[8];
    for (int i = 0; i < 8; i++) v[i] = i < cnt ? x[i * stride] : 0.0f;
    return _mm256_setr_ps(v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7]);
}

/* out[r] = activation row r0 + r . W row, for r < M. The float arithmetic is a fixed function of
 * the row's integer sums: per unit u (a legacy block, or a K super-block) an exact int32 sum, and
 * lane u % 8 of acc takes float(sum) * (weight scale * activation scale) (and the min's term);
 * out = the lanes added in gg_hsum's order. gg_panel (many rows at once) takes the same
 * operations per (row, output), so a row's result does not depend on the batch it is in. */
INLINE void gg_row(const int type, const int M, const uint8_t *row, const gg_act *act, int64_t r0, int64_t nblk,
                   float *out) {
    /* a local copy: the vector stores below may alias anything, and would make every field of
     * *act a reload (and its addresses recomputed) for every super-block */
    const gg_act local = *act, *a = &local;
    const int64_t gbytes = GG_GROUP_BYTES(type);
    __m256 acc[GG_TILE];
    for (int r = 0; r < M; r++) acc[r] = _mm256_setzero_ps();
    if (!GG_KQUANT(type)) {
        for (int64_t g = 0; 8 * g < nblk; g++)
            gg_legacy_group(type, M, row + g * gbytes, gbytes, nblk - 8 * g < 8 ? (int)(nblk - 8 * g) : 8, a, r0, g,
                            acc);
    } else {
        const int64_t groups = nblk / 8;
        for (int64_t g0 = 0; g0 < groups; g0 += 8) {
            __m256i I[GG_TILE][8], Imin[GG_TILE][8];
            int cnt = groups - g0 < 8 ? (int)(groups - g0) : 8;
            for (int j = 0; j < 8; j++) {
                if (j >= cnt) { /* past the row: zeros, which add nothing */
                    for (int r = 0; r < M; r++) I[r][j] = Imin[r][j] = _mm256_setzero_si256();
                    continue;
                }
                __m256i Ij[GG_TILE], Imj[GG_TILE];
                gg_k_group(type, M, row + (g0 + j) * gbytes, gbytes, a, r0, g0 + j, Ij, Imj);
                for (int r = 0; r < M; r++)
                    I[r][j] = Ij[r], Imin[r][j] = type == GG_Q6_K ? _mm256_setzero_si256() : Imj[r];
            }
            /* the scales as vectors straight from the blocks and the activation scales (eight
             * scalar stores read back as one vector would wait on the stores) */
            __m256 D, Dmin;
            gg_k_scales8(type, row + g0 * gbytes, gbytes, cnt, &D, &Dmin);
            for (int r = 0; r < M; r++) {
                const float *xd = a->d + (r0 + r) * a->nb8 + 8 * g0;
                __m256 xdv = gg_strided8(xd, 8, cnt);
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(gg_reduce8(I[r])), _mm256_mul_ps(D, xdv), acc[r]);
                if (type != GG_Q6_K)
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(gg_reduce8(Imin[r])), _mm256_mul_ps(Dmin, xdv), acc[r]);
            }
        }
    }
    for (int r = 0; r < M; r++) out[r] = gg_hsum(acc[r]);
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
            for (int64_t r = 0; r < m; r++)
                store1(y, y_bf16, r * ldy + j, vdot(x, x_bf16, r * k, wrow, 0, 0, k) + b);
        }
        free(wrow);
    }
}

/* ---------- the linear ---------- */

/* Repacked rows j0 .. j1 (whole groups of 8) against activation rows r0 .. r0 + M into y: the
 * x8 kernels where built, else each group read back in the file's layout and run a row at a time */
static void gg_x8_group_rows(int type, int M, const uint8_t *w, int64_t row_bytes, int64_t j0, int64_t j1, int64_t nblk,
                             const gg_act *a, int64_t r0, const void *bias, void *y, int y_bf16, int64_t ldy,
                             const gg_row_fn *fns) {
    for (int64_t jg = j0; jg < j1; jg += 8) {
        float out[8 * GG_TILE];
#if GG_PANELS
        (void)fns;
        gg_x8_rows(type, M, w + jg * row_bytes, GG_X8_UNITS(type, nblk), a, r0, out);
#else
        const uint8_t *rows = gg_x8_file_rows(type, w + jg * row_bytes, row_bytes, GG_X8_UNITS(type, nblk));
        for (int c = 0; c < 8; c++) {
            float o[GG_TILE];
            fns[M - 1](rows + c * row_bytes, a, r0, nblk, o);
            for (int r = 0; r < M; r++) out[8 * r + c] = o[r];
        }
#endif
        for (int c = 0; c < 8; c++) {
            float b = bias ? load1(bias, y_bf16, jg + c) : 0.0f;
            for (int r = 0; r < M; r++) store1(y, y_bf16, (r0 + r) * ldy + jg + c, out[8 * r + c] + b);
        }
    }
}

#define GG_WEIGHT_BLOCK 16                 /* weight rows a thread takes at a time */
#define GG_ACT_BYTES ((int64_t)256 * 1024) /* activation rows per pass over W: about this much int8 (L2) */

void pl_gguf_linear(int type, const uint8_t *w, int64_t row_bytes, int64_t n, int64_t k, const void *x, int x_bf16,
                    int64_t m, const void *bias, void *y, int y_bf16, int64_t ldy, int nthreads) {
    const int x8 = (type & GG_X8) != 0;
    type &= ~GG_X8;
    if (m <= 0 || n <= 0 || !gg_block_values(type) || k % gg_block_values(type)) return; /* gguf_ops checks */
    if (x8 && (!gg_x8_type(type) || n % 8)) return;
    if (type == GG_F32 || type == GG_F16 || type == GG_BF16) {
        gg_float_linear(type, w, row_bytes, n, k, x, x_bf16, m, bias, y, y_bf16, ldy, nthreads);
        return;
    }
    const gg_row_fn *fns = gg_row_fns(type);
    if (!fns) return;
    int64_t nblk = k / 32, nb8 = (nblk + 7) / 8 * 8;
    gg_act a = {.kq = nb8 * 32, .nb8 = nb8, .group = GG_KQUANT(type) ? 256 : 32};
    size_t fbytes = (size_t)((m * nb8 * sizeof(float) + 63) / 64 * 64);
    a.q = aligned_alloc(64, (size_t)(m * a.kq));
    a.d = aligned_alloc(64, fbytes);
    a.ds = aligned_alloc(64, fbytes);
    a.s16 = aligned_alloc(64, (size_t)((m * nb8 * 2 * sizeof(int16_t) + 63) / 64 * 64));
    a.b32 = aligned_alloc(64, (size_t)((m * nb8 * sizeof(int16_t) + 63) / 64 * 64));
    int64_t pass = GG_ACT_BYTES / a.kq / GG_TILE * GG_TILE;
    if (pass < GG_TILE) pass = GG_TILE;
    int64_t wblocks = (n + GG_WEIGHT_BLOCK - 1) / GG_WEIGHT_BLOCK;
    int panels = GG_PANELS && m >= (x8 ? GG_X8_PANEL_ROWS : GG_PANEL_ROWS);
    /* One parallel region for the call (on a shared machine every fork and join waits for
     * whichever thread another process holds): the activations quantized (a few rows, before
     * it), one barrier, then a pass over W per block of activation rows, with no barrier
     * between passes (each writes its own rows of y); or, for many rows, the panels. */
    int quantize_in_region = m >= GG_TILE;
    if (!quantize_in_region)
        for (int64_t r = 0; r < m; r++) gg_quantize(x, x_bf16, r, k, &a);
#pragma omp parallel num_threads(nthreads)
    {
        if (quantize_in_region) {
#pragma omp for schedule(static)
            for (int64_t r = 0; r < m; r++) gg_quantize(x, x_bf16, r, k, &a);
        }
#if GG_PANELS
        if (panels) gg_panel_linear(type, x8, w, row_bytes, n, nblk, &a, m, bias, y, y_bf16, ldy);
#endif
        for (int64_t rb = 0; !panels && rb < m; rb += pass) {
            int64_t re = rb + pass < m ? rb + pass : m;
#pragma omp for schedule(static) nowait
            for (int64_t wb = 0; wb < wblocks; wb++) {
                int64_t j0 = wb * GG_WEIGHT_BLOCK, j1 = j0 + GG_WEIGHT_BLOCK < n ? j0 + GG_WEIGHT_BLOCK : n;
                for (int64_t r0 = rb; r0 < re; r0 += GG_TILE) {
                    int M = re - r0 < GG_TILE ? (int)(re - r0) : GG_TILE;
                    if (x8) {
                        gg_x8_group_rows(type, M, w, row_bytes, j0, j1, nblk, &a, r0, bias, y, y_bf16, ldy, fns);
                        continue;
                    }
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
    free(a.b32);
    free(a.s16);
    free(a.ds);
    free(a.d);
    free(a.q);
}
