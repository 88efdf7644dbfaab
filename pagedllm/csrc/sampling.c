/* Over the logits: top-k selection, re-scoring chosen logits, argmax, the top-p nucleus, a draw. */
#include "common.h"

/* ---------- top-k indices per row (any order) ----------
 * A k-entry min-heap per row; the scan compares a vector of values at a time against the heap's
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
        const void *row = row_ptr(x, bf16, r * n);
        float *val = malloc((size_t)k * sizeof(float));
        int64_t *idx = out + r * k;
        for (int64_t i = 0; i < k; i++) {
            float v = load1(row, bf16, i);
            val[i] = v != v ? -INFINITY : v, idx[i] = i;
        }
        for (int64_t i = k / 2 - 1; i >= 0; i--) heap_sift_down(val, idx, k, i);
        for (int64_t i = k; i < n; i += VL) {
            unsigned m = vm_bits(vm_and(vm_tail(n - i), vgt(vload(row, bf16, i, n - i), vset1(val[0]))));
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
        store1(logits, l_bf16, r * vocab + id, vdot(hidden, h_bf16, r * dim, weight, w_bf16, id * dim, dim));
    }
}

/* ---------- argmax per row, as torch.max(dim) gives it ----------
 * The first maximum's index; the first NaN's if the row has one; 0 for a row of -inf.
 * Each lane keeps its own first maximum (strict >), so the smallest index among the lanes
 * holding the row's maximum is the row's first. */

void pl_argmax_rows(const void *x, int bf16, int64_t rows, int64_t n, int64_t stride, int64_t *out, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(rows * n >= 65536 ? nthreads : 1)
    for (int64_t r = 0; r < rows; r++) {
        const void *row = row_ptr(x, bf16, r * stride);
        vf best = vset1(-INFINITY);
        vi at = vi_zero();
        vm nan = vm_none();
        int64_t i = 0;
        for (; i < n && i < ((int64_t)1 << 31) - VL; i += VL) {
            vm m = vm_tail(n - i);
            vf v = vload(row, bf16, i, n - i);
            nan = vm_or(nan, vm_and(m, visnan(v)));
            vm gt = vm_and(m, vgt(v, best));
            best = vsel(gt, v, best);
            at = vi_sel(gt, vi_iota((int32_t)i), at);
        }
        int64_t result = 0;
        if (vm_bits(nan)) {
            for (int64_t j = 0; j < n; j++) {
                float v = load1(row, bf16, j);
                if (v != v) { result = j; break; }
            }
        } else {
            vm is_max = veq(best, vset1(vhmax(best)));
            if (vm_bits(is_max)) result = vi_min_where(is_max, at);
        }
        out[r] = result;
    }
}

/* ---------- one random draw per row from unnormalised probabilities (inverse CDF) ----------
 * Row r's token is the first i with p[0] + .. + p[i] > u[r] * (p[0] + .. + p[n - 1]): a draw from p / sum(p) for u uniform in [0, 1), one random number a
 * row where an exponential race takes one per token. Sums in double: the row's blocks of
 * SAMPLE_BLOCK values (8 lanes, then the lanes in a fixed order), their running totals, the
 * first block whose running total passes the target, then that block value by value. A
 * crossing is always at a positive p; where the scan's own rounding stops short of the target,
 * the block's last positive value is taken. A row whose sum is not a positive finite number
 * gets -1 (NaNs, or nothing to draw: the caller decides). */
#define SAMPLE_BLOCK 512

INLINE double sample_block_sum(const float *p, int64_t len) {
    double lane[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= len; i += 8)
        for (int l = 0; l < 8; l++) lane[l] += (double)p[i + l];
    for (int l = 0; i < len; i++, l++) lane[l] += (double)p[i];
    return ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
}

