/* Q4_K, Q6_K, Q5_0 and Q4_0 weights repacked 8 rows at a time (the "x8" layout), for decode's few
 * activation rows. A row-at-a-time kernel spends most of its instructions on one row's scales
 * and sums (~90 per 256 values); with 8 rows side by side each 32-byte load holds 4 quants of
 * every row, one vpdpbusd multiplies them by 4 broadcast activations, and the 8 rows' scales,
 * sums and float steps run as one vector each. One thread, one activation row, 2,048 x 4,096
 * weights in L3 on a Zen 4 EPYC: Q4_K 33.6 GB/s against the row kernel's 19.2, Q6_K 37.7
 * against 28.0.
 *
 * A unit is one super-block (Q5_0, Q4_0: one block of 32) of 8 consecutive rows; a row group's
 * units follow each other: the repacked tensor is n rows of units x (unit bytes / 8), the file's
 * size but for Q6_K's 2.9% more (its units padded to cache lines).
 *   Q4_K unit (1152 bytes): [0, 32) each row's first 4 bytes (d | dmin << 16); [32, 128) the
 *     scale words (block bytes 4-7, 8-11, 12-15) as 8 dwords each; [128, 1152) qs: for chunk p
 *     (0-3) and quad j (0-7), 4 bytes of each row, qs[32 p + 4 j ..] (32 bytes).
 *   Q6_K unit (1728 bytes): [0, 16) each row's d; [16, 144) for scale i (0-15) each row's sc[i];
 *     [144, 1680) for half h, quad j (96 bytes): each row's qh[32 h + 4 j ..], then for chunk c
 *     (0-1) each row's ql[64 h + 32 c + 4 j ..], in the order the kernel reads them; [1680,
 *     1728) zeros, so that units start on cache lines.
 *   Q5_0 unit (176 bytes): [0, 16) each row's d; [16, 48) each row's qh, its bits reordered
 *     (gg_q5_0_qh_x8): bit 8 s + j holds the fifth bit of value 4 j + s, so the fifth bits of a
 *     step's 4 values of every row are one shift and mask away; [48, 176) for quad c
 *     (0-3) each row's qs[4 c ..] (32 bytes): its low nibbles are values 4c .., its high ones
 *     16 + 4c ..
 *   Q4_0 unit (144 bytes): [0, 16) each row's d; [16, 144) Q5_0's qs layout.
 * The integer sums and the float operations per (row, super-block) are gg_row's (gguf.c), in the
 * same order, so a repacked weight gives the file layout's results bit for bit, whatever the
 * batch. The panels (many rows, gguf_panel.c) are built from the units; the portable build,
 * which has no x8 kernels, reads each group back in the file's layout (gg_x8_file_rows). */
#include "gguf_blocks.h"

/* A Q5_0 row's qh word in the unit's bit order (to_x8: bit 4 j + s to bit 8 s + j), or back */
static void gg_q5_0_qh_x8(uint8_t *p, int to_x8) {
    uint32_t w, out = 0;
    memcpy(&w, p, 4);
    for (int s = 0; s < 4; s++)
        for (int j = 0; j < 8; j++)
            out |= to_x8 ? ((w >> (4 * j + s)) & 1u) << (8 * s + j) : ((w >> (8 * s + j)) & 1u) << (4 * j + s);
    memcpy(p, &out, 4);
}

