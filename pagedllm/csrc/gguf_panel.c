/* The GGUF linear for many activation rows: weight panels decoded once, then integer GEMM tiles.
 * From GG_PANEL_ROWS activation rows on, a thread takes 8 weight rows (a panel) at a time,
 * decodes their quants once into bytes interleaved 4 values a row (8 rows x 4 values = one
 * vector: "a step"), with their scales laid out as vectors over the 8 rows, and then runs every
 * activation row against it: 4 activation values broadcast, one vpmaddubsw per step and row, the
 * int16 products summed over as many steps as cannot overflow (a span: 8 for 4-bit quants, 4 for
 * 5-bit, 2 for 6-bit) before one vpmaddwd by the span's scale. With VNNI a step is one vpdpbusd
 * into int32 instead, and a K sub-block's sum is multiplied by its scale once (vpmulld); with
 * AVX-512's 32 registers a tile runs two panels (16 outputs) against each broadcast.
 * Decoding costs once per panel instead of once per 4 activation rows, and a step serves 8
 * outputs with no horizontal sums.
 * The per-unit integer sums are gg_row's, and so are the float operations on them. */
#include "gguf_blocks.h"

#if GG_PANELS
#define GG_NR 8                 /* weight rows in a panel */
#define GG_SLOT_Q 2048          /* a panel's group: quants, 64 steps x 32 bytes */
#define GG_SLOT_SC 512          /* int16 scale pairs by span unit: up to 16 x 16 lanes */
#define GG_SLOT_PAIR 256        /* int16 pairs for the mins / Q6_K's offset: 8 x 16 lanes */
#define GG_SLOT_F 512           /* float scales by unit (legacy: 8 blocks x 8 rows; then the mins) */
#define GG_SLOT (GG_SLOT_Q + GG_SLOT_SC + GG_SLOT_PAIR + GG_SLOT_F)
/* Panels a tile runs at once. Two share each activation broadcast (4 rows x 16 outputs: 8 sums
 * and 8 sub-block sums in flight), which takes AVX-512's 32 vector registers; 16 hold one. */
#if GG_VNNI && defined(__AVX512VL__)
#define GG_NP 2
#else
#define GG_NP 1
#endif

/* Row c's scales (its group at grp, nb blocks of it in the row) into a panel slot: Q6_K's 16 and
 * Q4_K / Q5_K's 8 sub-block scales as int16 pairs by unit (sc), the mins or Q6_K's scales in
 * pairs (pair), the f16 scales as floats (f) */
static void gg_panel_scales(const int type, const uint8_t *grp, int c, int nb, uint8_t *slot) {
    const int64_t bytes32 = GG_BYTES32(type);
    int16_t *sc = (int16_t *)(slot + GG_SLOT_Q), *pair = (int16_t *)(slot + GG_SLOT_Q + GG_SLOT_SC);
    float *f = (float *)(slot + GG_SLOT_Q + GG_SLOT_SC + GG_SLOT_PAIR);
    if (type == GG_Q6_K) {
        const int8_t *s = (const int8_t *)(grp + 192);
        for (int u = 0; u < 16; u++) sc[16 * u + 2 * c] = sc[16 * u + 2 * c + 1] = s[u];
        for (int i = 0; i < 8; i++) pair[16 * i + 2 * c] = s[2 * i], pair[16 * i + 2 * c + 1] = s[2 * i + 1];
        f[c] = gg_half(grp + 208);
    } else if (GG_KQUANT(type)) {
        uint32_t v[4];
        uint8_t scs[8], mns[8];
        gg_k_scales(grp + 4, &v[0], &v[1], &v[2], &v[3]);
        memcpy(scs, &v[0], 4), memcpy(scs + 4, &v[1], 4), memcpy(mns, &v[2], 4), memcpy(mns + 4, &v[3], 4);
        for (int u = 0; u < 8; u++) sc[16 * u + 2 * c] = sc[16 * u + 2 * c + 1] = scs[u];
        for (int i = 0; i < 4; i++) pair[16 * i + 2 * c] = mns[2 * i], pair[16 * i + 2 * c + 1] = mns[2 * i + 1];
        f[c] = gg_half(grp), f[8 + c] = -gg_half(grp + 2);
    } else {
        for (int b = 0; b < nb; b++) {
            f[8 * b + c] = gg_half(grp + b * bytes32);
            if (GG_HAS_MIN(type)) f[64 + 8 * b + c] = gg_half(grp + b * bytes32 + 2);
        }
    }
}

