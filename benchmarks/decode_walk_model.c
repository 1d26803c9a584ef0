/* A model of the paged decode kernel's memory walk, without its arithmetic: what memory gives the
   decode's access pattern (compile and run it as below).

   Two pools (K and V) of pages of 16 slots x 8 kv heads x ROW bytes, 512 MiB in all, on
   transparent huge pages; the pages visited in a random order, split over T OpenMP threads. Per
   page and kv head: its 16 K rows, then its 16 V rows (ORDER 0: head by head, as the kernel
   reads; ORDER 1: each head's rows as if they were contiguous, address order), summed into a
   vector; the page AHEAD pages on is prefetched one line per line read, K and V each in address
   order (the kernel's PD_PREFETCH cursors). Prints bytes read per second, best of 5 passes.

     gcc -O2 -march=native -fopenmp benchmarks/decode_walk_model.c -o /tmp/walk
     /tmp/walk 256 2 0 1     # bf16 rows of 128 dims, 2 threads, head order, 1 page ahead
     /tmp/walk 256 2 0 1 1   # the same over K/V page pairs in one pool (PagedKV's kv_store) */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

int main(int argc, char **argv) {
  if (argc != 5 && argc != 6) {
    fprintf(stderr,
            "usage: %s ROW_BYTES THREADS ORDER(0 head, 1 address) AHEAD [LAYOUT(0 two pools, 1 "
            "pairs)]\n",
            argv[0]);
    return 2;
  }
  const size_t row = (size_t)atol(argv[1]), page = 16 * 8 * row, n = (512ul << 20) / 2 / page;
  const int threads = atoi(argv[2]), order = atoi(argv[3]), ahead = atoi(argv[4]);
  const int pairs = argc == 6 && atoi(argv[5]) == 1; /* PagedKV's kv_store: K then V per page */
  char *pools[2];
  for (int i = 0; i < 2; i++) {
    pools[i] = aligned_alloc(1 << 21, n * page);
    madvise(pools[i], n * page, MADV_HUGEPAGE);
    memset(pools[i], 1, n * page);
  }
  /* page p's K (kv 0) or V (kv 1): two pools, or pairs of pages in one (both pools' memory) */
#define PAGE_AT(kv, p) \
  (pairs ? pools[0] + (2 * (size_t)(p) + (kv)) * page : pools[kv] + (size_t)(p) * page)
  if (pairs) { /* one pool of 2 n pages: the two allocations as one */
    free(pools[0]);
    free(pools[1]);
    pools[0] = aligned_alloc(1 << 21, 2 * n * page);
    madvise(pools[0], 2 * n * page, MADV_HUGEPAGE);
    memset(pools[0], 1, 2 * n * page);
    pools[1] = NULL;
  }
  int32_t *perm = malloc(n * sizeof *perm);
  for (size_t i = 0; i < n; i++) perm[i] = (int32_t)i;
  srand(1);
  for (size_t i = n - 1; i > 0; i--) {
    const size_t j = (size_t)rand() % (i + 1);
    const int32_t t = perm[i];
    perm[i] = perm[j], perm[j] = t;
  }
  double best = 1e30;
  float sink = 0.0f;
  for (int pass = 0; pass < 5; pass++) {
    const double t0 = omp_get_wtime();
#pragma omp parallel num_threads(threads) reduction(+ : sink)
    {
      __m512 acc = _mm512_setzero_ps();
#pragma omp for schedule(static)
      for (size_t i = 0; i < n; i++) {
        const size_t next = i + ahead < n ? (size_t)perm[i + ahead] : (size_t)perm[i];
        const char *cur[2], *end[2];
        for (int kv = 0; kv < 2; kv++) cur[kv] = PAGE_AT(kv, next), end[kv] = cur[kv] + page;
        for (int h = 0; h < 8; h++)
          for (int kv = 0; kv < 2; kv++) {
            const char *base = PAGE_AT(kv, perm[i]);
            for (int s = 0; s < 16; s++)
              for (size_t o = 0; o < row; o += 64) {
                if (ahead && cur[kv] < end[kv]) _mm_prefetch(cur[kv], _MM_HINT_T0), cur[kv] += 64;
                const size_t r = order ? (size_t)(h * 16 + s) : (size_t)(s * 8 + h);
                acc = _mm512_add_ps(acc, _mm512_castsi512_ps(_mm512_load_si512(base + r * row + o)));
              }
          }
      }
      sink += _mm512_reduce_add_ps(acc);
    }
    const double t = omp_get_wtime() - t0;
    best = t < best ? t : best;
  }
  printf("rows of %zu bytes, %d threads, %s order, %d page(s) ahead, %s: %.1f GB/s (sink %g)\n",
         row, threads, order ? "address" : "head", ahead, pairs ? "K/V pairs" : "two pools",
         2.0 * n * page / best / 1e9, (double)sink);
  return 0;
}