/* 8 rows (row r at rows + r * row_bytes, nsb units) to or from their units at x8 */
static void gg_x8_move(int type, uint8_t *rows, int64_t row_bytes, int64_t nsb, uint8_t *x8, int to_x8) {
    const int64_t gbytes = GG_X8_BLOCK_BYTES(type), ubytes = GG_X8_UNIT(type);
    gg_piece pieces[8][72];
    int count[8];
    for (int r = 0; r < 8; r++) count[r] = gg_x8_pieces(type, r, pieces[r]);
    for (int64_t g = 0; g < nsb; g++)
        for (int r = 0; r < 8; r++) {
            uint8_t *blk = rows + r * row_bytes + g * gbytes, *unit = x8 + g * ubytes;
            for (int i = 0; i < count[r]; i++) {
                const gg_piece *p = &pieces[r][i];
                if (to_x8)
                    gg_piece_copy(unit + p->dst, blk + p->src, p->len);
                else
                    gg_piece_copy(blk + p->src, unit + p->dst, p->len);
            }
            if (type == GG_Q5_0) gg_q5_0_qh_x8(to_x8 ? unit + 16 + 4 * r : blk + 2, to_x8);
        }
}

#if GG_PANELS
/* The same moves as gg_x8_move's to x8, the quants' dwords (Q4_K's 36 from its block's start, of
 * which 32 here; Q6_K's ql and qh, 48) by 8 x 8 transposes: dword f of row r lands at its piece's
 * place for row 0, + 4 r. The rest piece by piece. */
static void gg_x8_pack(int type, const uint8_t *rows, int64_t row_bytes, int64_t nsb, uint8_t *x8) {
    const int64_t gbytes = GG_GROUP_BYTES(type), ubytes = GG_X8_UNIT(type);
    /* the first transposed dword's piece, and the pieces transposed */
    const int first = type == GG_Q4_K ? 0 : 17, dwords = type == GG_Q4_K ? 32 : 48;
    gg_piece pieces[8][72];
    int count[8];
    for (int r = 0; r < 8; r++) count[r] = gg_x8_pieces(type, r, pieces[r]);
    for (int64_t g = 0; g < nsb; g++) {
        const uint8_t *blk = rows + g * gbytes;
        uint8_t *unit = x8 + g * ubytes;
        for (int i = 0; i < dwords / 8; i++) {
            __m256i in[8], out[8];
            for (int r = 0; r < 8; r++) in[r] = _mm256_loadu_si256((const __m256i *)(blk + r * row_bytes + 32 * i));
            gg_transpose8(in, out);
            for (int s = 0; s < 8; s++)
                _mm256_storeu_si256((__m256i *)(unit + pieces[0][first + 8 * i + s].dst), out[s]);
        }
        for (int r = 0; r < 8; r++)
            for (int k = 0; k < count[r]; k++)
                if (k < first || k >= first + dwords) {
                    const gg_piece *p = &pieces[r][k];
                    gg_piece_copy(unit + p->dst, blk + r * row_bytes + p->src, p->len);
                }
    }
}
#endif

void pl_gguf_repack(int type, const uint8_t *w, int64_t row_bytes, int64_t n, int64_t k, uint8_t *out, int nthreads) {
    if (!gg_x8_type(type) || n % 8 || k % gg_block_values(type)) return; /* gguf_ops checks */
    const int64_t nsb = GG_X8_UNITS(type, k / 32), out_row = nsb * GG_X8_UNIT(type) / 8;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t i = 0; i < n / 8; i++) {
        uint8_t *x8 = out + 8 * i * out_row;
        for (int64_t g = 0; type == GG_Q6_K && g < nsb; g++) /* the padding */
            memset(x8 + g * GG_X8_Q6_K_UNIT + 8 * 210, 0, GG_X8_Q6_K_UNIT - 8 * 210);
#if GG_PANELS
        if (GG_KQUANT(type)) {
            gg_x8_pack(type, w + 8 * i * row_bytes, row_bytes, nsb, x8);
            continue;
        }
#endif
        gg_x8_move(type, (uint8_t *)w + 8 * i * row_bytes, row_bytes, nsb, x8, 1);
    }
}

/* A thread's buffer for a group read back (kept from call to call, as the panel scratch is) */
static __thread uint8_t *gg_x8_buf;
static __thread size_t gg_x8_buf_bytes;

