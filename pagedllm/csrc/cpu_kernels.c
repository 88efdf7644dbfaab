/* CPU kernels for the batch-1/small-batch decode path, where PyTorch's generic ops are
 * bound by per-op overhead or by a weight stream that runs far below memory bandwidth.
 *
 * Compiled at first use by pagedllm/model_executor/layers/cpu_kernels.py with
 * `gcc -O3 -march=native -fopenmp` and loaded with ctypes. Needs AVX-512 F/BW/VL and VNNI;
 * where they are missing the build fails and the Python side keeps its torch paths.
 * OpenMP: the library links libgomp.so.1, which resolves to the copy torch has already
 * loaded, so both share one thread pool.
 *
 * Tensors are passed as raw pointers; `bf16` flags say whether a float tensor is bfloat16
 * (1) or float32 (0). Accumulation is always float32 (int32 for the integer dot products).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if !defined(__AVX512F__) || !defined(__AVX512BW__) || !defined(__AVX512VL__) || !defined(__AVX512VNNI__)
#error "pagedllm CPU kernels need AVX-512 F, BW, VL and VNNI"
#endif

#define INLINE static inline __attribute__((always_inline))

/* ---------- float32 / bfloat16 loads and stores, 16 lanes ---------- */

INLINE __m512 bf16_to_f32(__m256i v) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16)); }

INLINE __m256i f32_to_bf16(__m512 v) {
    /* round to nearest even, as torch's .to(torch.bfloat16) does */
    __m512i x = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(x, 16), _mm512_set1_epi32(1));
    x = _mm512_add_epi32(x, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(x, 16));
}

INLINE __m512 load16(const void *p, int bf16, int64_t i, __mmask16 m) {
    if (bf16) return bf16_to_f32(_mm256_maskz_loadu_epi16(m, (const uint16_t *)p + i));
    return _mm512_maskz_loadu_ps(m, (const float *)p + i);
}

INLINE void store16(void *p, int bf16, int64_t i, __m512 v, __mmask16 m) {
    if (bf16) _mm256_mask_storeu_epi16((uint16_t *)p + i, m, f32_to_bf16(v));
    else _mm512_mask_storeu_ps((float *)p + i, m, v);
}

INLINE __mmask16 tail16(int64_t left) { return left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1); }

