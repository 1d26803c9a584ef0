/* Fused attention on CPU, forward and backward, walking a mask's tile classification (why, the
   build and the tile description: selfattn/kernels/fused_attention.py, its host).

   Entry points: fa_forward(iargs, ptrs, n_threads, c) and fa_backward(iargs, ptrs, n_threads, c,
   scale). iargs holds the integers and ptrs the data pointers, in the order of the A_* and P_*
   enums below; the host fills both by name from the same lists (INT_ARGS, PTR_ARGS), and a test
   checks that they match these enums. Plain C11 with GNU vector extensions, POSIX threads and
   OpenMP (thread_pool.h): no PyTorch headers. Every tensor is contiguous; q, k, v float32, bf16 or fp16 (A_DT, converted
   to float32 as tiles are packed), the forward's out in their dtype, everything else float32.

   The score matrix is cut into tiles of BQ query rows x BK keys. The host lists, per query tile,
   its non-EMPTY key tiles (CSR: rowptr, cols) and for each the index of its PARTIAL mask block
   (pids; -1 for a FULL tile, which gets no mask work); the backward also gets the transpose
   (colptr, rows, cpids). A PARTIAL block is a byte per pair (1: attend), one block per
   (tile, mask batch, mask head).

   Every product is one micro-kernel, mm: C (M x N) += A (M x K) B (K x N), A's elements
   broadcast against 16-float rows of B, RB x 4 vector accumulators held in registers. Scores
   are in base 2 (the host passes c = scale * log2(e), applied to q as it is packed), so the
   softmax uses exp2. The forward has two work items: fwd_t on transposed tiles (16 query rows
   a vector; AVX-512 builds, calls without dropout, and without score mods but for bf16) and
   fwd_item on row-major ones (everything else). */

#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#define POOL_NAME "sa-fused"
#include "thread_pool.h"
#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
/* the transposed forward (fwd_t) uses AVX-512 lane masks, and BW's byte tests for its masks */
#define HAVE_TRANSPOSED 1
#else
#define HAVE_TRANSPOSED 0
#endif

/* iargs, in order */
enum {
  A_B, A_HQ, A_HKV, A_SQ, A_SK, A_D, A_DV, A_BQ, A_BK, A_NQ, A_NK, A_MB, A_MH, A_DT, A_QOFF,
  A_SEED, A_BIAS_SB, A_BIAS_SH, A_BIAS_SQ, A_BIAS_SK, A_SLOPES_SB, A_NARGS
};
/* ptrs, in order */
enum {
  P_Q, P_K, P_V, P_ROWPTR, P_COLS, P_PIDS, P_COLPTR, P_ROWS, P_CPIDS, P_BITS, P_OUT, P_LSE,
  P_M, P_L, P_DO, P_DLSE, P_DELTA, P_DQ, P_DK, P_DV, P_SLOPES, P_DROP, P_BIAS, P_CAP, P_DBIAS,
  P_FINITE, P_NPTRS
};

/* dtype of q, k, v (A_DT) and of the forward's out; dO and every other output are float32 */
enum { F32 = 0, BF16 = 1, F16 = 2 };

#define VW 16      /* floats per vector: one AVX-512 register (two AVX2 ones) */
#define BK 64      /* keys per tile: four vectors, the width of every score tile */
#define MAXBQ 64   /* most query rows per tile */
#define CACHE_LINE 64 /* bytes: the stride of software prefetches */
#define FWD_GRAIN 8   /* most forward items a thread claims at once (Job.grain) */
#define FWD_CLAIMS 8  /* fewest claims per thread that Job.grain leaves */
#define NV 4       /* vectors per accumulator row of mm */
#if defined(__AVX512F__)
#define RB 4 /* rows per register block: 4 x 4 accumulators + 4 B rows fit 32 zmm registers */
#else
#define RB 2 /* 16 ymm registers (or fewer): half the rows */
#endif
#define LN2F 0.6931471805599453f

typedef float v16 __attribute__((vector_size(VW * 4)));
typedef int32_t v16i __attribute__((vector_size(VW * 4)));