const uint8_t *gg_x8_file_rows(int type, const uint8_t *grp, int64_t row_bytes, int64_t nsb) {
    size_t bytes = (size_t)(8 * row_bytes);
    if (bytes > gg_x8_buf_bytes) {
        free(gg_x8_buf);
        gg_x8_buf_bytes = (bytes + 4095) / 4096 * 4096;
        gg_x8_buf = aligned_alloc(64, gg_x8_buf_bytes);
    }
    gg_x8_move(type, gg_x8_buf, row_bytes, nsb, (uint8_t *)grp, 0);
    return gg_x8_buf;
}

#if GG_PANELS
/* Q4_K, two activation rows and more (which take longer over a unit): the unit GG_X8_AHEAD units
 * on prefetched. For one row, and for Q6_K (one thread, 1 to 4 rows from memory), the hardware's
 * own prefetch of the stream does better. */
#define GG_X8_AHEAD 2
INLINE void gg_x8_prefetch(const int M, const uint8_t *u, const int ubytes) {
    if (M > 1)
        for (int off = 0; off < ubytes; off += 64) _mm_prefetch((const char *)u + GG_X8_AHEAD * ubytes + off, _MM_HINT_T0);
}

INLINE __m256i gg_bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* Byte s (0-3) of each dword */
INLINE __m256i gg_byte_of(__m256i v, int s) {
    return _mm256_and_si256(_mm256_srli_epi32(v, 8 * s), _mm256_set1_epi32(0xFF));
}

/* ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7)): gg_hsum's order, one row a lane */
INLINE __m256 gg_x8_sum(const __m256 *A) {
    return _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(A[0], A[4]), _mm256_add_ps(A[2], A[6])),
                         _mm256_add_ps(_mm256_add_ps(A[1], A[5]), _mm256_add_ps(A[3], A[7])));
}

/* Without VNNI a vpdpbusd is three instructions (vpmaddubsw, vpmaddwd with ones, vpaddd), so the
 * kernels below add vpmaddubsw's int16 pairs over as many steps as stay under 2^15 (gguf.c's
 * bounds: 8 steps for 4-bit quants, 4 for 5-bit, 2 for 6-bit), then widen them with one vpmaddwd
 * whose int16 operand is the sub-block's scale where there is one. The integer sums are the
 * same, so are the results. */
INLINE __m256i gg_mb(__m256i u, const int8_t *x) { return _mm256_maddubs_epi16(u, gg_bcast4(x)); }

/* Bytes s and s + 1 (s = 0 or 2) of each dword as its two int16 halves */
INLINE __m256i gg_byte_pair16(__m256i v, int s) {
    const __m256i pick = _mm256_add_epi8(_mm256_setr_epi8(0, -128, 1, -128, 4, -128, 5, -128, 8, -128, 9, -128, 12, -128,
                                                          13, -128, 0, -128, 1, -128, 4, -128, 5, -128, 8, -128, 9, -128,
                                                          12, -128, 13, -128),
                                         _mm256_set1_epi16((short)(s | s << 8)));
    return _mm256_shuffle_epi8(v, pick);
}

/* Byte s (0-3) of each dword in both of its int16 halves */
INLINE __m256i gg_byte_twice16(__m256i v, int s) {
    return _mm256_shuffle_epi8(v, _mm256_add_epi8(_mm256_setr_epi8(0, -128, 0, -128, 4, -128, 4, -128, 8, -128, 8, -128,
                                                                   12, -128, 12, -128, 0, -128, 0, -128, 4, -128, 4,
                                                                   -128, 8, -128, 8, -128, 12, -128, 12, -128),
                                                  _mm256_set1_epi16((short)s)));
}