INLINE float bf16_scalar(uint16_t v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

INLINE uint16_t bf16_round(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7FFF + ((u >> 16) & 1);
    return (uint16_t)(u >> 16);
}

INLINE void store1(void *p, int bf16, int64_t i, float v) {
    if (bf16) ((uint16_t *)p)[i] = bf16_round(v);
    else ((float *)p)[i] = v;
}

INLINE float load1(const void *p, int bf16, int64_t i) {
    return bf16 ? bf16_scalar(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* ---------- activations as int16, one scale per row ---------- */

#define KPAD(k) (((k) + 127) / 128 * 128)

/* xq[r] = round(x[r] / sx[r]) with sx[r] = max|x[r]| / qmax, zero-padded to KPAD(k).
 * ~15 bits per value: the dot products below lose far less than bf16 activations would. */
static void quantize_rows_i16(const void *x, int bf16, int64_t m, int64_t k, float qmax, int16_t *xq, float *sx) {
    int64_t kp = KPAD(k);
    for (int64_t r = 0; r < m; r++) {
        const void *row = bf16 ? (const void *)((const uint16_t *)x + r * k) : (const void *)((const float *)x + r * k);
        __m512 amax = _mm512_setzero_ps();
        for (int64_t i = 0; i < k; i += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(load16(row, bf16, i, tail16(k - i))));
        float a = _mm512_reduce_max_ps(amax);
        sx[r] = a > 0 ? a / qmax : 1.0f;
        __m512 inv = _mm512_set1_ps(a > 0 ? qmax / a : 0.0f);
        int16_t *out = xq + r * kp;
        memset(out, 0, kp * sizeof(int16_t));
        for (int64_t i = 0; i < k; i += 16) {
            __mmask16 m16 = tail16(k - i);
            __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(load16(row, bf16, i, m16), inv));
            _mm256_mask_storeu_epi16(out + i, m16, _mm512_cvtsepi32_epi16(q));
        }
    }
}

/* ---------- weight-only int8 linear: y = x @ (q * scale)^T + bias ----------
 * One weight row at a time, for all activation rows: a single sequential stream per thread.
 * (Tiles of 4 weight rows, read side by side, ran at a third of the bandwidth here: the
 * hardware prefetchers follow 4 short interleaved streams poorly.) */

/* Lanes hold at most 2 * 2048 products of |127 * 32767| within a 4096-wide chunk: < 2^31. */
#define I8_CHUNK 4096

INLINE void w8_row(const int16_t *xq, int64_t kp, int M, const int8_t *wrow, int64_t k, float *out) {
    for (int r = 0; r < M; r++) out[r] = 0.0f;
    for (int64_t k0 = 0; k0 < k; k0 += I8_CHUNK) {
        int64_t k1 = k0 + I8_CHUNK < k ? k0 + I8_CHUNK : k;
        __m512i acc[4];
        for (int r = 0; r < M; r++) acc[r] = _mm512_setzero_si512();
        for (int64_t kk = k0; kk < k1; kk += 32) {
            __mmask32 m = k1 - kk >= 32 ? (__mmask32)0xFFFFFFFFu : (__mmask32)((1u << (k1 - kk)) - 1);
            __m512i wv = _mm512_cvtepi8_epi16(_mm256_maskz_loadu_epi8(m, wrow + kk));
            for (int r = 0; r < M; r++)
                acc[r] = _mm512_dpwssd_epi32(acc[r], _mm512_load_si512((const void *)(xq + r * kp + kk)), wv);
        }
        for (int r = 0; r < M; r++) out[r] += _mm512_reduce_add_ps(_mm512_cvtepi32_ps(acc[r]));
    }
}

#define W8_ROW_M(MM) w8_row(xq + r0 * kp, kp, MM, wrow, k, out)

void pl_w8a16_linear(const void *x, int x_bf16, int64_t m, int64_t k, const int8_t *w, const uint16_t *w_scale,
                     const void *bias, int64_t n, void *y, int y_bf16, int nthreads) {
    int64_t kp = KPAD(k);
    int16_t *xq = aligned_alloc(64, (size_t)(m * kp * sizeof(int16_t)));
    float *sx = malloc((size_t)m * sizeof(float));
    quantize_rows_i16(x, x_bf16, m, k, 32767.0f, xq, sx);
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t nn = 0; nn < n; nn++) {
        const int8_t *wrow = w + nn * k;
        float ws = bf16_scalar(w_scale[nn]), b = bias ? load1(bias, y_bf16, nn) : 0.0f;
        for (int64_t r0 = 0; r0 < m; r0 += 4) {
            float out[4];
            int M = m - r0 < 4 ? (int)(m - r0) : 4;
            switch (M) {  /* constant row counts, so the loops over rows unroll */
                case 1: W8_ROW_M(1); break;
                case 2: W8_ROW_M(2); break;
                case 3: W8_ROW_M(3); break;
                default: W8_ROW_M(4); break;
            }
            for (int r = 0; r < M; r++) store1(y, y_bf16, (r0 + r) * n + nn, out[r] * sx[r0 + r] * ws + b);
        }
    }
    free(sx);
    free(xq);
}

/* ---------- weight-only int4 linear, groups of g inputs: w = (q - 8) * s + z ----------
 * Packed per row in 128-input blocks of 64 bytes: byte i holds input i (low nibble) and
 * input 64 + i (high nibble). sz: [n, k / g, 2] float32 (s, z - 8 s), so w = q * s + sz[1]. Needs k % 128 == 0 and
 * g % 128 == 0.
 * The activations, quantized to |xq| <= 127 * 256 - 128, are split as xq = 256 * x1 + x2 with
 * x1 in [-127, 127] and x2 in [-128, 127],
 * so both halves run as u8 (nibble) x s8 VNNI dot products, 64 per instruction. */

static void split_rows_i8(const int16_t *xq, int64_t m, int64_t kp, int8_t *x1, int8_t *x2) {
    for (int64_t i = 0; i < m * kp; i++) {
        int v = xq[i], hi = (v + 128) >> 8;  /* floor((v + 128) / 256) */
        x1[i] = (int8_t)hi;
        x2[i] = (int8_t)(v - 256 * hi);
    }
}

INLINE void w4_row(const int8_t *x1, const int8_t *x2, int64_t kp, int M, const uint8_t *wrow, const float *sz,
                   int64_t g, const float *xsum, int64_t groups, float *out) {
    __m512 facc[4];
    float fz[4];
    for (int r = 0; r < M; r++) facc[r] = _mm512_setzero_ps(), fz[r] = 0.0f;
    const __m512i lo_mask = _mm512_set1_epi8(0x0F);
    for (int64_t gi = 0; gi < groups; gi++) {
        __m512i a[4], b[4];
        for (int r = 0; r < M; r++) a[r] = b[r] = _mm512_setzero_si512();
        for (int64_t k0 = gi * g; k0 < (gi + 1) * g; k0 += 128) {
            __m512i v = _mm512_loadu_si512((const void *)(wrow + k0 / 2));
            __m512i lo = _mm512_and_si512(v, lo_mask);
            __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), lo_mask);
            for (int r = 0; r < M; r++) {
                const int8_t *p1 = x1 + r * kp + k0, *p2 = x2 + r * kp + k0;
                a[r] = _mm512_dpbusd_epi32(a[r], lo, _mm512_load_si512((const void *)p1));
                a[r] = _mm512_dpbusd_epi32(a[r], hi, _mm512_load_si512((const void *)(p1 + 64)));
                b[r] = _mm512_dpbusd_epi32(b[r], lo, _mm512_load_si512((const void *)p2));
                b[r] = _mm512_dpbusd_epi32(b[r], hi, _mm512_load_si512((const void *)(p2 + 64)));
            }
        }
        float zb = sz[2 * gi + 1];
        __m512 sv = _mm512_set1_ps(sz[2 * gi]);
        for (int r = 0; r < M; r++) {
            __m512i d = _mm512_add_epi32(_mm512_slli_epi32(a[r], 8), b[r]);
            facc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), sv, facc[r]);
            fz[r] += zb * xsum[r * groups + gi];
        }
    }
    for (int r = 0; r < M; r++) out[r] = _mm512_reduce_add_ps(facc[r]) + fz[r];
}

