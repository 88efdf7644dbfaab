/* The paged KV cache on the C side: decode attention reading K/V in place through block tables, and
 * the write of a step's K/V into a byte (quantized) cache. */
#include "common.h"

/* ---------- paged decode attention: one query token per sequence ----------
 * q, out: [s, hq, d] (bf16 says their dtype); caches: [blocks, block_size, hk, d] of vec.h's
 * KV kind `kv` (the activations' float type, or bytes with k_scales / v_scales [blocks,
 * block_size, hk, d / 32]: one per 32 elements); block_tables: [s, bt_stride]; seq_lens include
 * the new token (already written to the cache). Each (sequence, kv head) is one task that reads
 * its keys through the block table once for all hq / hk query heads: scores, an exact float32
 * softmax, then the weighted sum of values. d % 32 == 0. */

#define MAX_GROUP 8

#ifdef PL_AVX512
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
#endif

/* VL elements of a cache row of KV kind `kv` as floats (a byte cache's times its group's scale:
 * element `at` has scale scales[at / 32]). */
INLINE vf kv_load(const void *c, int kv, const float *scales, int64_t at) {
    if (kv <= KV_BF16) return vload(c, kv, at, VL);
    return vmul(vload_kv8((const uint8_t *)c + at, kv), vset1(scales[at >> 5]));
}

/* Scores of one key against G query heads (qh: the G rows of q, as stored). */
INLINE void key_scores(const void *kc, int kv, const float *k_scales, int64_t at, const void *q, int bf16, int64_t d,
                       int64_t G, float *dst, int64_t dst_stride, float scale) {
    vf acc[MAX_GROUP];
    for (int64_t g = 0; g < G; g++) acc[g] = vzero();
#if defined(PL_AVX512) && defined(__AVX512BF16__)
    if (kv == KV_BF16 && bf16) {  /* bf16 pairs straight into float32 sums: no conversion of the keys */
        for (int64_t c = 0; c < d; c += 32) {
            __m512bh kb = (__m512bh)_mm512_loadu_si512((const uint16_t *)kc + at + c);
            for (int64_t g = 0; g < G; g++)
                acc[g] = _mm512_dpbf16_ps(acc[g], kb, (__m512bh)_mm512_loadu_si512((const uint16_t *)q + g * d + c));
        }
    } else
#endif
    {
        for (int64_t c = 0; c < d; c += VL) {
            vf kr = kv_load(kc, kv, k_scales, at + c);
            for (int64_t g = 0; g < G; g++) acc[g] = vfmadd(kr, vload(q, bf16, g * d + c, VL), acc[g]);
        }
    }
#ifdef PL_AVX512
    for (int64_t g = 0; g < G; g += 4) {
        __m512 z = _mm512_setzero_ps();
        float sums[4];
        _mm_storeu_ps(sums, reduce4(acc[g], g + 1 < G ? acc[g + 1] : z, g + 2 < G ? acc[g + 2] : z,
                                    g + 3 < G ? acc[g + 3] : z));
        for (int64_t j = 0; j < 4 && g + j < G; j++) dst[(g + j) * dst_stride] = sums[j] * scale;
    }
#else
    for (int64_t g = 0; g < G; g++) dst[g * dst_stride] = vhsum(acc[g]) * scale;
#endif
}

static void softmax_rows(float *p, int64_t rows, int64_t n) {
    for (int64_t g = 0; g < rows; g++) {
        float *row = p + g * n;
        vf mx = vset1(-INFINITY);
        for (int64_t i = 0; i < n; i += VL) mx = vsel(vm_tail(n - i), vmax(mx, vloadf(row + i, n - i)), mx);
        vf m = vset1(vhmax(mx)), sum = vzero();
        for (int64_t i = 0; i < n; i += VL) {
            vf e = vexp(vsub(vloadf(row + i, n - i), m));
            vstoref(row + i, e, n - i);
            sum = vadd(sum, vsel(vm_tail(n - i), e, vzero()));
        }
        vf inv = vset1(1.0f / vhsum(sum));
        for (int64_t i = 0; i < n; i += VL) vstoref(row + i, vmul(vloadf(row + i, n - i), inv), n - i);
    }
}

/* out rows of G heads = p [G, n] @ values at off[0..n). Keys in the outer loop: each value row
 * (d contiguous elements) is read once, front to back, and the G x d sums stay in L1 (`acc`).
 * (Passes over all the keys for 16 lanes at a time would read one cache line per key per pass:
 * ~4.5 GB/s from memory on an AVX2 EPYC, a third of what it streams.) Each element sums its
 * keys in order, one `vfmadd` each. */
INLINE void weighted_values(const void *vc, int kv, const float *v_scales, const int64_t *off, int64_t n,
                            const float *p, int64_t G, int64_t d, float *acc, void *out, int bf16) {
    for (int64_t j = 0; j < G * d; j += VL) vstoref(acc + j, vzero(), VL);
    for (int64_t i = 0; i < n; i++) {
        vf w[MAX_GROUP];
        for (int64_t g = 0; g < G; g++) w[g] = vset1(p[g * n + i]);
        for (int64_t c = 0; c < d; c += VL) {
            vf v = kv_load(vc, kv, v_scales, off[i] + c);
            for (int64_t g = 0; g < G; g++) vstoref(acc + g * d + c, vfmadd(v, w[g], vloadf(acc + g * d + c, VL)), VL);
        }
    }
    for (int64_t g = 0; g < G; g++)
        for (int64_t c = 0; c < d; c += VL) vstore(out, bf16, g * d + c, vloadf(acc + g * d + c, VL), VL);
}