/* out[r] (lane c: row c of the group) = activation row r0 + r . the group's row c, r < M */
INLINE void gg_x8_q4k(const int M, const uint8_t *grp, int64_t nsb, const gg_act *act, int64_t r0, __m256 *out) {
    const gg_act local = *act, *a = &local; /* see gg_row */
    const __m256i m4 = _mm256_set1_epi8(15), m6 = _mm256_set1_epi8(0x3F), top = _mm256_set1_epi8(0x30);
    __m256 acc[GG_TILE][8];
    for (int r = 0; r < M; r++)
        for (int j = 0; j < 8; j++) acc[r][j] = _mm256_setzero_ps();
    for (int64_t g = 0; g < nsb; g++) {
        const uint8_t *u = grp + g * GG_X8_Q4_K_UNIT;
        gg_x8_prefetch(M, u, GG_X8_Q4_K_UNIT);
        const __m256i U0 = _mm256_loadu_si256((const __m256i *)(u + 32)), U1 = _mm256_loadu_si256((const __m256i *)(u + 64));
        const __m256i U2 = _mm256_loadu_si256((const __m256i *)(u + 96));
        const __m256i sc[2] = {_mm256_and_si256(U0, m6),
                               _mm256_or_si256(_mm256_and_si256(U2, m4), _mm256_and_si256(_mm256_srli_epi32(U0, 2), top))};
        const __m256i mn[2] = {_mm256_and_si256(U1, m6), _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(U2, 4), m4),
                                                                        _mm256_and_si256(_mm256_srli_epi32(U1, 2), top))};
        const int8_t *xq[GG_TILE];
        __m256i I[GG_TILE], Imin[GG_TILE];
        for (int r = 0; r < M; r++) {
            xq[r] = a->q + (r0 + r) * a->kq + 256 * g;
            I[r] = Imin[r] = _mm256_setzero_si256();
        }
#pragma GCC unroll 4
        for (int p = 0; p < 4; p++) {
            __m256i d0[GG_TILE], d1[GG_TILE];
            for (int r = 0; r < M; r++) d0[r] = d1[r] = _mm256_setzero_si256();
#pragma GCC unroll 8
            for (int j = 0; j < 8; j++) {
                __m256i lo = gg_x8_step(GG_Q4_K, u, 2 * p, j), hi = gg_x8_step(GG_Q4_K, u, 2 * p + 1, j);
                for (int r = 0; r < M; r++) {
#if GG_VNNI
                    d0[r] = GG_DPBUSD(d0[r], lo, gg_bcast4(xq[r] + 64 * p + 4 * j));
                    d1[r] = GG_DPBUSD(d1[r], hi, gg_bcast4(xq[r] + 64 * p + 32 + 4 * j));
#else
                    d0[r] = _mm256_add_epi16(d0[r], gg_mb(lo, xq[r] + 64 * p + 4 * j));
                    d1[r] = _mm256_add_epi16(d1[r], gg_mb(hi, xq[r] + 64 * p + 32 + 4 * j));
#endif
                }
            }
            /* sub-blocks 2p and 2p + 1: bytes 2 (p % 2) and 2 (p % 2) + 1 of sc[p / 2] */
#if GG_VNNI
            __m256i s0 = gg_byte_of(sc[p / 2], 2 * (p % 2)), s1 = gg_byte_of(sc[p / 2], 2 * (p % 2) + 1);
            for (int r = 0; r < M; r++)
                I[r] = _mm256_add_epi32(I[r], _mm256_add_epi32(_mm256_mullo_epi32(d0[r], s0), _mm256_mullo_epi32(d1[r], s1)));
#else
            __m256i s0 = gg_byte_twice16(sc[p / 2], 2 * (p % 2)), s1 = gg_byte_twice16(sc[p / 2], 2 * (p % 2) + 1);
            for (int r = 0; r < M; r++)
                I[r] = _mm256_add_epi32(I[r], _mm256_add_epi32(_mm256_madd_epi16(d0[r], s0), _mm256_madd_epi16(d1[r], s1)));
#endif
        }
        /* the mins of sub-blocks s, s + 1 as int16 pairs, against the pair of activation sums */
        for (int s = 0; s < 8; s += 2) {
            __m256i mv = gg_byte_pair16(mn[s / 4], s % 4);
            for (int r = 0; r < M; r++)
                Imin[r] = GG_DPWSSD(Imin[r], mv, gg_bcast4((const int8_t *)(a->b32 + (r0 + r) * a->nb8 + 8 * g + s)));
        }
        const __m256i dd = _mm256_loadu_si256((const __m256i *)u);
        const __m256 D = gg_dword_halves(dd, 0), Dmin = _mm256_xor_ps(gg_dword_halves(dd, 1), _mm256_set1_ps(-0.0f));
        for (int r = 0; r < M; r++) {
            __m256 xd = _mm256_set1_ps(a->d[(r0 + r) * a->nb8 + 8 * g]), *A = &acc[r][g % 8];
            *A = _mm256_fmadd_ps(_mm256_cvtepi32_ps(I[r]), _mm256_mul_ps(D, xd), *A);
            *A = _mm256_fmadd_ps(_mm256_cvtepi32_ps(Imin[r]), _mm256_mul_ps(Dmin, xd), *A);
        }
    }
    for (int r = 0; r < M; r++) out[r] = gg_x8_sum(acc[r]);
}

