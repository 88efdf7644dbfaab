/* Read bandwidth of a file's mapping with 1 and 2 threads, and how much of it the kernel maps in
 * 2 MiB pages (FilePmdMapped): what a batch-1 decode step, which streams every weight once,
 * can reach through that mapping.
 *
 *   gcc -O3 -march=native -fopenmp benchmarks/mapping_bandwidth.c -o /tmp/mapping_bandwidth
 *   /tmp/mapping_bandwidth FILE [drop]
 *
 * `drop` evicts the file's clean cached pages first (POSIX_FADV_DONTNEED) and advises the
 * mapping MADV_HUGEPAGE, so the pages come back from disk in whatever folio size the filesystem
 * gives a huge-page mapping (pagedllm's loader does the same, transformers_utils/page_cache.py).
 * Best of 5 passes over the whole file, after one pass that faults it in. */
#define _GNU_SOURCE
#include <fcntl.h>
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

static long long read_all(const uint8_t *p, size_t n, int threads) {
    long long total = 0;
#pragma omp parallel num_threads(threads) reduction(+ : total)
    {
        __m256i a = _mm256_setzero_si256(), b = _mm256_setzero_si256();
#pragma omp for schedule(static)
        for (size_t i = 0; i < n; i += 64) {
            a = _mm256_add_epi32(a, _mm256_loadu_si256((const __m256i *)(p + i)));
            b = _mm256_add_epi32(b, _mm256_loadu_si256((const __m256i *)(p + i + 32)));
        }
        int32_t lanes[8];
        _mm256_storeu_si256((__m256i *)lanes, _mm256_add_epi32(a, b));
        for (int i = 0; i < 8; i++) total += lanes[i];
    }
    return total;
}

static long pmd_mapped_kb(const void *address) {
    FILE *f = fopen("/proc/self/smaps", "r");
    char line[512];
    int found = 0;
    long kb = -1;
    while (f && fgets(line, sizeof line, f)) {
        unsigned long start, end;
        if (sscanf(line, "%lx-%lx ", &start, &end) == 2 && strchr(line, '-') < strchr(line, ' ')) {
            if (found) break;
            found = start == (unsigned long)address;
        } else if (found && sscanf(line, "FilePmdMapped: %ld kB", &kb) == 1) {
            break;
        }
    }
    if (f) fclose(f);
    return kb;
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s FILE [drop]\n", argv[0]);
        return 2;
    }
    int fd = open(argv[1], O_RDONLY);
    struct stat st;
    if (fd < 0 || fstat(fd, &st)) {
        perror(argv[1]);
        return 1;
    }
    size_t n = (size_t)st.st_size / 64 * 64;
    int drop = argc > 2 && !strcmp(argv[2], "drop");
    if (drop) posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    const uint8_t *p = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) {
        perror("mmap");
        return 1;
    }
    if (drop) madvise((void *)p, (size_t)st.st_size, MADV_HUGEPAGE);
    long long check = read_all(p, n, 2);
    printf("%s: %.2f GB, FilePmdMapped %.2f GB\n", argv[1], n / 1e9, pmd_mapped_kb(p) * 1024.0 / 1e9);
    for (int threads = 1; threads <= 2; threads++) {
        double best = 1e30;
        for (int rep = 0; rep < 5; rep++) {
            double t = omp_get_wtime();
            check += read_all(p, n, threads);
            t = omp_get_wtime() - t;
            best = t < best ? t : best;
        }
        printf("  %d thread%s: %.1f GB/s\n", threads, threads > 1 ? "s" : "", n / best / 1e9);
    }
    return check == 42; /* keeps the reads */
}