static inline v16 ld(const float *x) {
  v16 r;
  memcpy(&r, x, sizeof r);
  return r;
}
static inline void st(float *x, v16 r) { memcpy(x, &r, sizeof r); }
static inline v16 splat(float x) { return (v16){0} + x; }
static inline v16 vmax(v16 a, v16 b) {
  const v16i gt = a > b;
  return (v16)(((v16i)a & gt) | ((v16i)b & ~gt));
}
/* Horizontal max / sum of 16 floats by halving shuffles (4 steps, not 15 scalar ones). */
static inline v16 swap_halves(v16 x, int w) {
  switch (w) {
    case 8: return __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    case 4: return __builtin_shufflevector(x, x, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    case 2: return __builtin_shufflevector(x, x, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    default: return __builtin_shufflevector(x, x, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  }
}
static inline float hmax(v16 x) {
  for (int w = 8; w >= 1; w /= 2) x = vmax(x, swap_halves(x, w));
  return x[0];
}
static inline float hsum(v16 x) {
  for (int w = 8; w >= 1; w /= 2) x += swap_halves(x, w);
  return x[0];
}
static inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

/* 2^x of 16 floats: x = n + f with |f| <= 1/2, 2^f by its Taylor series to degree 7 (relative
   error ~3e-9, under float32's half ulp), 2^n built in the exponent bits. x below -126 (under
   FLT_MIN; -inf for a masked key) gives exactly 0, NaN stays NaN. */
static inline v16 exp2v(v16 x) {
  const v16 lo = splat(-126.0f);
  const v16i under = x < lo;
  x = (v16)(((v16i)lo & under) | ((v16i)x & ~under));
  const v16 magic = splat(12582912.0f); /* 1.5 * 2^23: adding it rounds to an integer */
  const v16 n = (x + magic) - magic;
  const v16 f = x - n;
  v16 y = splat(1.5252733804059841e-05f);
  y = y * f + 1.5403530393381609e-04f;
  y = y * f + 1.3333558146428443e-03f;
  y = y * f + 9.6181291076284772e-03f;
  y = y * f + 5.5504108664821580e-02f;
  y = y * f + 2.4022650695910071e-01f;
  y = y * f + 6.9314718055994531e-01f;
  y = y * f + 1.0f;
  const v16i e = (__builtin_convertvector(n, v16i) + 127) << 23;
  return (v16)((v16i)(y * (v16)e) & ~under);
}

/* log2 of 16 floats, for the forward's row sums (l >= 1, or 0, or NaN: NaN stays NaN; 0 gives
   finite nonsense, which finish_rows replaces): Cephes' log2f (Moshier) on vectors. x = 2^e m
   with m in [sqrt(1/2), sqrt(2)), f = m - 1 (exact), ln(1 + f) = f - f^2/2 + f^3 P(f), and
   log2 e = 1 + LOG2E_1 applied so that its leading 1 multiplies exactly: 1.4 float32 ulps at
   most over 2e7 values in [1, 2^31) (glibc's log2f, one call per row, was ~1% of a bf16 window
   forward in perf). */
static inline v16 log2v(v16 x) {
  static const float c[] = {7.0376836292e-2f, -1.1514610310e-1f, 1.1676998740e-1f,
                            -1.2420140846e-1f, 1.4249322787e-1f, -1.6668057665e-1f,
                            2.0000714765e-1f, -2.4999993993e-1f, 3.3333331174e-1f};
  const float LOG2E_1 = 0.44269504088896340736f; /* log2(e) - 1 */
  const v16i bits = (v16i)x;
  v16i e = ((bits >> 23) & 0xff) - 127;
  v16 m = (v16)((bits & 0x007fffff) | 0x3f800000); /* [1, 2) */
  const v16i big = m > 1.41421356f;                /* -1 where m is halved and e raised */
  m = (v16)(((v16i)(m * 0.5f) & big) | ((v16i)m & ~big));
  e -= big;
  const v16 f = m - 1.0f, z = f * f;
  v16 p = splat(c[0]);
  for (unsigned i = 1; i < sizeof c / sizeof c[0]; i++) p = p * f + c[i];
  const v16 y = f * z * p - 0.5f * z; /* ln(1 + f) - f */
  const v16 r = y * LOG2E_1 + f * LOG2E_1 + y + f + __builtin_convertvector(e, v16);
  const v16i nan = x != x;
  return (v16)((bits & nan) | ((v16i)r & ~nan));
}

/* tanh of 16 floats, odd. |x| < TANH_POLY_MAX: x · p(x²), p a degree-5 least-squares fit of
   tanh(x)/x on [0, 1/2] (relative error 3.8e-10 in exact arithmetic); above it (1 - e) / (1 + e)
   with e = 2^(-2|x| log2(e)) from exp2v, where 1 - e >= 0.39 cancels no digits; e = 0 gives
   exactly ±1 (±inf included), NaN stays NaN. Measured against tanh in float64 on every 61st
   float32 in [-20, 20] (36M values, down to denormals): at most 2.8 ulp of float32 (at 0.549,
   the switch); 1 - 2 / (2^(2x log2(e)) + 1) alone is 2·10^7 ulp near 0, where the soft cap's
   argument usually is. tests/kernels/test_fused_attention.py keeps it under 4 ulp. */
#define TANH_POLY_MAX 0.5f
static inline v16 tanhv(v16 x) {
  const v16i sign = (v16i)x & ((v16i){0} + (int32_t)0x80000000u);
  const v16 a = (v16)((v16i)x & ~sign), a2 = a * a;
  v16 p = splat(-0.0066394669969970206f);
  p = p * a2 + 0.021292919597931774f;
  p = p * a2 - 0.053898069132019027f;
  p = p * a2 + 0.13332954240019484f;
  p = p * a2 - 0.33333326590061013f;
  const v16 small = a + a * (p * a2);
  const v16 e = exp2v(a * (-2.0f * 1.4426950408889634f));
  const v16 large = (1.0f - e) / (1.0f + e);
  const v16i use_small = a < TANH_POLY_MAX;
  const v16 t = (v16)(((v16i)small & use_small) | ((v16i)large & ~use_small));
  return (v16)((v16i)t | sign);
}

/* n floats: y = f(x), 16 at a time (the test entry points of the kernel's vector functions). */
static void map16(const float *x, float *y, int64_t n, v16 (*f)(v16)) {
  int64_t i = 0;
  for (; i + VW <= n; i += VW) st(y + i, f(ld(x + i)));
  if (i < n) {
    float buf[VW] = {0};
    memcpy(buf, x + i, sizeof(float) * (size_t)(n - i));
    const v16 t = f(ld(buf));
    memcpy(y + i, &t, sizeof(float) * (size_t)(n - i));
  }
}

/* n floats: y = tanh(x) as the kernel computes it (tests measure its error). */
void fa_tanh(const float *x, float *y, int64_t n) { map16(x, y, n, tanhv); }

/* n floats: y = log2(x) as the forward computes its lse (tests measure its error). */
void fa_log2(const float *x, float *y, int64_t n) { map16(x, y, n, log2v); }

/* -- the micro-kernel: RB rows of C (stride ldc) += A (RB x K; element k of row r at A[r lda +
   k ldk]) B (K x nv*VW, stride ldb), with nv a constant at each call site, so the accumulators
   stay in registers; zero: C = A B instead (C is not read); scale (not NULL): C's rows are first
   multiplied by scale[r] (the online softmax's rescale, folded into the load). */
static inline __attribute__((always_inline)) void mm_block(float *C, int64_t ldc, const float *A,
                                                           int64_t lda, int64_t ldk,
                                                           const float *B, int64_t ldb,
                                                           int64_t K, int nv, int zero,
                                                           const float *scale) {
  v16 acc[RB][NV];
  int r, x;
  for (r = 0; r < RB; r++)
    for (x = 0; x < nv; x++) acc[r][x] = splat(0.0f);
  for (int64_t k = 0; k < K; k++) {
    v16 b[NV];
    for (x = 0; x < nv; x++) {
      b[x] = ld(B + k * ldb + x * VW);
#if defined(__AVX512F__)
      /* in a register: gcc folds the load into each of the RB FMAs that read it (RB loads
         instead of one: the loop then waits on loads, not on FMAs) */
      __asm__("" : "+v"(b[x]));
#endif
    }
    for (r = 0; r < RB; r++) {
      const float a = A[r * lda + k * ldk];
      for (x = 0; x < nv; x++) acc[r][x] += a * b[x];
    }
  }
  /* the call's K products summed on their own, then added to C: a gradient tile summed over
     every (query tile, head) of a kv head was one chain of G Sq FMAs (dK of an MQA call with 9
     heads 5.6x the naive fp32 error, where sgemm sums in blocks); now a chain of K per call and
     one of the calls */
  for (r = 0; r < RB; r++)
    for (x = 0; x < nv; x++) {
      v16 c = acc[r][x];
      if (!zero) c += scale ? ld(C + r * ldc + x * VW) * scale[r] : ld(C + r * ldc + x * VW);
      st(C + r * ldc + x * VW, c);
    }
}

/* RB rows of C (RB x N) += A (RB x K) B (K x N) (zero: C = A B); N a multiple of VW (the
   callers pad). C = A B (the scores, dP: K is the head dim, up to 256) in blocks of MM_KC, each
   summed on its own and added to C (mm_block): one FMA chain over D made a sharp row's weights
   ~2.5x less precise than the naive fp32 formula's (decode rows at scale 2, D = 111: dV 2.2x
   the naive error, dq and dK 2.5-2.8x, rms; D = 256: dq 4.0x, dK 3.6x at most); in blocks of
   64, 1.35-1.4x, 1.6-1.8x (D = 256: 1.5x, 1.8x). Blocks of 32 measured a little more precise
   and ~10 % slower at D = 64, which 64 leaves as one block. The accumulating calls (K <= 64
   rows or keys a tile) are one block. */
#define MM_KC 64
static inline __attribute__((always_inline)) void mm_rows_z(float *C, int64_t ldc,
                                                            const float *A, int64_t lda,
                                                            int64_t ldk, const float *B,
                                                            int64_t ldb, int64_t K, int64_t N,
                                                            int zero, const float *scale) {
  /* C = A B: K the head dim, the scores' and dP's dots; else one block (at least 1: K = 0 must
     still end the loop after its one pass, which scales C) */
  const int64_t KC = zero ? MM_KC : K > 0 ? K : 1;
  for (int64_t n = 0; n < N; n += NV * VW)
    for (int64_t k0 = 0; k0 < K || k0 == 0; k0 += KC) {
      float *c = C + n;
      const float *a = A + k0 * ldk, *b = B + k0 * ldb + n;
      const int64_t kc = K - k0 < KC ? K - k0 : KC;
      const int z = zero && k0 == 0;
      const float *sc = k0 == 0 ? scale : NULL;
      switch ((N - n) / VW) {
        case 1: mm_block(c, ldc, a, lda, ldk, b, ldb, kc, 1, z, sc); break;
        case 2: mm_block(c, ldc, a, lda, ldk, b, ldb, kc, 2, z, sc); break;
        case 3: mm_block(c, ldc, a, lda, ldk, b, ldb, kc, 3, z, sc); break;
        default: mm_block(c, ldc, a, lda, ldk, b, ldb, kc, 4, z, sc); break;
      }
    }
}
static void mm_rows(float *C, int64_t ldc, const float *A, int64_t lda, const float *B,
                    int64_t ldb, int64_t K, int64_t N) {
  mm_rows_z(C, ldc, A, lda, 1, B, ldb, K, N, 0, NULL);
}
static void mm_rows0(float *C, int64_t ldc, const float *A, int64_t lda, const float *B,
                     int64_t ldb, int64_t K, int64_t N) {
  mm_rows_z(C, ldc, A, lda, 1, B, ldb, K, N, 1, NULL);
}
#if HAVE_TRANSPOSED
/* mm_rows with A's elements k apart by ldk and C's rows first scaled (scale NULL: not) */
static void mm_rows_s(float *C, int64_t ldc, const float *A, int64_t lda, int64_t ldk,
                      const float *B, int64_t ldb, int64_t K, int64_t N, const float *scale) {
  mm_rows_z(C, ldc, A, lda, ldk, B, ldb, K, N, 0, scale);
}
#endif

static void mm(float *C, int64_t ldc, const float *A, int64_t lda, const float *B, int64_t ldb,
               int64_t M, int64_t K, int64_t N) {
  for (int64_t r = 0; r < M; r += RB) mm_rows(C + r * ldc, ldc, A + r * lda, lda, B, ldb, K, N);
}
/* C = A B (M x N): mm without reading C, K in the blocks mm_rows0 sums */
static void mm0(float *C, int64_t ldc, const float *A, int64_t lda, const float *B, int64_t ldb,
                int64_t M, int64_t K, int64_t N) {
  for (int64_t r = 0; r < M; r += RB) mm_rows0(C + r * ldc, ldc, A + r * lda, lda, B, ldb, K, N);
}

#if defined(__AVX512BF16__)
/* -- bf16 scores (forward): vdpbf16ps multiplies bf16 pairs exactly and sums them in float32,
   32 products per instruction against 16 per float32 FMA. A (RB rows; word k of row r at
   A[r lda + k ldk]) and B (pairs x BK, a row per pair) hold 32-bit words of two bf16 (elements
   2p, 2p + 1 of a row of q, of a key; or of two keys' weights, of two V rows); C (RB x nv*VW,
   stride ldc) += A B over npairs pairs (B: stride ldb words). scale (not NULL): C's rows are
   first multiplied by scale[r] (the online softmax's rescale, folded into the load). */
static inline __attribute__((always_inline)) void mm_bf16_block(float *C, int64_t ldc,
                                                                const uint32_t *A, int64_t lda,
                                                                int64_t ldk, const uint32_t *B,
                                                                int64_t ldb, int64_t npairs,
                                                                int nv, int zero,
                                                                const float *scale) {
  __m512 acc[RB][NV];
  int r, x;
  for (r = 0; r < RB; r++)
    for (x = 0; x < nv; x++) {
      acc[r][x] = zero ? _mm512_setzero_ps() : _mm512_loadu_ps(C + r * ldc + x * VW);
      if (scale) acc[r][x] = _mm512_mul_ps(acc[r][x], _mm512_set1_ps(scale[r]));
    }
  for (int64_t k = 0; k < npairs; k++) {
    __m512bh b[NV];
    for (x = 0; x < nv; x++) b[x] = (__m512bh)_mm512_loadu_si512(B + k * ldb + x * VW);
    for (r = 0; r < RB; r++) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32((int)A[r * lda + k * ldk]);
      for (x = 0; x < nv; x++) acc[r][x] = _mm512_dpbf16_ps(acc[r][x], a, b[x]);
    }
  }
  for (r = 0; r < RB; r++)
    for (x = 0; x < nv; x++) _mm512_storeu_ps(C + r * ldc + x * VW, acc[r][x]);
}

/* RB rows of C += A B for N columns of B (a multiple of VW); zero: C = A B. */
static void mm_bf16_rows(float *C, int64_t ldc, const uint32_t *A, int64_t lda, int64_t ldk,
                         const uint32_t *B, int64_t ldb, int64_t npairs, int64_t N, int zero,
                         const float *scale) {
  for (int64_t n = 0; n < N; n += NV * VW) {
    const int64_t nv = (N - n) / VW < NV ? (N - n) / VW : NV;
    float *c = C + n;
    const uint32_t *b = B + n;
    switch (nv + NV * !!zero) { /* nv and zero constants in each call */
      case 1: mm_bf16_block(c, ldc, A, lda, ldk, b, ldb, npairs, 1, 0, scale); break;
      case 2: mm_bf16_block(c, ldc, A, lda, ldk, b, ldb, npairs, 2, 0, scale); break;
      case 3: mm_bf16_block(c, ldc, A, lda, ldk, b, ldb, npairs, 3, 0, scale); break;
      case 4: mm_bf16_block(c, ldc, A, lda, ldk, b, ldb, npairs, 4, 0, scale); break;
      case 5: mm_bf16_block(c, ldc, A, lda, ldk, b, ldb, npairs, 1, 1, NULL); break;
      case 6: mm_bf16_block(c, ldc, A, lda, ldk, b, ldb, npairs, 2, 1, NULL); break;
      case 7: mm_bf16_block(c, ldc, A, lda, ldk, b, ldb, npairs, 3, 1, NULL); break;
      default: mm_bf16_block(c, ldc, A, lda, ldk, b, ldb, npairs, 4, 1, NULL); break;
    }
  }
}

/* The weights of RB rows of s (stride BK) rounded to bf16 (to nearest even) in key order: word
   p of row r is the pair of keys 2p, 2p + 1, as mm_bf16 reads A. */
static void weights_bf16(uint32_t *w, const float *s) {
  for (int r = 0; r < RB; r++)
    for (int k = 0; k < BK; k += 2 * VW) {
      const __m512bh x = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(s + r * BK + k + VW),
                                             _mm512_loadu_ps(s + r * BK + k));
      _mm512_storeu_si512(w + r * (BK / 2) + k / 2, (__m512i)x);
    }
}
#define HAVE_DPBF16 1
#else
#define HAVE_DPBF16 0
#endif

/* bf16 pair words (element 2p low, 2p + 1 high; a missing last element 0) of n rows of width
   bf16 elements from element offset off of src, rows of ld words, rows [n, rows_padded) 0. */
static void pack_pairs(uint32_t *dst, int64_t ld, const uint16_t *src, int64_t off, int64_t n,
                       int64_t width, int64_t rows_padded) {
  const int64_t np = (width + 1) / 2;
  for (int64_t r = 0; r < rows_padded; r++) {
    uint32_t *o = dst + r * ld;
    const uint16_t *x = src + off + r * width;
    if (r >= n) {
      memset(o, 0, sizeof(uint32_t) * np);
      continue;
    }
    for (int64_t e = 0; e < width / 2; e++) o[e] = x[2 * e] | (uint32_t)x[2 * e + 1] << 16;
    if (width % 2) o[np - 1] = x[width - 1];
  }
}

/* nk keys (rows of width bf16) as pair words transposed, t (pairs x BK), keys >= nk 0. */
static void pack_pairs_t(uint32_t *t, const uint16_t *src, int64_t off, int64_t nk,
                         int64_t width) {
  const int64_t np = (width + 1) / 2;
  for (int64_t e = 0; e < np; e++) memset(t + e * BK + nk, 0, sizeof(uint32_t) * (BK - nk));
  for (int64_t k = 0; k < nk; k++) {
    const uint16_t *x = src + off + k * width;
    for (int64_t e = 0; e < width / 2; e++) t[e * BK + k] = x[2 * e] | (uint32_t)x[2 * e + 1] << 16;
    if (width % 2) t[(np - 1) * BK + k] = x[width - 1];
  }
}

/* nk V rows (width bf16 each, from element offset off) as pair words of keys 2p, 2p + 1: t
   (BK / 2 x ld), keys >= nk and columns >= width 0. Two rows are interleaved 16 columns at a
   time (a word per element of each was a tenth of a bf16 forward's time). */
static void pack_v_pairs(uint32_t *t, const uint16_t *src, int64_t off, int64_t nk, int64_t width,
                         int64_t ld) {
  typedef uint16_t v16h __attribute__((vector_size(VW * 2)));
  typedef uint32_t v16w __attribute__((vector_size(VW * 4)));
  for (int64_t p = 0; p < BK / 2; p++) {
    uint32_t *o = t + p * ld;
    const uint16_t *x = src + off + 2 * p * width, *y = x + width;
    const int second = 2 * p + 1 < nk; /* the pair's second key exists */
    int64_t e = 0;
    if (2 * p >= nk) {
      memset(o, 0, sizeof(uint32_t) * ld);
      continue;
    }
    for (; e + VW <= width; e += VW) {
      v16h a, b = {0};
      memcpy(&a, x + e, sizeof a);
      if (second) memcpy(&b, y + e, sizeof b);
      const v16w w = __builtin_convertvector(a, v16w) | __builtin_convertvector(b, v16w) << 16;
      memcpy(o + e, &w, sizeof w);
    }
    for (; e < width; e++) o[e] = x[e] | (uint32_t)(second ? y[e] : 0) << 16;
    for (; e < ld; e++) o[e] = 0;
  }
}

typedef struct {
  const int64_t *a;
  void *const *p;
  float c;     /* scale * log2(e): q is multiplied by it as it is packed */
  float scale; /* the softmax scale (backward: dQ = dS K scale) */
  int64_t n_items;
  int64_t next; /* work counter, atomic */
  void (*item)(const void *job, int64_t item, float *scratch);
  int64_t scratch; /* floats of scratch per thread */
  /* K and V packed once per call, per (b, kv head, key tile) block (NULL: not used):
     kt Kᵀ (D x BK), vt Vᵀ (Dv x BK), kp K (BK x Dp), vp V (BK x Dvp), float32 */
  float *kt, *vt, *kp, *vp;
  /* bf16 K with vdpbf16ps (forward): per block, its keys' bf16 pair words transposed ((D + 1) / 2
     x BK uint32, in a float-sized buffer); kt is then not packed */
  float *kb;
  /* bf16 V for the bf16 P V (forward): per block, pairs of keys' V rows as bf16 pair words
     (BK / 2 x Dvp uint32); vp is then not packed */
  float *vb;
  float *packed; /* the one buffer holding them (pack_kv) */
  uint8_t *rr;    /* forward: row_ranges of every PARTIAL block's rows */
  int pooled;    /* 1: packed is the kept pool, held locked until free_packed */
  /* bf16 forward on transposed score tiles (fwd_bf16_item): kb holds each block's keys as rows
     of pair words (BK x (D + 1) / 2, zero past the last key), not transposed; tb the PARTIAL
     blocks as key masks (key_masks) */
  int bt;
  struct KeyMasks *tb;
  /* items a thread claims at once (0 or 1: one): consecutive forward items are consecutive query
     tiles of a head, which share most of their key tiles (a sliding window's 5 of 5 but one) and
     whose q rows follow each other (fwd_t prefetches the next ones): one thread running a run of
     them reads K, V and q once into its own core's cache, where single claims alternated the
     tiles between the cores */
  int64_t grain;
} Job;

/* Shapes of one call, read from iargs. */
typedef struct {
  int64_t B, Hq, Hkv, G, Sq, Sk, D, Dv, Dp, Dvp, bq, nq, nk, mb, mh;
  int dt;
} Dims;

static Dims dims(const int64_t *a) {
  Dims d = {a[A_B], a[A_HQ], a[A_HKV], a[A_HQ] / a[A_HKV], a[A_SQ], a[A_SK], a[A_D], a[A_DV],
            round_up(a[A_D], VW), round_up(a[A_DV], VW), a[A_BQ], a[A_NQ], a[A_NK], a[A_MB],
            a[A_MH], (int)a[A_DT]};
  return d;
}

int fa_has_f16(void) {
#ifdef __FLT16_MAX__
  return 1;
#else
  return 0;
#endif
}

/* n elements of dtype dt at element offset off of src, times mul, as float32 into dst. bf16 and
   fp16 are converted here, as the tiles are packed: the inputs are read once per use, never
   copied whole. */
static inline void load_row(float *dst, const void *src, int64_t off, int64_t n, int dt,
                            float mul) {
  int64_t e;
  if (dt == BF16) {
    const uint16_t *x = (const uint16_t *)src + off;
    for (e = 0; e < n; e++) {
      const uint32_t bits = (uint32_t)x[e] << 16;
      float f;
      memcpy(&f, &bits, 4);
      dst[e] = f * mul;
    }
#ifdef __FLT16_MAX__
  } else if (dt == F16) {
    const _Float16 *x = (const _Float16 *)src + off;
    for (e = 0; e < n; e++) dst[e] = (float)x[e] * mul;
#endif
  } else {
    const float *x = (const float *)src + off;
    for (e = 0; e < n; e++) dst[e] = x[e] * mul;
  }
}

/* n floats of src into dst (dtype dt) from element offset off: bf16 rounded to nearest even
   (NaN stays NaN), fp16 by the compiler's conversion. A bf16 call's out written as bf16 is half
   the fresh pages of a float32 one, and no float32 -> bf16 copy after the call. */
static inline void store_row(void *dst, int64_t off, const float *src, int64_t n, int dt) {
  int64_t e;
  if (dt == BF16) {
    uint16_t *y = (uint16_t *)dst + off;
    e = 0;
#if defined(__AVX512BF16__) /* the same rounding, 16 at a time (scalar: 7% of a bf16 forward);
                               denormal floats (below 2^-126) come out as 0 */
    for (; e + VW <= n; e += VW)
      _mm256_storeu_si256((__m256i *)(y + e), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src + e)));
#endif
    for (; e < n; e++) {
      uint32_t bits;
      memcpy(&bits, src + e, 4);
      const int nan = (bits & 0x7fffffffu) > 0x7f800000u;
      y[e] = nan ? (uint16_t)(bits >> 16 | 0x40) : (uint16_t)((bits + 0x7fffu + (bits >> 16 & 1)) >> 16);
    }
#ifdef __FLT16_MAX__
  } else if (dt == F16) {
    _Float16 *y = (_Float16 *)dst + off;
    for (e = 0; e < n; e++) y[e] = (_Float16)src[e];
#endif
  } else {
    memcpy((float *)dst + off, src, sizeof(float) * (size_t)n);
  }
}

/* -- Whether q and out hold only finite numbers, which the forward tells the host (P_FINITE: a
   byte the host sets to 1, and an item that meets a NaN or Inf sets to 0; NULL: not asked). The
   host trusts a result only when both are (backends/exact.fused_or_exact), and each item checks
   its own q rows as it packs them and its out rows as it stores them, data it holds anyway: a
   sum over each tensor on the host measured 1.2 ms of a 35 ms bf16 window-256 forward at
   S=16384 (one thread), this ~nothing. */

/* 1 when the n elements of dtype dt at element offset off of x are finite (NaN and Inf have
   every exponent bit set) */
static int elems_finite(const void *x, int64_t off, int64_t n, int dt) {
  uint32_t bad = 0;
  if (dt == F32) {
    const uint32_t *w = (const uint32_t *)x + off;
    for (int64_t e = 0; e < n; e++) bad |= (w[e] & 0x7f800000u) == 0x7f800000u;
  } else {
    const uint16_t *h = (const uint16_t *)x + off, ex = dt == BF16 ? 0x7f80 : 0x7c00;
    for (int64_t e = 0; e < n; e++) bad |= (h[e] & ex) == ex;
  }
  return !bad;
}

/* The magnitude from which a float32 that store_row writes as dtype dt comes out infinite (it
   rounds to nearest even): bf16's largest finite plus half its last place (0x7f7f8000: the tie
   goes up, to the even Inf), fp16's 65504 + 16 likewise; float32's own Inf. */
static float stored_inf_from(int dt) {
  return dt == BF16 ? 0x1.ffp+127f : (dt == F16 ? 65520.0f : INFINITY);
}

/* n rows of width elements from element offset off of src (dtype dt), times mul, into dst
   (rows_padded x ld floats, zero padded). */
static void pack_rows(float *dst, int64_t ld, const void *src, int64_t off, int64_t n,
                      int64_t width, int64_t rows_padded, float mul, int dt) {
  for (int64_t r = 0; r < rows_padded; r++) {
    float *o = dst + r * ld;
    if (r < n)
      load_row(o, src, off + r * width, width, dt, mul);
    else
      memset(o, 0, sizeof(float) * width);
    memset(o + width, 0, sizeof(float) * (ld - width));
  }
}

/* nk rows of width elements (a K or V tile; element offset off of src, dtype dt) transposed into
   t (width x BK), columns >= nk zero; row is a scratch row of width floats. */
static void pack_t(float *t, const void *src, int64_t off, int64_t nk, int64_t width, int dt,
                   float *row) {
  for (int64_t e = 0; e < width; e++) memset(t + e * BK + nk, 0, sizeof(float) * (BK - nk));
  for (int64_t k = 0; k < nk; k++) {
    const float *x = row;
    if (dt == F32)
      x = (const float *)src + off + k * width;
    else
      load_row(row, src, off + k * width, width, dt, 1.0f);
    for (int64_t e = 0; e < width; e++) t[e * BK + k] = x[e];
  }
}