/* Scale i of the 8 rows (Q6_K: int8 at u + 16 + 8 i) in both int16 halves of each row's dword */
INLINE __m256i gg_q6k_scale_twice16(const uint8_t *u, int i) {
    __m128i v = _mm_loadl_epi64((const __m128i *)(u + 16 + 8 * i));
    return _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(v, v));
}

INLINE void gg_x8_q6k(const int M, const uint8_t *grp, int64_t nsb, const gg_act *act, int64_t r0, __m256 *out) {
    const gg_act local = *act, *a = &local;
    __m256 acc[GG_TILE][8];
    for (int r = 0; r < M; r++)
        for (int j = 0; j < 8; j++) acc[r][j] = _mm256_setzero_ps();
    for (int64_t g = 0; g < nsb; g++) {
        const uint8_t *u = grp + g * GG_X8_Q6_K_UNIT;
        const int8_t *xq[GG_TILE];
        const int16_t *xs[GG_TILE];
        __m256i I[GG_TILE];
        for (int r = 0; r < M; r++) {
            xq[r] = a->q + (r0 + r) * a->kq + 256 * g;
            xs[r] = a->s16 + (r0 + r) * 2 * a->nb8 + 16 * g;
            I[r] = _mm256_setzero_si256();
        }
        /* half h of the block, 16-value half e of its sub-blocks, ql chunk c: sub-blocks 4h + c
         * (low nibbles) and 4h + c + 2 (high), two accumulators a row (AVX2 has 16 registers) */
#pragma GCC unroll 8
        for (int hec = 0; hec < 8; hec++) {
            const int h = hec / 4, e = hec / 2 % 2, c = hec % 2;
#if GG_VNNI
            __m256i dt[2][GG_TILE]; /* sub-block 4h + c + 2i: its dot less 32 x the activations' sum */
            for (int i = 0; i < 2; i++)
                for (int r = 0; r < M; r++) dt[i][r] = _mm256_set1_epi32(-32 * xs[r][2 * (4 * h + c + 2 * i) + e]);
#pragma GCC unroll 4
            for (int jj = 0; jj < 4; jj++) {
                const int j = 4 * e + jj;
                for (int i = 0; i < 2; i++) {
                    const int b = 4 * h + c + 2 * i;
                    __m256i q = gg_x8_step(GG_Q6_K, u, b, j);
                    for (int r = 0; r < M; r++) dt[i][r] = GG_DPBUSD(dt[i][r], q, gg_bcast4(xq[r] + 32 * b + 4 * j));
                }
            }
            for (int i = 0; i < 2; i++) {
                const int b = 4 * h + c + 2 * i;
                __m256i scv = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(u + 16 + 8 * (2 * b + e))));
                for (int r = 0; r < M; r++) I[r] = _mm256_add_epi32(I[r], _mm256_mullo_epi32(dt[i][r], scv));
            }
#else /* two steps' int16 pairs at a time, widened by the scale; the offset after the loop */
            for (int i = 0; i < 2; i++) {
                const int b = 4 * h + c + 2 * i;
                const __m256i scv = gg_q6k_scale_twice16(u, 2 * b + e);
#pragma GCC unroll 2
                for (int jj = 0; jj < 4; jj += 2) {
                    const int j = 4 * e + jj;
                    __m256i q0 = gg_x8_step(GG_Q6_K, u, b, j), q1 = gg_x8_step(GG_Q6_K, u, b, j + 1);
                    for (int r = 0; r < M; r++) {
                        __m256i t = _mm256_add_epi16(gg_mb(q0, xq[r] + 32 * b + 4 * j), gg_mb(q1, xq[r] + 32 * b + 4 * j + 4));
                        I[r] = _mm256_add_epi32(I[r], _mm256_madd_epi16(t, scv));
                    }
                }
            }
#endif
        }
