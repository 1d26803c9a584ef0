/* Quantised matmul for decode on CPU: y (M, N) = x (M, K) . W^T (+ bias) for a few input rows,
   with W kept as small integers and per-group scales (the host: selfattn/kernels/quant_matmul.py).

   Weights, row-major, one row of W after another, as a GGUF file stores its blocks' integers:
   - s8: int8 codes (N, K); w = d . q
   - u4: uint8 (N, K/2), 32-weight blocks of 16 bytes: byte j of a block holds element j in its
         low nibble and element j + 16 in its high one (GGML's Q4 order);
         zero mode OFFSET8: w = d . (q - 8) (Q4_0), MIN: w = d . q + m (Q4_1)
   - d, m: fp16 bits (N, K / (32 . gb)): one scale (and minimum) per group of gb 32-blocks.

   Design: a decode step reads every weight once, so the weight bytes read per second bound it.
   The activations are quantised on the fly to int8 per 32-block (llama.cpp's Q8 activations:
   scale = max|x| / 127, round to nearest even), once per call on the calling thread; every
   weight row then costs one integer dot product per block and input row (u8 x s8 multiply-adds:
   vpdpbusd with VNNI, vpmaddubsw + vpmaddwd with AVX2) and one float multiply-add per block
   for the scales. Offsets are integer: the s8 codes become the u8 side as q + 128 (an xor),
   corrected by -128 . sum(xq) of the block; Q4_0's -8 by -8 . sum(xq): both exact, added to
   the block's integer accumulator before it is converted. Q4_1's minimums add
   sum_b m_b . sx_b . sum(xq_b) as a float dot product per row.
   The u4 codes are the u8 side as they are (after a nibble mask); on AVX-512 four blocks' low
   nibbles fill one register, so the activations of the u4 paths there are stored permuted (per
   4 blocks: the 4 first halves, then the 4 second halves) and the bytes are read in place.

   Threads split N in chunks of rows pulled from a counter (thread_pool.h): each row's result
   is independent of who computes it and of the thread count.

   Instruction sets (qmm_supports, the host picks the best or SELFATTN_QUANT_ISA's): generic C
   (any CPU), AVX2 (maddubs; s8 by the sign trick: |w| against sign(x, w), the weight on the u8
   side because a code of -128 is 128 there, while x, within +-127, negates safely), AVX-VNNI
   (256-bit vpdpbusd) and AVX-512 VNNI. All compute the same integer sums per block; they differ
   only in the order of the float sums. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define POOL_NAME "sa-qmm"
#include "thread_pool.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define HAVE_X86_PATHS 1
#include <immintrin.h>
#endif

enum { ISA_GENERIC = 0, ISA_AVX2 = 1, ISA_AVXVNNI = 2, ISA_AVX512VNNI = 3 };
enum { W_S8 = 0, W_U4 = 1 };
enum { Z_NONE = 0, Z_OFFSET8 = 1, Z_MIN = 2 };
enum { D_F32 = 0, D_BF16 = 1 };

/* Blocks of a row's per-block arrays are padded to a multiple of this (zeros), so the vector
   paths read whole vectors of scales and whole 4-block groups of activations. */
#define NB_PAD 16
/* int32 lanes a block's sums take in the AVX-512 path's vectors (rows512) */
#define LANES(c) ((c)->wt == W_U4 ? 4 : 8)

static inline float half_to_float(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
  if (exp == 0x1F) {
    bits = sign | 0x7F800000u | (man << 13);
  } else if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else { /* subnormal: normalise */
      int e = -1;
      do {
        e++;
        man <<= 1;
      } while (!(man & 0x400));
      bits = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3FF) << 13);
    }
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  float f;
  memcpy(&f, &bits, 4);
  return f;
}

static inline float bf16_to_float(uint16_t h) {
  const uint32_t bits = (uint32_t)h << 16;
  float f;
  memcpy(&f, &bits, 4);
  return f;
}

static inline uint16_t float_to_bf16(float f) { /* round to nearest even; NaN stays NaN */
  uint32_t bits;
  memcpy(&bits, &f, 4);
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((bits >> 16) | 0x40);
  bits += 0x7FFFu + ((bits >> 16) & 1);
  return (uint16_t)(bits >> 16);
}

/* -- the call ----------------------------------------------------------------------------- */
typedef struct {
  int64_t M, N, K, nb, nbp, gb, chunk, n_chunks, ystride;
  int wt, zp, isa, odt, bdt;
  const uint8_t *qs;
  const uint16_t *d, *mn;
  const void *bias;
  void *y;
  /* the quantised activations: xq (M, nbp . 32) int8, sx (M, nbp) float scales, xs (M, nbp)
     sx . sum(xq) per block, cz (M, nbp) int32 correction per block */
  const int8_t *xq;
  const float *sx, *xs;
  const int32_t *cz;
  /* AVX-512 only: the same per lane (M, nbp . LANES) (rows512) */
  const float *sxv, *xsv;
  const int32_t *czv;
  int64_t next; /* chunk counter, atomic */
} Call;

/* One 32-block of x (dtype xdt) -> int8 codes blk, their sum; returns the block's scale
   max|x| / 127 (codes: x / scale rounded to nearest even, within +-127). */
static float quantise_block(const void *src, int xdt, int8_t *blk, int *sum) {
  float row[32];
  if (xdt == D_F32) {
    memcpy(row, src, sizeof row);
  } else {
    for (int j = 0; j < 32; j++) row[j] = bf16_to_float(((const uint16_t *)src)[j]);
  }
  float amax = 0;
  for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(row[j]));
  const float s = amax / 127.0f;
  const float id = s != 0.0f ? 1.0f / s : 0.0f;
  int total = 0;
  for (int j = 0; j < 32; j++) {
    float v = nearbyintf(row[j] * id); /* to nearest even (the default rounding mode) */
    v = v > 127.0f ? 127.0f : (v < -127.0f ? -127.0f : v);
    blk[j] = (int8_t)v;
    total += blk[j];
  }
  *sum = total;
  return s;
}

