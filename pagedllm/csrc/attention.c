/* Paged decode attention: reads each sequence's keys in place through its block table. */
#include "common.h"

/* ---------- paged decode attention: one query token per sequence ----------
 * q, out: [s, hq, d]; caches: [blocks, block_size, hk, d]; block_tables: [s, bt_stride];
 * seq_lens include the new token (already written to the cache). Each (sequence, kv head)
 * is one task that reads its keys through the block table once for all hq / hk query
 * heads: scores, an exact float32 softmax, then the weighted sum of values. d % 32 == 0. */

#define MAX_GROUP 8

/* The four horizontal sums of a, b, c, d, in one pass of shuffles. */
INLINE __m128 reduce4(__m512 a, __m512 b, __m512 c, __m512 d) {
    __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
    __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
    __m512 abcd = _mm512_add_ps(
        _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(ab), _mm512_castps_pd(cd))),
        _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(ab), _mm512_castps_pd(cd))));
    __m256 h = _mm256_add_ps(_mm512_castps512_ps256(abcd), _mm512_extractf32x8_ps(abcd, 1));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

/* Scores of one key against G query heads (qh: the G rows of q, as stored). */
INLINE void key_scores(const void *kc, int bf16, int64_t at, const void *q, int64_t d, int64_t G, float *dst,
                       int64_t dst_stride, float scale) {
    __m512 acc[MAX_GROUP];
    for (int64_t g = 0; g < G; g++) acc[g] = _mm512_setzero_ps();
#ifdef __AVX512BF16__
    if (bf16) {  /* bf16 pairs straight into float32 sums: no conversion of the keys */
        for (int64_t c = 0; c < d; c += 32) {
            __m512bh kv = (__m512bh)_mm512_loadu_si512((const uint16_t *)kc + at + c);
            for (int64_t g = 0; g < G; g++)
                acc[g] = _mm512_dpbf16_ps(acc[g], kv, (__m512bh)_mm512_loadu_si512((const uint16_t *)q + g * d + c));
        }
    } else
#endif
    {
        for (int64_t c = 0; c < d; c += 16) {
            __m512 kv = load16(kc, bf16, at + c, 0xFFFF);
            for (int64_t g = 0; g < G; g++) acc[g] = _mm512_fmadd_ps(kv, load16(q, bf16, g * d + c, 0xFFFF), acc[g]);
        }
    }
    for (int64_t g = 0; g < G; g += 4) {
        __m512 z = _mm512_setzero_ps();
        float sums[4];
        _mm_storeu_ps(sums, reduce4(acc[g], g + 1 < G ? acc[g + 1] : z, g + 2 < G ? acc[g + 2] : z,
                                    g + 3 < G ? acc[g + 3] : z));
        for (int64_t j = 0; j < 4 && g + j < G; j++) dst[(g + j) * dst_stride] = sums[j] * scale;
    }
}

static void softmax_rows(float *p, int64_t rows, int64_t n) {
    for (int64_t g = 0; g < rows; g++) {
        float *row = p + g * n;
        __m512 mx = _mm512_set1_ps(-INFINITY);
        for (int64_t i = 0; i < n; i += 16) mx = _mm512_max_ps(mx, _mm512_mask_loadu_ps(mx, tail16(n - i), row + i));
        __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx)), sum = _mm512_setzero_ps();
        for (int64_t i = 0; i < n; i += 16) {
            __mmask16 k = tail16(n - i);
            __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, row + i), m));
            _mm512_mask_storeu_ps(row + i, k, e);
            sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(k, e));
        }
        __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(sum));
        for (int64_t i = 0; i < n; i += 16)
            _mm512_mask_storeu_ps(row + i, tail16(n - i), _mm512_mul_ps(_mm512_maskz_loadu_ps(tail16(n - i), row + i), inv));
    }
}

/* out rows of G heads = p [G, n] @ values at off[0..n): two 16-lane chunks per pass. */
static void weighted_values(const void *vc, int bf16, const int64_t *off, int64_t n, const float *p, int64_t G,
                            int64_t d, void *out) {
    for (int64_t c = 0; c < d; c += 32) {
        __m512 acc[MAX_GROUP][2];
        for (int64_t g = 0; g < G; g++) acc[g][0] = acc[g][1] = _mm512_setzero_ps();
        for (int64_t i = 0; i < n; i++) {
            __m512 v0 = load16(vc, bf16, off[i] + c, 0xFFFF), v1 = load16(vc, bf16, off[i] + c + 16, 0xFFFF);
            for (int64_t g = 0; g < G; g++) {
                __m512 w = _mm512_set1_ps(p[g * n + i]);
                acc[g][0] = _mm512_fmadd_ps(v0, w, acc[g][0]);
                acc[g][1] = _mm512_fmadd_ps(v1, w, acc[g][1]);
            }
        }
        for (int64_t g = 0; g < G; g++) {
            store16(out, bf16, g * d + c, acc[g][0], 0xFFFF);
            store16(out, bf16, g * d + c + 16, acc[g][1], 0xFFFF);
        }
    }
}

void pl_paged_decode_attention(const void *q, int64_t num_seqs, int64_t hq, int64_t hk, int64_t d, const void *k_cache,
                               const void *v_cache, int64_t block_size, int bf16, const int64_t *block_tables,
                               int64_t table_stride, const int64_t *seq_lens, int64_t window, float scale, void *out,
                               int nthreads) {
    int64_t group = hq / hk, esize = bf16 ? 2 : 4;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads)
    for (int64_t task = 0; task < num_seqs * hk; task++) {
        int64_t s = task / hk, h = task % hk, len = seq_lens[s];
        int64_t lo = window > 0 && len > window ? len - window : 0, n = len - lo;
        const int64_t *table = block_tables + s * table_stride;
        int64_t G = group < MAX_GROUP ? group : MAX_GROUP;
        /* each key's element offset in the caches, resolved through the block table once */
        int64_t *off = malloc((size_t)n * sizeof(int64_t));
        float *p = malloc((size_t)(G * n) * sizeof(float));
        for (int64_t t = lo, i = 0; t < len; t++, i++) off[i] = ((table[t / block_size] * block_size + t % block_size) * hk + h) * d;
        for (int64_t g0 = 0; g0 < group; g0 += MAX_GROUP) {
            int64_t gg = group - g0 < MAX_GROUP ? group - g0 : MAX_GROUP;
            int64_t head = s * hq + h * group + g0;
            const char *qh = (const char *)q + head * d * esize;
            for (int64_t i = 0; i < n; i++) key_scores(k_cache, bf16, off[i], qh, d, gg, p + i, n, scale);
            softmax_rows(p, gg, n);
            weighted_values(v_cache, bf16, off, n, p, gg, d, (char *)out + head * d * esize);
        }
        free(p);
        free(off);
    }
}