#if !GG_VNNI
        /* 32 x each scale times its 16 activations' sum, taken off: scales 2i and 2i + 1 of
         * each row as an int16 pair, against the pair of sums */
        __m256i O[GG_TILE];
        for (int r = 0; r < M; r++) O[r] = _mm256_setzero_si256();
        for (int i = 0; i < 16; i += 2) {
            __m256i sp = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(_mm_loadl_epi64((const __m128i *)(u + 16 + 8 * i)),
                                                                _mm_loadl_epi64((const __m128i *)(u + 24 + 8 * i))));
            for (int r = 0; r < M; r++) O[r] = _mm256_add_epi32(O[r], _mm256_madd_epi16(sp, gg_bcast4((const int8_t *)(xs[r] + i))));
        }
        for (int r = 0; r < M; r++) I[r] = _mm256_sub_epi32(I[r], _mm256_slli_epi32(O[r], 5));
#endif
        const __m256 D = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)u));
        for (int r = 0; r < M; r++) {
            __m256 xd = _mm256_set1_ps(a->d[(r0 + r) * a->nb8 + 8 * g]), *A = &acc[r][g % 8];
            *A = _mm256_fmadd_ps(_mm256_cvtepi32_ps(I[r]), _mm256_mul_ps(D, xd), *A);
        }
    }
    for (int r = 0; r < M; r++) out[r] = gg_x8_sum(acc[r]);
}

/* Q5_0 / Q4_0: a unit a block. Block b's exact integer sum less the offset (16 / 8) x the
 * activations' block sum, into lane b % 8 as gg_legacy_group adds it (float(sum) x (d x
 * activation scale)). */
INLINE void gg_x8_legacy(const int type, const int M, const uint8_t *grp, int64_t nblk, const gg_act *act, int64_t r0,
                         __m256 *out) {
    const gg_act local = *act, *a = &local;
    __m256 acc[GG_TILE][8];
    for (int r = 0; r < M; r++)
        for (int j = 0; j < 8; j++) acc[r][j] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nblk; b++) {
        const uint8_t *u = grp + b * GG_X8_UNIT(type);
        for (int off = 0; off < GG_X8_UNIT(type); off += 64) /* as gg_legacy_group: the stream alone lags */
            _mm_prefetch((const char *)u + GG_PREFETCH_BYTES + off, _MM_HINT_T0);
        __m256i I[GG_TILE]; /* each row's block sum */
#if GG_VNNI
        /* C independent sums a row (4 for one row, 2 for two): one chain of 8 dependent vpdpbusd
         * would bound a unit at ~40 cycles */
        const int C = M >= 3 ? 1 : 4 / M;
        __m256i part[GG_TILE][4];
        for (int r = 0; r < M; r++)
            for (int c = 0; c < C; c++) part[r][c] = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++) {
            __m256i q = gg_x8_step(type, u, 0, j);
            for (int r = 0; r < M; r++)
                part[r][j % C] = GG_DPBUSD(part[r][j % C], q, gg_bcast4(a->q + (r0 + r) * a->kq + 32 * b + 4 * j));
        }
        for (int r = 0; r < M; r++) {
            I[r] = part[r][0];
            for (int c = 1; c < C; c++) I[r] = _mm256_add_epi32(I[r], part[r][c]);
        }