/* -inf where the tile's mask block forbids (pid >= 0) and past the last key (nk < BK). */
static void mask_scores(float *s, int64_t tq, int64_t nk, const uint8_t *bits) {
  for (int64_t r = 0; r < tq; r++) {
    float *row = s + r * BK;
    if (bits) {
      const uint8_t *m = bits + r * BK;
      for (int64_t k = 0; k < nk; k++)
        if (!m[k]) row[k] = -INFINITY;
    }
    for (int64_t k = nk; k < BK; k++) row[k] = -INFINITY;
  }
}

/* Each row of the PARTIAL mask blocks (n_rows rows of BK bytes) as two bytes: the keys [lo, hi)
   from its first to its last attended key, lo | NOT_INTERVAL when it attends only some of them
   (then the kernel reads its bytes). A window's, a causal diagonal's or a document edge's rows
   are intervals: the forward masks them by comparing key indices, and never reads their bytes
   again (it read them once per head and tile, L3 misses measured a tenth of a bf16 window-256
   forward). The bytes are OR-folded 8 at a time: bit 0 of each byte of f says "nonzero". */
#define NOT_INTERVAL 0x80
static void row_ranges(uint8_t *rr, const uint8_t *bits, int64_t n_rows) {
  const uint64_t low = 0x0101010101010101ull;
  for (int64_t r = 0; r < n_rows; r++) {
    int lo = -1, hi = 0, n = 0;
    for (int i = 0; i < BK / 8; i++) {
      uint64_t w;
      memcpy(&w, bits + r * BK + 8 * i, 8);
#if __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
      w = __builtin_bswap64(w); /* byte j of the row in bits 8j.. as below */
#endif
      w |= w >> 4, w |= w >> 2, w |= w >> 1;
      const uint64_t f = w & low;
      if (!f) continue;
      if (lo < 0) lo = 8 * i + __builtin_ctzll(f) / 8;
      hi = 8 * i + (63 - __builtin_clzll(f)) / 8 + 1;
      n += __builtin_popcountll(f);
    }
    if (lo < 0) lo = 0; /* attends nothing: the empty interval [0, 0) */
    rr[2 * r] = (uint8_t)(lo | (n != hi - lo ? NOT_INTERVAL : 0)), rr[2 * r + 1] = (uint8_t)hi;
  }
}

/* For each block of RB rows of a tile, the keys [lo, hi) that one of its rows attends: [0, nk)
   for a FULL tile (rr NULL), from its rows' ranges (rr, row_ranges) for a PARTIAL one (empty:
   lo >= hi). Bytes past nk are not the mask's: ranges are clipped there. */
static void key_ranges(int64_t *lo, int64_t *hi, const uint8_t *rr, int64_t tq, int64_t tqp,
                       int64_t nk) {
  for (int64_t r0 = 0; r0 < tqp; r0 += RB) {
    int64_t a = rr ? nk : 0, b = rr ? 0 : nk;
    for (int64_t r = r0; rr && r < r0 + RB && r < tq; r++) {
      const int64_t l = rr[2 * r] & ~NOT_INTERVAL, h = rr[2 * r + 1] < nk ? rr[2 * r + 1] : nk;
      if (l >= h) continue;
      a = l < a ? l : a;
      b = h > b ? h : b;
    }
    lo[r0 / RB] = a, hi[r0 / RB] = b;
  }
}

/* ALiBi (Press et al., 2021), symmetric as flash-attention's: s -= slope2 * |i - j| for query
   position i = qpos0 + r and key j = c0 + k; slope2 is the head's slope times log2(e) (scores
   are base 2). Distances within a call are exact in float32 below 2^24. */
static void add_alibi(float *s, int64_t tqp, int64_t qpos0, int64_t c0, float slope2) {
  v16 iota;
  for (int i = 0; i < VW; i++) iota[i] = (float)i;
  const v16i abs_mask = (v16i){0} + 0x7fffffff;
  for (int64_t r = 0; r < tqp; r++)
    for (int64_t k = 0; k < BK; k += VW) {
      const v16 dist = splat((float)(qpos0 + r - c0 - k)) - iota;
      st(s + r * BK + k, ld(s + r * BK + k) - slope2 * (v16)((v16i)dist & abs_mask));
    }
}

/* The additive bias (P_BIAS: float32 times log2(e), the host's copy of the call's view; strides
   A_BIAS_S*, 0 on broadcast axes) of rows [0, tq) and keys [0, nk) of the tile whose first row
   is r0 and first key c0, for sequence b and query head h. */
static void add_bias(float *s, const int64_t *a, const float *bias, int64_t b, int64_t h,
                     int64_t r0, int64_t c0, int64_t tq, int64_t nk) {
  const int64_t sq = a[A_BIAS_SQ], sk = a[A_BIAS_SK];
  const float *base = bias + b * a[A_BIAS_SB] + h * a[A_BIAS_SH] + r0 * sq + c0 * sk;
  for (int64_t r = 0; r < tq; r++) {
    float *row = s + r * BK;
    const float *x = base + r * sq;
    if (sk == 1)
      for (int64_t k = 0; k < nk; k++) row[k] += x[k];
    else
      for (int64_t k = 0; k < nk; k++) row[k] += x[k * sk];
  }
}

/* The ALiBi slope (base 2) of sequence b, query head h: slopes (Hq,) shared by every sequence
   (A_SLOPES_SB 0) or (B, Hq), one row per sequence (flash-attn's per-batch slopes). */
static inline float slope_of(const int64_t *a, void *const *p, int64_t b, int64_t h) {
  return ((const float *)p[P_SLOPES])[b * a[A_SLOPES_SB] + h];
}

/* Whether the soft cap comes before ALiBi (flash-attn's order; P_CAP's third float): the cap
   then sees the bias but not ALiBi, which adds to the capped score. Otherwise the cap is last.
   ALiBi takes no gradient and adds a constant, so the cap's derivative (dcap) is the same
   function of the score it capped either way, and dBias keeps the chain through the cap. */
static inline int cap_first(void *const *p) {
  return p[P_CAP] && ((const float *)p[P_CAP])[2] != 0.0f;
}

/* The score mods of one tile, in the order the host accepts them (ALiBi and the bias, the soft
   cap last; or the bias, the cap, then ALiBi: cap_first): s (tqp x BK, base 2) of rows r0 +
   [0, tq), keys c0 + [0, nk) of sequence b, query head h. The soft cap, cap2 · tanh(s / cap2)
   with cap2 = cap · log2(e) (the cap in base-2 units: the same function of the natural score),
   leaves 1 - tanh², its derivative, in dcap when dcap is not NULL (the backward's chain rule). */
static void apply_mods(float *s, float *dcap, const int64_t *a, void *const *p, int64_t b,
                       int64_t h, int64_t r0, int64_t c0, int64_t tq, int64_t tqp, int64_t nk) {
  const int late_alibi = cap_first(p);
  if (p[P_SLOPES] && !late_alibi) add_alibi(s, tqp, a[A_QOFF] + r0, c0, slope_of(a, p, b, h));
  if (p[P_BIAS]) add_bias(s, a, (const float *)p[P_BIAS], b, h, r0, c0, tq, nk);
  if (p[P_CAP]) {
    const float *cap = (const float *)p[P_CAP]; /* {cap2, 1 / cap2, cap first} */
    const v16 c = splat(cap[0]), inv = splat(cap[1]);
    for (int64_t i = 0; i < tqp * BK; i += VW) {
      const v16 t = tanhv(ld(s + i) * inv);
      st(s + i, c * t);
      if (dcap) st(dcap + i, 1.0f - t * t);
    }
  }
  if (p[P_SLOPES] && late_alibi) add_alibi(s, tqp, a[A_QOFF] + r0, c0, slope_of(a, p, b, h));
}

/* Whether the call has a score mod (ALiBi, a bias, a soft cap): apply_mods' or apply_mods_t's
   work. */
static inline int has_mods(void *const *p) { return p[P_SLOPES] || p[P_BIAS] || p[P_CAP]; }

/* ALiBi on a transposed tile (apply_mods_t's layout and ranges). */
static void alibi_t(float *sT, const int64_t *a, void *const *p, int64_t b, int64_t h,
                    int64_t r0, int64_t c0, int64_t nqv, int64_t ka, int64_t kz) {
  v16 iota;
  for (int i = 0; i < VW; i++) iota[i] = (float)i;
  const v16i abs_mask = (v16i){0} + 0x7fffffff;
  const float slope2 = slope_of(a, p, b, h);
  const int64_t qpos0 = a[A_QOFF] + r0;
  for (int64_t k = ka; k < kz; k++)
    for (int64_t v = 0; v < nqv; v++) { /* |i - j| for rows qpos0 + v VW + lane, key c0 + k */
      const v16 dist = splat((float)(qpos0 + v * VW - c0 - k)) + iota;
      float *x = sT + k * MAXBQ + v * VW;
      st(x, ld(x) - slope2 * (v16)((v16i)dist & abs_mask));
    }
}

/* apply_mods on a transposed tile (fwd_t's Sᵀ: key k's scores of 16 query rows a vector, row r
   at sT[k MAXBQ + r], base 2): keys [ka, kz) of the tile whose first key is c0, the nqv vectors
   of rows from r0 (rows past tq get ALiBi and the cap, not the bias, which has no row there);
   the same arithmetic, so the same scores, as apply_mods gives fwd_item. */
static void apply_mods_t(float *sT, const int64_t *a, void *const *p, int64_t b, int64_t h,
                         int64_t r0, int64_t c0, int64_t tq, int64_t nqv, int64_t ka, int64_t kz) {
  int64_t k, v, r;
  const int late_alibi = cap_first(p);
  if (p[P_SLOPES] && !late_alibi) alibi_t(sT, a, p, b, h, r0, c0, nqv, ka, kz);
  if (p[P_BIAS]) {
    const int64_t sq = a[A_BIAS_SQ], sk = a[A_BIAS_SK];
    const float *base = (const float *)p[P_BIAS] + b * a[A_BIAS_SB] + h * a[A_BIAS_SH] + r0 * sq;
    for (k = ka; k < kz; k++) {
      const float *x = base + (c0 + k) * sk;
      float *row = sT + k * MAXBQ;
      for (r = 0; r < tq; r++) row[r] += x[r * sq];
    }
  }
  if (p[P_CAP]) {
    const float *cap = (const float *)p[P_CAP]; /* {cap2, 1 / cap2, cap first} */
    const v16 c = splat(cap[0]), inv = splat(cap[1]);
    for (k = ka; k < kz; k++)
      for (v = 0; v < nqv; v++) {
        float *x = sT + k * MAXBQ + v * VW;
        st(x, c * tanhv(ld(x) * inv));
      }
  }
  if (p[P_SLOPES] && late_alibi) alibi_t(sT, a, p, b, h, r0, c0, nqv, ka, kz);
}

/* -- attention dropout, counter-based: the same kept pairs as selfattn.backends._common.
   dropout_keep (murmur3's 32-bit finaliser over seed, b, h, query position, key position; the
   top 24 bits give u in [0, 1), kept iff u >= p), so every backend and the recomputing backward
   drop the same (query, key) pairs for a seed. */
#define GOLDEN 0x9E3779B9u
typedef uint32_t v16u __attribute__((vector_size(VW * 4)));

static inline uint32_t fmix32(uint32_t x) {
  x ^= x >> 16, x *= 0x85EBCA6Bu, x ^= x >> 13, x *= 0xC2B2AE35u;
  return x ^ (x >> 16);
}
static inline v16u fmix16(v16u x) {
  x ^= x >> 16, x *= 0x85EBCA6Bu, x ^= x >> 13, x *= 0xC2B2AE35u;
  return x ^ (x >> 16);
}

/* The hash state after (seed, b, h): seed0 is the host's hash of the seed alone. */
static uint32_t dropout_bh(int64_t seed0, int64_t b, int64_t h) {
  const uint32_t x = fmix32((uint32_t)seed0 ^ ((uint32_t)b + GOLDEN));
  return fmix32(x ^ ((uint32_t)h + GOLDEN));
}

/* x (rows [0, tq) x BK) *= keep / (1 - p) for query positions qpos0 + r and keys c0 + k;
   drop = {p, 1 / (1 - p)}. */
static void dropout_scale(float *x, int64_t tq, uint32_t xbh, int64_t qpos0, int64_t c0,
                          const float *drop) {
  v16u iota;
  for (int i = 0; i < VW; i++) iota[i] = (uint32_t)i;
  const v16 p = splat(drop[0]), inv_keep = splat(drop[1]), unit = splat(1.0f / 16777216.0f);
  for (int64_t r = 0; r < tq; r++) {
    const uint32_t xr = fmix32(xbh ^ ((uint32_t)(qpos0 + r) + GOLDEN));
    for (int64_t k = 0; k < BK; k += VW) {
      const v16u kv = ((v16u){0} + ((uint32_t)(c0 + k) + GOLDEN)) + iota;
      const v16u h = fmix16(((v16u){0} + xr) ^ kv);
      const v16 u = __builtin_convertvector((v16i)(h >> 8), v16) * unit;
      const v16i keep = u >= p;
      st(x + r * BK + k, (v16)((v16i)(ld(x + r * BK + k) * inv_keep) & keep));
    }
  }
}

static const uint8_t *block_bits(const Dims *d, void *const *p, int64_t pid, int64_t b,
                                 int64_t h) {
  if (pid < 0) return NULL;
  const int64_t mb = d->mb > 1 ? b : 0, mh = d->mh > 1 ? h : 0;
  return (const uint8_t *)p[P_BITS] + ((pid * d->mb + mb) * d->mh + mh) * d->bq * BK;
}

/* Work item (b, h, query tile i) of the forward and the dQ pass: its rows and key tiles. */
typedef struct {
  int64_t b, h, i, tq, tqp;
  int64_t row0; /* first row of (B, Hq, Sq) */
  int64_t kvh;  /* first key row of its kv head in (B, Hkv, Sk) */
  const int32_t *cols, *pids; /* its non-EMPTY key tiles [0, n) and their PARTIAL blocks */
  int64_t n;
} QTile;

static QTile q_tile(const Dims *d, void *const *p, int64_t item) {
  QTile t;
  const int32_t *rowptr = (const int32_t *)p[P_ROWPTR];
  t.i = item % d->nq, t.h = (item / d->nq) % d->Hq, t.b = item / (d->nq * d->Hq);
  const int64_t r0 = t.i * d->bq;
  t.tq = d->bq < d->Sq - r0 ? d->bq : d->Sq - r0, t.tqp = round_up(t.tq, RB);
  t.row0 = (t.b * d->Hq + t.h) * d->Sq + r0, t.kvh = (t.b * d->Hkv + t.h / d->G) * d->Sk;
  t.cols = (const int32_t *)p[P_COLS] + rowptr[t.i], t.pids = (const int32_t *)p[P_PIDS] + rowptr[t.i];
  t.n = rowptr[t.i + 1] - rowptr[t.i];
  return t;
}

/* ------------------------------------------------------------------------------------------ */
/* Forward: work item (b, h, query tile i)                                                     */
/* ------------------------------------------------------------------------------------------ */

/* -- normalise rows [0, tq) of a forward item (first row row0 of (B, Hq, Sq)): acc (stride Dvp)
   / l into out, lse, and the statistics m, l for the backward; a row with no key gets out 0, lse
   -inf and (m, l) = (0, 1), which make every weight the backward recomputes 0. finite: whether
   the item's q rows were; with the out rows as stored, into P_FINITE. */