#ifdef HAVE_X86_PATHS
/* quantise_block in AVX-512: the same operations, so the same codes and scale. */
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq"))) static float quantise_block512(
    const void *src, int xdt, int8_t *blk, int *sum) {
  __m512 a, b;
  if (xdt == D_F32) {
    a = _mm512_loadu_ps(src), b = _mm512_loadu_ps((const float *)src + 16);
  } else {
    const __m512i h = _mm512_loadu_si512(src); /* 32 bf16 */
    a = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(h)), 16));
    b = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(h, 1)), 16));
  }
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
  const float s = amax / 127.0f;
  const __m512 id = _mm512_set1_ps(s != 0.0f ? 1.0f / s : 0.0f);
  const __m512i lim = _mm512_set1_epi32(127), nlim = _mm512_set1_epi32(-127);
  __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, id)); /* nearest even (MXCSR default) */
  __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, id));
  qa = _mm512_max_epi32(_mm512_min_epi32(qa, lim), nlim);
  qb = _mm512_max_epi32(_mm512_min_epi32(qb, lim), nlim);
  _mm_storeu_si128((__m128i *)blk, _mm512_cvtepi32_epi8(qa));
  _mm_storeu_si128((__m128i *)(blk + 16), _mm512_cvtepi32_epi8(qb));
  *sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
  return s;
}
#endif

/* Quantise x row by row into the call's buffers (layout per the ISA and weight codes). */
static void quantise_x(Call *c, const void *x, int xdt, int8_t *xq, float *sx, float *xs,
                       int32_t *cz) {
  const int permuted = c->isa == ISA_AVX512VNNI && c->wt == W_U4;
  const int xor_s8 = c->wt == W_S8 && (c->isa == ISA_AVXVNNI || c->isa == ISA_AVX512VNNI);
  float (*block)(const void *, int, int8_t *, int *) = quantise_block;
#ifdef HAVE_X86_PATHS
  if (c->isa == ISA_AVX512VNNI) block = quantise_block512;
#endif
  const int64_t K = c->K, nb = c->nb, nbp = c->nbp, esize = xdt == D_F32 ? 4 : 2;
  for (int64_t m = 0; m < c->M; m++) {
    int8_t *q = xq + m * nbp * 32;
    memset(q + nb * 32, 0, (size_t)((nbp - nb) * 32));
    for (int64_t b = nb; b < nbp; b++) sx[m * nbp + b] = 0, xs[m * nbp + b] = 0, cz[m * nbp + b] = 0;
    for (int64_t b = 0; b < nb; b++) {
      int8_t blk[32];
      int sum;
      const float s = block((const char *)x + (m * K + b * 32) * esize, xdt, blk, &sum);
      if (permuted) { /* per 4 blocks: first halves at 16 . (b % 4), second halves 64 later */
        int8_t *g = q + (b / 4) * 128 + (b % 4) * 16;
        memcpy(g, blk, 16);
        memcpy(g + 64, blk + 16, 16);
      } else {
        memcpy(q + b * 32, blk, 32);
      }
      sx[m * nbp + b] = s;
      xs[m * nbp + b] = s * (float)sum;
      cz[m * nbp + b] = c->zp == Z_OFFSET8 ? -8 * sum : (xor_s8 ? -128 * sum : 0);
    }
  }
}

/* -- the dot products: one weight row against one quantised activation row ------------------ */
/* sum over blocks b of float(isum_b + cz_b) . dw_b . sx_b, isum_b the block's integer dot */
static float dot_generic(const Call *c, const uint8_t *w, const int8_t *xq, const float *dw,
                         const float *sx, const int32_t *cz) {
  float acc = 0;
  for (int64_t b = 0; b < c->nb; b++) {
    int32_t s = cz[b];
    const int8_t *xb = xq + b * 32;
    if (c->wt == W_S8) {
      const int8_t *wb = (const int8_t *)w + b * 32;
      for (int j = 0; j < 32; j++) s += (int32_t)wb[j] * xb[j];
    } else {
      const uint8_t *wb = w + b * 16;
      for (int j = 0; j < 16; j++) s += (int32_t)(wb[j] & 15) * xb[j] + (int32_t)(wb[j] >> 4) * xb[j + 16];
    }
    acc += (float)s * (dw[b] * sx[b]);
  }
  return acc;
}

#ifdef HAVE_X86_PATHS
#define T_AVX2 __attribute__((target("avx2,fma,f16c")))
#define T_AVXVNNI __attribute__((target("avx2,fma,f16c,avxvnni")))
#define T_AVX512 __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")))

/* The block's 8 int32 lanes (256-bit paths): the correction in lane 0. */
#define CORR256(v) _mm256_zextsi128_si256(_mm_cvtsi32_si128(v))

/* One 32-block's codes as 32 bytes in element order: u4 nibbles (low halves, then high). */
#define U4_BLOCK(w, b)                                                                           \
  ({                                                                                              \
    const __m128i v_ = _mm_loadu_si128((const __m128i *)((w) + (b) * 16));                     \
    _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v_, 4), v_), _mm256_set1_epi8(0x0F));       \
  })

T_AVX2 static inline float hsum256(__m256 a) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
}

T_AVX2 static float dot_avx2(const Call *c, const uint8_t *w, const int8_t *xq, const float *dw,
                             const float *sx, const int32_t *cz) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc = _mm256_setzero_ps();
  for (int64_t b = 0; b < c->nb; b++) {
    const __m256i x = _mm256_loadu_si256((const __m256i *)(xq + b * 32));
    __m256i p;
    if (c->wt == W_S8) { /* |w| (u8) against x with w's sign (s8): no offset to correct */
      const __m256i wv = _mm256_loadu_si256((const __m256i *)(w + b * 32));
      p = _mm256_maddubs_epi16(_mm256_sign_epi8(wv, wv), _mm256_sign_epi8(x, wv));
    } else {
      p = _mm256_maddubs_epi16(U4_BLOCK(w, b), x);
    }
    const __m256i s = _mm256_add_epi32(_mm256_madd_epi16(p, ones), CORR256(cz[b]));
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(dw[b] * sx[b]), acc);
  }
  return hsum256(acc);
}

