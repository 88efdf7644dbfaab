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
        const void *row = row_ptr(x, bf16, (r / inner) * stride_outer + (r % inner) * stride_inner);
        vf ss = vzero();
        for (int64_t c = 0; c < cols; c += VL) {
            vf v = vload(row, bf16, c, cols - c);
            ss = vfmadd(v, v, ss);
        }
        vf rs = vset1(1.0f / sqrtf(vhsum(ss) / (float)cols + eps));
        for (int64_t c = 0; c < cols; c += VL) {
            vf v = vmul(vload(row, bf16, c, cols - c), rs);
            if (!gemma && bf16) v = vround_bf16(v);
            v = vmul(v, vloadf(w + c, cols - c));
            if (residual) {
                if (bf16) v = vround_bf16(v);
                v = vadd(v, vload(residual, bf16, r * cols + c, cols - c));
            }
            vstore(out, bf16, r * cols + c, v, cols - c);
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
        for (int64_t c = 0; c < d; c += VL) vstoref(y + c, vload(qkv, bf16, src + c, d - c), d - c);
        if (w) {
            vf ss = vzero();
            for (int64_t c = 0; c < d; c += VL) {
                vf v = vloadf(y + c, d - c);
                ss = vfmadd(v, v, ss);
            }
            vf rs = vset1(1.0f / sqrtf(vhsum(ss) / (float)d + eps));
            for (int64_t c = 0; c < d; c += VL) {
                vf v = vmul(vloadf(y + c, d - c), rs);
                if (!gemma && bf16) v = vround_bf16(v);
                v = vmul(v, vloadf(w + c, d - c));
                if (bf16) v = vround_bf16(v);
                vstoref(y + c, v, d - c);
            }
        }
        const float *cs = cos_cache + positions[t] * rot, *sn = sin_cache + positions[t] * rot;
        for (int64_t c = 0; c < half; c += VL) {
            vf a = vloadf(y + c, VL), b = vloadf(y + half + c, VL);
            vstore(dst, bf16, at + c, vfnmadd(b, vloadf(sn + c, VL), vmul(a, vloadf(cs + c, VL))), VL);
            vstore(dst, bf16, at + half + c, vfmadd(a, vloadf(sn + half + c, VL), vmul(b, vloadf(cs + half + c, VL))),
                   VL);
        }
        for (int64_t c = rot; c < d; c += VL) vstore(dst, bf16, at + c, vloadf(y + c, d - c), d - c);
    }
}

/* ---------- gated activations: out = act(gate) * up over rows of [gate | up] ----------
 * ACT_SILU: x / (1 + e^-x); ACT_GELU_TANH: GELU, tanh approximation, as g * sigmoid(2t) with
 * t = k (g + 0.044715 g^3). Float32 inside, one rounding at the end (torch rounds act(gate)
 * before the multiply in bf16). cpu_kernels.ACTIVATIONS reads the ids from this enum. */
enum { ACT_SILU = 0, ACT_GELU_TANH = 1 };

void pl_act_and_mul(const void *x, int bf16, int64_t rows, int64_t d, int act, void *out, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(rows * d >= 65536 ? nthreads : 1)
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t c = 0; c < d; c += VL) {
            vf g = vload(x, bf16, r * 2 * d + c, d - c), u = vload(x, bf16, r * 2 * d + d + c, d - c), s;
            if (act == ACT_SILU) {
                s = vsigmoid(g);
            } else {
                vf t = vmul(vset1(0.7978845608028654f), vfmadd(vmul(vset1(0.044715f), g), vmul(g, g), g));
                s = vsigmoid(vadd(t, t));
            }
            vstore(out, bf16, r * d + c, vmul(vmul(g, s), u), d - c);
        }
    }
}