#define W4_ROW_M(MM) w4_row(x1 + r0 * kp, x2 + r0 * kp, kp, MM, wrow, sz + nn * groups * 2, g, xsum + r0 * groups, groups, out)

void pl_w4a16_linear(const void *x, int x_bf16, int64_t m, int64_t k, const uint8_t *w, const float *sz,
                     int64_t g, const void *bias, int64_t n, void *y, int y_bf16, int nthreads) {
    int64_t kp = KPAD(k), groups = k / g;
    int16_t *xq = aligned_alloc(64, (size_t)(m * kp * sizeof(int16_t)));
    int8_t *x1 = aligned_alloc(64, (size_t)(m * kp)), *x2 = aligned_alloc(64, (size_t)(m * kp));
    float *sx = malloc((size_t)m * sizeof(float));
    float *xsum = malloc((size_t)(m * groups) * sizeof(float));
    quantize_rows_i16(x, x_bf16, m, k, 127.0f * 256.0f - 128.0f, xq, sx);
    split_rows_i8(xq, m, kp, x1, x2);
    for (int64_t r = 0; r < m; r++)
        for (int64_t gi = 0; gi < groups; gi++) {
            int64_t s = 0;
            for (int64_t i = gi * g; i < (gi + 1) * g; i++) s += xq[r * kp + i];
            xsum[r * groups + gi] = (float)s;
        }
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t nn = 0; nn < n; nn++) {
        const uint8_t *wrow = w + nn * (k / 2);
        for (int64_t r0 = 0; r0 < m; r0 += 4) {
            float out[4];
            int M = m - r0 < 4 ? (int)(m - r0) : 4;
            switch (M) {
                case 1: W4_ROW_M(1); break;
                case 2: W4_ROW_M(2); break;
                case 3: W4_ROW_M(3); break;
                default: W4_ROW_M(4); break;
            }
            for (int r = 0; r < M; r++) {
                float v = out[r] * sx[r0 + r];
                if (bias) v += load1(bias, y_bf16, nn);
                store1(y, y_bf16, (r0 + r) * n + nn, v);
            }
        }
    }
    free(xsum);
    free(sx);
    free(x2);
    free(x1);
    free(xq);
}

/* ---------- paged decode attention: one query token per sequence ----------
 * q, out: [s, hq, d]; caches: [blocks, block_size, hk, d]; block_tables: [s, bt_stride];
 * seq_lens include the new token (already written to the cache). Each (sequence, kv head)
 * is one task that reads its keys through the block table once for all hq / hk query
 * heads: scores, an exact float32 softmax, then the weighted sum of values. d % 32 == 0. */