T_AVXVNNI static float dot_avxvnni(const Call *c, const uint8_t *w, const int8_t *xq,
                                   const float *dw, const float *sx, const int32_t *cz) {
  const __m256i flip = _mm256_set1_epi8((char)0x80);
  __m256 acc = _mm256_setzero_ps();
  for (int64_t b = 0; b < c->nb; b++) {
    const __m256i x = _mm256_loadu_si256((const __m256i *)(xq + b * 32));
    const __m256i wv =
        c->wt == W_S8
            ? _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(w + b * 32)), flip) /* q+128 */
            : U4_BLOCK(w, b);
    const __m256i s = _mm256_dpbusd_avx_epi32(CORR256(cz[b]), wv, x);
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(dw[b] * sx[b]), acc);
  }
  return hsum256(acc);
}

/* The AVX-512 path takes 64 bytes of codes a step: 4 u4 blocks (lanes 4i..4i+3 of a vector of
   16 int32 sums are block i: the low nibbles are the blocks' first halves, the high ones their
   second halves, and the activations are stored permuted to match) or 2 s8 blocks (lanes
   8i..8i+7, codes as q + 128). Per input row the call spreads each block's activation scale
   over its lanes (sxv), and its integer correction and sx . sum(xq) into its first lane (czv,
   xsv): one load each, no shuffles per row and step. */

/* Rows m0..m0+MT-1 of x against one weight row (MT a constant after inlining: the weight
   vector is loaded, unpacked and its scales spread once for all of them). */
__attribute__((always_inline)) T_AVX512 static inline void rows512(const Call *c, const uint8_t *w,
                                                                 const float *dw, const float *mw,
                                                                 int64_t m0, const int MT,
                                                                 float *out) {
  __m512 acc[4];
  for (int r = 0; r < MT; r++) acc[r] = _mm512_setzero_ps();
  const int64_t nb = c->nb, vstride = c->nbp * LANES(c);
  const int minimums = c->zp == Z_MIN;
  if (c->wt == W_U4) {
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    const __m512i spread = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    for (int64_t b = 0; b < nb; b += 4) {
      const __m512i v = b + 4 <= nb ? _mm512_loadu_si512(w + b * 16)
                                    : _mm512_maskz_loadu_epi8(~0ULL >> (64 - 16 * (nb - b)), w + b * 16);
      const __m512i lo = _mm512_and_si512(v, m4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
      const __m512 d16 = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_loadu_ps(dw + b)));
      const __m512 m16 = minimums ? _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_loadu_ps(mw + b)))
                                  : _mm512_setzero_ps();
      for (int r = 0; r < MT; r++) {
        const int64_t o = (m0 + r) * vstride + b * 4;
        const int8_t *xg = c->xq + ((m0 + r) * c->nbp + b) * 32;
        __m512i s = _mm512_loadu_si512(c->czv + o);
        s = _mm512_dpbusd_epi32(s, lo, _mm512_loadu_si512(xg));
        s = _mm512_dpbusd_epi32(s, hi, _mm512_loadu_si512(xg + 64));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(d16, _mm512_loadu_ps(c->sxv + o)), acc[r]);
        if (minimums) acc[r] = _mm512_fmadd_ps(m16, _mm512_loadu_ps(c->xsv + o), acc[r]);
      }
    }
  } else {
    const __m512i spread = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    for (int64_t b = 0; b < nb; b += 2) {
      const __m512i v = b + 2 <= nb ? _mm512_loadu_si512(w + b * 32)
                                    : _mm512_maskz_loadu_epi8(~0ULL >> 32, w + b * 32);
      const __m512i u = _mm512_xor_si512(v, flip); /* q + 128; past the row: 128 . 0 */
      const __m512 d16 = _mm512_permutexvar_ps(
          spread, _mm512_castps128_ps512(_mm_castsi128_ps(_mm_loadl_epi64((const __m128i *)(dw + b)))));
      for (int r = 0; r < MT; r++) {
        const int64_t o = (m0 + r) * vstride + b * 8;
        __m512i s = _mm512_loadu_si512(c->czv + o);
        s = _mm512_dpbusd_epi32(s, u, _mm512_loadu_si512(c->xq + ((m0 + r) * c->nbp + b) * 32));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(d16, _mm512_loadu_ps(c->sxv + o)), acc[r]);
      }
    }
  }
  for (int r = 0; r < MT; r++) out[m0 + r] = _mm512_reduce_add_ps(acc[r]);
}

T_AVX512 static void rows_avx512(const Call *c, const uint8_t *w, const float *dw,
                                 const float *mw, float *out) {
  int64_t m = 0;
  for (; m + 4 <= c->M; m += 4) rows512(c, w, dw, mw, m, 4, out);
  switch (c->M - m) {
    case 3: rows512(c, w, dw, mw, m, 3, out); break;
    case 2: rows512(c, w, dw, mw, m, 2, out); break;
    case 1: rows512(c, w, dw, mw, m, 1, out); break;
  }
}

/* A row's fp16 scales -> float, one per 32-block (a group's scale repeated gb times). */
T_AVX2 static void expand_f16c(const uint16_t *h, int64_t n_groups, int64_t gb, float *out) {
  if (gb == 1) {
    int64_t g = 0;
    for (; g + 8 <= n_groups; g += 8)
      _mm256_storeu_ps(out + g, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + g))));
    for (; g < n_groups; g++) out[g] = _cvtsh_ss(h[g]);
    return;
  }
  for (int64_t g = 0; g < n_groups; g++) {
    const float v = _cvtsh_ss(h[g]);
    for (int64_t i = 0; i < gb; i++) out[g * gb + i] = v;
  }
}
#endif

static void expand_generic(const uint16_t *h, int64_t n_groups, int64_t gb, float *out) {
  for (int64_t g = 0; g < n_groups; g++) {
    const float v = half_to_float(h[g]);
    for (int64_t i = 0; i < gb; i++) out[g * gb + i] = v;
  }
}

