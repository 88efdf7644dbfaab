/* The core's ceiling for the GGUF panels: 256-bit vpdpbusd throughput with no memory traffic, and
 * the same multiply-adds in the panels' shape (4 activation rows x 16 outputs, a row's 16 bytes
 * broadcast per 4 steps by vpshufd, each 8-step sub-block's int32 sum scaled by vpmulld), with
 * the weights and activations streamed from L1/L2 as a panel's are.
 *
 *   gcc -O3 -march=native benchmarks/vnni_peak.c -o /tmp/vnni_peak && /tmp/vnni_peak
 *
 * One thread; a vpdpbusd on 256 bits is 32 multiply-adds. The clock is estimated from a chain of
 * dependent integer adds (one a cycle). Every loop over accumulators is unrolled, so they stay in
 * registers: an accumulator kept in memory makes each vpdpbusd wait on a store and a load, and
 * the loop measures that instead (half the rate at 16 chains). */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static double clock_ghz(void) {
    uint64_t x = 0;
    const long n = 500000000L;
    double t0 = now();
    for (long i = 0; i < n; i++) __asm__ volatile("add $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\tadd $1, %0" : "+r"(x));
    return 4.0 * n / (now() - t0) / 1e9;
}

/* 8 or 16 independent accumulators, registers only: the instruction's throughput once its
 * latency is covered. The instructions are written out (inline asm, 8 to a statement: an asm
 * takes at most 30 operands) so that nothing but them runs in the loop. */
#define DP(i) "vpdpbusd %[y], %[x], %" #i "\n\t"
#define DP8(a0, a1, a2, a3, a4, a5, a6, a7)                                                        \
    __asm__ volatile(DP(0) DP(1) DP(2) DP(3) DP(4) DP(5) DP(6) DP(7)                                \
                     : "+v"(a0), "+v"(a1), "+v"(a2), "+v"(a3), "+v"(a4), "+v"(a5), "+v"(a6), "+v"(a7) \
                     : [x] "v"(x), [y] "v"(y))
static double chains(long n, int chains) {
    __m256i a0 = _mm256_set1_epi32(0), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    __m256i b0 = a0, b1 = a0, b2 = a0, b3 = a0, b4 = a0, b5 = a0, b6 = a0, b7 = a0;
    __m256i x = _mm256_set1_epi8(3), y = _mm256_set1_epi8(5);
    double t0 = now();
    if (chains == 8)
        for (long i = 0; i < n; i++) DP8(a0, a1, a2, a3, a4, a5, a6, a7);
    else
        for (long i = 0; i < n; i++) {
            DP8(a0, a1, a2, a3, a4, a5, a6, a7);
            DP8(b0, b1, b2, b3, b4, b5, b6, b7);
        }
    double t = now() - t0;
    __m256i s[] = {a0, a1, a2, a3, a4, a5, a6, a7, b0, b1, b2, b3, b4, b5, b6, b7}, sum = a0;
    for (int i = 1; i < 16; i++) sum = _mm256_add_epi32(sum, s[i]);
    if (_mm256_extract_epi32(sum, 0) == 42) printf(" ");
    return (double)n * chains / t;
}

/* The panel tile's inner loop: 4 rows x 2 panels, 8-step units, a scale multiply per unit */
static double panel_shape(const uint8_t *w, const int8_t *x, long n) {
    __m256i tot[8];
    for (int i = 0; i < 8; i++) tot[i] = _mm256_setzero_si256();
    double t0 = now();
    for (long u0 = 0; u0 < n; u0 += 8) {
        __m256i u[8];
        for (int i = 0; i < 8; i++) u[i] = _mm256_setzero_si256();
#pragma GCC unroll 2
        for (long t = u0; t < u0 + 8; t += 4) {
            long tw = t & 2047, tx = (4 * t) & 8191;
            __m256i wv[2][4];
#pragma GCC unroll 2
            for (int p = 0; p < 2; p++)
#pragma GCC unroll 4
                for (int s = 0; s < 4; s++)
                    wv[p][s] = _mm256_load_si256((const __m256i *)(w + 65600 * p + 32 * (tw + s)));
#pragma GCC unroll 4
            for (int r = 0; r < 4; r++) {
                __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(x + 8256 * r + tx)));
                __m256i xb[4] = {_mm256_shuffle_epi32(v, 0x00), _mm256_shuffle_epi32(v, 0x55),
                                 _mm256_shuffle_epi32(v, 0xAA), _mm256_shuffle_epi32(v, 0xFF)};
#pragma GCC unroll 4
                for (int s = 0; s < 4; s++)
#pragma GCC unroll 2
                    for (int p = 0; p < 2; p++) u[2 * r + p] = _mm256_dpbusd_epi32(u[2 * r + p], wv[p][s], xb[s]);
            }
        }
        __m256i sc = _mm256_srai_epi32(_mm256_load_si256((const __m256i *)(w + 32 * (u0 & 2047))), 16);
        for (int i = 0; i < 8; i++) tot[i] = _mm256_add_epi32(tot[i], _mm256_mullo_epi32(u[i], sc));
    }
    double t = now() - t0;
    int s = 0;
    for (int i = 0; i < 8; i++) s += _mm256_extract_epi32(tot[i], 0);
    if (s == 42) printf(" ");
    return (double)n * 8 / t;
}

int main(void) {
    uint8_t *w = aligned_alloc(64, 1 << 18);
    int8_t *x = aligned_alloc(64, 1 << 16);
    for (int i = 0; i < 1 << 18; i++) w[i] = (uint8_t)(i * 7);
    for (int i = 0; i < 1 << 16; i++) x[i] = (int8_t)(i * 13);
    double ghz = clock_ghz();
    printf("clock ~%.2f GHz\n", ghz);
    double r8 = chains(200000000L, 8), r16 = chains(100000000L, 16), rp = panel_shape(w, x, 40000000L);
    printf("vpdpbusd, 8 chains:   %.2f G/s = %.0f GMAC/s (%.2f a cycle)\n", r8 / 1e9, 32 * r8 / 1e9, r8 / ghz / 1e9);
    printf("vpdpbusd, 16 chains:  %.2f G/s = %.0f GMAC/s (%.2f a cycle)\n", r16 / 1e9, 32 * r16 / 1e9, r16 / ghz / 1e9);
    printf("panel tile's shape:   %.2f G/s = %.0f GMAC/s (%.2f a cycle)\n", rp / 1e9, 32 * rp / 1e9, rp / ghz / 1e9);
    free(w);
    free(x);
    return 0;
}
