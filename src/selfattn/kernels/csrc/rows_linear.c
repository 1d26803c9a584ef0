/* Batch-invariant linear: out (M, N) float32 = x (M, K) float32 @ w (N, K)^T, w float32 or
   bfloat16, for deterministic mode (kernels/determinism.py).

   Why: every output element is summed in one order fixed by K alone, whatever M, the row's
   position and the thread count. torch's matmul (MKL) runs a GEMV for one row and GEMM kernels
   of other summation orders for 2-3 and 4+ rows, so a row rounds by the batch around it; padding
   to 4 rows fixes the kernel but runs a GEMM at half a GEMV's speed on a decode step's
   memory-bound weights. Here a decode step reads each weight row once, as a GEMV does.

   The order: 16 lanes of partial sums over k = 16j + lane (one FMA per chunk), then the
   remaining k < K in order into a scalar, then the lanes summed pairwise (8 + 8, 4 + 4, 2 + 2,
   1 + 1) and the scalar added last. Work items are blocks of ITEM_ROWS weight rows: each
   participant (thread_pool.h) pulls items from a counter and computes every x row against its
   block's weight rows, NB at a time so that one x chunk serves NB FMAs while the block's rows
   stay in L1. Which thread computes an item changes nothing in it. */

#include <stdint.h>
#include <string.h>

#include "thread_pool.h"

enum { W_F32 = 0, W_BF16 = 1 };
#define VW 16        /* lanes of the partial sums */
#define NB 4         /* weight rows sharing each x chunk */
#define ITEM_ROWS 64 /* weight rows per work item: a few thousand items at most per call */

typedef float vf __attribute__((vector_size(VW * 4)));
typedef uint32_t vu __attribute__((vector_size(VW * 4)));
typedef uint16_t vh __attribute__((vector_size(VW * 2)));

typedef struct {
  const float *x;
  const void *w;
  float *out;
  int64_t M, N, K, next, n_items;
  int wdt;
} Job;

static inline vf load_x(const float *p) {
  vf v;
  memcpy(&v, p, sizeof v);
  return v;
}

/* 16 weights as float32 lanes: bf16 bits shifted into the high half (exact) */
static inline vf load_w(const void *w, int64_t at, int wdt) {
  if (wdt == W_F32) return load_x((const float *)w + at);
  vh h;
  memcpy(&h, (const uint16_t *)w + at, sizeof h);
  vu u = __builtin_convertvector(h, vu) << 16;
  vf f;
  memcpy(&f, &u, sizeof f);
  return f;
}

static inline float w_at(const void *w, int64_t at, int wdt) {
  if (wdt == W_F32) return ((const float *)w)[at];
  uint32_t u = (uint32_t)((const uint16_t *)w)[at] << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

/* -- the fixed reduction: lanes pairwise, then the tail's scalar */
static inline float finish(vf acc, float tail) {
  float a[VW];
  memcpy(a, &acc, sizeof a);
  for (int width = VW / 2; width >= 1; width /= 2)
    for (int i = 0; i < width; i++) a[i] += a[i + width];
  return a[0] + tail;
}

/* out[m, n0 .. n0 + nb) for every m: nb <= NB weight rows against each x row */
static void rows_block(const Job *j, int64_t n0, int nb) {
  const int64_t K = j->K, K16 = K / VW * VW;
  for (int64_t m = 0; m < j->M; m++) {
    const float *xm = j->x + m * K;
    vf acc[NB];
    float tail[NB];
    for (int r = 0; r < NB; r++) acc[r] = (vf){0}, tail[r] = 0.0f;
    for (int64_t k = 0; k < K16; k += VW) {
      const vf xv = load_x(xm + k);
      for (int r = 0; r < nb; r++) acc[r] += xv * load_w(j->w, (n0 + r) * K + k, j->wdt);
    }
    for (int r = 0; r < nb; r++) {
      for (int64_t k = K16; k < K; k++) tail[r] += xm[k] * w_at(j->w, (n0 + r) * K + k, j->wdt);
      j->out[m * j->N + n0 + r] = finish(acc[r], tail[r]);
    }
  }
}

static int rows_task(void *ctx, void *scratch) {
  Job *j = ctx;
  (void)scratch;
  for (;;) {
    const int64_t item = __atomic_fetch_add(&j->next, 1, __ATOMIC_RELAXED);
    if (item >= j->n_items) return 0;
    const int64_t lo = item * ITEM_ROWS, hi = lo + ITEM_ROWS < j->N ? lo + ITEM_ROWS : j->N;
    for (int64_t n = lo; n < hi; n += NB) rows_block(j, n, (int)(hi - n < NB ? hi - n : NB));
  }
}

/* rows_linear(x, w, out, M, N, K, wdt, n_threads) -> 0, or 1 when a participant failed */
int rows_linear(const float *x, const void *w, float *out, int64_t M, int64_t N, int64_t K,
                int wdt, int n_threads) {
  Job j = {x, w, out, M, N, K, 0, (N + ITEM_ROWS - 1) / ITEM_ROWS, wdt};
  if (M <= 0 || N <= 0) return 0;
  int n = n_threads < 1 ? 1 : n_threads;
  if (n > j.n_items) n = (int)j.n_items;
  return pool_run(rows_task, &j, n, 0);
}