#define MAX_GROUP 8

/* e^x as 2^n * e^r with |r| <= ln2 / 2 and a degree-7 Taylor polynomial, within ~2 ulp of
 * expf; 0 below -103, inf above ~88.7 (scalef saturates). */
INLINE __m512 exp512(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-103.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504089f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
    __m512 p = _mm512_set1_ps(1.0f / 5040);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

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

/* ---------- RMSNorm over rows of `cols` ----------
 * Row r of x starts at (r / inner) * stride_outer + (r % inner) * stride_inner (so a
 * [tokens, heads, head_dim] view of a wider projection needs no copy); out is contiguous.
 * gemma = 1: out = cast(x * rsqrt(mean(x^2) + eps) * w)          (w = 1 + weight, float32)
 * gemma = 0: out = cast(cast(x * rsqrt(mean(x^2) + eps)) * w)    (Llama: scale after the cast)
 * With `residual`, out = cast(residual + that) instead (the add of a post-norm). */

void pl_rms_norm(const void *x, int64_t rows, int64_t cols, int64_t inner, int64_t stride_outer, int64_t stride_inner,
                 int bf16, const float *w, float eps, int gemma, const void *residual, void *out, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(rows >= 16 ? nthreads : 1)
    for (int64_t r = 0; r < rows; r++) {
        int64_t base = (r / inner) * stride_outer + (r % inner) * stride_inner;
        const void *row = bf16 ? (const void *)((const uint16_t *)x + base) : (const void *)((const float *)x + base);
        __m512 ss = _mm512_setzero_ps();
        for (int64_t c = 0; c < cols; c += 16) {
            __m512 v = load16(row, bf16, c, tail16(cols - c));
            ss = _mm512_fmadd_ps(v, v, ss);
        }
        __m512 rs = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(ss) / (float)cols + eps));
        for (int64_t c = 0; c < cols; c += 16) {
            __mmask16 m = tail16(cols - c);
            __m512 v = _mm512_mul_ps(load16(row, bf16, c, m), rs);
            __m512 wv = _mm512_maskz_loadu_ps(m, w + c);
            if (gemma) {
                v = _mm512_mul_ps(v, wv);
            } else {
                if (bf16) v = bf16_to_f32(f32_to_bf16(v));
                v = _mm512_mul_ps(v, wv);
            }
            if (residual) {
                if (bf16) v = bf16_to_f32(f32_to_bf16(v));
                v = _mm512_add_ps(v, load16(residual, bf16, r * cols + c, m));
            }
            store16(out, bf16, r * cols + c, v, m);
        }
    }
}

/* ---------- top-k indices per row (any order) ----------
 * A k-entry min-heap per row; the scan compares 16 values at a time against the heap's
 * minimum, so only the rare values that beat it cost more than a compare. Among equal
 * values the earlier index is kept. NaN is never selected. */

INLINE void heap_sift_down(float *val, int64_t *idx, int64_t k, int64_t i) {
    for (;;) {
        int64_t l = 2 * i + 1, r = l + 1, m = i;
        if (l < k && (val[l] < val[m] || (val[l] == val[m] && idx[l] > idx[m]))) m = l;
        if (r < k && (val[r] < val[m] || (val[r] == val[m] && idx[r] > idx[m]))) m = r;
        if (m == i) return;
        float tv = val[i]; val[i] = val[m]; val[m] = tv;
        int64_t ti = idx[i]; idx[i] = idx[m]; idx[m] = ti;
        i = m;
    }
}

void pl_topk_indices(const void *x, int bf16, int64_t rows, int64_t n, int64_t k, int64_t *out, int nthreads) {
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads)
    for (int64_t r = 0; r < rows; r++) {
        const void *row = bf16 ? (const void *)((const uint16_t *)x + r * n) : (const void *)((const float *)x + r * n);
        float *val = malloc((size_t)k * sizeof(float));
        int64_t *idx = out + r * k;
        for (int64_t i = 0; i < k; i++) {
            float v = load1(row, bf16, i);
            val[i] = v != v ? -INFINITY : v, idx[i] = i;
        }
        for (int64_t i = k / 2 - 1; i >= 0; i--) heap_sift_down(val, idx, k, i);
        for (int64_t i = k; i < n; i += 16) {
            __mmask16 m = _mm512_mask_cmp_ps_mask(tail16(n - i), load16(row, bf16, i, tail16(n - i)),
                                                  _mm512_set1_ps(val[0]), _CMP_GT_OQ);
            while (m) {
                int j = __builtin_ctz(m);
                m &= m - 1;
                float v = load1(row, bf16, i + j);
                if (v > val[0]) {  /* the minimum may have risen within this vector */
                    val[0] = v, idx[0] = i + j;
                    heap_sift_down(val, idx, k, 0);
                }
            }
        }
        free(val);
    }
}