/* Weight rows w[0 .. cols) (cols <= 8; the rest zeros) into the panel: per group a slot of
 * GG_SLOT bytes. rowbuf: 8 x kq bytes, each row's quants decoded in order first (one sequential
 * stream a row), then transposed into steps. */
static void gg_panel_build(const int type, const uint8_t *w, int64_t row_bytes, int cols, int64_t nblk, int64_t kq,
                           uint8_t *panel, uint8_t *rowbuf) {
    const int64_t gbytes = GG_GROUP_BYTES(type);
    const int64_t groups = (nblk + 7) / 8;
    /* a full panel writes every byte its tile reads; a short one's missing lanes are zeros */
    if (cols < GG_NR) memset(panel, 0, (size_t)(groups * GG_SLOT));
    for (int c = 0; c < GG_NR; c++) {
        uint8_t *dst = rowbuf + c * kq;
        if (c >= cols) {
            memset(dst, 0, (size_t)kq);
            continue;
        }
        const uint8_t *row = w + c * row_bytes;
        for (int64_t g = 0; g < groups; g++) {
            const uint8_t *grp = row + g * gbytes;
            uint8_t *slot = panel + g * GG_SLOT;
            int nb = nblk - 8 * g < 8 ? (int)(nblk - 8 * g) : 8;
            for (int b = 0; b < nb; b++)
                _mm256_storeu_si256((__m256i *)(dst + 256 * g + 32 * b), gg_quants(type, grp, b));
            for (int b = nb; b < 8; b++) _mm256_storeu_si256((__m256i *)(dst + 256 * g + 32 * b), _mm256_setzero_si256());
            gg_panel_scales(type, grp, c, nb, slot);
        }
    }
    for (int64_t g = 0; g < groups; g++)
        for (int b = 0; b < 8; b++) {
            __m256i in[8], out[8];
            for (int c = 0; c < GG_NR; c++) in[c] = _mm256_loadu_si256((const __m256i *)(rowbuf + c * kq + 256 * g + 32 * b));
            gg_transpose8(in, out);
            for (int s = 0; s < 8; s++) _mm256_store_si256((__m256i *)(panel + g * GG_SLOT + 256 * b + 32 * s), out[s]);
        }
}

/* A repacked group of 8 rows (gguf_x8.c) into the panel: its quants are already the panel's
 * steps, 4 bytes a row; the scales are read back a row at a time. Q5_0's and Q4_0's units are
 * blocks, 8 to a panel group (a short last group's missing blocks: zero steps, as gg_panel_build
 * leaves them). */
static void gg_panel_build_x8(const int type, const uint8_t *grp8, int64_t nblk, uint8_t *panel) {
    const int64_t ubytes = GG_X8_UNIT(type);
    if (!GG_KQUANT(type)) {
        const int64_t bytes32 = GG_BYTES32(type);
        for (int64_t g = 0; g < (nblk + 7) / 8; g++) {
            uint8_t *slot = panel + g * GG_SLOT, blk[GG_GROUP_BYTES(GG_Q5_0)]; /* the widest legacy group */
            const int nb = nblk - 8 * g < 8 ? (int)(nblk - 8 * g) : 8;
            for (int b = 0; b < 8; b++)
                for (int j = 0; j < 8; j++)
                    _mm256_store_si256((__m256i *)(slot + 256 * b + 32 * j),
                                       b < nb ? gg_x8_step(type, grp8 + (8 * g + b) * ubytes, 0, j) : _mm256_setzero_si256());
            for (int c = 0; c < GG_NR; c++) {
                for (int b = 0; b < nb; b++) memcpy(blk + bytes32 * b, grp8 + (8 * g + b) * ubytes + 2 * c, 2);
                gg_panel_scales(type, blk, c, nb, slot);
            }
        }
        return;
    }
    for (int64_t g = 0; g < nblk / 8; g++) {
        const uint8_t *unit = grp8 + g * ubytes;
        uint8_t *slot = panel + g * GG_SLOT, blk[210];
        for (int b = 0; b < 8; b++)
            for (int j = 0; j < 8; j++)
                _mm256_store_si256((__m256i *)(slot + 256 * b + 32 * j), gg_x8_step(type, unit, b, j));
        for (int c = 0; c < GG_NR; c++) {
            gg_x8_header(type, unit, c, blk);
            gg_panel_scales(type, blk, c, 8, slot);
        }
    }
}

