/* Per-row layers: RMSNorm, q/k norm + rotary, gated activations. */
#include "common.h"

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