typedef float (*dot_fn)(const Call *, const uint8_t *, const int8_t *, const float *,
                        const float *, const int32_t *);
typedef void (*rows_fn)(const Call *, const uint8_t *, const float *, const float *, float *);
typedef void (*expand_fn)(const uint16_t *, int64_t, int64_t, float *);

/* out[m] for every input row m against weight row w: a dot product per row, plus the Q4_1
   minimums' term. */
static inline void rows_by_dot(const Call *c, dot_fn dot, const uint8_t *w, const float *dw,
                               const float *mw, float *out) {
  for (int64_t m = 0; m < c->M; m++) {
    const int64_t o = m * c->nbp;
    float v = dot(c, w, c->xq + o * 32, dw, c->sx + o, c->cz + o);
    if (c->zp == Z_MIN) {
      float t = 0;
      for (int64_t b = 0; b < c->nb; b++) t += mw[b] * c->xs[o + b];
      v += t;
    }
    out[m] = v;
  }
}

static void rows_generic(const Call *c, const uint8_t *w, const float *dw, const float *mw,
                         float *out) {
  rows_by_dot(c, dot_generic, w, dw, mw, out);
}
#ifdef HAVE_X86_PATHS
static void rows_avx2(const Call *c, const uint8_t *w, const float *dw, const float *mw,
                      float *out) {
  rows_by_dot(c, dot_avx2, w, dw, mw, out);
}
static void rows_avxvnni(const Call *c, const uint8_t *w, const float *dw, const float *mw,
                         float *out) {
  rows_by_dot(c, dot_avxvnni, w, dw, mw, out);
}
#endif

/* One participant: chunks of rows from the counter; scratch holds a row's expanded scales and
   minimums (nbp floats each, the padding zero) and its M results. */
#define TASK_SCRATCH(c) ((size_t)(2 * (c)->nbp + (c)->M) * sizeof(float))
static int rows_task(void *ctx, void *scratch) {
  Call *c = (Call *)ctx;
  float *dw = (float *)scratch, *mw = dw + c->nbp, *out = mw + c->nbp;
  rows_fn rows = rows_generic;
  expand_fn expand = expand_generic;
#ifdef HAVE_X86_PATHS
  if (c->isa >= ISA_AVX2) expand = expand_f16c;
  if (c->isa == ISA_AVX2) rows = rows_avx2;
  if (c->isa == ISA_AVXVNNI) rows = rows_avxvnni;
  if (c->isa == ISA_AVX512VNNI) rows = rows_avx512;
#endif
  const int64_t n_groups = c->nb / c->gb;
  const int64_t row_bytes = c->wt == W_S8 ? c->K : c->K / 2;
  for (;;) {
    const int64_t k = __atomic_fetch_add(&c->next, 1, __ATOMIC_RELAXED);
    if (k >= c->n_chunks) break;
    const int64_t n0 = k * c->chunk, n1 = n0 + c->chunk < c->N ? n0 + c->chunk : c->N;
    for (int64_t n = n0; n < n1; n++) {
      expand(c->d + n * n_groups, n_groups, c->gb, dw);
      if (c->zp == Z_MIN) expand(c->mn + n * n_groups, n_groups, c->gb, mw);
      rows(c, c->qs + n * row_bytes, dw, mw, out);
      float bias = 0;
      if (c->bias)
        bias = c->bdt == D_F32 ? ((const float *)c->bias)[n]
                               : bf16_to_float(((const uint16_t *)c->bias)[n]);
      for (int64_t m = 0; m < c->M; m++) {
        const float v = out[m] + bias;
        if (c->odt == D_F32)
          ((float *)c->y)[m * c->ystride + n] = v;
        else
          ((uint16_t *)c->y)[m * c->ystride + n] = float_to_bf16(v);
      }
    }
  }
  return 0;
}

/* 1 where this CPU (and compiler) runs instruction-set path `isa`. */
int qmm_supports(int isa) {
  if (isa == ISA_GENERIC) return 1;
#ifdef HAVE_X86_PATHS
  __builtin_cpu_init();
  const int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                   __builtin_cpu_supports("f16c");
  if (isa == ISA_AVX2) return avx2;
  if (isa == ISA_AVXVNNI) return avx2 && __builtin_cpu_supports("avxvnni");
  if (isa == ISA_AVX512VNNI)
    return avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("avx512vnni");
#endif
  return 0;
}

/* The calling thread's buffers, kept and grown across calls: the activations' codes and scales
   (x_buf), a fused step's normed input and fp32 products (f_buf). */
static __thread void *x_buf, *f_buf;
static __thread size_t x_buf_bytes, f_buf_bytes;

static void *grown(void **buf, size_t *have, size_t bytes) {
  if (*have < bytes) {
    free(*buf);
    *buf = malloc(bytes);
    *have = *buf ? bytes : 0;
  }
  return *buf;
}

/* The weights' arguments, in the order of the W_* enum (the host builds them once per layer):
   N, K, wt, zp, gb (top of file), bdt and the pointers of qs, d, m (or 0) and bias (or 0). */
enum { W_N, W_K, W_WT, W_ZP, W_GB, W_BDT, W_QS, W_D, W_M, W_BIAS, W_NARGS };

/* A call of weights w on M rows; 0, or 2 on bad sizes. */
static int call_of(Call *c, const int64_t *w, int64_t M, int isa) {
  const int64_t N = w[W_N], K = w[W_K], gb = w[W_GB];
  if (M <= 0 || N <= 0 || K <= 0 || K % 32 || gb <= 0 || (K / 32) % gb || isa < 0 ||
      isa > ISA_AVX512VNNI)
    return 2;
  *c = (Call){.M = M, .N = N, .K = K, .nb = K / 32, .gb = gb, .wt = (int)w[W_WT],
              .zp = (int)w[W_ZP], .isa = isa, .bdt = (int)w[W_BDT],
              .qs = (const uint8_t *)(intptr_t)w[W_QS], .d = (const uint16_t *)(intptr_t)w[W_D],
              .mn = (const uint16_t *)(intptr_t)w[W_M], .bias = (const void *)(intptr_t)w[W_BIAS]};
  c->nbp = (c->nb + NB_PAD - 1) / NB_PAD * NB_PAD;
  return 0;
}