void pl_sample_from_probs(const float *probs, int64_t rows, int64_t n, const double *u, int64_t *out, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(rows * n >= 65536 ? nthreads : 1)
    for (int64_t r = 0; r < rows; r++) {
        const float *p = probs + r * n;
        const int64_t nblk = (n + SAMPLE_BLOCK - 1) / SAMPLE_BLOCK;
        double *cum = malloc((size_t)(nblk > 0 ? nblk : 1) * sizeof(double)), total = 0.0;
        for (int64_t b = 0; b < nblk; b++) {
            int64_t len = n - b * SAMPLE_BLOCK < SAMPLE_BLOCK ? n - b * SAMPLE_BLOCK : SAMPLE_BLOCK;
            cum[b] = total += sample_block_sum(p + b * SAMPLE_BLOCK, len);
        }
        int64_t choice = -1;
        if (total > 0.0 && isfinite(total)) {
            const double target = u[r] * total;
            int64_t b = 0;
            while (cum[b] <= target && b < nblk - 1) b++;
            const int64_t start = b * SAMPLE_BLOCK, end = start + SAMPLE_BLOCK < n ? start + SAMPLE_BLOCK : n;
            double run = b > 0 ? cum[b - 1] : 0.0;
            for (int64_t i = start; i < end; i++) {
                if (!(p[i] > 0.0f)) continue;
                choice = i;
                if ((run += (double)p[i]) > target) break;
            }
        }
        out[r] = choice;
        free(cum);
    }
}

/* ---------- top-p nucleus per row, without a sort ----------
 * keep[r, i] = 1 for the tokens of row r's nucleus: those whose mass above them (every likelier
 * token's probability, in descending order) is under top_p[r]; every token where the row's
 * mass does not reach top_p. A positive float's bits rise with its value, so their top 13
 * (exponent and 4 mantissa bits: buckets ~4% wide) bucket a row in one pass, each bucket's mass
 * summed in double. Buckets above the one where the running mass (from the top) reaches top_p
 * are kept whole, those below dropped; only that bucket's tokens are sorted (probability
 * descending, then index), and kept while the mass above them is under top_p. Zeros, negative
 * values and -0.0 go to bucket 0, NaN and inf to the top one. */
#define NUCLEUS_BUCKETS 4096

typedef struct {
    float p;
    int64_t i;
} nucleus_tok;

static int nucleus_cmp(const void *a, const void *b) {
    const nucleus_tok *x = a, *y = b;
    if (x->p != y->p) return x->p > y->p ? -1 : 1;
    return x->i < y->i ? -1 : x->i > y->i;
}

INLINE int nucleus_bucket(float v) {
    uint32_t bits;
    memcpy(&bits, &v, 4);
    if (bits >> 31 || bits == 0) return 0;
    return bits >= 0x7F800000u ? NUCLEUS_BUCKETS - 1 : (int)(bits >> 19);
}

void pl_top_p_keep(const float *probs, int64_t rows, int64_t n, const double *top_p, uint8_t *keep, int nthreads) {
#pragma omp parallel for schedule(dynamic, 1) num_threads(rows > 1 ? nthreads : 1)
    for (int64_t r = 0; r < rows; r++) {
        const float *p = probs + r * n;
        uint8_t *k = keep + r * n;
        double *mass = calloc(NUCLEUS_BUCKETS, sizeof(double));
        int64_t *count = calloc(NUCLEUS_BUCKETS, sizeof(int64_t));
        for (int64_t i = 0; i < n; i++) {
            int b = nucleus_bucket(p[i]);
            mass[b] += (double)p[i];
            count[b]++;
        }
        const double tp = top_p[r];
        double above = 0.0;
        int cut = -1; /* the bucket where the running mass reaches top_p; -1: it never does */
        for (int b = NUCLEUS_BUCKETS - 1; b >= 0; b--) {
            if (above + mass[b] >= tp) {
                cut = b;
                break;
            }
            above += mass[b];
        }
        nucleus_tok *edge = malloc((size_t)(cut >= 0 && count[cut] ? count[cut] : 1) * sizeof(nucleus_tok));
        int64_t m = 0;
        for (int64_t i = 0; i < n; i++) {
            int b = nucleus_bucket(p[i]);
            k[i] = b > cut;
            if (b == cut) edge[m].p = p[i], edge[m++].i = i;
        }
        qsort(edge, (size_t)m, sizeof(nucleus_tok), nucleus_cmp);
        for (int64_t j = 0; j < m; j++) {
            k[edge[j].i] = above < tp;
            above += (double)edge[j].p;
        }
        free(edge);
        free(count);
        free(mass);
    }
}