/* Steps t0 .. t0 + n of a group's panel against M activation rows (xq[r]: the group's values),
 * into the int16 sums s16[r] (one vpmaddubsw + vpaddw a step) */
INLINE void gg_panel_steps(const int M, const uint8_t *q, const int8_t *const *xq, int t0, int n, __m256i *s16) {
#pragma GCC unroll 2
    for (int t = t0; t < t0 + n; t++) {
        __m256i w = _mm256_load_si256((const __m256i *)(q + 32 * t));
        for (int r = 0; r < M; r++) {
            int32_t x4;
            memcpy(&x4, xq[r] + 4 * t, 4);
            s16[r] = _mm256_add_epi16(s16[r], _mm256_maddubs_epi16(w, _mm256_set1_epi32(x4)));
        }
    }
}

INLINE __m256i gg_panel_dot(const int type, __m256i acc, __m256i w, __m256i xb) {
    if (type == GG_Q8_0) return GG_DPBUSD(acc, _mm256_abs_epi8(w), _mm256_sign_epi8(xb, w));
    return GG_DPBUSD(acc, w, xb);
}

/* The same steps (n a multiple of 4) of NP panels (q[p]: their groups) straight into int32 sums,
 * one vpdpbusd a step with VNNI (and for Q8_0, whose products do not fit int16 pairs, always).
 * A row's 16 activation bytes for 4 steps are loaded once into both halves and each step's 4
 * broadcast by vpshufd: a broadcast load per step and row leaves the loads, not the multiplies,
 * the limit. The sums: panel p's in i32[GG_TILE * p + r]; with one panel the odd steps go to a
 * second chain, i32[GG_TILE + r], which the caller adds (a vpdpbusd waits for the one before it
 * on its accumulator). The same exact integers as the int16 route. */
INLINE void gg_panel_dots(const int type, const int M, const int NP, const uint8_t *const *q, const int8_t *const *xq,
                          int t0, int n, __m256i *i32) {
    for (int t = t0; t < t0 + n; t += 4) {
        __m256i w[GG_NP][4];
        for (int p = 0; p < NP; p++)
            for (int s = 0; s < 4; s++) w[p][s] = _mm256_load_si256((const __m256i *)(q[p] + 32 * (t + s)));
        for (int r = 0; r < M; r++) {
            __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(xq[r] + 4 * t)));
            __m256i xb[4] = {_mm256_shuffle_epi32(v, 0x00), _mm256_shuffle_epi32(v, 0x55),
                             _mm256_shuffle_epi32(v, 0xAA), _mm256_shuffle_epi32(v, 0xFF)};
            for (int s = 0; s < 4; s++)
                for (int p = 0; p < NP; p++) {
                    int k = GG_TILE * (NP == 1 ? s % 2 : p) + r;
                    i32[k] = gg_panel_dot(type, i32[k], w[p][s], xb[s]);
                }
        }
    }
}

/* M activation rows (r0 ..) against NP decoded panels (panel + p * pstride): A[8 (GG_TILE p + r)
 * + lane] are the float accumulators of row r and panel p, lanes the panel's 8 outputs, indexed
 * by unit % 8 as gg_row's lanes are. Each output's integer sums and float operations are the
 * same whatever NP. */