/* Quantise x (M rows, dtype xdt) into the calling thread's buffers for call c; 0 or 1 (out of
   memory). */
static int quantise_for(Call *c, const void *x, int xdt) {
  const int64_t M = c->M;
  const int spread = c->isa == ISA_AVX512VNNI ? LANES(c) : 0;
  const size_t bytes = (size_t)M * (size_t)c->nbp * (32 + 3 * 4 + 3 * 4 * (size_t)spread);
  if (!grown(&x_buf, &x_buf_bytes, bytes)) return 1;
  int8_t *xq = (int8_t *)x_buf;
  float *sx = (float *)(xq + M * c->nbp * 32), *xs = sx + M * c->nbp;
  int32_t *cz = (int32_t *)(xs + M * c->nbp);
  quantise_x(c, x, xdt, xq, sx, xs, cz);
  c->xq = xq, c->sx = sx, c->xs = xs, c->cz = cz;
  if (spread) { /* each block's scale over its lanes; correction and sx . sum in its first */
    const int64_t n = M * c->nbp;
    float *sxv = (float *)(cz + n), *xsv = sxv + n * spread;
    int32_t *czv = (int32_t *)(xsv + n * spread);
    for (int64_t i = 0; i < n; i++)
      for (int l = 0; l < spread; l++) {
        sxv[i * spread + l] = sx[i];
        xsv[i * spread + l] = l ? 0.0f : xs[i];
        czv[i * spread + l] = l ? 0 : cz[i];
      }
    c->sxv = sxv, c->xsv = xsv, c->czv = czv;
  }
  return 0;
}

/* Set call c to write y (dtype odt, row stride ystride) in chunks for up to n_threads
   participants; returns the participants that have work. */
static int plan_rows(Call *c, void *y, int odt, int64_t ystride, int n_threads) {
  c->y = y, c->odt = odt, c->ystride = ystride, c->next = 0;
  if (n_threads < 1) n_threads = 1;
  /* a few chunks per thread, so that a late or slow participant still finds work */
  int64_t chunk = c->N / (8 * (int64_t)n_threads);
  chunk = chunk < 16 ? 16 : chunk;
  c->chunk = chunk, c->n_chunks = (c->N + chunk - 1) / chunk;
  return c->n_chunks < n_threads ? (int)c->n_chunks : n_threads;
}

/* Run call c's rows on up to n_threads participants into y (dtype odt, row stride ystride). */
static int run_rows(Call *c, void *y, int odt, int64_t ystride, int n_threads) {
  n_threads = plan_rows(c, y, odt, ystride, n_threads);
  return pool_run(rows_task, c, n_threads, TASK_SCRATCH(c));
}

/* Two calls' rows (a SwiGLU's gate and up) in one parallel region: each participant takes the
   first call's chunks, then the second's. */
static int pair_task(void *ctx, void *scratch) {
  Call **calls = (Call **)ctx;
  return rows_task(calls[0], scratch) | rows_task(calls[1], scratch);
}

/* y (M, N) = x (M, K) . W^T + bias. w: the weights' arguments (W_* above). x: xdt (D_F32 /
   D_BF16) contiguous; y: the same dtype, contiguous. isa: a path qmm_supports() accepts (the
   host checks). Returns 0, 1 when memory ran out, 2 on bad sizes. */
int quant_matmul(const int64_t *w, int64_t M, const void *x, void *y, int xdt, int isa,
                 int n_threads) {
  Call c;
  int status = call_of(&c, w, M, isa);
  if (status) return status;
  if (quantise_for(&c, x, xdt)) return 1;
  return run_rows(&c, y, xdt, c.N, n_threads);
}

/* -- dequantisation: rows of W as floats, for a matmul of many rows ------------------------- */
/* Past a few input rows a dense matmul (oneDNN's, AMX's) beats the integer dot products, but
   only if the weights become floats cheaply: the host dequantises a chunk of rows here, once
   per call, straight into the matmul's dtype. Each weight is the layout reference's value
   (quant_matmul.py's dequantize): d . q (or d . (q - 8)) is exact in fp32, q4_1 adds m with one
   rounding (a fused multiply-add of an exact product rounds the same); bf16 rounds that to
   nearest even, as a tensor's .to(bfloat16) does. */
typedef struct {
  Call c;
  int64_t n0, n1, chunk, next;
  void *out;
  int odt;
} Deq;

/* Row n of W: K floats into row (generic C). */
static void deq_row_generic(const Call *c, int64_t n, float *row) {
  const int64_t G = c->nb / c->gb, per = 32 * c->gb;
  const uint16_t *d = c->d + n * G, *mn = c->zp == Z_MIN ? c->mn + n * G : NULL;
  if (c->wt == W_S8) {
    const int8_t *q = (const int8_t *)c->qs + n * c->K;
    for (int64_t k = 0; k < c->K; k++) row[k] = (float)q[k] * half_to_float(d[k / per]);
    return;
  }
  const uint8_t *q = c->qs + n * (c->K / 2);
  for (int64_t b = 0; b < c->nb; b++) {
    const float ds = half_to_float(d[b / c->gb]);
    const float ms = mn ? half_to_float(mn[b / c->gb]) : 0.0f;
    float *r = row + b * 32;
    for (int j = 0; j < 16; j++) {
      const uint8_t v = q[b * 16 + j];
      if (mn) {
        r[j] = (float)(v & 15) * ds + ms, r[j + 16] = (float)(v >> 4) * ds + ms;
      } else { /* no "+ 0": Q4_0's product at q = 8 keeps its sign (-0 for d < 0) */
        r[j] = ((float)(v & 15) - 8.0f) * ds, r[j + 16] = ((float)(v >> 4) - 8.0f) * ds;
      }
    }
  }
}