#else /* int16 pairs over 8 steps (Q4_0) or 4 (Q5_0), then widened */
        const int S = type == GG_Q4_0 ? 8 : 4;
        const __m256i ones = _mm256_set1_epi16(1);
        __m256i t[GG_TILE];
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++) {
            __m256i q = gg_x8_step(type, u, 0, j);
            for (int r = 0; r < M; r++) {
                __m256i p = gg_mb(q, a->q + (r0 + r) * a->kq + 32 * b + 4 * j);
                t[r] = j % S ? _mm256_add_epi16(t[r], p) : p;
                if (j % S == S - 1) {
                    __m256i w = _mm256_madd_epi16(t[r], ones);
                    I[r] = j < S ? w : _mm256_add_epi32(I[r], w);
                }
            }
        }
#endif
        const __m256 D = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)u));
        for (int r = 0; r < M; r++) {
            const int64_t at = (r0 + r) * a->nb8 + b;
            __m256i Io = _mm256_sub_epi32(I[r], _mm256_set1_epi32(GG_OFFSET(type) * (int32_t)a->b32[at]));
            __m256 *A = &acc[r][b % 8];
            *A = _mm256_fmadd_ps(_mm256_cvtepi32_ps(Io), _mm256_mul_ps(D, _mm256_set1_ps(a->d[at])), *A);
        }
    }
    for (int r = 0; r < M; r++) out[r] = gg_x8_sum(acc[r]);
}

INLINE void gg_x8_q50(const int M, const uint8_t *grp, int64_t nblk, const gg_act *a, int64_t r0, __m256 *out) {
    gg_x8_legacy(GG_Q5_0, M, grp, nblk, a, r0, out);
}

INLINE void gg_x8_q40(const int M, const uint8_t *grp, int64_t nblk, const gg_act *a, int64_t r0, __m256 *out) {
    gg_x8_legacy(GG_Q4_0, M, grp, nblk, a, r0, out);
}

/* Each kernel once per row count (M a constant in each), and the table of the four */
#define GG_X8_FN(kern, M)                                                                                     \
    static void kern##_##M(const uint8_t *grp, int64_t nsb, const gg_act *a, int64_t r0, __m256 *out) {      \
        kern(M, grp, nsb, a, r0, out);                                                                        \
    }
#define GG_X8_FNS(kern) GG_X8_FN(kern, 1) GG_X8_FN(kern, 2) GG_X8_FN(kern, 3) GG_X8_FN(kern, 4)
#define GG_X8_TABLE(kern) {kern##_1, kern##_2, kern##_3, kern##_4}
GG_X8_FNS(gg_x8_q4k)
GG_X8_FNS(gg_x8_q6k)
GG_X8_FNS(gg_x8_q50)
GG_X8_FNS(gg_x8_q40)

void gg_x8_rows(int type, int M, const uint8_t *grp, int64_t nsb, const gg_act *a, int64_t r0, float *out) {
    typedef void (*fn)(const uint8_t *, int64_t, const gg_act *, int64_t, __m256 *);
    static const fn q4k[GG_TILE] = GG_X8_TABLE(gg_x8_q4k), q6k[GG_TILE] = GG_X8_TABLE(gg_x8_q6k),
                    q50[GG_TILE] = GG_X8_TABLE(gg_x8_q50), q40[GG_TILE] = GG_X8_TABLE(gg_x8_q40);
    __m256 o[GG_TILE];
    (type == GG_Q4_K ? q4k : type == GG_Q6_K ? q6k : type == GG_Q5_0 ? q50 : q40)[M - 1](grp, nsb, a, r0, o);
    for (int r = 0; r < M; r++) _mm256_storeu_ps(out + 8 * r, o[r]);
}
#endif
