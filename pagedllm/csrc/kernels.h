/* The library's exports: every function Python calls, declared once.
 *
 * Each *.c file includes this header (through common.h), so gcc checks every definition against
 * its declaration here, and the build (-Werror=missing-prototypes) fails on a non-static function
 * not declared anywhere. pagedllm/model_executor/layers/cpu_kernels.py reads this file to set the
 * ctypes argument types: a pointer of any kind is a void pointer there, `int64_t` a 64-bit and
 * `int` a 32-bit integer, `float` a float. Keep each declaration in that vocabulary, one
 * `void pl_...(...);` each; `bf16` flags are 1 for a bfloat16 tensor and 0 for float32, and
 * `nthreads` is the OpenMP team size.
 */
#ifndef PAGEDLLM_KERNELS_H
#define PAGEDLLM_KERNELS_H

#include <stdint.h>

/* attention.c: one query token per sequence against its paged K/V (window: 0, or the sliding window;
 * kv: vec.h's KV kind, with a scale per 32 elements for a byte cache), and a step's K/V into a byte cache */
void pl_paged_decode_attention(const void *q, int64_t num_seqs, int64_t hq, int64_t hk, int64_t d, const void *k_cache,
                               const void *v_cache, int64_t block_size, int bf16, int kv, const float *k_scales,
                               const float *v_scales, const int64_t *block_tables, int64_t table_stride,
                               const int64_t *seq_lens, int64_t window, float scale, void *out, int nthreads);
void pl_kv_cache_write(const void *k, const void *v, int bf16, int64_t n, int64_t hk, int64_t d, int64_t k_stride,
                       int64_t v_stride, const int64_t *slots, uint8_t *k_cache, uint8_t *v_cache, float *k_scales,
                       float *v_scales, int kv, int nthreads);

/* gemv_int4.c: y[m, n] = x[m, k] @ dequant(w)^T (+ bias), int4 with per-group scales and zeros */
void pl_w4a16_linear(const void *x, int x_bf16, int64_t m, int64_t k, const uint8_t *w, const float *sz, int64_t g,
                     const void *bias, int64_t n, void *y, int y_bf16, int nthreads);
/* the same with 8-bit activations, no bias: an LM head's ranking */
void pl_w4a8_rank(const void *x, int x_bf16, int64_t m, int64_t k, const uint8_t *w, const float *sz, int64_t g,
                  int64_t n, void *y, int y_bf16, int nthreads);

/* gemv_int8.c: the int8 weight-only linear, the W8A8 ranking of a head's rows, and int8 row sums */
void pl_w8a16_linear(const void *x, int x_bf16, int64_t m, int64_t k, const int8_t *w, const uint16_t *w_scale,
                     const void *bias, int64_t n, void *y, int y_bf16, int nthreads);
void pl_u8s8_rank(const void *x, int x_bf16, int64_t m, int64_t k, const int8_t *w, const uint16_t *w_scale,
                  const int32_t *w_sum, int64_t n, void *y, int y_bf16, int nthreads);
void pl_i8_row_sums(const int8_t *w, int64_t n, int64_t k, int32_t *out, int nthreads);

/* gguf.c: a GGUF tensor's rows to floats, an LM head's candidates re-scored from its blocks, and the
 * linear over its blocks (type: ggml's type id) */
void pl_gguf_dequantize(int type, const uint8_t *w, int64_t row_bytes, int64_t k, const int64_t *rows, int64_t count,
                        void *out, int out_bf16, int64_t ldo, int nthreads);
/* logits[r, idx[r, j]] = hidden[r] . row idx[r, j] of W (dequantized in hidden's dtype), j < topk */
void pl_gguf_rescore(int type, const uint8_t *w, int64_t row_bytes, int64_t k, const void *hidden, int h_bf16,
                     int64_t rows, const int64_t *idx, int64_t topk, void *logits, int l_bf16, int64_t vocab,
                     int nthreads);
/* gguf_x8.c: n (a multiple of 8) Q4_K / Q6_K / Q5_0 / Q4_0 rows repacked 8 at a time (type | GG_X8
 * for the linear); out: n rows of units (k / 256 super-blocks, k / 32 legacy blocks), contiguous */
void pl_gguf_repack(int type, const uint8_t *w, int64_t row_bytes, int64_t n, int64_t k, uint8_t *out, int nthreads);
void pl_gguf_linear(int type, const uint8_t *w, int64_t row_bytes, int64_t n, int64_t k, const void *x, int x_bf16,
                    int64_t m, const void *bias, void *y, int y_bf16, int64_t ldy, int nthreads);

/* pointwise.c: RMSNorm (optionally with a residual add), q/k norm + rotary, gated activations */
void pl_rms_norm(const void *x, int64_t rows, int64_t cols, int64_t inner, int64_t stride_outer, int64_t stride_inner,
                 int bf16, const float *w, float eps, int gemma, const void *residual, void *out, int nthreads);
void pl_qk_norm_rope(const void *qkv, int bf16, int64_t T, int64_t row_stride, int64_t hq, int64_t hk, int64_t d,
                     const float *q_w, const float *k_w, float eps, int gemma, const float *cos_cache,
                     const float *sin_cache, const int64_t *positions, int64_t rot, void *q_out, void *k_out,
                     int nthreads);
void pl_act_and_mul(const void *x, int bf16, int64_t rows, int64_t d, int act, void *out, int nthreads);

/* sampling.c: top-k indices and argmax over logits rows, exact re-scoring of chosen logits, a
 * random draw per row from probabilities, each row's top-p nucleus (keep: 1 byte a token) */
void pl_topk_indices(const void *x, int bf16, int64_t rows, int64_t n, int64_t k, int64_t *out, int nthreads);
void pl_rescore_logits(const void *hidden, int h_bf16, int64_t rows, int64_t dim, const void *weight, int w_bf16,
                       const int64_t *idx, int64_t k, void *logits, int l_bf16, int64_t vocab, int nthreads);
void pl_argmax_rows(const void *x, int bf16, int64_t rows, int64_t n, int64_t stride, int64_t *out, int nthreads);
void pl_sample_from_probs(const float *probs, int64_t rows, int64_t n, const double *u, int64_t *out, int nthreads);
void pl_top_p_keep(const float *probs, int64_t rows, int64_t n, const double *top_p, uint8_t *keep, int nthreads);

#endif /* PAGEDLLM_KERNELS_H */