static void finish_rows(const Dims *d, void *const *p, int64_t row0, int64_t tq, float *acc,
                        const float *m, const float *l, int finite) {
  /* the statistics go through these, then out in whole vectors: one scalar store per row and
     statistic held the store buffer full while the lines came in */
  float lse[MAXBQ], mo[MAXBQ], lout[MAXBQ];
  const float inf_from = stored_inf_from(d->dt);
  /* lanes (and the rows' tails) that met an out element stored as NaN/Inf: reduced once, at
     the end (a reduction per row showed as ~0.5 ms of a 35 ms bf16 window forward in perf) */
  v16i bad = {0};
  int bad_tail = 0;
  for (int64_t r = 0; r < tq; r++) {
    float *o = acc + r * d->Dvp;
    if (l[r] != 0.0f) { /* NaN (a NaN score) normalises to NaN, for the host's exact redo */
      const float inv = 1.0f / l[r];
      int64_t k = 0;
      for (; k + VW <= d->Dv; k += VW) {
        const v16 x = ld(o + k) * inv;
        st(o + k, x);
        bad |= ~((v16)((v16i)x & 0x7fffffff) < inf_from); /* NaN: not below */
      }
      for (; k < d->Dv; k++) {
        o[k] *= inv;
        bad_tail |= !(fabsf(o[k]) < inf_from);
      }
      mo[r] = m[r], lout[r] = l[r];
    } else {
      memset(o, 0, sizeof(float) * d->Dv);
      mo[r] = 0.0f, lout[r] = 1.0f;
    }
    store_row(p[P_OUT], (row0 + r) * d->Dv, o, d->Dv, d->dt);
  }
  for (int64_t r = 0; r < tq; r += VW) { /* rows past tq: scratch, computed and not stored */
    const v16 lr = ld(l + r);
    const v16i empty = lr == 0.0f; /* no key: lse -inf */
    const v16 y = (ld(m + r) + log2v(lr)) * LN2F;
    st(lse + r, (v16)(((v16i)splat(-INFINITY) & empty) | ((v16i)y & ~empty)));
  }
  memcpy((float *)p[P_LSE] + row0, lse, sizeof(float) * (size_t)tq);
  memcpy((float *)p[P_M] + row0, mo, sizeof(float) * (size_t)tq);
  memcpy((float *)p[P_L] + row0, lout, sizeof(float) * (size_t)tq);
  for (int i = 0; i < VW; i++) bad_tail |= bad[i];
  if ((bad_tail || !finite) && p[P_FINITE]) /* a byte other items may write: the same 0 */
    __atomic_store_n((uint8_t *)p[P_FINITE], 0, __ATOMIC_RELAXED);
}

/* The online-softmax step of one block of RB rows of a tile (s: RB x BK, base-2 scores times
   mul in columns [v0, v1), the only ones read or written), in one pass per row: scale, mask
   (bits: the rows' mask bytes, stride BK, NULL for a FULL tile; keys >= nk), the row max, the
   rescale of the row's running sum and output accumulator (stride dvp) to a new max, then the
   weights 2^(s - m) (over s) and their sum, kept as a vector per row (lv: RB x VW; summed
   across once, at the end: not once per tile and row). Rows [nr, RB) (padding) get weight 0.
   rr: the rows' ranges (row_ranges; NULL with bits): an interval row is masked by key index. */
static inline void softmax_block(float *s, int64_t nr, int64_t v0, int64_t v1, int64_t nk,
                                 const uint8_t *bits, const uint8_t *rr, float mul, float *m,
                                 float *lv, float *acc, int64_t dvp) {
  typedef uint8_t v16b __attribute__((vector_size(VW)));
  v16 iota;
  for (int i = 0; i < VW; i++) iota[i] = (float)i;
  const v16 ninf = splat(-INFINITY);
  for (int64_t r = 0; r < RB; r++) {
    float *row = s + r * BK;
    int64_t k;
    if (r >= nr) {
      for (k = v0; k < v1; k += VW) st(row + k, splat(0.0f));
      continue;
    }
    v16 mx = ninf;
    const int holes = bits && (rr[2 * r] & NOT_INTERVAL); /* read this row's mask bytes */
    const int64_t hi = bits && rr[2 * r + 1] < nk ? rr[2 * r + 1] : nk;
    const v16 lo_v = splat(bits ? (float)(rr[2 * r] & ~NOT_INTERVAL) : 0.0f);
    for (k = v0; k < v1; k += VW) {
      v16 x = ld(row + k) * mul;
      if (holes) {
        v16b b;
        memcpy(&b, bits + r * BK + k, VW);
        const v16i keep = __builtin_convertvector(b, v16i) != 0;
        x = (v16)(((v16i)x & keep) | ((v16i)ninf & ~keep));
      }
      if (bits || k + VW > hi) { /* keys [lo, hi) of an interval row, below nk */
        const v16 key = iota + (float)k;
        const v16i keep = (key >= lo_v) & (key < (float)hi);
        x = (v16)(((v16i)x & keep) | ((v16i)ninf & ~keep));
      }
      st(row + k, x);
      mx = vmax(mx, x);
    }
    const float mn = fmaxf(m[r], hmax(mx));
    if (mn == -INFINITY) { /* no key yet: weights 0, nothing to rescale */
      /* vmax never keeps a NaN, so a tile whose attended scores are all NaN looks empty here:
         a NaN sum instead (NaN out and lse, for the host's exact redo), or the row would come
         back empty (0, -inf) or ignore those keys */
      int nan = 0;
      for (k = v0; k < v1; k++) nan |= row[k] != row[k];
      if (nan) st(lv + r * VW, splat(NAN));
      for (k = v0; k < v1; k += VW) st(row + k, splat(0.0f));
      continue;
    }
    if (mn > m[r]) {
      const float alpha = exp2f(m[r] - mn); /* 0 while m is -inf: acc and l are 0 then */
      st(lv + r * VW, ld(lv + r * VW) * alpha);
      for (k = 0; k < dvp; k += VW) st(acc + r * dvp + k, ld(acc + r * dvp + k) * alpha);
      m[r] = mn;
    }
    const v16 mv = splat(mn);
    v16 sum = splat(0.0f);
    for (k = v0; k < v1; k += VW) {
      const v16 w = exp2v(ld(row + k) - mv);
      st(row + k, w);
      sum += w;
    }
    st(lv + r * VW, ld(lv + r * VW) + sum);
  }
}

static void fwd_item(const void *vjob, int64_t item, float *buf) {
  const Job *job = (const Job *)vjob;
  const Dims d = dims(job->a);
  void *const *p = job->p;
  const QTile qt = q_tile(&d, p, item);
  const int64_t b = qt.b, h = qt.h, tq = qt.tq, tqp = qt.tqp, row0 = qt.row0, kvh = qt.kvh;
  float *qs = buf, *s = qs + MAXBQ * d.Dp, *acc = s + MAXBQ * BK, *m = acc + MAXBQ * d.Dvp;
  float *l = m + MAXBQ;
  const int64_t blk0 = kvh / d.Sk * d.nk; /* first packed block of this kv head */
  const int mods = has_mods(p);
  const float *drop = (const float *)p[P_DROP];
  const uint32_t xbh = drop ? dropout_bh(job->a[A_SEED], b, h) : 0;
  int64_t r, t, lo[MAXBQ / RB], hi[MAXBQ / RB];

  const int64_t npairs = (d.D + 1) / 2;
  uint32_t *qb = (uint32_t *)(l + MAXBQ); /* q's bf16 pair words, unscaled (bf16 path) */
  uint32_t *pw = qb + MAXBQ * d.Dp;       /* RB rows of weights as bf16 pairs (bf16 P V) */
  if (job->kb)
    pack_pairs(qb, npairs, (const uint16_t *)p[P_Q], row0 * d.D, tq, d.D, tqp);
  else
    pack_rows(qs, d.Dp, p[P_Q], row0 * d.D, tq, d.D, tqp, job->c, d.dt);
  const int q_finite = elems_finite(p[P_Q], row0 * d.D, tq * d.D, d.dt); /* rows now in L1 */
  float *lv = (float *)(pw + RB * BK / 2); /* each row's running sum as a vector */
  for (r = 0; r < tqp; r++) m[r] = -INFINITY;
  memset(lv, 0, sizeof(float) * tqp * VW);
  memset(acc, 0, sizeof(float) * tqp * d.Dvp);
  for (t = 0; t < qt.n; t++) {
    const int64_t c0 = (int64_t)qt.cols[t] * BK, nk = BK < d.Sk - c0 ? BK : d.Sk - c0;
    const int64_t blk = blk0 + qt.cols[t];
    const uint8_t *bits = block_bits(&d, p, qt.pids[t], b, h);
    const uint8_t *rr = bits ? job->rr + (bits - (const uint8_t *)p[P_BITS]) / BK * 2 : NULL;
    const float *kt = job->kb ? NULL : job->kt + blk * d.D * BK;
    const float *vb = job->vp ? job->vp + blk * BK * d.Dvp : (const float *)p[P_V] + (kvh + c0) * d.Dv;
    /* each block of RB rows computes only the keys [lo, hi) some of its rows attend: a PARTIAL
       tile's masked corners (a window's or a causal diagonal's triangle) are skipped */
    key_ranges(lo, hi, rr, tq, tqp, nk);
    /* one block of RB rows at a time through scores and softmax, its scores in L1; then P V
       block by block (K's tile, then V's, stay in L1: alternating them per block measured 1.25x
       slower on dense float32 tiles) */
    for (r = 0; r < tqp; r += RB) {
      const int64_t k0 = lo[r / RB], k1 = hi[r / RB];
      if (k1 <= k0) continue;
      const int64_t v0 = k0 / VW * VW, v1 = round_up(k1, VW), nr = tq - r < RB ? tq - r : RB;
      float *sb = s + r * BK, mul = 1.0f;
      /* -- scores of the block, base 2 */
#if HAVE_DPBF16
      if (job->kb) { /* exact bf16 products summed in float32, times c in the softmax pass */
        const uint32_t *kb = (const uint32_t *)job->kb + blk * npairs * BK;
        mm_bf16_rows(sb + v0, BK, qb + r * npairs, npairs, 1, kb + v0, BK, npairs, v1 - v0, 1,
                     NULL);
        mul = job->c;
      } else
#endif
        mm_rows0(sb + v0, BK, qs + r * d.Dp, d.Dp, kt + v0, BK, d.D, v1 - v0);
      if (mods) { /* the mods take scaled scores */
        for (int64_t i = 0; i < RB * BK; i += VW) st(sb + i, ld(sb + i) * mul);
        mul = 1.0f;
        apply_mods(sb, NULL, job->a, p, b, h, qt.i * d.bq + r, c0, nr, RB, nk);
      }
      /* -- online softmax: rescale each row's running sums to its new max; scores -> weights */
      softmax_block(sb, nr, v0, v1, nk, bits ? bits + r * BK : NULL, rr ? rr + 2 * r : NULL, mul,
                    m + r, lv + r * VW,
                    acc + r * d.Dvp, d.Dvp);
      if (drop) /* l (and so lse) stays the undropped normaliser */
        dropout_scale(sb, nr, xbh, job->a[A_QOFF] + qt.i * d.bq + r, c0, drop);
    }
    /* -- weighted V rows: acc += P V over each block's keys [k0, k1) */
    for (r = 0; r < tqp; r += RB) {
      const int64_t k0 = lo[r / RB], k1 = hi[r / RB];
      if (k1 <= k0) continue;
      float *sb = s + r * BK;
#if HAVE_DPBF16
      if (job->vb) { /* weights rounded to bf16, times bf16 V pairs, summed in float32 */
        const uint32_t *vpairs = (const uint32_t *)job->vb + blk * (BK / 2) * d.Dvp;
        const int64_t p0 = k0 / 2, p1 = (k1 + 1) / 2;
        weights_bf16(pw, sb);
        mm_bf16_rows(acc + r * d.Dvp, d.Dvp, pw + p0, BK / 2, 1, vpairs + p0 * d.Dvp, d.Dvp,
                     p1 - p0, d.Dvp, 0, NULL);
        continue;
      }
#endif
      mm_rows(acc + r * d.Dvp, d.Dvp, sb + k0, BK, vb + k0 * d.Dvp, d.Dvp, k1 - k0, d.Dvp);
    }
  }
  for (r = 0; r < tq; r++) l[r] = hsum(ld(lv + r * VW));
  finish_rows(&d, p, row0, tq, acc, m, l, q_finite);
}

/* ------------------------------------------------------------------------------------------ */
/* forward on transposed score tiles (AVX-512 builds; calls without dropout, and without      */
/* score mods but for bf16): the layout puts 16 query rows in a vector, so the online         */
/* softmax's row max, sum, rescale factor and running max are vertical vector operations, no  */
/* horizontal reduction, scalar step or branch per row (per row they were half the time of a  */
/* window-256 forward, on 4 vectors a row: latency-bound chains).                             */
/* ------------------------------------------------------------------------------------------ */

/* A PARTIAL block (one per tile, mask batch and mask head) as the transposed forward reads it:
   per key a 64-bit mask of the query rows that attend it (bit r: row r; rows past the tile's
   and keys past the tile's last are 0), so a vector of 16 rows takes its 16 bits as an AVX-512
   lane mask; the keys [ka, kz) some row attends, and per block of RB rows the keys [lo, hi)
   one of its rows attends (empty: lo >= hi). */
typedef struct KeyMasks {
  uint64_t keys[BK];
  uint8_t lo[MAXBQ / RB], hi[MAXBQ / RB], ka, kz;
} KeyMasks;

#if HAVE_TRANSPOSED
/* The key masks of every PARTIAL block instance (index as block_bits'), from the byte blocks,
   clipped to each tile's rows (tq) and keys (nk): each row's bytes as a 64-bit key mask (one
   vptestmb), then that 64 x 64 bit matrix transposed 8 rows at a time (vptestmq per key). */
static void key_masks(KeyMasks *tb, const Dims *d, void *const *p) {
  const int32_t *rowptr = (const int32_t *)p[P_ROWPTR], *cols = (const int32_t *)p[P_COLS];
  const int32_t *pids = (const int32_t *)p[P_PIDS];
  const int64_t per_tile = d->mb * d->mh;
  for (int64_t i = 0; i < d->nq; i++) {
    const int64_t tq = d->bq < d->Sq - i * d->bq ? d->bq : d->Sq - i * d->bq;
    for (int64_t t = rowptr[i]; t < rowptr[i + 1]; t++) {
      if (pids[t] < 0) continue;
      const int64_t c0 = (int64_t)cols[t] * BK, nk = BK < d->Sk - c0 ? BK : d->Sk - c0;
      const uint64_t in_tile = nk == 64 ? ~0ull : (1ull << nk) - 1;
      for (int64_t inst = pids[t] * per_tile; inst < (pids[t] + 1) * per_tile; inst++) {
        const uint8_t *bits = (const uint8_t *)p[P_BITS] + inst * d->bq * BK;
        KeyMasks *km = tb + inst;
        uint64_t rows[MAXBQ] = {0}, all = 0;
        for (int64_t r = 0; r < tq; r++) {
          const __m512i x = _mm512_loadu_si512(bits + r * BK);
          rows[r] = _mm512_test_epi8_mask(x, x) & in_tile;
          all |= rows[r];
        }
        __m512i R[MAXBQ / 8];
        for (int j = 0; j < MAXBQ / 8; j++) R[j] = _mm512_loadu_si512(rows + 8 * j);
        for (int k = 0; k < BK; k++) {
          const __m512i bit = _mm512_set1_epi64((long long)(1ull << k));
          uint64_t mk = 0;
          for (int j = 0; j < MAXBQ / 8; j++)
            mk |= (uint64_t)_mm512_test_epi64_mask(R[j], bit) << (8 * j);
          km->keys[k] = mk;
        }
        for (int rb = 0; rb < MAXBQ / RB; rb++) {
          uint64_t u = 0;
          for (int r = RB * rb; r < RB * (rb + 1); r++) u |= rows[r];
          km->lo[rb] = u ? (uint8_t)__builtin_ctzll(u) : BK;
          km->hi[rb] = u ? (uint8_t)(64 - __builtin_clzll(u)) : 0;
        }
        km->ka = all ? (uint8_t)__builtin_ctzll(all) : 0;
        km->kz = all ? (uint8_t)(64 - __builtin_clzll(all)) : 0;
      }
    }
  }
}

/* 2^x of 16 floats for the bf16 path's weights: x = n + f, |f| <= 1/2, 2^f by a degree-5
   polynomial (minimax in relative error on [-1/2, 1/2] with p(0) = 1: 1.8e-7 in float32, as
   exact as exp2v's degree 7), 2^n by vscalefps (0 far below FLT_MIN: no clamp, no exponent
   arithmetic). Lanes not in keep are 0. Degree 3 (1.0e-4, a twentieth of bf16's half ulp, fine
   for the weights) measured only 1-2% faster and would take the lse, whose row sums it makes,
   off float32 accuracy. */
static inline __m512 exp2w(__m512 x, __mmask16 keep) {
  static const float c[] = {0.0013264708686619997f, 0.009671511128544807f, 0.05550733953714371f,
                            0.24022242426872253f, 0.6931470036506653f};
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 y = _mm512_set1_ps(c[0]);
  for (unsigned i = 1; i < sizeof c / sizeof c[0]; i++) y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(c[i]));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.0f));
  return _mm512_maskz_scalef_ps(keep, y, n);
}