/* ---------- re-scoring chosen logits ----------
 * logits[r, idx[r, j]] = hidden[r] . weight[idx[r, j]] for j < k, in float32: the exact
 * values of a quantized head's candidates, without gathering [rows, k, hidden] weights. */

void pl_rescore_logits(const void *hidden, int h_bf16, int64_t rows, int64_t dim, const void *weight, int w_bf16,
                       const int64_t *idx, int64_t k, void *logits, int l_bf16, int64_t vocab, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t rj = 0; rj < rows * k; rj++) {
        int64_t r = rj / k, id = idx[rj];
        __m512 acc = _mm512_setzero_ps();
        for (int64_t c = 0; c < dim; c += 16) {
            __mmask16 m = tail16(dim - c);
            acc = _mm512_fmadd_ps(load16(hidden, h_bf16, r * dim + c, m), load16(weight, w_bf16, id * dim + c, m), acc);
        }
        store1(logits, l_bf16, r * vocab + id, _mm512_reduce_add_ps(acc));
    }
}

/* ---------- gated activations: out = act(gate) * up over rows of [gate | up] ----------
 * act 0: SiLU, x / (1 + e^-x); act 1: GELU, tanh approximation. Float32 inside, one rounding
 * at the end (torch rounds act(gate) before the multiply in bf16). */

/* 1 / (1 + e^-x): reciprocal estimate plus one Newton step (~1 ulp), not a division. */
INLINE __m512 sigmoid512(__m512 x) {
    __m512 d = _mm512_add_ps(_mm512_set1_ps(1.0f), exp512(_mm512_sub_ps(_mm512_setzero_ps(), x)));
    __m512 r = _mm512_rcp14_ps(d);
    r = _mm512_mul_ps(r, _mm512_fnmadd_ps(d, r, _mm512_set1_ps(2.0f)));
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(d, _mm512_set1_ps(INFINITY), _CMP_NEQ_OQ), r);
}

void pl_act_and_mul(const void *x, int bf16, int64_t rows, int64_t d, int act, void *out, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(rows * d >= 65536 ? nthreads : 1)
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t c = 0; c < d; c += 16) {
            __mmask16 m = tail16(d - c);
            __m512 g = load16(x, bf16, r * 2 * d + c, m), u = load16(x, bf16, r * 2 * d + d + c, m), s;
            if (act == 0) {
                s = sigmoid512(g);  /* silu(g) = g * sigmoid(g) */
            } else {
                /* gelu_tanh(g) = 0.5 g (1 + tanh(t)) = g * sigmoid(2t), t = k (g + 0.044715 g^3) */
                __m512 t = _mm512_mul_ps(_mm512_set1_ps(0.7978845608028654f),
                                         _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(0.044715f), g), _mm512_mul_ps(g, g), g));
                s = sigmoid512(_mm512_add_ps(t, t));
            }
            store16(out, bf16, r * d + c, _mm512_mul_ps(_mm512_mul_ps(g, s), u), m);
        }
    }
}

/* ---------- argmax per row, as torch.max(dim) gives it ----------
 * The first maximum's index; the first NaN's if the row has one; 0 for a row of -inf.
 * Each lane keeps its own first maximum (strict >), so the smallest index among the lanes
 * holding the row's maximum is the row's first. */