#ifdef HAVE_X86_PATHS
/* 16 floats -> 16 bf16, rounded to nearest even; a NaN stays a (quiet) NaN: float_to_bf16. */
T_AVX512 static inline __m256i bf16_of512(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb));
  r = _mm512_mask_or_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), bits,
                           _mm512_set1_epi32(0x400000));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
}

T_AVX512 static inline void deq_store512(void *dst, int64_t i, __m512 v, int odt) {
  if (odt == D_F32)
    _mm512_storeu_ps((float *)dst + i, v);
  else
    _mm256_storeu_si256((__m256i *)((uint16_t *)dst + i), bf16_of512(v));
}

/* Row n of W into dst (dtype odt), a 32-block at a time; dw, mw: the row's scales and
   minimums per block (expand_f16c). */
T_AVX512 static void deq_row512(const Call *c, int64_t n, const float *dw, const float *mw,
                                void *dst, int odt) {
  const __m128i m4 = _mm_set1_epi8(0x0F);
  const __m512 eight = _mm512_set1_ps(8.0f);
  for (int64_t b = 0; b < c->nb; b++) {
    const __m512 ds = _mm512_set1_ps(dw[b]);
    __m512 lo, hi;
    if (c->wt == W_S8) {
      const int8_t *q = (const int8_t *)c->qs + n * c->K + b * 32;
      lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q))), ds);
      hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 16)))), ds);
    } else {
      const __m128i v = _mm_loadu_si128((const __m128i *)(c->qs + n * (c->K / 2) + b * 16));
      lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(v, m4)));
      hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(v, 4), m4)));
      if (c->zp == Z_MIN) {
        const __m512 ms = _mm512_set1_ps(mw[b]);
        lo = _mm512_fmadd_ps(lo, ds, ms), hi = _mm512_fmadd_ps(hi, ds, ms);
      } else {
        lo = _mm512_mul_ps(_mm512_sub_ps(lo, eight), ds);
        hi = _mm512_mul_ps(_mm512_sub_ps(hi, eight), ds);
      }
    }
    deq_store512(dst, b * 32, lo, odt);
    deq_store512(dst, b * 32 + 16, hi, odt);
  }
}
#endif

/* One participant: chunks of rows from the counter; scratch holds a row of floats (K >= 2 nb:
   also a row's scales and minimums). */
static int deq_task(void *ctx, void *scratch) {
  Deq *q = (Deq *)ctx;
  const Call *c = &q->c;
  const int64_t esize = q->odt == D_F32 ? 4 : 2, span = q->n1 - q->n0;
  for (;;) {
    const int64_t k = __atomic_fetch_add(&q->next, 1, __ATOMIC_RELAXED);
    if (k * q->chunk >= span) break;
    const int64_t r0 = q->n0 + k * q->chunk;
    const int64_t r1 = r0 + q->chunk < q->n1 ? r0 + q->chunk : q->n1;
    for (int64_t n = r0; n < r1; n++) {
      char *dst = (char *)q->out + (n - q->n0) * c->K * esize;
#ifdef HAVE_X86_PATHS
      if (c->isa == ISA_AVX512VNNI) {
        float *dw = (float *)scratch, *mw = dw + c->nb;
        const int64_t G = c->nb / c->gb;
        expand_f16c(c->d + n * G, G, c->gb, dw);
        if (c->zp == Z_MIN) expand_f16c(c->mn + n * G, G, c->gb, mw);
        deq_row512(c, n, dw, mw, dst, q->odt);
        continue;
      }
#endif
      float *row = q->odt == D_F32 ? (float *)dst : (float *)scratch;
      deq_row_generic(c, n, row);
      if (q->odt == D_BF16)
        for (int64_t i = 0; i < c->K; i++) ((uint16_t *)dst)[i] = float_to_bf16(row[i]);
    }
  }
  return 0;
}

/* out (n1 - n0, K), contiguous, dtype odt = rows n0..n1 of W dequantised (above). Returns 0,
   1 when memory ran out, 2 on bad sizes or rows. */
int quant_dequantize(const int64_t *w, int64_t n0, int64_t n1, void *out, int odt, int isa,
                     int n_threads) {
  Deq q = {.n0 = n0, .n1 = n1, .out = out, .odt = odt, .next = 0};
  int status = call_of(&q.c, w, 1, isa);
  if (status) return status;
  if (n0 < 0 || n1 > q.c.N || n0 >= n1 || (odt != D_F32 && odt != D_BF16)) return 2;
  if (n_threads < 1) n_threads = 1;
  const int64_t span = n1 - n0;
  int64_t chunk = span / (4 * (int64_t)n_threads);
  q.chunk = chunk < 8 ? 8 : chunk;
  const int64_t n_chunks = (span + q.chunk - 1) / q.chunk;
  if (n_chunks < n_threads) n_threads = (int)n_chunks;
  return pool_run(deq_task, &q, n_threads, (size_t)q.c.K * sizeof(float));
}

/* -- a fused step: a linear layer with its neighbours in a decoder block ---------------------- */
/* The values round as the same ops in PyTorch round them (the host's module path: rms_norm,
   the product rounded to the dtype, then RoPE, the SwiGLU product or the residual sum each
   rounded once), so that a fused step and the modules give the same values but for the order
   of a sum: round() below is a no-op in fp32, bf16's rounding in bf16. */
static inline float rounded(float v, int dt) { return dt == D_BF16 ? bf16_to_float(float_to_bf16(v)) : v; }
static inline float load_dt(const void *p, int64_t i, int dt) {
  return dt == D_F32 ? ((const float *)p)[i] : bf16_to_float(((const uint16_t *)p)[i]);
}
static inline void store_dt(void *p, int64_t i, float v, int dt) {
  if (dt == D_F32)
    ((float *)p)[i] = v;
  else
    ((uint16_t *)p)[i] = float_to_bf16(v);
}

/* rms_norm(x) . g row by row into xn (fp32): torch.rms_norm's steps (the mean of squares in
   fp32, x . rsqrt(mean + eps) rounded to the dtype), then the weight's product rounded. */