INLINE void gg_panel_tile(const int type, const int M, const int NP, const uint8_t *panel, int64_t pstride,
                          const gg_act *a, int64_t r0, int64_t nblk, __m256 *A) {
    const int span = type == GG_Q6_K ? 2 : (type == GG_Q5_0 || type == GG_Q5_1 || type == GG_Q5_K) ? 4 : 8;
    const __m256i ones = _mm256_set1_epi16(1);
    for (int p = 0; p < NP; p++)
#pragma GCC unroll 32 /* stores, not a rep stos: its start-up is most of a short row's tile */
        for (int i = 0; i < 8 * M; i++) A[8 * GG_TILE * p + i] = _mm256_setzero_ps();
    for (int64_t g = 0; 8 * g < nblk; g++) {
        const uint8_t *slot[GG_NP];
        const __m256i *sc[GG_NP], *pair[GG_NP];
        const float *f[GG_NP];
        for (int p = 0; p < NP; p++) {
            slot[p] = panel + p * pstride + g * GG_SLOT;
            sc[p] = (const __m256i *)(slot[p] + GG_SLOT_Q), pair[p] = (const __m256i *)(slot[p] + GG_SLOT_Q + GG_SLOT_SC);
            f[p] = (const float *)(slot[p] + GG_SLOT_Q + GG_SLOT_SC + GG_SLOT_PAIR);
        }
        const int8_t *xq[GG_TILE];
        const float *xd[GG_TILE];
        const int16_t *b32[GG_TILE];
        for (int r = 0; r < M; r++) {
            xq[r] = a->q + (r0 + r) * a->kq + 256 * g;
            xd[r] = a->d + (r0 + r) * a->nb8 + 8 * g;
            b32[r] = a->b32 + (r0 + r) * a->nb8 + 8 * g;
        }
        __m256i s16[GG_TILE], i32[2 * GG_TILE];
        if (!GG_KQUANT(type)) {
            int nb = nblk - 8 * g < 8 ? (int)(nblk - 8 * g) : 8;
            for (int b = 0; b < nb; b++) {
                for (int r = 0; r < 2 * GG_TILE; r++) i32[r] = _mm256_setzero_si256();
                if (GG_VNNI || type == GG_Q8_0) {
                    gg_panel_dots(type, M, NP, slot, xq, 8 * b, 8, i32);
                    for (int r = 0; NP == 1 && r < M; r++) i32[r] = _mm256_add_epi32(i32[r], i32[GG_TILE + r]);
                } else {
                    for (int t = 8 * b; t < 8 * b + 8; t += span) {
                        for (int r = 0; r < M; r++) s16[r] = _mm256_setzero_si256();
                        gg_panel_steps(M, slot[0], xq, t, span, s16);
                        for (int r = 0; r < M; r++) i32[r] = _mm256_add_epi32(i32[r], _mm256_madd_epi16(s16[r], ones));
                    }
                }
                for (int p = 0; p < NP; p++) {
                    __m256 D = _mm256_load_ps(f[p] + 8 * b);
                    for (int r = 0; r < M; r++) {
                        __m256 *acc = A + 8 * (GG_TILE * p + r) + b;
                        int32_t bs = b32[r][b];
                        __m256i I = i32[GG_TILE * p + r];
                        if (GG_OFFSET(type)) I = _mm256_sub_epi32(I, _mm256_set1_epi32(GG_OFFSET(type) * bs));
                        __m256 xdv = _mm256_set1_ps(xd[r][b]);
                        *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(I), _mm256_mul_ps(D, xdv), *acc);
                        if (GG_HAS_MIN(type))
                            *acc = _mm256_fmadd_ps(_mm256_set1_ps((float)bs),
                                                   _mm256_mul_ps(_mm256_load_ps(f[p] + 64 + 8 * b), xdv), *acc);
                    }
                }
            }
            continue;
        }
        const int unit = type == GG_Q6_K ? 4 : 8; /* steps under one sub-block scale */
        for (int r = 0; r < 2 * GG_TILE; r++) i32[r] = _mm256_setzero_si256();
        /* With VNNI, a sub-block's sums in int32, times its scale (the int16 pair's upper half,
         * sign-extended: Q6_K's scales are signed) */
        if (GG_VNNI) {
#pragma GCC unroll 1
            for (int t = 0; t < 64; t += unit) {
                __m256i u32[2 * GG_TILE];
                for (int r = 0; r < 2 * GG_TILE; r++) u32[r] = _mm256_setzero_si256();
                gg_panel_dots(type, M, NP, slot, xq, t, unit, u32);
                for (int p = 0; p < NP; p++) {
                    __m256i scv = _mm256_srai_epi32(_mm256_load_si256(sc[p] + t / unit), 16);
                    for (int r = 0; r < M; r++) {
                        __m256i s = NP == 1 ? _mm256_add_epi32(u32[r], u32[GG_TILE + r]) : u32[GG_TILE * p + r];
                        i32[GG_TILE * p + r] = _mm256_add_epi32(i32[GG_TILE * p + r], _mm256_mullo_epi32(s, scv));
                    }
                }
            }
        } else {
#pragma GCC unroll 1
            for (int t = 0; t < 64; t += span) {
                for (int r = 0; r < M; r++) s16[r] = _mm256_setzero_si256();
                gg_panel_steps(M, slot[0], xq, t, span, s16);
                __m256i scv = _mm256_load_si256(sc[0] + t / unit);
                for (int r = 0; r < M; r++) i32[r] = _mm256_add_epi32(i32[r], _mm256_madd_epi16(s16[r], scv));
            }
        }
        for (int p = 0; p < NP; p++) {
            __m256 D = _mm256_load_ps(f[p]);
            for (int r = 0; r < M; r++) {
                __m256 *acc = A + 8 * (GG_TILE * p + r) + g % 8;
                __m256 xdv = _mm256_set1_ps(xd[r][0]);
                __m256i I = i32[GG_TILE * p + r];
                if (type == GG_Q6_K) { /* 32 * sum of sc[u] * the activations' 16-value sums */
                    const int16_t *x16 = a->s16 + (r0 + r) * 2 * a->nb8 + 16 * g;
                    __m256i o = _mm256_setzero_si256();
                    for (int i = 0; i < 8; i++) {
                        int32_t v;
                        memcpy(&v, x16 + 2 * i, 4);
                        o = GG_DPWSSD(o, _mm256_load_si256(pair[p] + i), _mm256_set1_epi32(v));
                    }
                    I = _mm256_sub_epi32(I, _mm256_slli_epi32(o, 5));
                }
                *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(I), _mm256_mul_ps(D, xdv), *acc);
                if (type != GG_Q6_K) {
                    __m256i mn = _mm256_setzero_si256();
                    for (int i = 0; i < 4; i++) {
                        int32_t v;
                        memcpy(&v, b32[r] + 2 * i, 4);
                        mn = GG_DPWSSD(mn, _mm256_load_si256(pair[p] + i), _mm256_set1_epi32(v));
                    }
                    *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(mn), _mm256_mul_ps(_mm256_load_ps(f[p] + 8), xdv), *acc);
                }
            }
        }
    }
}