void pl_argmax_rows(const void *x, int bf16, int64_t rows, int64_t n, int64_t stride, int64_t *out, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(rows * n >= 65536 ? nthreads : 1)
    for (int64_t r = 0; r < rows; r++) {
        const void *row = bf16 ? (const void *)((const uint16_t *)x + r * stride) : (const void *)((const float *)x + r * stride);
        __m512 best = _mm512_set1_ps(-INFINITY);
        __m512i at = _mm512_setzero_si512(), iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        __mmask16 nan = 0;
        int64_t i = 0;
        for (; i < n && i < ((int64_t)1 << 31) - 16; i += 16) {
            __mmask16 m = tail16(n - i);
            __m512 v = load16(row, bf16, i, m);
            nan |= _mm512_mask_cmp_ps_mask(m, v, v, _CMP_UNORD_Q);
            __mmask16 gt = _mm512_mask_cmp_ps_mask(m, v, best, _CMP_GT_OQ);
            best = _mm512_mask_mov_ps(best, gt, v);
            at = _mm512_mask_mov_epi32(at, gt, _mm512_add_epi32(iota, _mm512_set1_epi32((int)i)));
        }
        int64_t result = 0;
        if (nan) {
            for (int64_t j = 0; j < n; j++) {
                float v = load1(row, bf16, j);
                if (v != v) { result = j; break; }
            }
        } else {
            float mx = _mm512_reduce_max_ps(best);
            __mmask16 is_max = _mm512_cmp_ps_mask(best, _mm512_set1_ps(mx), _CMP_EQ_OQ);
            if (is_max) result = _mm512_mask_reduce_min_epi32(is_max, at);
        }
        out[r] = result;
    }
}

/* ---------- q/k RMSNorm and rotary embedding, straight from the fused qkv output ----------
 * qkv rows: [q heads | k heads | v heads] * d, row_stride elements apart. Each q and k head is
 * normalised (when its weight is given; as pl_rms_norm, rounded to the dtype as torch's norm
 * output is) and rotated (neox style: halves of the first `rot` dims; cos/sin rows of
 * `rot` floats at the token's position), then written to q_out [T, hq, d] / k_out [T, hk, d].
 * Needs rot % 32 == 0 and d <= 1024. */

void pl_qk_norm_rope(const void *qkv, int bf16, int64_t T, int64_t row_stride, int64_t hq, int64_t hk, int64_t d,
                     const float *q_w, const float *k_w, float eps, int gemma, const float *cos_cache,
                     const float *sin_cache, const int64_t *positions, int64_t rot, void *q_out, void *k_out,
                     int nthreads) {
#pragma omp parallel for schedule(static) num_threads(T >= 8 ? nthreads : 1)
    for (int64_t task = 0; task < T * (hq + hk); task++) {
        int64_t t = task / (hq + hk), h = task % (hq + hk), half = rot / 2;
        int is_q = h < hq;
        const float *w = is_q ? q_w : k_w;
        void *dst = is_q ? q_out : k_out;
        int64_t at = is_q ? (t * hq + h) * d : (t * hk + h - hq) * d, src = t * row_stride + h * d;
        float y[1024];
        for (int64_t c = 0; c < d; c += 16) _mm512_mask_storeu_ps(y + c, tail16(d - c), load16(qkv, bf16, src + c, tail16(d - c)));
        if (w) {
            __m512 ss = _mm512_setzero_ps();
            for (int64_t c = 0; c < d; c += 16) {
                __m512 v = _mm512_maskz_loadu_ps(tail16(d - c), y + c);
                ss = _mm512_fmadd_ps(v, v, ss);
            }
            __m512 rs = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(ss) / (float)d + eps));
            for (int64_t c = 0; c < d; c += 16) {
                __mmask16 m = tail16(d - c);
                __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, y + c), rs);
                if (!gemma && bf16) v = bf16_to_f32(f32_to_bf16(v));
                v = _mm512_mul_ps(v, _mm512_maskz_loadu_ps(m, w + c));
                if (bf16) v = bf16_to_f32(f32_to_bf16(v));
                _mm512_mask_storeu_ps(y + c, m, v);
            }
        }
        const float *cs = cos_cache + positions[t] * rot, *sn = sin_cache + positions[t] * rot;
        for (int64_t c = 0; c < half; c += 16) {
            __m512 a = _mm512_loadu_ps(y + c), b = _mm512_loadu_ps(y + half + c);
            store16(dst, bf16, at + c,
                    _mm512_fnmadd_ps(b, _mm512_loadu_ps(sn + c), _mm512_mul_ps(a, _mm512_loadu_ps(cs + c))), 0xFFFF);
            store16(dst, bf16, at + half + c,
                    _mm512_fmadd_ps(a, _mm512_loadu_ps(sn + half + c), _mm512_mul_ps(b, _mm512_loadu_ps(cs + half + c))),
                    0xFFFF);
        }
        for (int64_t c = rot; c < d; c += 16) store16(dst, bf16, at + c, _mm512_maskz_loadu_ps(tail16(d - c), y + c), tail16(d - c));
    }
}