/* One (sequence s, kv head h) task; `kv` is a constant at each call, so each KV kind gets its own
 * copy of the loops. */
INLINE void decode_task(const void *q, int bf16, int64_t s, int64_t h, int64_t hq, int64_t hk, int64_t d,
                        const void *k_cache, const void *v_cache, int kv, const float *k_scales,
                        const float *v_scales, int64_t block_size, const int64_t *block_tables, int64_t table_stride,
                        const int64_t *seq_lens, int64_t window, float scale, void *out) {
    int64_t group = hq / hk, esize = bf16 ? 2 : 4, len = seq_lens[s];
    int64_t lo = window > 0 && len > window ? len - window : 0, n = len - lo;
    const int64_t *table = block_tables + s * table_stride;
    int64_t G = group < MAX_GROUP ? group : MAX_GROUP;
    /* each key's element offset in the caches, resolved through the block table once */
    int64_t *off = malloc((size_t)n * sizeof(int64_t));
    /* scores [G, n], then the weighted sums [G, d]: one allocation per task */
    float *p = malloc((size_t)(G * (n + d)) * sizeof(float)), *acc = p + G * n;
    for (int64_t t = lo, i = 0; t < len; t++, i++) off[i] = ((table[t / block_size] * block_size + t % block_size) * hk + h) * d;
    for (int64_t g0 = 0; g0 < group; g0 += MAX_GROUP) {
        int64_t gg = group - g0 < MAX_GROUP ? group - g0 : MAX_GROUP;
        int64_t head = s * hq + h * group + g0;
        const char *qh = (const char *)q + head * d * esize;
        for (int64_t i = 0; i < n; i++)
            key_scores(k_cache, kv, k_scales, off[i], qh, bf16, d, gg, p + i, n, scale);
        softmax_rows(p, gg, n);
        weighted_values(v_cache, kv, v_scales, off, n, p, gg, d, acc, (char *)out + head * d * esize, bf16);
    }
    free(p);
    free(off);
}

void pl_paged_decode_attention(const void *q, int64_t num_seqs, int64_t hq, int64_t hk, int64_t d, const void *k_cache,
                               const void *v_cache, int64_t block_size, int bf16, int kv, const float *k_scales,
                               const float *v_scales, const int64_t *block_tables, int64_t table_stride,
                               const int64_t *seq_lens, int64_t window, float scale, void *out, int nthreads) {
    int64_t tasks = num_seqs * hk;  /* no more threads than tasks: a lone decode runs on one */
#pragma omp parallel for schedule(dynamic, 1) num_threads(tasks < nthreads ? (int)tasks : nthreads)
    for (int64_t task = 0; task < tasks; task++) {
        int64_t s = task / hk, h = task % hk;
#define PL_TASK(KIND) decode_task(q, bf16, s, h, hq, hk, d, k_cache, v_cache, KIND, k_scales, v_scales, block_size, \
                                  block_tables, table_stride, seq_lens, window, scale, out)
        switch (kv) {
        case KV_INT8: PL_TASK(KV_INT8); break;
        case KV_FP8_E4M3: PL_TASK(KV_FP8_E4M3); break;
        case KV_FP8_E5M2: PL_TASK(KV_FP8_E5M2); break;
        case KV_BF16: PL_TASK(KV_BF16); break;
        default: PL_TASK(KV_F32); break;
        }
#undef PL_TASK
    }
}

/* ---------- a step's keys and values into a byte cache ----------
 * k, v: [n, hk, d] rows k_stride / v_stride elements apart (heads contiguous), of the float type
 * `bf16` says; slots: each row's slot (block * block_size + offset). Each group of 32 elements
 * is stored as bytes of kind `kv` with the scale absmax / qmax (1 for an all-zero group) in the
 * scales [slots, hk, d / 32]: element = round(x / scale), clamped to +-qmax (kv_quant.quantize).
 * d % 32 == 0. */
void pl_kv_cache_write(const void *k, const void *v, int bf16, int64_t n, int64_t hk, int64_t d, int64_t k_stride,
                       int64_t v_stride, const int64_t *slots, uint8_t *k_cache, uint8_t *v_cache, float *k_scales,
                       float *v_scales, int kv, int nthreads) {
    float qmax = kv == KV_INT8 ? 127.0f : kv == KV_FP8_E4M3 ? 448.0f : 57344.0f;
    int64_t groups = d / 32;
#pragma omp parallel for schedule(static) num_threads(n * hk >= 64 ? nthreads : 1)
    for (int64_t task = 0; task < 2 * n * hk * groups; task++) {
        int64_t per_side = n * hk * groups;
        int is_v = task >= per_side;
        int64_t r = (task % per_side) / (hk * groups), h = (task / groups) % hk, grp = task % groups;
        const void *src = is_v ? v : k;
        int64_t at = r * (is_v ? v_stride : k_stride) + h * d + grp * 32, dst = (slots[r] * hk + h) * d + grp * 32;
        float amax = 0.0f;
        for (int64_t c = 0; c < 32; c++) {
            float a = fabsf(load1(src, bf16, at + c));
            amax = a > amax ? a : amax;
        }
        float sc = amax / qmax;
        if (!(sc > 0.0f)) sc = 1.0f;
        (is_v ? v_scales : k_scales)[dst / 32] = sc;
        uint8_t *out = (is_v ? v_cache : k_cache) + dst;
        for (int64_t c = 0; c < 32; c++) {
            float x = load1(src, bf16, at + c) / sc;
            out[c] = f32_to_kv8(x > qmax ? qmax : x < -qmax ? -qmax : x, kv);
        }
    }
}