/* A's 8 accumulators of row r added as gg_hsum adds a vector's lanes: one output per lane */
INLINE __m256 gg_panel_sum(const __m256 *A) {
    __m256 s0 = _mm256_add_ps(A[0], A[4]), s1 = _mm256_add_ps(A[1], A[5]);
    __m256 s2 = _mm256_add_ps(A[2], A[6]), s3 = _mm256_add_ps(A[3], A[7]);
    return _mm256_add_ps(_mm256_add_ps(s0, s2), _mm256_add_ps(s1, s3));
}

/* The tiles, one per (type, M, panels), and each type's panel builder: all constant in each */
typedef void (*gg_tile_fn)(const uint8_t *, int64_t, const gg_act *, int64_t, int64_t, __m256 *);
typedef void (*gg_build_fn)(const uint8_t *, int64_t, int, int64_t, int64_t, uint8_t *, uint8_t *);
typedef struct {
    gg_tile_fn tile[GG_NP][GG_TILE]; /* [panels - 1][rows - 1] */
    gg_build_fn build;
} gg_kernels;
#define GG_TILE_FN(name, T, M, NP)                                                                               \
    static void name##_tile_##M##_##NP(const uint8_t *p, int64_t ps, const gg_act *a, int64_t r0, int64_t nb, \
                                       __m256 *A) {                                                             \
        gg_panel_tile(T, M, NP, p, ps, a, r0, nb, A);                                                          \
    }