/* w[i] (16 words each) <- column i of the 16 x 16 matrix of words w held by rows */
static inline void transpose16(__m512i w[VW]) {
  __m512i t[VW];
  int i, j;
  for (i = 0; i < 8; i++) {
    t[2 * i] = _mm512_unpacklo_epi32(w[2 * i], w[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(w[2 * i], w[2 * i + 1]);
  }
  for (i = 0; i < 4; i++) {
    w[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    w[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    w[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    w[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (i = 0; i < 2; i++)
    for (j = 0; j < 4; j++) {
      t[8 * i + j] = _mm512_shuffle_i32x4(w[8 * i + j], w[8 * i + j + 4], 0x88);
      t[8 * i + j + 4] = _mm512_shuffle_i32x4(w[8 * i + j], w[8 * i + j + 4], 0xdd);
    }
  for (j = 0; j < 8; j++) {
    w[j] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0x88);
    w[j + 8] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0xdd);
  }
}

/* Work item (b, h, query tile i), as fwd_item's, on transposed tiles: Sᵀ = K Qᵀ (a key per row,
   16 query rows a vector), then per vector of 16 rows the max over the tile's keys, the new
   running max and rescale factor, the weights 2^(s - m) and their sum, then out += P V with P's
   elements broadcast from the weights' tile (the rescale folded into the accumulator's load).
   bf (a constant): bf16 q, k, v by vdpbf16ps, the weights as bf16 pair words of two keys (pw:
   pair p, row r at p MAXBQ + r) and raw scores times c in the softmax; else float32, q times c
   as it is packed and the weights in place of the scores. */
static inline __attribute__((always_inline)) void fwd_t(const void *vjob, int64_t item,
                                                        float *buf, const int bf) {
  const Job *job = (const Job *)vjob;
  const Dims d = dims(job->a);
  void *const *p = job->p;
  const QTile qt = q_tile(&d, p, item);
  const int64_t tq = qt.tq, tqp = qt.tqp, row0 = qt.row0, np = (d.D + 1) / 2;
  const int64_t nqv = (tq + VW - 1) / VW; /* vectors of 16 query rows */
  /* Qᵀ: float32 D x MAXBQ, or bf16 pair words np x MAXBQ */
  float *qT = buf, *st = buf + d.D * MAXBQ; /* Sᵀ: BK x MAXBQ */
  uint32_t *pw = (uint32_t *)(st + BK * MAXBQ);      /* P (bf): BK / 2 x MAXBQ pair words */
  float *acc = (float *)(pw + BK / 2 * MAXBQ);       /* out: MAXBQ x Dvp */
  float *m = acc + MAXBQ * d.Dvp, *l = m + MAXBQ, *alpha = l + MAXBQ;
  const int64_t blk0 = qt.kvh / d.Sk * d.nk;
  /* bf16 scores are s c with c = scale log2(e): the max is taken on s, so c must be positive;
     a negative scale negates q instead (exact in bf16). float32 q is packed times c. */
  const int mods = has_mods(p);
  /* with score mods, bf16 scores are scaled by c before them (the mods take base-2 scores) and
     the softmax's factor is 1 */
  const float cs = bf ? fabsf(job->c) : 1.0f, c = mods ? 1.0f : cs;
  const uint32_t flip = bf && job->c < 0 ? 0x80008000u : 0;
  const __m512 vc = _mm512_set1_ps(c), ninf = _mm512_set1_ps(-INFINITY), one = _mm512_set1_ps(1);
  int64_t r, k, t, v;

  /* -- the next item's q rows (the next rows of (B, Hq, Sq), where an item usually follows) into
     cache while this one computes: packing Qᵀ from memory stalled on its misses (~8% of a bf16
     window forward: one burst of loads per item that the hardware prefetcher does not foresee) */
  {
    const int64_t esz = d.dt == F32 ? 4 : 2, last = d.B * d.Hq * d.Sq;
    const int64_t n1 = row0 + tq + d.bq < last ? d.bq : last - row0 - tq;
    const char *nx = (const char *)p[P_Q] + (row0 + tq) * d.D * esz;
    for (k = 0; k < n1 * d.D * esz; k += CACHE_LINE) _mm_prefetch(nx + k, _MM_HINT_T0);
    /* and this item's output lines for writing: finish_rows' stores waited on their misses */
    const char *ox = (const char *)p[P_OUT] + row0 * d.Dv * esz;
    for (k = 0; k < tq * d.Dv * esz; k += CACHE_LINE) _mm_prefetch(ox + k, _MM_HINT_ET0);
    for (v = P_LSE; v <= P_L; v++)
      for (k = 0; k < tq * (int64_t)sizeof(float); k += CACHE_LINE)
        _mm_prefetch((const char *)((const float *)p[v] + row0) + k, _MM_HINT_ET0);
  }
  /* -- Qᵀ, rows [tq, nqv VW) 0: blocks of 16 rows x 16 32-bit words (floats, or for even D
     bf16 pairs: 4 bytes of q) transposed in registers (scalar stores were a quarter of this
     item's time, vpgatherdd 40%); their finiteness tested there too */
  int q_finite;
  if (!bf && d.dt != F32) { /* fp16: converted and scaled element by element */
    memset(qT, 0, sizeof(float) * d.D * MAXBQ);
    for (r = 0; r < tq; r++)
      for (k = 0; k < d.D; k++) load_row(qT + k * MAXBQ + r, p[P_Q], (row0 + r) * d.D + k, 1, d.dt, job->c);
    q_finite = elems_finite(p[P_Q], row0 * d.D, tq * d.D, d.dt);
  } else if (!bf || d.D % 2 == 0) {
    const int64_t words = bf ? np : d.D;
    const __m512i fl = _mm512_set1_epi32((int)flip);
    const __m512 cq = _mm512_set1_ps(job->c);
    /* NaN/Inf: all 8 exponent bits of a bf16, which sit where a float32's do in its upper half
       (16-bit lanes: both of a bf16 pair word, the odd ones of a float32) */
    const __m512i ex = _mm512_set1_epi32(0x7f807f80);
    const __mmask32 halves = bf ? 0xffffffffu : 0xaaaaaaaau;
    __mmask32 nonfinite = 0;
    for (v = 0; v < nqv; v++)
      for (k = 0; k < words; k += VW) {
        const __mmask16 cols = words - k >= VW ? 0xffff : (__mmask16)((1u << (words - k)) - 1);
        const __mmask16 in = tq - v * VW >= VW ? 0xffff : (__mmask16)((1u << (tq - v * VW)) - 1);
        const uint32_t *x = (const uint32_t *)p[P_Q] + (row0 + v * VW) * words + k;
        __m512i w[VW];
        for (r = 0; r < VW; r++)
          w[r] = v * VW + r < tq ? _mm512_maskz_loadu_epi32(cols, x + r * words)
                                 : _mm512_setzero_si512();
        for (r = 0; r < VW; r++)
          nonfinite |= _mm512_mask_cmpeq_epi16_mask(halves, _mm512_and_si512(w[r], ex), ex);
        transpose16(w);
        for (r = 0; r < VW && k + r < words; r++)
          _mm512_storeu_si512(qT + (k + r) * MAXBQ + v * VW,
                              bf ? _mm512_maskz_xor_epi32(in, w[r], fl)
                                 : (__m512i)_mm512_maskz_mul_ps(in, (__m512)w[r], cq));
      }
    q_finite = !nonfinite;
  } else {
    uint32_t *qw = (uint32_t *)qT;
    memset(qw, 0, sizeof(uint32_t) * np * MAXBQ);
    for (r = 0; r < tq; r++) {
      const uint16_t *x = (const uint16_t *)p[P_Q] + (row0 + r) * d.D;
      for (k = 0; k < d.D / 2; k++)
        qw[k * MAXBQ + r] = (x[2 * k] | (uint32_t)x[2 * k + 1] << 16) ^ flip;
      qw[(np - 1) * MAXBQ + r] = x[d.D - 1] ^ (flip & 0xffffu);
    }
    q_finite = elems_finite(p[P_Q], row0 * d.D, tq * d.D, d.dt);
  }
  for (r = 0; r < nqv * VW; r++) m[r] = -INFINITY, l[r] = 0.0f;
  memset(acc, 0, sizeof(float) * tqp * d.Dvp);
  for (t = 0; t < qt.n; t++) {
    const int64_t c0 = (int64_t)qt.cols[t] * BK, nk = BK < d.Sk - c0 ? BK : d.Sk - c0;
    const int64_t blk = blk0 + qt.cols[t];
    const uint8_t *bits = block_bits(&d, p, qt.pids[t], qt.b, qt.h);
    const KeyMasks *km = bits ? job->tb + (bits - (const uint8_t *)p[P_BITS]) / (d.bq * BK) : NULL;
    const int64_t ka = km ? km->ka : 0, kz = km ? km->kz : nk;
    /* K's rows (of pair words for bf16): in place (a bf16 pair word is 4 bytes of k), but for
       odd bf16 D and a last tile of fewer than BK keys, which the blocks of RB keys would read
       past: packed there (kb / kp, zero rows past nk) */
    const int in_place = nk == BK && (bf ? d.D % 2 == 0 : d.dt == F32);
    const int64_t lda = bf ? np : (in_place ? d.D : d.Dp);
    const float *kr = in_place ? (const float *)p[P_K] + (qt.kvh + c0) * (bf ? np : d.D)
                               : (bf ? job->kb + blk * BK * np : job->kp + blk * BK * d.Dp);
    if (kz <= ka) continue;
    /* -- Sᵀ of keys [ka, kz) by blocks of RB keys, each over the vectors of rows that attend
       one of them (a PARTIAL tile's masked corner is skipped) */
    for (k = ka / RB * RB; k < kz; k += RB) {
      int64_t v0 = 0, v1 = nqv;
      if (km) {
        const uint64_t any = km->keys[k] | km->keys[k + 1] | km->keys[k + 2] | km->keys[k + 3];
        if (!any) continue;
        v0 = __builtin_ctzll(any) / VW, v1 = (63 - __builtin_clzll(any)) / VW + 1;
      }
#if HAVE_DPBF16
      if (bf) {
        mm_bf16_rows(st + k * MAXBQ + v0 * VW, MAXBQ, (const uint32_t *)kr + k * np, np, 1,
                     (const uint32_t *)qT + v0 * VW, MAXBQ, np, (v1 - v0) * VW, 1, NULL);
        continue;
      }
#endif
      mm_rows0(st + k * MAXBQ + v0 * VW, MAXBQ, kr + k * lda, lda, qT + v0 * VW, MAXBQ, d.D,
               (v1 - v0) * VW);
    }
    if (mods) { /* scores of keys no row attends (skipped blocks: stale) stay masked below */
      if (cs != 1.0f)
        for (k = ka; k < kz; k++)
          for (v = 0; v < nqv; v++)
            _mm512_storeu_ps(st + k * MAXBQ + v * VW,
                             _mm512_mul_ps(_mm512_loadu_ps(st + k * MAXBQ + v * VW), _mm512_set1_ps(cs)));
      apply_mods_t(st, job->a, p, qt.b, qt.h, qt.i * d.bq, c0, tq, nqv, ka, kz);
    }
    /* -- per vector of rows: max, new running max, rescale, then weights and their sum */
    uint64_t rescale = 0; /* rows whose running max rose (their out must be rescaled) */
    for (v = 0; v < nqv; v++) {
      float *sv = st + v * VW;
      /* keys [va, vz): those a row of this vector attends (a PARTIAL tile's masked corner is
         not exponentiated: its weights would be 0, which adds nothing to the sum, and P V reads
         only keys in its row block's [lo, hi), inside [va, vz)) */
      int64_t va = ka, vz = kz;
      if (km) {
        va = BK, vz = 0;
        for (int b = VW / RB * (int)v; b < VW / RB * ((int)v + 1); b++)
          if (km->lo[b] < km->hi[b]) {
            va = va < km->lo[b] ? va : km->lo[b];
            vz = vz > km->hi[b] ? vz : km->hi[b];
          }
        if (vz <= va) continue; /* no key for these rows: m, l unchanged, P V skips them */
      }
      __m512 mx = ninf, mx2 = ninf; /* two chains: vmaxps' latency, not its rate, bounds one */
      if (km) {
        for (k = va; k + 1 < vz; k += 2) {
          mx = _mm512_mask_max_ps(mx, (__mmask16)(km->keys[k] >> (VW * v)), mx,
                                  _mm512_loadu_ps(sv + k * MAXBQ));
          mx2 = _mm512_mask_max_ps(mx2, (__mmask16)(km->keys[k + 1] >> (VW * v)), mx2,
                                   _mm512_loadu_ps(sv + (k + 1) * MAXBQ));
        }
        if (k < vz)
          mx = _mm512_mask_max_ps(mx, (__mmask16)(km->keys[k] >> (VW * v)), mx,
                                  _mm512_loadu_ps(sv + k * MAXBQ));
      } else {
        for (k = ka; k + 1 < kz; k += 2) {
          mx = _mm512_max_ps(mx, _mm512_loadu_ps(sv + k * MAXBQ));
          mx2 = _mm512_max_ps(mx2, _mm512_loadu_ps(sv + (k + 1) * MAXBQ));
        }
        if (k < kz) mx = _mm512_max_ps(mx, _mm512_loadu_ps(sv + k * MAXBQ));
      }
      mx = _mm512_max_ps(mx, mx2);
      const __m512 mo = _mm512_loadu_ps(m + v * VW);
      const __mmask16 some = _mm512_cmp_ps_mask(mx, ninf, _CMP_GT_OQ);
      const __m512 mn = _mm512_max_ps(mo, _mm512_mask_mul_ps(ninf, some, mx, vc));
      /* 2^(m_old - m_new): 0 while m_old is -inf, 1 where no key has come yet (exp2v: float32
         exact, the running sums keep their precision) */
      const __mmask16 live = _mm512_cmp_ps_mask(mn, ninf, _CMP_GT_OQ);
      const __m512 a = _mm512_mask_blend_ps(live, one, (__m512)exp2v((v16)_mm512_sub_ps(mo, mn)));
      rescale |= (uint64_t)_mm512_cmp_ps_mask(a, one, _CMP_NEQ_UQ) << (VW * v);
      _mm512_storeu_ps(m + v * VW, mn);
      _mm512_storeu_ps(alpha + v * VW, a);
      const __m512 negm = _mm512_sub_ps(_mm512_setzero_ps(), mn);
      __m512 sum = _mm512_setzero_ps();
      for (k = va / 2 * 2; k < vz; k += 2) { /* keys k, k + 1 (one bf16 pair word a row) */
        __mmask16 k0, k1;
        if (km) {
          k0 = (__mmask16)(km->keys[k] >> (VW * v)), k1 = (__mmask16)(km->keys[k + 1] >> (VW * v));
        } else {
          k0 = 0xffff, k1 = k + 1 < kz ? 0xffff : 0;
        }
        const __m512 s0 = _mm512_loadu_ps(sv + k * MAXBQ), s1 = _mm512_loadu_ps(sv + (k + 1) * MAXBQ);
        if (mods) { /* a -Inf score (a bias) is a key not attended: weight 0 (exp2w would make
                       NaN of it); a NaN one stays and makes the row NaN */
          k0 &= _mm512_cmp_ps_mask(s0, ninf, _CMP_NEQ_UQ);
          k1 &= _mm512_cmp_ps_mask(s1, ninf, _CMP_NEQ_UQ);
        }
        const __m512 w0 = exp2w(_mm512_fmadd_ps(s0, vc, negm), k0);
        const __m512 w1 = exp2w(_mm512_fmadd_ps(s1, vc, negm), k1);
        sum = _mm512_add_ps(sum, _mm512_add_ps(w0, w1));
#if HAVE_DPBF16
        if (bf) {
          /* interleaves the bf16 of w0, w1: word of lane i = (w0_i, w1_i) */
          const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10,
                                                 25, 9, 24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3,
                                                 18, 2, 17, 1, 16, 0);
          const __m512i wb = _mm512_permutexvar_epi16(pairs, (__m512i)_mm512_cvtne2ps_pbh(w1, w0));
          _mm512_storeu_si512(pw + k / 2 * MAXBQ + v * VW, wb);
          continue;
        }
#endif
        _mm512_storeu_ps(sv + k * MAXBQ, w0); /* float32: the weights over the scores */
        _mm512_storeu_ps(sv + (k + 1) * MAXBQ, w1);
      }
      _mm512_storeu_ps(l + v * VW, _mm512_fmadd_ps(_mm512_loadu_ps(l + v * VW), a, sum));
    }
    /* -- out += P V, each block of RB rows over the keys one of its rows attends */
    for (r = 0; r < tqp; r += RB) {
      const int64_t lo = km ? km->lo[r / RB] : 0, hi = km ? km->hi[r / RB] : nk;
      const float *sc = rescale >> r & ((1u << RB) - 1) ? alpha + r : NULL;
      if (hi <= lo) continue; /* no key for these rows: their max did not move */
#if HAVE_DPBF16
      if (bf) {
        const uint32_t *vpairs = (const uint32_t *)job->vb + blk * (BK / 2) * d.Dvp;
        const int64_t p0 = lo / 2, p1 = (hi + 1) / 2;
        mm_bf16_rows(acc + r * d.Dvp, d.Dvp, pw + p0 * MAXBQ + r, 1, MAXBQ, vpairs + p0 * d.Dvp,
                     d.Dvp, p1 - p0, d.Dvp, 0, sc);
        continue;
      }
#endif
      const float *vr = job->vp ? job->vp + blk * BK * d.Dvp : (const float *)p[P_V] + (qt.kvh + c0) * d.Dv;
      mm_rows_s(acc + r * d.Dvp, d.Dvp, st + lo * MAXBQ + r, 1, MAXBQ, vr + lo * d.Dvp, d.Dvp,
                hi - lo, d.Dvp, sc);
    }
  }
  finish_rows(&d, p, row0, tq, acc, m, l, q_finite);
}

static void fwd_f32_item(const void *vjob, int64_t item, float *buf) { fwd_t(vjob, item, buf, 0); }
#if HAVE_DPBF16
static void fwd_bf16_item(const void *vjob, int64_t item, float *buf) { fwd_t(vjob, item, buf, 1); }
#endif

static int64_t fwd_t_scratch(const Dims *d) { /* fwd_t's buffers */
  return MAXBQ * d->D + BK * MAXBQ + BK / 2 * MAXBQ + MAXBQ * d->Dvp + 3 * MAXBQ;
}
#endif

static int64_t fwd_scratch(const Dims *d) { /* then q's bf16 pairs, RB rows of bf16 weights */
  return MAXBQ * d->Dp + MAXBQ * BK + MAXBQ * d->Dvp + 2 * MAXBQ + MAXBQ * d->Dp + RB * BK / 2 +
         MAXBQ * VW; /* and the row sums' vectors */
}

/* ------------------------------------------------------------------------------------------ */
/* Backward: P = 2^(s - m) / l recomputed from the forward's row statistics;                   */
/* dP = dO Vᵀ, dS = P ∘ (dP - Δ), dV = Pᵀ dO, dK = dSᵀ Q scale, dQ = dS K scale.                */
/* Two passes, each writing its own rows (no atomics, deterministic): dQ by query tile (and    */
/* the Δ of peaked rows), then dK, dV by key tile (all query tiles, the G heads of a kv head); */
/* or one pass per (b, kv head) (dkvq_item), bitwise the same.                                 */
/* ------------------------------------------------------------------------------------------ */

/* The weights P (in s) and dS (in dp) of one tile, given its scores s and dP = dO Vᵀ in dp:
   rows [tq, tqp) and masked pairs get 0. */
static void weights_and_ds(float *s, float *dp, int64_t tq, int64_t tqp, const float *m,
                           const float *l, const float *delta) {
  for (int64_t r = 0; r < tqp; r++) {
    float *srow = s + r * BK, *drow = dp + r * BK;
    if (r >= tq) {
      memset(srow, 0, sizeof(float) * BK);
      memset(drow, 0, sizeof(float) * BK);
      continue;
    }
    const float inv = 1.0f / l[r], mr = m[r], dr = delta[r];
    for (int64_t k = 0; k < BK; k += VW) {
      const v16 w = exp2v(ld(srow + k) - mr) * inv;
      st(srow + k, w);
      st(drow + k, w * (ld(drow + k) - dr));
    }
  }
}

/* t (BK x MAXBQ) = sᵀ over tqp rows */
static void transpose(float *t, const float *s, int64_t tqp) {
  for (int64_t r = 0; r < tqp; r++)
    for (int64_t k = 0; k < BK; k++) t[k * MAXBQ + r] = s[r * BK + k];
}

/* Scores s (base 2, score mods applied, masked pairs -inf) of query rows qs (tqp x Dp, times
   c; rows r0 + [0, tq) of sequence b, head h) against one key tile (kt: D x BK; keys c0 + [0,
   nk)), and dP = dO Vᵀ of dO rows dob (tqp x Dvp) against vt (Dv x BK), times keep / (1 - p)
   under dropout; dcap: the soft cap's derivative (tqp x BK scratch). keep_tiles and tile_ds both
   start here, so they see bitwise the same P and dP. */
static void tile_sp(const Dims *d, const int64_t *a, void *const *p, const float *qs,
                    const float *dob, const float *kt, const float *vt, float *s, float *dp,
                    float *dcap, int64_t tq, int64_t tqp, int64_t nk, const uint8_t *bits,
                    int64_t b, int64_t h, int64_t r0, int64_t c0) {
  const float *drop = (const float *)p[P_DROP];
  mm0(s, BK, qs, d->Dp, kt, BK, tqp, d->D, BK);
  apply_mods(s, dcap, a, p, b, h, r0, c0, tq, tqp, nk);
  mask_scores(s, tq, nk, bits);
  mm0(dp, BK, dob, d->Dvp, vt, BK, tqp, d->Dv, BK);
  /* dropout: dS = P ∘ (dP ∘ keep / (1 - p) - Δ), and dV takes the dropped weights */
  if (drop) dropout_scale(dp, tq, dropout_bh(a[A_SEED], b, h), a[A_QOFF] + r0, c0, drop);
}

/* The weights (dropped) into s and dS (with respect to the unmodded score) into dp, from
   tile_sp's scores and dP (dcap: its soft cap derivative) and the rows' Δ. */
static void tile_finish(const int64_t *a, void *const *p, float *s, float *dp, const float *dcap,
                        int64_t tq, int64_t tqp, const float *m, const float *l, const float *delta,
                        int64_t b, int64_t h, int64_t r0, int64_t c0) {
  const float *drop = (const float *)p[P_DROP];
  weights_and_ds(s, dp, tq, tqp, m, l, delta);
  if (drop)
    dropout_scale(s, tq, dropout_bh(a[A_SEED], b, h), a[A_QOFF] + r0, c0, drop);
  if (p[P_CAP]) /* through the cap: dS · (1 - tanh²) */
    for (int64_t i = 0; i < tqp * BK; i += VW) st(dp + i, ld(dp + i) * ld(dcap + i));
}

/* Scores and dS of one tile (arguments as tile_sp and tile_finish), into s (the weights,
   dropped) and dp (dS). */
static void tile_ds(const Dims *d, const int64_t *a, void *const *p, const float *qs,
                    const float *dob, const float *kt, const float *vt, float *s, float *dp,
                    float *dcap, int64_t tq, int64_t tqp, int64_t nk, const uint8_t *bits,
                    const float *m, const float *l, const float *delta, int64_t b, int64_t h,
                    int64_t r0, int64_t c0) {
  tile_sp(d, a, p, qs, dob, kt, vt, s, dp, dcap, tq, tqp, nk, bits, b, h, r0, c0);
  tile_finish(a, p, s, dp, dcap, tq, tqp, m, l, delta, b, h, r0, c0);
}

/* -- Δ on peaked rows. dS = P ∘ (dP - Δ) sums to -dlse over a row only while Δ is the mean of
   the very dP the backward computes, weighted by its very P; rowsum(dO ∘ O) (FlashAttention-2's
   Δ, Dao 2023, Algorithm 2 line 4; PyTorch's CPU flash backward, aten/src/ATen/native/cpu/
   FlashAttentionKernel.cpp, `grad_out * out` summed per row) matches it only to the rounding of
   O: O rounded to q's dtype (bf16: 2^-9 of |O|), and the forward's scores and weights, which
   differ from the backward's recomputed ones in the last bits (fp32: 4.5x the naive error on a
   decode row even with O exact), all of it landing in Δ. That error reaches each key of the row
   in proportion to its weight; on a row with most of its weight on one key, that key's dS is a
   small difference ((1 - P) times the spread of dP) and the error swamps it: dq 87x the naive
   fp32 error on a decode row of weight 0.9 on one key, and an error at all where each row
   attends one key under dropout (exact dS 0).
   A query tile with a row whose largest weight 1/l is over 1/PEAKED_L (past it, that error
   grows over 1 / (1 - 1/PEAKED_L) = 2x a spread row's; on 400 single decode rows, rowsum(dO ∘ O)
   stayed under a fifth of the ratio rule's bound in bf16/fp16 below weight 0.8) takes Δ =
   rowsum(P ∘ dP) / rowsum(P), with P and dP bitwise tile_ds's, summed in float64: its item
   (dkvq_item, or dq_rows in the two-pass backward, whose dQ pass then runs first) computes the
   tile's scores and dP for all its key tiles first and keeps them (keep_tiles). No product is
   computed twice: fwd+bwd with most rows peaked measured 1.02-1.07x the rowsum(dO ∘ O) kernel
   (one thread, CPU time), where an extra pass over the products measured 1.31x. A one-key
   row's dS is then exactly 0 and a peaked row's as precise as the naive formula's (the weights'
   own sum, not 1 but the forward's l, cancels their common rounding). Other rows keep
   rowsum(dO ∘ O), whose error their spread-out dS absorbs; a query tile without a peaked row
   costs a scan of its l. In fp32 such sharp rows' P itself was ~2.5x less precise than sgemm's
   while each score was one FMA chain over D; the scores now sum D in blocks (MM_KC).
   DBIAS_DELTA: a call that asks for the bias gradient takes this Δ on every row, peaked or not.
   dBias sums dS over the bias's broadcast dims, and over keys (a bias per query row) dS cancels
   exactly (Σ_k dS = Σ P dP - Δ Σ P = 0 for this Δ): rowsum(dO ∘ O)'s rounding was then all
   that remained, 6.7x the naive fp32 error (1.5x the ratio rule's bound; fuzz seed 32, a bias
   broadcast over keys with ALiBi, a window and a soft cap); with this Δ, 1.6x the naive error.
   The cost falls on those calls only: forward + backward of window 256, S = 2,048, 8 heads, D =
   64, 2 threads, 1.0x with an (H, 1, S) bias, 1.02-1.06x with a full one, 1.10-1.16x with a
   per-row (S, 1) one; fuzz seeds 11 and 12's two generic-build dBias cases (1.15-1.2x the bound)
   pass with it too. */
#define PEAKED_L 2.0f

/* Whether one of rows [0, tq) (their forward l) is peaked. */
static int rows_peaked(const float *l, int64_t tq) {
  int peaked = 0;
  for (int64_t r = 0; r < tq; r++) peaked |= l[r] < PEAKED_L;
  return peaked;
}

/* Whether rows [0, tq) take Δ from their own P and dP: a call with the bias gradient db
   (DBIAS_DELTA), or one of them peaked. */
static int kept_delta(const void *db, const float *l, int64_t tq) {
  return db != NULL || rows_peaked(l, tq);
}

/* rowsum(P ∘ dP) into acc and rowsum(P) into wsum (float64, rows [0, tq)) of one tile's scores
   s and dP (tile_sp's), the weights as weights_and_ds computes them. */
static void delta_sums(double *acc, double *wsum, const float *s, const float *dp,
                       const float *m, const float *l, int64_t tq) {
  for (int64_t r = 0; r < tq; r++) {
    const float inv = 1.0f / l[r], mr = m[r];
    v16 sum = splat(0.0f), ws = splat(0.0f);
    for (int64_t k = 0; k < BK; k += VW) {
      const v16 w = exp2v(ld(s + r * BK + k) - mr) * inv;
      sum += w * ld(dp + r * BK + k), ws += w;
    }
    acc[r] += hsum(sum), wsum[r] += hsum(ws);
  }
}

/* Δ of rows [0, tq) (first row row0 of (B, Hq, Sq)) from their sums: every row of the tile,
   the weighted mean being at least as precise where a row is not peaked; 0 for a row with no
   key (no weight: its dS is 0 whatever Δ is). */
static void delta_store(void *const *p, int64_t row0, int64_t tq, const double *acc,
                        const double *wsum) {
  const float *dlse = (const float *)p[P_DLSE];
  float *delta = (float *)p[P_DELTA] + row0;
  for (int64_t r = 0; r < tq; r++) {
    const double mean = wsum[r] > 0 ? acc[r] / wsum[r] : 0.0;
    delta[r] = (float)(dlse ? mean - dlse[row0 + r] : mean);
  }
}

/* dK, dV of key tile j of kv head hk, sequence b. */
static void dkv_item(const void *vjob, int64_t item, float *buf) {
  const Job *job = (const Job *)vjob;
  const Dims d = dims(job->a);
  void *const *p = job->p;
  const int64_t j = item % d.nk, hk = (item / d.nk) % d.Hkv, b = item / (d.nk * d.Hkv);
  const int64_t c0 = j * BK, nk = BK < d.Sk - c0 ? BK : d.Sk - c0;
  const int32_t *colptr = (const int32_t *)p[P_COLPTR], *rows = (const int32_t *)p[P_ROWS];
  const int32_t *cpids = (const int32_t *)p[P_CPIDS];
  const int64_t kv0 = (b * d.Hkv + hk) * d.Sk + c0; /* first key row of (B, Hkv, Sk) */
  float *qs = buf, *dob = qs + MAXBQ * d.Dp, *s = dob + MAXBQ * d.Dvp, *dp = s + MAXBQ * BK;
  float *pt = dp + MAXBQ * BK, *dst = pt + BK * MAXBQ, *dk = dst + BK * MAXBQ, *dv = dk + BK * d.Dp;
  float *dcap = dv + BK * d.Dvp;
  const int64_t blk = (b * d.Hkv + hk) * d.nk + j;
  const float *kt = job->kt + blk * d.D * BK, *vt = job->vt + blk * d.Dv * BK;
  int64_t t, g, r, k;

  memset(dk, 0, sizeof(float) * BK * (d.Dp + d.Dvp)); /* dk and dv */
  for (t = colptr[j]; t < colptr[j + 1]; t++) {
    const int64_t i = rows[t], r0 = i * d.bq;
    const int64_t tq = d.bq < d.Sq - r0 ? d.bq : d.Sq - r0, tqp = round_up(tq, RB);
    for (g = 0; g < d.G; g++) {
      const int64_t h = hk * d.G + g, row0 = (b * d.Hq + h) * d.Sq + r0;
      pack_rows(qs, d.Dp, p[P_Q], row0 * d.D, tq, d.D, tqp, job->c, d.dt);
      pack_rows(dob, d.Dvp, p[P_DO], row0 * d.Dv, tq, d.Dv, tqp, 1.0f, F32);
      tile_ds(&d, job->a, p, qs, dob, kt, vt, s, dp, dcap, tq, tqp, nk,
              block_bits(&d, p, cpids[t], b, h), (const float *)p[P_M] + row0,
              (const float *)p[P_L] + row0, (const float *)p[P_DELTA] + row0, b, h, r0, c0);
      transpose(pt, s, tqp);
      transpose(dst, dp, tqp);
      mm(dv, d.Dvp, pt, MAXBQ, dob, d.Dvp, BK, tqp, d.Dvp); /* dV += Pᵀ dO */
      mm(dk, d.Dp, dst, MAXBQ, qs, d.Dp, BK, tqp, d.Dp);    /* dK += dSᵀ (Q c) */
    }
  }
  /* qs holds q * scale * log2(e): dK = dSᵀ Q scale = dk / log2(e) = dk * ln(2) */
  float *DK = (float *)p[P_DK] + kv0 * d.D, *DV = (float *)p[P_DV] + kv0 * d.Dv;
  for (r = 0; r < nk; r++) {
    for (k = 0; k < d.D; k++) DK[r * d.D + k] = dk[r * d.Dp + k] * LN2F;
    for (k = 0; k < d.Dv; k++) DV[r * d.Dv + k] = dv[r * d.Dvp + k];
  }
}

static int64_t dkv_scratch(const Dims *d) {
  return MAXBQ * (d->Dp + d->Dvp) + 5 * MAXBQ * BK + BK * (d->Dp + d->Dvp);
}

/* The most key tiles one query tile visits. */
static int64_t most_key_tiles(const Dims *d, void *const *p) {
  const int32_t *rowptr = (const int32_t *)p[P_ROWPTR];
  int64_t most = 0;
  for (int64_t i = 0; i < d->nq; i++)
    most = rowptr[i + 1] - rowptr[i] > most ? rowptr[i + 1] - rowptr[i] : most;
  return most;
}

/* A peaked query tile (qt; q rows qs, dO rows dob packed; its kv head's first packed block
   blk0): the scores, dP and cap derivatives of each of its key tiles into kept (3 x
   most_key_tiles tiles of MAXBQ x BK: scores, then dP, then the cap's), and its rows' Δ from
   them into P_DELTA; tile_dS then takes each tile's dS from them. */
static void keep_tiles(const Job *job, const Dims *d, const QTile *qt, const float *qs,
                       const float *dob, int64_t blk0, float *kept) {
  void *const *p = job->p;
  const int64_t nt = most_key_tiles(d, p);
  const float *m = (const float *)p[P_M] + qt->row0, *l = (const float *)p[P_L] + qt->row0;
  double acc[MAXBQ] = {0}, wsum[MAXBQ] = {0};
  for (int64_t t = 0; t < qt->n; t++) {
    const int64_t c0 = (int64_t)qt->cols[t] * BK, nk = BK < d->Sk - c0 ? BK : d->Sk - c0;
    const int64_t blk = blk0 + qt->cols[t];
    float *s = kept + t * MAXBQ * BK, *dp = s + nt * MAXBQ * BK, *dcap = dp + nt * MAXBQ * BK;
    tile_sp(d, job->a, p, qs, dob, job->kt + blk * d->D * BK, job->vt + blk * d->Dv * BK, s, dp,
            dcap, qt->tq, qt->tqp, nk, block_bits(d, p, qt->pids[t], qt->b, qt->h), qt->b, qt->h,
            qt->i * d->bq, c0);
    delta_sums(acc, wsum, s, dp, m, l, qt->tq);
  }
  delta_store(p, qt->row0, qt->tq, acc, wsum);
}

/* The weights (in *s) and dS (in *dp) of key tile t of query tile qt: from the kept tiles
   (kept not NULL: keep_tiles ran), else computed here in the buffers *s, *dp (dcap scratch). */
static void tile_dS(const Job *job, const Dims *d, const QTile *qt, const float *qs,
                    const float *dob, int64_t blk0, int64_t t, const float *kept, float **s,
                    float **dp, float *dcap) {
  void *const *p = job->p;
  const int64_t c0 = (int64_t)qt->cols[t] * BK, nk = BK < d->Sk - c0 ? BK : d->Sk - c0;
  const int64_t blk = blk0 + qt->cols[t], r0 = qt->i * d->bq, row0 = qt->row0;
  const float *m = (const float *)p[P_M] + row0, *l = (const float *)p[P_L] + row0;
  const float *delta = (const float *)p[P_DELTA] + row0;
  if (kept) {
    const int64_t nt = most_key_tiles(d, p);
    *s = (float *)kept + t * MAXBQ * BK, *dp = *s + nt * MAXBQ * BK;
    tile_finish(job->a, p, *s, *dp, *dp + nt * MAXBQ * BK, qt->tq, qt->tqp, m, l, delta, qt->b,
                qt->h, r0, c0);
  } else {
    tile_ds(d, job->a, p, qs, dob, job->kt + blk * d->D * BK, job->vt + blk * d->Dv * BK, *s, *dp,
            dcap, qt->tq, qt->tqp, nk, block_bits(d, p, qt->pids[t], qt->b, qt->h), m, l, delta,
            qt->b, qt->h, r0, c0);
  }
}

/* Floats of scratch for kept tiles: where some row is peaked (rows_peaked), 3 x most_key_tiles
   tiles (a window's few, not nk). */
static int64_t kept_scratch(const Dims *d, void *const *p, int peaked) {
  return peaked ? 3 * most_key_tiles(d, p) * MAXBQ * BK : 0;
}

/* dS of rows [0, tq) and keys [0, nk) of a tile (first row r0, first key c0; sequence b, query
   head h) added into the bias gradient db (the bias's shape: the strides A_BIAS_S*, 0 on its
   broadcast axes, which the adds sum over in the callers' fixed order). float64 where the bias
   broadcasts over query rows or keys (dbias_wide: sums of up to B·Hq·Sq terms, into a row- or
   column-sized tensor), float32 else (a bias of (Sq, Sk) scores sums at most B·Hq terms per
   element, and its float64 copy would be twice its own size). */
static int dbias_wide(const int64_t *a) { return a[A_BIAS_SQ] == 0 || a[A_BIAS_SK] == 0; }
static void add_dbias(void *db, const int64_t *a, const float *ds, int64_t b, int64_t h,
                      int64_t r0, int64_t c0, int64_t tq, int64_t nk) {
  const int64_t sq = a[A_BIAS_SQ], sk = a[A_BIAS_SK];
  const int64_t off = b * a[A_BIAS_SB] + h * a[A_BIAS_SH] + r0 * sq + c0 * sk;
  for (int64_t r = 0; r < tq; r++) {
    const float *x = ds + r * BK;
    if (dbias_wide(a)) {
      double *row = (double *)db + off + r * sq;
      for (int64_t k = 0; k < nk; k++) row[k * sk] += x[k];
    } else {
      float *row = (float *)db + off + r * sq; /* sk == 1 */
      for (int64_t k = 0; k < nk; k++) row[k] += x[k];
    }
  }
}

/* dQ of query tile i of head h, sequence b (item, as q_tile numbers them); with db (not NULL)
   its dS also goes into the bias gradient (add_dbias). A peaked tile first sets its rows' Δ
   (keep_tiles): this pass runs before dkv_item's, which reads them. */
static void dq_rows(const Job *job, const Dims *dd, int64_t item, float *buf, void *db) {
  const Dims d = *dd;
  void *const *p = job->p;
  const QTile qt = q_tile(&d, p, item);
  const int64_t tq = qt.tq, tqp = qt.tqp, row0 = qt.row0;
  float *qs = buf, *dob = qs + MAXBQ * d.Dp, *s = dob + MAXBQ * d.Dvp, *dp = s + MAXBQ * BK;
  float *dq = dp + MAXBQ * BK, *dcap = dq + MAXBQ * d.Dp, *kept = dcap + MAXBQ * BK;
  const int64_t blk0 = qt.kvh / d.Sk * d.nk; /* first packed block of this kv head */
  const int peaked = qt.n > 0 && kept_delta(db, (const float *)p[P_L] + row0, tq);
  int64_t t, r, k;

  pack_rows(qs, d.Dp, p[P_Q], row0 * d.D, tq, d.D, tqp, job->c, d.dt);
  pack_rows(dob, d.Dvp, p[P_DO], row0 * d.Dv, tq, d.Dv, tqp, 1.0f, F32);
  memset(dq, 0, sizeof(float) * tqp * d.Dp);
  if (peaked) keep_tiles(job, &d, &qt, qs, dob, blk0, kept);
  for (t = 0; t < qt.n; t++) {
    const int64_t c0 = (int64_t)qt.cols[t] * BK, nk = BK < d.Sk - c0 ? BK : d.Sk - c0;
    float *ws = s, *ds = dp;
    tile_dS(job, &d, &qt, qs, dob, blk0, t, peaked ? kept : NULL, &ws, &ds, dcap);
    if (db) add_dbias(db, job->a, ds, qt.b, qt.h, qt.i * d.bq, c0, tq, nk);
    mm(dq, d.Dp, ds, BK, job->kp + (blk0 + qt.cols[t]) * BK * d.Dp, d.Dp, tqp, nk,
       d.Dp); /* dQ += dS K */
  }
  float *DQ = (float *)p[P_DQ] + row0 * d.D;
  for (r = 0; r < tq; r++)
    for (k = 0; k < d.D; k++) DQ[r * d.D + k] = dq[r * d.Dp + k] * job->scale;
}

static void dq_item(const void *vjob, int64_t item, float *buf) {
  const Job *job = (const Job *)vjob;
  const Dims d = dims(job->a);
  dq_rows(job, &d, item, buf, NULL);
}

/* The bias gradient's items: one per block of it that no other item adds into, (bias batch,
   bias head, query tile) over the axes the bias does not broadcast (a broadcast axis: one
   block for all of it). */
static int64_t dbias_items(const Dims *d, const int64_t *a) {
  return (a[A_BIAS_SB] ? d->B : 1) * (a[A_BIAS_SH] ? d->Hq : 1) * (a[A_BIAS_SQ] ? d->nq : 1);
}

/* dQ of every (sequence, head, query tile) whose dS adds into one block of the bias gradient
   (dbias_items), in a fixed order (query tile, sequence, head): the sums over broadcast axes
   never depend on the thread count, with no atomics. */
static void dq_dbias_item(const void *vjob, int64_t item, float *buf) {
  const Job *job = (const Job *)vjob;
  const Dims d = dims(job->a);
  const int64_t *a = job->a;
  const int64_t ni = a[A_BIAS_SQ] ? d.nq : 1, nh = a[A_BIAS_SH] ? d.Hq : 1;
  const int64_t i0 = item % ni, h0 = item / ni % nh, b0 = item / ni / nh;
  const int64_t i1 = a[A_BIAS_SQ] ? i0 + 1 : d.nq, h1 = a[A_BIAS_SH] ? h0 + 1 : d.Hq;
  const int64_t b1 = a[A_BIAS_SB] ? b0 + 1 : d.B;
  for (int64_t i = a[A_BIAS_SQ] ? i0 : 0; i < i1; i++)
    for (int64_t b = a[A_BIAS_SB] ? b0 : 0; b < b1; b++)
      for (int64_t h = a[A_BIAS_SH] ? h0 : 0; h < h1; h++)
        dq_rows(job, &d, (b * d.Hq + h) * d.nq + i, buf, job->p[P_DBIAS]);
}

static int64_t dq_scratch(const Dims *d, void *const *p, int peaked) {
  return MAXBQ * (d->Dp + d->Dvp) + 3 * MAXBQ * BK + MAXBQ * d->Dp + kept_scratch(d, p, peaked);
}

/* dK, dV of every key tile of kv head hk, sequence b, and dQ of its G heads, in one pass: each
   (query tile, head) recomputes its tiles' scores and dP once for all three gradients, where the
   two passes above compute them twice (5 products per tile against 7) and pack Q and dO again
   for every key tile. dK, dV accumulate in scratch for all Sk keys, in the two-pass order
   (query tile, then head, per key tile) and dQ per key tile in order, so the result is bitwise
   the two passes'. Used while there are enough (b, kv head) items for the threads (fused_bwd). */
static void dkvq_item(const void *vjob, int64_t item, float *buf) {
  const Job *job = (const Job *)vjob;
  const Dims d = dims(job->a);
  void *const *p = job->p;
  const int64_t hk = item % d.Hkv, b = item / d.Hkv;
  float *qs = buf, *dob = qs + MAXBQ * d.Dp, *s = dob + MAXBQ * d.Dvp, *dp = s + MAXBQ * BK;
  float *pt = dp + MAXBQ * BK, *dst = pt + BK * MAXBQ, *dcap = dst + BK * MAXBQ;
  float *dq = dcap + MAXBQ * BK, *dk = dq + MAXBQ * d.Dp, *dv = dk + d.nk * BK * d.Dp;
  float *kept = dv + d.nk * BK * d.Dvp;
  const int64_t blk0 = (b * d.Hkv + hk) * d.nk, kv0 = (b * d.Hkv + hk) * d.Sk;
  int64_t i, g, t, r, k;

  memset(dk, 0, sizeof(float) * d.nk * BK * (d.Dp + d.Dvp)); /* dk and dv */
  for (i = 0; i < d.nq; i++) {
    for (g = 0; g < d.G; g++) {
      const QTile qt = q_tile(&d, p, ((b * d.Hq + hk * d.G + g) * d.nq) + i);
      const int64_t tq = qt.tq, tqp = qt.tqp, row0 = qt.row0;
      const int peaked = qt.n > 0 && rows_peaked((const float *)p[P_L] + row0, tq);
      pack_rows(qs, d.Dp, p[P_Q], row0 * d.D, tq, d.D, tqp, job->c, d.dt);
      pack_rows(dob, d.Dvp, p[P_DO], row0 * d.Dv, tq, d.Dv, tqp, 1.0f, F32);
      memset(dq, 0, sizeof(float) * tqp * d.Dp);
      if (peaked) keep_tiles(job, &d, &qt, qs, dob, blk0, kept);
      for (t = 0; t < qt.n; t++) {
        const int64_t j = qt.cols[t], c0 = j * BK, nk = BK < d.Sk - c0 ? BK : d.Sk - c0;
        float *ws = s, *ds = dp;
        tile_dS(job, &d, &qt, qs, dob, blk0, t, peaked ? kept : NULL, &ws, &ds, dcap);
        mm(dq, d.Dp, ds, BK, job->kp + (blk0 + j) * BK * d.Dp, d.Dp, tqp, nk, d.Dp); /* dQ += dS K */
        transpose(pt, ws, tqp);
        transpose(dst, ds, tqp);
        mm(dv + c0 * d.Dvp, d.Dvp, pt, MAXBQ, dob, d.Dvp, BK, tqp, d.Dvp); /* dV += Pᵀ dO */
        mm(dk + c0 * d.Dp, d.Dp, dst, MAXBQ, qs, d.Dp, BK, tqp, d.Dp);    /* dK += dSᵀ (Q c) */
      }
      float *DQ = (float *)p[P_DQ] + row0 * d.D;
      for (r = 0; r < tq; r++)
        for (k = 0; k < d.D; k++) DQ[r * d.D + k] = dq[r * d.Dp + k] * job->scale;
    }
  }
  /* as dkv_item: dK = dk * ln(2) (qs holds q * scale * log2(e)) */
  float *DK = (float *)p[P_DK] + kv0 * d.D, *DV = (float *)p[P_DV] + kv0 * d.Dv;
  for (r = 0; r < d.Sk; r++) {
    for (k = 0; k < d.D; k++) DK[r * d.D + k] = dk[r * d.Dp + k] * LN2F;
    for (k = 0; k < d.Dv; k++) DV[r * d.Dv + k] = dv[r * d.Dvp + k];
  }
}

static int64_t dkvq_scratch(const Dims *d, void *const *p, int peaked) {
  return dkv_scratch(d) + MAXBQ * d->Dp + d->nk * BK * (d->Dp + d->Dvp) +
         kept_scratch(d, p, peaked);
}

/* The one-pass backward (dkvq_item) runs while each thread gets FUSED_ITEMS_PER_THREAD (b, kv
   head) items or more (fewer leave threads idle at the end: the two passes split by tile) and
   its per-thread dK, dV scratch stays under FUSED_SCRATCH_BYTES. */
#define FUSED_ITEMS_PER_THREAD 4
#define FUSED_SCRATCH_BYTES ((int64_t)64 << 20)
static int fused_bwd(const Dims *d, void *const *p, int n_threads, int peaked) {
  return (n_threads <= 1 || d->B * d->Hkv >= (int64_t)FUSED_ITEMS_PER_THREAD * n_threads) &&
         (int64_t)sizeof(float) * dkvq_scratch(d, p, peaked) <= FUSED_SCRATCH_BYTES;
}

/* ------------------------------------------------------------------------------------------ */
/* Threads: the pool's participants (thread_pool.h: PyTorch's OpenMP threads, or workers of   */
/* its own) pull work items from an atomic counter; each item writes its own output rows, so   */
/* the result does not depend on the thread count or the schedule.                             */
/* ------------------------------------------------------------------------------------------ */

static int worker(void *arg, void *scratch) {
  Job *job = (Job *)arg;
  /* scratch comes zeroed: padding columns that no pack writes are zero, never garbage */
  const int64_t grain = job->grain > 1 ? job->grain : 1;
  for (;;) {
    const int64_t first = __atomic_fetch_add(&job->next, grain, __ATOMIC_RELAXED);
    if (first >= job->n_items) break;
    for (int64_t item = first; item < first + grain && item < job->n_items; item++)
      job->item(job, item, (float *)scratch);
  }
  return 0;
}

static int run_items(Job *job, int n_threads) {
  int n = n_threads < 1 ? 1 : n_threads;
  if (n > job->n_items) n = job->n_items > 0 ? (int)job->n_items : 1;
  return pool_run(worker, job, n, sizeof(float) * (size_t)job->scratch);
}

/* -- K and V packed once per call, as the work items read them: block (b, kv head, key tile) of
   each layout the job asks for, converted to float32. Packing per work item instead repeats it
   for every query tile and head that reads the key tile. */
static void pack_item(const void *vjob, int64_t blk, float *row) {
  const Job *job = (const Job *)vjob;
  const Dims d = dims(job->a);
  void *const *p = job->p;
  const int64_t j = blk % d.nk, kv0 = blk / d.nk * d.Sk + j * BK; /* first key row */
  const int64_t nk = BK < d.Sk - j * BK ? BK : d.Sk - j * BK;
  const int32_t *colptr = (const int32_t *)p[P_COLPTR];
  if (colptr[j] == colptr[j + 1]) return; /* no query tile reads this key tile */
  if (job->kt) pack_t(job->kt + blk * d.D * BK, p[P_K], kv0 * d.D, nk, d.D, d.dt, row);
  if (job->kb && job->bt && d.D % 2 == 0 && nk == BK) {
    /* fwd_bf16_item reads these keys' pair words in place */
  } else if (job->kb && job->bt)
    pack_pairs((uint32_t *)job->kb + blk * ((d.D + 1) / 2) * BK, (d.D + 1) / 2,
               (const uint16_t *)p[P_K], kv0 * d.D, nk, d.D, BK);
  else if (job->kb)
    pack_pairs_t((uint32_t *)job->kb + blk * ((d.D + 1) / 2) * BK, (const uint16_t *)p[P_K],
                 kv0 * d.D, nk, d.D);
  if (job->vb) pack_v_pairs((uint32_t *)job->vb + blk * (BK / 2) * d.Dvp, (const uint16_t *)p[P_V],
                            kv0 * d.Dv, nk, d.Dv, d.Dvp);
  if (job->vt) pack_t(job->vt + blk * d.Dv * BK, p[P_V], kv0 * d.Dv, nk, d.Dv, d.dt, row);
  if (job->kp && !(job->bt && nk == BK && d.dt == F32)) /* fwd_t reads those in place */
    pack_rows(job->kp + blk * BK * d.Dp, d.Dp, p[P_K], kv0 * d.D, nk, d.D, BK, 1.0f, d.dt);
  if (job->vp)
    pack_rows(job->vp + blk * BK * d.Dvp, d.Dvp, p[P_V], kv0 * d.Dv, nk, d.Dv, BK, 1.0f, d.dt);
}

/* The packed K and V live in one buffer that is kept from call to call (while at most
   POOL_KEEP_BYTES): a fresh malloc of tens of MiB is fresh pages, and their page faults and
   zeroing measured a fifth of a bf16 window-256 forward at S=16384 (one thread). One
   call at a time holds it (a concurrent call allocates its own). */
#define POOL_KEEP_BYTES ((size_t)256 << 20)
/* The pool is asked for 2 MiB pages (where the OS has transparent huge pages on request): kept
   4 KiB pages measured 1.25x slower than fresh ones on dense float32 tiles (each query tile
   reads a kv head's whole packed K, 1 MiB at S=4096: TLB misses), huge ones as fast as fresh
   ones there and faster on a window's. */
#define POOL_ALIGN ((size_t)2 << 20)

/* Ask for 2 MiB pages over the whole 2 MiB pages of [p, p + bytes) (a hint: where the OS has
   transparent huge pages on request; failure changes nothing). */
static void huge_pages(void *p, size_t bytes) {
#ifdef MADV_HUGEPAGE
  const uintptr_t a = ((uintptr_t)p + POOL_ALIGN - 1) & ~(uintptr_t)(POOL_ALIGN - 1);
  const uintptr_t z = ((uintptr_t)p + bytes) & ~(uintptr_t)(POOL_ALIGN - 1);
  if (z > a) madvise((void *)a, z - a, MADV_HUGEPAGE);
#else
  (void)p, (void)bytes;
#endif
}
/* An output the host has just allocated, to be written whole: on 2 MiB pages where it is at
   least FRESH_MAP_BYTES, glibc's largest mmap threshold (DEFAULT_MMAP_THRESHOLD_MAX on 64-bit),
   from which every allocation is a new mapping, faulted in page by page as the kernel writes it:
   4 KiB faults measured 16 ms of an 86 ms float32 window-256 forward at S=16384 (a 32 MiB out,
   one thread, in a VM). Smaller ones come from the heap, reused from call to call: left alone. */
#define FRESH_MAP_BYTES ((size_t)32 << 20)
static void fresh_output(void *p, size_t bytes) {
  if (p && bytes >= FRESH_MAP_BYTES) huge_pages(p, bytes);
}
static pthread_mutex_t pool_lock = PTHREAD_MUTEX_INITIALIZER;
static void *pool;
static size_t pool_bytes;

/* Allocate and fill the packed layouts job asks for (a non-NULL placeholder in kt/vt/kp/vp
   means: wanted). 0, or 1 when memory ran out. */
static int pack_kv(Job *job, const Dims *d, int n_threads) {
  const int64_t n_blk = d->B * d->Hkv * d->nk;
  float **slots[6] = {&job->kt, &job->vt, &job->kp, &job->vp, &job->kb, &job->vb};
  const int64_t sizes[6] = {d->D * BK, d->Dv * BK,  BK * d->Dp, BK * d->Dvp, (d->D + 1) / 2 * BK,
                            BK / 2 * d->Dvp};
  size_t total = 0;
  for (int i = 0; i < 6; i++)
    if (*slots[i]) total += sizeof(float) * (size_t)(n_blk * sizes[i]);
  job->packed = NULL, job->pooled = 0;
  if (total && pthread_mutex_trylock(&pool_lock) == 0) {
    if (pool_bytes < total) {
      free(pool);
      if (posix_memalign(&pool, POOL_ALIGN, total)) pool = NULL;
      if (pool) huge_pages(pool, total);
      pool_bytes = pool ? total : 0;
    }
    if (pool) job->packed = pool, job->pooled = 1;
    else pthread_mutex_unlock(&pool_lock);
  }
  if (total && !job->packed) job->packed = malloc(total);
  if (total && !job->packed) {
    for (int i = 0; i < 6; i++) *slots[i] = NULL;
    return 1;
  }
  float *next = job->packed;
  for (int i = 0; i < 6; i++)
    if (*slots[i]) *slots[i] = next, next += n_blk * sizes[i];
  Job pack = *job;
  pack.n_items = n_blk, pack.next = 0, pack.item = pack_item;
  pack.scratch = d->Dp + d->Dvp;
  return run_items(&pack, n_threads);
}

static void free_packed(Job *job) {
  if (!job->pooled) {
    free(job->packed);
  } else {
    if (pool_bytes > POOL_KEEP_BYTES) free(pool), pool = NULL, pool_bytes = 0;
    pthread_mutex_unlock(&pool_lock);
  }
  job->packed = NULL, job->pooled = 0;
}

#define WANTED ((float *)1) /* placeholder: pack_kv allocates it */

#if HAVE_TRANSPOSED
static v16 exp2w_all(v16 x) { return (v16)exp2w((__m512)x, 0xffff); }
#endif

/* n floats: y = 2^x as the forward computes its weights: exp2w on the transposed path (AVX-512
   builds), exp2v elsewhere (tests measure its error). */
void fa_exp2w(const float *x, float *y, int64_t n) {
#if HAVE_TRANSPOSED
  map16(x, y, n, exp2w_all);
#else
  map16(x, y, n, exp2v);
#endif
}

/* 0 on success, 1 when scratch memory could not be allocated, 2 for a tile width this build
   does not have (BK). out (B, Hq, Sq, Dv) in q's dtype, lse, m, l (B, Hq, Sq) float32; P_FINITE
   (NULL or one byte the host set to 1): 0 where q or out holds a NaN or Inf (finish_rows). */
int fa_forward(const int64_t *iargs, void *const *ptrs, int n_threads, float c) {
  if (iargs[A_BK] != BK || iargs[A_BQ] > MAXBQ || iargs[A_BQ] < 1) return 2;
  const Dims d = dims(iargs);
  /* float32 V whose rows are whole vectors is read in place; other V is packed */
  float *vp = d.dt == F32 && d.Dv == d.Dvp ? NULL : WANTED;
  /* bf16 scores by vdpbf16ps where the build has it (-march=native on a CPU with avx512_bf16) */
  float *kb = HAVE_DPBF16 && d.dt == BF16 ? WANTED : NULL;
  /* transposed tiles (fwd_t) where the build has AVX-512 (bf16 by vdpbf16ps where it has
     avx512_bf16, else converted as float32 and fp16 are); dropout acts on fwd_item's row-major
     tiles, and so do score mods but for bf16 by vdpbf16ps (apply_mods_t): there fwd_t measured
     0.63x (ALiBi) and 0.79x (soft cap) fwd_item's time, window 256 at S=16384, 2 threads, where
     float32 measured the same, and its lse moved a float32 bias gradient past the ratio bound in
     one fuzz case */
  const int mods = has_mods(ptrs);
  const int bt = HAVE_TRANSPOSED && !ptrs[P_DROP] && (!mods || kb);
  Job job = {iargs, ptrs, c, 0.0f, d.B * d.Hq * d.nq, 0, fwd_item, fwd_scratch(&d),
             kb || bt ? NULL : WANTED, NULL, bt && !kb ? WANTED : NULL, kb ? NULL : vp, kb, kb,
             NULL, NULL, 0, bt, NULL};
#if HAVE_TRANSPOSED
  if (bt) job.item = fwd_f32_item, job.scratch = fwd_t_scratch(&d);
#endif
#if HAVE_DPBF16
  if (bt && kb) job.item = fwd_bf16_item;
#endif
  /* the PARTIAL blocks: as many as the largest index in pids, plus one */
  const int32_t *pids = (const int32_t *)ptrs[P_PIDS];
  int64_t n_partial = 0;
  for (int64_t t = 0; t < ((const int32_t *)ptrs[P_ROWPTR])[d.nq]; t++)
    n_partial = pids[t] >= n_partial ? pids[t] + 1 : n_partial;
  const int64_t n_rows = n_partial * d.mb * d.mh * d.bq;
#if HAVE_TRANSPOSED
  if (job.bt) {
    job.tb = malloc(sizeof(KeyMasks) * (size_t)(n_partial * d.mb * d.mh) + 1);
    if (job.tb == NULL) return 1;
    key_masks(job.tb, &d, ptrs);
  } else {
    job.rr = malloc(2 * (size_t)n_rows + 1);
    if (job.rr == NULL) return 1;
    row_ranges(job.rr, (const uint8_t *)ptrs[P_BITS], n_rows);
  }
#else
  job.rr = malloc(2 * (size_t)n_rows + 1);
  if (job.rr == NULL) return 1;
  row_ranges(job.rr, (const uint8_t *)ptrs[P_BITS], n_rows);
#endif
  fresh_output(ptrs[P_OUT], (size_t)(d.B * d.Hq * d.Sq * d.Dv) * (d.dt == F32 ? 4 : 2));
  int status = pack_kv(&job, &d, n_threads);
  /* runs of FWD_GRAIN items, but fewer where a thread would get under FWD_CLAIMS claims (the
     last claims balance the threads' ends) */
  const int64_t per_thread = job.n_items / (n_threads > 1 ? n_threads : 1) / FWD_CLAIMS;
  job.grain = per_thread < 1 ? 1 : (per_thread < FWD_GRAIN ? per_thread : FWD_GRAIN);
  if (!status) status = run_items(&job, n_threads);
  free_packed(&job);
  free(job.rr);
  free(job.tb);
  return status;
}

/* Δ = rowsum(dO ∘ O) - dlse of every row, into P_DELTA (keep_tiles then redoes peaked rows). The
   dot product is one FMA chain from 0 in element order, as mm computes each entry of dP. */
static void row_deltas(const Dims *d, void *const *p) {
  const float *dout = (const float *)p[P_DO], *out = (const float *)p[P_OUT];
  const float *dlse = (const float *)p[P_DLSE];
  float *delta = (float *)p[P_DELTA];
  for (int64_t r = 0; r < d->B * d->Hq * d->Sq; r++) {
    float acc = 0.0f;
    for (int64_t e = 0; e < d->Dv; e++) {
#ifdef __FMA__
      acc = fmaf(dout[r * d->Dv + e], out[r * d->Dv + e], acc);
#else
      acc = acc + dout[r * d->Dv + e] * out[r * d->Dv + e];
#endif
    }
    delta[r] = dlse ? acc - dlse[r] : acc;
  }
}

/* dq (B, Hq, Sq, D), dk (B, Hkv, Sk, D), dv (B, Hkv, Sk, Dv): float32, from dO, the forward's
   out, m, l and the lse's gradient dlse (NULL: none); P_DELTA is scratch (B, Hq, Sq). P_DBIAS
   (not NULL): the bias's gradient, zeros of the bias's shape on entry (float64 where
   dbias_wide, else float32); dQ then runs
   as its own pass (dq_dbias_item), not in the one-pass dkvq_item. The two-pass backward runs
   dQ first: its peaked query tiles set their rows' Δ, which dK, dV read. */
int fa_backward(const int64_t *iargs, void *const *ptrs, int n_threads, float c, float scale) {
  if (iargs[A_BK] != BK || iargs[A_BQ] > MAXBQ || iargs[A_BQ] < 1) return 2;
  const Dims d = dims(iargs);
  fresh_output(ptrs[P_DQ], sizeof(float) * (size_t)(d.B * d.Hq * d.Sq * d.D));
  fresh_output(ptrs[P_DK], sizeof(float) * (size_t)(d.B * d.Hkv * d.Sk * d.D));
  fresh_output(ptrs[P_DV], sizeof(float) * (size_t)(d.B * d.Hkv * d.Sk * d.Dv));
  row_deltas(&d, ptrs);
  Job kv = {iargs, ptrs, c, scale, d.B * d.Hkv * d.nk, 0, dkv_item, dkv_scratch(&d),
            WANTED, WANTED, WANTED, NULL, NULL, NULL, NULL, NULL, 0};
  int status = pack_kv(&kv, &d, n_threads);
  const int peaked = kept_delta(ptrs[P_DBIAS], (const float *)ptrs[P_L], d.B * d.Hq * d.Sq);
  Job q = kv;
  q.n_items = d.B * d.Hq * d.nq, q.item = dq_item, q.scratch = dq_scratch(&d, ptrs, peaked);
  if (ptrs[P_DBIAS]) /* dQ by blocks of the bias gradient */
    q.n_items = dbias_items(&d, iargs), q.item = dq_dbias_item;
  if (!ptrs[P_DBIAS] && fused_bwd(&d, ptrs, n_threads, peaked)) { /* one pass: dkvq_item */
    kv.n_items = d.B * d.Hkv, kv.item = dkvq_item, kv.scratch = dkvq_scratch(&d, ptrs, peaked);
    if (!status) status = run_items(&kv, n_threads);
  } else { /* dQ first: it sets the Δ of peaked rows that dK, dV read */
    if (!status) status = run_items(&q, n_threads);
    if (!status) status = run_items(&kv, n_threads);
  }
  free_packed(&kv);
  return status;
}

/* The instruction sets this build was compiled for, as bits: 1 AVX2, 2 FMA, 4 AVX-512F,
   8 AVX-512 BF16. 0: baseline code (the generic build). */
int fa_isa(void) {
  int bits = 0;
#ifdef __AVX2__
  bits |= 1;
#endif
#ifdef __FMA__
  bits |= 2;
#endif
#ifdef __AVX512F__
  bits |= 4;
#endif
#ifdef __AVX512BF16__
  bits |= 8;
#endif
  return bits;
}

/* Tile width the host must classify with. */
int fa_block_k(void) { return BK; }