static void norm_rows(const void *x, int xdt, int64_t M, int64_t K, const void *g, int gdt,
                      float eps, float *xn) {
  for (int64_t m = 0; m < M; m++) {
    float ss = 0;
    for (int64_t k = 0; k < K; k++) {
      const float v = load_dt(x, m * K + k, xdt);
      ss += v * v;
    }
    const float inv = 1.0f / sqrtf(ss / (float)K + eps);
    for (int64_t k = 0; k < K; k++) {
      const float v = rounded(load_dt(x, m * K + k, xdt) * inv, xdt);
      xn[m * K + k] = g ? rounded(v * load_dt(g, k, gdt), xdt) : v;
    }
  }
}

/* The fused step's fixed options (int64 each, by these indices; a pointer 0: the part is
   absent): F_NORM_ON 1 normalises x first, by the norm's weight F_NORM (dtype F_NORM_DT; 0: none)
   and its eps as float bits; F_W2 a second weight (args as w) whose products pair with w's as
   SiLU(w . x) . (w2 . x); RoPE on the first F_ROPE_HEADS heads of F_HEAD_DIM outputs, F_ROT_DIM
   dims each (0 heads: none). */
enum { F_NORM_ON, F_NORM, F_NORM_DT, F_EPS, F_W2, F_ROPE_HEADS, F_HEAD_DIM, F_ROT_DIM, F_NARGS };

__attribute__((optimize("fp-contract=off"))) static void rope_row(float *v, const float *cs,
                                                                  const float *sn, int64_t heads,
                                                                  int64_t D, int64_t r, int dt) {
  float tmp[r];
  const int64_t h2 = r / 2;
  for (int64_t h = 0; h < heads; h++) {
    float *u = v + h * D;
    for (int64_t i = 0; i < r; i++) tmp[i] = rounded(u[i], dt); /* the product as stored */
    for (int64_t i = 0; i < r; i++) {
      const float a = tmp[i] * cs[i], b = tmp[i < h2 ? i + h2 : i - h2] * sn[i];
      u[i] = a + b;
    }
  }
}

static inline float silu(float g) { return g / (1.0f + expf(-g)); }

/* y (M, N) = the step of weights w over x (M, K) with the options f (F_* above); dtypes as
   quant_matmul's. Per call: res (M, N) in y's dtype added last (0: none; may be y), RoPE's
   half-split factors cos2, sin2 (fp32, rope_rows rows of F_ROT_DIM; row m of x takes row
   m % rope_rows). Returns 0, 1 when memory ran out, 2 on bad sizes or options. */
int quant_linear_step(const int64_t *w, const int64_t *f, int64_t M, const void *x, void *y,
                      const void *res, const float *cs, const float *sn, int64_t rope_rows,
                      int xdt, int isa, int n_threads) {
  Call c, c2;
  int status = call_of(&c, w, M, isa);
  if (status) return status;
  const int64_t N = c.N, K = c.K;
  const int64_t *w2 = (const int64_t *)(intptr_t)f[F_W2];
  if (w2) {
    if ((status = call_of(&c2, w2, M, isa))) return status;
    if (c2.N != N || c2.K != K || c2.wt != c.wt || c2.zp != c.zp) return 2;
  }
  const int64_t heads = f[F_ROPE_HEADS], D = f[F_HEAD_DIM], r = f[F_ROT_DIM];
  if (heads && (D <= 0 || r <= 0 || r > D || r % 2 || heads * D > N || rope_rows <= 0 || !cs ||
                !sn))
    return 2;
  const int64_t width = w2 ? 2 * N : N;
  float *buf = (float *)grown(&f_buf, &f_buf_bytes,
                              (size_t)M * (size_t)(width + (f[F_NORM_ON] ? K : 0)) * 4);
  if (!buf) return 1;
  float *acc = buf, *xn = buf + M * width;
  const void *xin = x;
  int xin_dt = xdt;
  if (f[F_NORM_ON]) {
    float eps;
    const uint32_t bits = (uint32_t)f[F_EPS];
    memcpy(&eps, &bits, 4);
    norm_rows(x, xdt, M, K, (const void *)(intptr_t)f[F_NORM], (int)f[F_NORM_DT], eps, xn);
    xin = xn, xin_dt = D_F32;
  }
  if (quantise_for(&c, xin, xin_dt)) return 1;
  if (w2) {
    c2.xq = c.xq, c2.sx = c.sx, c2.xs = c.xs, c2.cz = c.cz; /* the same quantised rows */
    c2.sxv = c.sxv, c2.xsv = c.xsv, c2.czv = c.czv;
    const int n1 = plan_rows(&c, acc, D_F32, width, n_threads);
    const int n2 = plan_rows(&c2, acc + N, D_F32, width, n_threads);
    Call *calls[2] = {&c, &c2};
    if (pool_run(pair_task, calls, n1 > n2 ? n1 : n2, TASK_SCRATCH(&c))) return 1;
  } else if (run_rows(&c, acc, D_F32, width, n_threads)) {
    return 1;
  }
  for (int64_t m = 0; m < M; m++) {
    float *a = acc + m * width;
    if (w2)
      for (int64_t n = 0; n < N; n++) {
        const float g = rounded(a[n], xdt), u = rounded(a[N + n], xdt);
        a[n] = rounded(silu(g), xdt) * u;
      }
    if (heads) {
      const int64_t row = m % rope_rows;
      rope_row(a, cs + row * r, sn + row * r, heads, D, r, xdt);
    }
    for (int64_t n = 0; n < N; n++) {
      float v = a[n];
      if (res) v = load_dt(res, m * N + n, xdt) + rounded(v, xdt);
      store_dt(y, m * N + n, v, xdt);
    }
  }
  return 0;
}