#if GG_NP == 2
#define GG_TILES2(name, T) \
    GG_TILE_FN(name, T, 1, 2) GG_TILE_FN(name, T, 2, 2) GG_TILE_FN(name, T, 3, 2) GG_TILE_FN(name, T, 4, 2)
#define GG_TILE_ROWS2(name) , {name##_tile_1_2, name##_tile_2_2, name##_tile_3_2, name##_tile_4_2}
#else
#define GG_TILES2(name, T)
#define GG_TILE_ROWS2(name)
#endif
#define GG_PANEL_FNS(name, T)                                                                                    \
    GG_TILE_FN(name, T, 1, 1) GG_TILE_FN(name, T, 2, 1) GG_TILE_FN(name, T, 3, 1) GG_TILE_FN(name, T, 4, 1)      \
    GG_TILES2(name, T)                                                                                           \
    static void name##_build(const uint8_t *w, int64_t rb, int cols, int64_t nblk, int64_t kq, uint8_t *p,        \
                             uint8_t *buf) {                                                                     \
        gg_panel_build(T, w, rb, cols, nblk, kq, p, buf);                                                        \
    }                                                                                                            \
    static const gg_kernels name##_kernels = {                                                                   \
        {{name##_tile_1_1, name##_tile_2_1, name##_tile_3_1, name##_tile_4_1} GG_TILE_ROWS2(name)}, name##_build};
GG_PANEL_FNS(gg_q4_0, GG_Q4_0)
GG_PANEL_FNS(gg_q4_1, GG_Q4_1)
GG_PANEL_FNS(gg_q5_0, GG_Q5_0)
GG_PANEL_FNS(gg_q5_1, GG_Q5_1)
GG_PANEL_FNS(gg_q8_0, GG_Q8_0)
GG_PANEL_FNS(gg_q4_k, GG_Q4_K)
GG_PANEL_FNS(gg_q5_k, GG_Q5_K)
GG_PANEL_FNS(gg_q6_k, GG_Q6_K)

static const gg_kernels *gg_kernels_of(int type) {
    switch (type) {
        case GG_Q4_0: return &gg_q4_0_kernels;
        case GG_Q4_1: return &gg_q4_1_kernels;
        case GG_Q5_0: return &gg_q5_0_kernels;
        case GG_Q5_1: return &gg_q5_1_kernels;
        case GG_Q8_0: return &gg_q8_0_kernels;
        case GG_Q4_K: return &gg_q4_k_kernels;
        case GG_Q5_K: return &gg_q5_k_kernels;
        case GG_Q6_K: return &gg_q6_k_kernels;
        default: return NULL;
    }
}

/* A thread's panel scratch, kept from call to call (OpenMP's threads persist): a fresh ~100 KB
 * buffer a call would come from mmap, page faults and all. */
static __thread uint8_t *gg_scratch;
static __thread size_t gg_scratch_bytes;

static uint8_t *gg_panel_scratch(size_t bytes) {
    if (bytes > gg_scratch_bytes) {
        free(gg_scratch);
        gg_scratch_bytes = (bytes + 4095) / 4096 * 4096;
        gg_scratch = aligned_alloc(64, gg_scratch_bytes);
    }
    return gg_scratch;
}

/* Activation rows a panel meets per pass. A pass's rows (256 x K bytes: 0.6 MB at K = 2,560,
 * 2.6 MB at 10,240) come from the cache while the panel sits in L2; a prompt of 8,192 rows met
 * by every panel at once would stream its whole quantized copy (84 MB at K = 10,240) from memory
 * once per panel. The panels are decoded again each pass: over 256 rows that is a few percent. */
#define GG_PANEL_PASS 256

/* Threads take GG_NP panels of 8 weight rows at a time; each meets a pass's activation rows, 4
 * at a time. The tiles start at the same rows (multiples of 4) whatever the pass, so a row's
 * result is the same bits as without passes. */
void gg_panel_linear(int type, int x8, const uint8_t *w, int64_t row_bytes, int64_t n, int64_t nblk,
                     const gg_act *a, int64_t m, const void *bias, void *y, int y_bf16, int64_t ldy) {
    const gg_kernels *kern = gg_kernels_of(type);
    const int64_t groups = (nblk + 7) / 8, pstride = groups * GG_SLOT, panels = (n + GG_NR - 1) / GG_NR;
    uint8_t *panel = gg_panel_scratch((size_t)(GG_NP * pstride + GG_NR * a->kq));
    uint8_t *rowbuf = panel + GG_NP * pstride;
    __m256 A[8 * GG_TILE * GG_NP];
    for (int64_t rb = 0; rb < m; rb += GG_PANEL_PASS) {
        int64_t re = m - rb < GG_PANEL_PASS ? m : rb + GG_PANEL_PASS;
        /* no barrier between passes: each writes its own rows of y, and a thread takes the same
         * panels in every pass (static schedule) */
#pragma omp for schedule(static) nowait
        for (int64_t pp = 0; pp < (panels + GG_NP - 1) / GG_NP; pp++) {
            const int np = panels - GG_NP * pp < GG_NP ? (int)(panels - GG_NP * pp) : GG_NP;
            const int64_t j0 = pp * GG_NP * GG_NR;
            float b[GG_NP * GG_NR] = {0}, out[GG_NR];
            for (int p = 0; p < np; p++) {
                int64_t jp = j0 + p * GG_NR;
                int cols = n - jp < GG_NR ? (int)(n - jp) : GG_NR;
                if (x8)
                    gg_panel_build_x8(type, w + jp * row_bytes, nblk, panel + p * pstride);
                else
                    kern->build(w + jp * row_bytes, row_bytes, cols, nblk, a->kq, panel + p * pstride, rowbuf);
            }
            const int64_t cols = n - j0 < GG_NP * GG_NR ? n - j0 : GG_NP * GG_NR;
            for (int c = 0; bias && c < cols; c++) b[c] = load1(bias, y_bf16, j0 + c);
            /* the next panels' weights (this thread's, as the schedule is static) prefetched to
             * L2 a share per tile: their build otherwise waits on memory, the tiles idle */
            const int64_t jn = j0 + GG_NP * GG_NR, nn = n - jn < GG_NP * GG_NR ? n - jn : GG_NP * GG_NR;
            const uint8_t *pf = w + jn * row_bytes, *pf_end = pf + (nn > 0 ? nn * row_bytes : 0);
            const int64_t tiles = (re - rb + GG_TILE - 1) / GG_TILE;
            const int64_t pf_step = ((pf_end - pf) / tiles + 63) / 64 * 64;
            for (int64_t r0 = rb; r0 < re; r0 += GG_TILE) {
                int M = re - r0 < GG_TILE ? (int)(re - r0) : GG_TILE;
                for (const uint8_t *e = pf + pf_step; pf < e && pf < pf_end; pf += 64) _mm_prefetch((const char *)pf, _MM_HINT_T1);
                kern->tile[np - 1][M - 1](panel, pstride, a, r0, nblk, A);
                for (int p = 0; p < np; p++)
                    for (int r = 0; r < M; r++) {
                        _mm256_storeu_ps(out, gg_panel_sum(A + 8 * (GG_TILE * p + r)));
                        for (int c = 0; c < GG_NR && p * GG_NR + c < cols; c++)
                            store1(y, y_bf16, (r0 + r) * ldy + j0 + p * GG_NR + c, out[c] + b[p * GG_NR + c]);
                    }
            }
        }
    }
}
#endif