/* -- consecutive decoder blocks' decode steps in one call --------------------------------------
   What a lean step of a plain Llama-layout block over quantised projections runs (the host:
   selfattn/nn/blocks.py's RowsStep.kernel_step), for n_layers blocks in a row: per block
   - qkv = quant_linear_step(qkv weights, norm and RoPE inside) of h;
   - the step's keys and values stored at their page slots (a copy of each token's Hkv . D row);
   - the queries copied out contiguous, and the paged attention kernel called through the host's
     prepared arguments (paged_decode.c's entry, its address given: another library);
   - x = h + out(attention); act = SiLU(gate(norm x)) . up(norm x); h = x + down(act).
   The same calls on the same buffers as the host's per-block path, so the same values; what
   it saves is the host's work between them (several µs a call, ~20 calls a block). */
typedef int (*attention_fn)(const int64_t *iargs, void *const *ptrs, int n_threads, float scale);

/* A block's fields, int64 each: its four steps' weights and options (the gate's options name
   the up weights as their pair), its K and V pages' base addresses, its attention scale as
   float bits. */
enum { LY_QKV_W, LY_QKV_F, LY_OUT_W, LY_OUT_F, LY_MLP_W, LY_MLP_F, LY_DOWN_W, LY_DOWN_F, LY_K,
       LY_V, LY_SCALE, LY_NARGS };
/* The step's fields: M token rows of d_model; Hq, Hkv heads of D (values Dv); RoPE's factors
   (rows of the rotated width); the slots (int64, M) where the rows' keys and values go, the page
   size P and the K and V pages' strides (elements) per page and per slot; the attention entry,
   its int and pointer arguments and the pointer slots of q, K, V, out, lse; the threads of each
   step and of the attention; the work buffers: qkv (M, (Hq + 2 Hkv) D), q (M, Hq D), o
   (M, Hq Dv), act (M, N of the gate), x (M, d_model). */
enum { ST_M, ST_DMODEL, ST_HQ, ST_HKV, ST_D, ST_DV, ST_COS, ST_SIN, ST_ROPE_ROWS, ST_SLOTS, ST_P,
       ST_KS0, ST_KS1, ST_VS0, ST_VS1, ST_ATTN, ST_IARGS, ST_PTRS, ST_PQ, ST_PK, ST_PV, ST_POUT,
       ST_PLSE, ST_T_QKV, ST_T_OUT, ST_T_MLP, ST_T_DOWN, ST_T_ATTN, ST_QKV, ST_QBUF, ST_OBUF,
       ST_ACT, ST_XBUF, ST_LSE, ST_NARGS };

#define AT(p) ((void *)(intptr_t)(p))

/* h (M, d_model, dtype xdt) through blocks layers[0 .. n_layers) in place. Returns 0, 1 when
   memory ran out, 2 on bad sizes, 3 when the attention kernel failed. */
int quant_block_steps(const int64_t *layers, int64_t n_layers, const int64_t *st, void *h, int xdt,
                      int isa) {
  const int64_t M = st[ST_M], Hq = st[ST_HQ], Hkv = st[ST_HKV], D = st[ST_D], Dv = st[ST_DV];
  const int64_t P = st[ST_P], es = xdt == D_F32 ? 4 : 2;
  const int64_t nqkv = (Hq + Hkv) * D + Hkv * Dv;
  const int64_t *slots = (const int64_t *)AT(st[ST_SLOTS]);
  char *qkv = AT(st[ST_QKV]), *qb = AT(st[ST_QBUF]);
  void *const *ptrs_c = AT(st[ST_PTRS]);
  void **ptrs = (void **)ptrs_c;
  const attention_fn attend = (attention_fn)AT(st[ST_ATTN]);
  if (M <= 0 || P <= 0 || n_layers < 0) return 2;
  ptrs[st[ST_PQ]] = qb, ptrs[st[ST_POUT]] = AT(st[ST_OBUF]), ptrs[st[ST_PLSE]] = AT(st[ST_LSE]);
  for (int64_t l = 0; l < n_layers; l++) {
    const int64_t *ly = layers + l * LY_NARGS;
    int status = quant_linear_step(AT(ly[LY_QKV_W]), AT(ly[LY_QKV_F]), M, h, qkv, NULL,
                                   AT(st[ST_COS]), AT(st[ST_SIN]), st[ST_ROPE_ROWS], xdt, isa,
                                   (int)st[ST_T_QKV]);
    if (status) return status;
    char *kp = AT(ly[LY_K]), *vp = AT(ly[LY_V]);
    for (int64_t t = 0; t < M; t++) { /* q rows out contiguous; k and v rows to their slots */
      const char *row = qkv + t * nqkv * es;
      const int64_t s = slots[t], page = s / P, at = s % P;
      memcpy(qb + t * Hq * D * es, row, (size_t)(Hq * D * es));
      memcpy(kp + (page * st[ST_KS0] + at * st[ST_KS1]) * es, row + Hq * D * es, (size_t)(Hkv * D * es));
      memcpy(vp + (page * st[ST_VS0] + at * st[ST_VS1]) * es, row + (Hq + Hkv) * D * es,
             (size_t)(Hkv * Dv * es));
    }
    ptrs[st[ST_PK]] = kp, ptrs[st[ST_PV]] = vp;
    float scale;
    const uint32_t bits = (uint32_t)ly[LY_SCALE];
    memcpy(&scale, &bits, 4);
    if (attend(AT(st[ST_IARGS]), ptrs_c, (int)st[ST_T_ATTN], scale)) return 3;
    void *x = AT(st[ST_XBUF]);
    if ((status = quant_linear_step(AT(ly[LY_OUT_W]), AT(ly[LY_OUT_F]), M, AT(st[ST_OBUF]), x, h,
                                    NULL, NULL, 0, xdt, isa, (int)st[ST_T_OUT])))
      return status;
    if ((status = quant_linear_step(AT(ly[LY_MLP_W]), AT(ly[LY_MLP_F]), M, x, AT(st[ST_ACT]), NULL,
                                    NULL, NULL, 0, xdt, isa, (int)st[ST_T_MLP])))
      return status;
    if ((status = quant_linear_step(AT(ly[LY_DOWN_W]), AT(ly[LY_DOWN_F]), M, AT(st[ST_ACT]), h, x,
                                    NULL, NULL, 0, xdt, isa, (int)st[ST_T_DOWN])))
      return status;
  }
  return 0;
}
