/* Paged decode on CPU: attention of a few query rows per sequence over a paged KV cache, each
   page read in place, once (why, and the build: selfattn/kernels/paged_decode.py, its host).

   Entry point: paged_decode(iargs, ptrs, n_threads, scale). iargs holds the integers and ptrs the
   data pointers, in the order of the A_* and P_* enums below; the host fills both by name from
   the same lists (INT_ARGS, PTR_ARGS), and a test checks that they match these enums. Plain C11
   with GNU vector extensions, POSIX threads and OpenMP (thread_pool.h): no PyTorch headers.

   Design. A decode step's time is memory latency, not arithmetic: pages lie at random places
   in the pool and a bf16 page's slot is 2 KiB, so the hardware prefetcher (which stops at 4 KiB
   boundaries) retrains every second slot, and misses overlap only as far as the out-of-order
   window reaches. Hence:
   - the next page's rows are prefetched in software into L2 while this page is computed, one
     line per line loaded inside the blocks (PD_PREFETCH); a whole page asked at once fills the
     miss buffers and stalls the core on the prefetch instructions themselves;
   - no staging buffer: K and V rows are converted in registers inside the dot-product and
     weighted-sum blocks (bf16 by a 16-bit shift, int8 by sign extension, fp8 e4m3 by a
     128-entry table of bf16 bits, or on ISA_AVX512_VBMI by byte tables looked up 64 codes an
     instruction, fp16 by vcvtph2ps; named intrinsics, as gcc lowers
     __builtin_convertvector from 8-bit vectors to one scalar convert per element);
   - a bf16 query against bf16 keys and V uses vdpbf16ps (exact products, fp32 sums) where the
     CPU has avx512_bf16; against int8 pages the keys take vpdpwssd on the query in int16 and V
     vpdpwssd on per-page int16 weights (page_step_i8dp);
   - each block serves all G query rows of a kv head (GQA: K/V read once per kv head), and a
     block's dot products are reduced together by a shuffle tree;
   - a page every row attends whole takes one fused step per kv head and group of 4 rows
     (page_step): max, exp and sum as vectors over the slots, the dequantisation scales folded
     in, acc rescaled as the V block loads it; the running max moves only past a slack
     (PD_MAX_SLACK) and the denominators are vector partial sums;
   - a page's int8 scales are gathered once for all heads (page_scales) and prefetched with the
     next page's rows;
   - a block's score sums are written from the register by masked stores (store_rows), not
     reloaded from the stack a float at a time.
   BENCHMARKS.md has the measurements behind each, and what was tried and dropped.

   Instruction sets: the block kernels are written once over a vector width VW and compiled three
   times (the SIMD pass at the end of this file includes itself): avx512 (VW 16), avx2 (VW 8)
   and generic (VW 8, the build's own target); ISA_AVX512_BF16 and ISA_AVX512_VBMI add blocks of
   their own to the avx512 pass. paged_decode_isa() picks the best this CPU runs,
   or a lower one on request (A_ISA; the host's SELFATTN_DECODE_ISA, tests force generic). */

#ifndef PD_SIMD_PASS

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define POOL_NAME "sa-paged"
#include "thread_pool.h"

enum { F32 = 0, BF16 = 1, F16 = 2, I8 = 3, LUT8 = 4 };
/* instruction sets, lowest first; ISA_AVX512_BF16 adds vdpbf16ps and vpdpwssd (avx512_bf16 and
   avx512_vnni: every CPU with the first has the second) to ISA_AVX512; ISA_AVX512_VBMI adds
   vpermt2b (fp8 pages converted by byte tables) to ISA_AVX512_BF16 */
enum { ISA_GENERIC = 0, ISA_AVX2 = 1, ISA_AVX512 = 2, ISA_AVX512_BF16 = 3, ISA_AVX512_VBMI = 4 };

/* iargs, in order */
enum {
  A_B, A_HQ, A_HKV, A_SQ, A_D, A_DV, A_P, A_MAXP, A_NSPLIT, A_SPLIT_PAGES,
  A_KSN, A_KSP, A_KSH, A_VSN, A_VSP, A_VSH, A_KDT, A_VDT, A_KSC, A_VSC, A_QDT, A_ISA, A_NI, A_ODT, A_NARGS
};
/* ptrs, in order */
enum { P_Q, P_K, P_V, P_KSCALE, P_VSCALE, P_LUT, P_TABLE, P_LO, P_HI, P_OUT, P_LSE, P_SINKS, P_HOLES, P_SCORES, P_NPTRS };

/* Widest vector of any pass, in floats: query rows are zero-padded to a multiple of it, so
   every block kernel loads whole vectors of q (and bf16 q pairs for vdpbf16ps: 2x as many). */
#define QPAD 32

int has_f16(void) {
#ifdef __FLT16_MAX__
  return 1;
#else
  return 0;
#endif
}

static int elem_size(int dt) { return dt == F32 ? 4 : (dt == BF16 || dt == F16 ? 2 : 1); }

/* Element i of a row of dtype dt as a float (scalar tails; fp8 through the 256-entry table,
   which PyTorch's own conversion filled: exact, NaN codes included). */
static inline float to_f32(const void *row, int64_t i, int dt, const float *lut) {
  if (dt == F32) return ((const float *)row)[i];
  if (dt == BF16) {
    uint32_t bits = (uint32_t)((const uint16_t *)row)[i] << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
  }
#ifdef __FLT16_MAX__
  if (dt == F16) return (float)((const _Float16 *)row)[i];
#endif
  if (dt == I8) return (float)((const int8_t *)row)[i];
  return lut[((const uint8_t *)row)[i]];
}

/* 2^e as a float for e in [-126, 127], and the unbiased exponent of a positive float (-127 for 0
   and subnormals, 128 for Inf/NaN): bit arithmetic where ldexpf / ilogbf are library calls. */
static inline float pow2f(int e) {
  const uint32_t bits = (uint32_t)(e + 127) << 23;
  float f;
  memcpy(&f, &bits, 4);
  return f;
}
static inline int exponent_of(float x) {
  uint32_t bits;
  memcpy(&bits, &x, 4);
  return (int)((bits >> 23) & 0xFF) - 127;
}

/* A score x of a key times the key's dequantisation scale k. The scores are dot products with the
   quantised key, scaled once; the fp64 twin scales each element first, so an Inf scale gives it
   0 * Inf = NaN elements (the key's zero codes) and a NaN score. Here too: k - k is 0 for a finite
   k (x * k + 0 is x * k exactly) and NaN for an infinite one, so a corrupted scale shows as NaN in
   the rows that attend its key, never as a key silently dropped (-Inf) or taking all the weight
   (+Inf). Keys no row attends are masked after this and add nothing. */
#define KEY_SCALE(x, k) ((x) * (k) + ((k) - (k)))

/* CALL with the runtime row count RB (1..4) as a compile-time constant RBC, one instance per
   value: the block kernels are always inlined, so each count gets its own unrolled loops. */
#define PD_WITH_RB(RB, CALL)                                                                      \
  switch (RB) {                                                                                   \
    case 4: { enum { RBC = 4 }; CALL; } break;                                                    \
    case 3: { enum { RBC = 3 }; CALL; } break;                                                    \
    case 2: { enum { RBC = 2 }; CALL; } break;                                                    \
    default: { enum { RBC = 1 }; CALL; } break;                                                   \
  }

/* Bytes a cache line holds: the prefetch stride. */
#define LINE 64
/* The next page's bytes, asked for one line per line the blocks load (PD_PREFETCH), in address
   order: `at` the next line to ask for, `end` past the page's used rows (all kv heads). Asked in
   bursts (a kv head's rows at once), the prefetches fill the core's miss buffers and stall it on
   the prefetch instructions themselves (benchmarks/decode_walk_model.c measures the walk).
   Asked in the order the blocks load this page (the same row of the next page), the lines of a
   2 KiB-strided slot column reach DRAM scattered over the page; in address order more bytes
   arrive a second and the hardware prefetcher follows the run. Asked into L2 (prefetcht1,
   PD_PF_LOCALITY), not L1: a line asked into L1 holds one of the core's few L1 miss buffers until
   it arrives, which caps the lines in flight (BENCHMARKS.md "Paged decode" has the measurement);
   the blocks' loads then find the line in L2, a few ns away. */
#define PD_PF_LOCALITY 2
typedef struct {
  const char *at, *end;
} Pf;
/* One line of cursor c (a Pf, not a pointer) where off is a line's start; PD_PREFETCH through a
   Pf pointer (NULL: none). A block that asks for many lines copies the cursor into a local Pf
   first (pf_local) and writes it back after: through the pointer, every line was a store and a
   reload of the cursor. */
#define PD_PREFETCH_AT(c, off)                                                                    \
  do {                                                                                            \
    if ((off) % LINE == 0 && (c).at < (c).end) {                                                  \
      __builtin_prefetch((c).at, 0, PD_PF_LOCALITY);                                              \
      (c).at += LINE;                                                                             \
    }                                                                                             \
  } while (0)
#define PD_PREFETCH(pf, off)                                                                      \
  do {                                                                                            \
    if (pf) PD_PREFETCH_AT(*(pf), off);                                                           \
  } while (0)
static inline Pf pf_local(const Pf *pf) { return pf ? *pf : (Pf){0, 0}; }

/* -- the block kernels, per instruction set: scores of a kv head's rows against a run of page
   slots, and their weighted V sum (the SIMD pass at the end of this file). pf: the byte offset
   of the next page's rows from these (0: none), prefetched as they go. */
typedef void (*scores_fn)(const float *q, int64_t Rh, int64_t Dp, int64_t D, const char *k0,
                          int64_t kstride, int64_t ns, int dt, const float *lut, float *out,
                          int64_t P, Pf *pf);
typedef void (*pv_fn)(float *acc, int64_t as, const float *w, int64_t ws, int RB, int64_t Dv,
                      const char *v0, int64_t vstride, int64_t sa, int64_t sb, int dt,
                      const float *lut);

/* A page's slots the fused step (page_step) takes at once: a row's scores are PD_SLOTS / VW
   vectors; a page with more slots takes it PD_SLOTS at a time, and a page whose slots only some
   rows attend takes the general path. */
#define PD_SLOTS 16
/* How far a score may exceed a row's running max before the fused step moves the max (see
   page_weights): the weights then stay <= e^8 ~ 3e3, far from fp32's range. */
#define PD_MAX_SLACK 8.0f
typedef void (*page_fn)(float *acc, int64_t Dv, float *m, float *l, const float *sc, int64_t P,
                        int RB, int64_t ns, const float *ksc, const float *vsc, const char *v0,
                        int64_t vstride, int dt, const float *lut, float *wbuf, Pf *pf);

/* the generic pass returns vectors wider than a portable target's registers from functions that
   are always inlined: no ABI is crossed */
#pragma GCC diagnostic ignored "-Wpsabi"
#define PD_SIMD_PASS 1
#define PD_X86 0
#define VW 8
#define ISA(name) name##_generic
#include __FILE__
#undef ISA
#undef VW
#undef PD_X86

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
/* The AVX-512 paths' tables, and the constructors that fill them at load time, compiled for
   the baseline target: code inside the AVX-512 region below may be vectorised with its
   instructions, and a constructor there runs on every CPU that loads the library. */
/* The bf16 bits of the fp8 e4m3fn magnitudes 0..127 (exponent 0: m 2^-9; 127: NaN) */
static const uint16_t E4M3_BF16[128] __attribute__((aligned(64))) = {
    0x0000, 0x3B00, 0x3B80, 0x3BC0, 0x3C00, 0x3C20, 0x3C40, 0x3C60,
    0x3C80, 0x3C90, 0x3CA0, 0x3CB0, 0x3CC0, 0x3CD0, 0x3CE0, 0x3CF0,
    0x3D00, 0x3D10, 0x3D20, 0x3D30, 0x3D40, 0x3D50, 0x3D60, 0x3D70,
    0x3D80, 0x3D90, 0x3DA0, 0x3DB0, 0x3DC0, 0x3DD0, 0x3DE0, 0x3DF0,
    0x3E00, 0x3E10, 0x3E20, 0x3E30, 0x3E40, 0x3E50, 0x3E60, 0x3E70,
    0x3E80, 0x3E90, 0x3EA0, 0x3EB0, 0x3EC0, 0x3ED0, 0x3EE0, 0x3EF0,
    0x3F00, 0x3F10, 0x3F20, 0x3F30, 0x3F40, 0x3F50, 0x3F60, 0x3F70,
    0x3F80, 0x3F90, 0x3FA0, 0x3FB0, 0x3FC0, 0x3FD0, 0x3FE0, 0x3FF0,
    0x4000, 0x4010, 0x4020, 0x4030, 0x4040, 0x4050, 0x4060, 0x4070,
    0x4080, 0x4090, 0x40A0, 0x40B0, 0x40C0, 0x40D0, 0x40E0, 0x40F0,
    0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170,
    0x4180, 0x4190, 0x41A0, 0x41B0, 0x41C0, 0x41D0, 0x41E0, 0x41F0,
    0x4200, 0x4210, 0x4220, 0x4230, 0x4240, 0x4250, 0x4260, 0x4270,
    0x4280, 0x4290, 0x42A0, 0x42B0, 0x42C0, 0x42D0, 0x42E0, 0x42F0,
    0x4300, 0x4310, 0x4320, 0x4330, 0x4340, 0x4350, 0x4360, 0x4370,
    0x4380, 0x4390, 0x43A0, 0x43B0, 0x43C0, 0x43D0, 0x43E0, 0x7FC0,
};
/* E4M3_BF16's low and high bytes: the lookup tables of the AVX512_VBMI path (e4m3_lookup) */
static uint8_t E4M3_BF16_BYTES[2][128] __attribute__((aligned(64))); /* [0] low, [1] high */
__attribute__((constructor)) static void fill_e4m3_bf16_bytes(void) {
  for (int i = 0; i < 128; i++) {
    E4M3_BF16_BYTES[0][i] = (uint8_t)(E4M3_BF16[i] & 0xFF);
    E4M3_BF16_BYTES[1][i] = (uint8_t)(E4M3_BF16[i] >> 8);
  }
}
/* vpermt2b indexes of the AVX512_VBMI path (PD_INTERLEAVE_IDX) */
static uint8_t PD_INTERLEAVE[4][64] __attribute__((aligned(64)));
__attribute__((constructor)) static void fill_interleave(void) {
  for (int k = 0; k < 32; k++) {
    PD_INTERLEAVE[0][2 * k] = (uint8_t)k, PD_INTERLEAVE[0][2 * k + 1] = (uint8_t)(64 + k);
    PD_INTERLEAVE[1][2 * k] = (uint8_t)(32 + k), PD_INTERLEAVE[1][2 * k + 1] = (uint8_t)(96 + k);
  }
  for (int k = 0; k < 16; k++)
    for (int half = 0; half < 2; half++) {
      uint8_t *x = PD_INTERLEAVE[2 + half] + 4 * k;
      const int e = 16 * half + k;
      x[0] = (uint8_t)e, x[1] = (uint8_t)(64 + e), x[2] = (uint8_t)(32 + e), x[3] = (uint8_t)(96 + e);
    }
}
#endif

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h>
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#define PD_X86 256
#define VW 8
#define ISA(name) name##_avx2
#include __FILE__
#undef ISA
#undef VW
#undef PD_X86
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl")
#define PD_X86 512
#define VW 16
#define ISA(name) name##_avx512
#include __FILE__
#undef ISA
#undef VW
#undef PD_X86
/* 32 elements of a key (or value) row from d as bf16 pairs; past D: 0 (q is 0 there too, but a
   key's bytes past its row may be NaN). int8 keys are integers of at most 8 bits, exact in bf16:
   widened, converted to fp32 and packed to bf16 (vcvtne2ps2bf16) without rounding. */
__attribute__((target("avx512bf16"), always_inline)) static inline __m512i key_pairs(
    const char *k, int64_t d, int64_t D, int kdt) {
  const __mmask32 m = D - d >= 32 ? ~(__mmask32)0 : (((__mmask32)1 << (D - d)) - 1);
  if (kdt == BF16) return _mm512_maskz_loadu_epi16(m, (const uint16_t *)k + d);
  const __m256i raw = _mm256_maskz_loadu_epi8(m, (const int8_t *)k + d);
  if (kdt == LUT8) {
    /* fp8 e4m3fn (s eeee mmm, bias 7), exact in bf16: the magnitude's bf16 bits from a table of
       128 (two vpermt2w over its halves, picked by bit 6), the sign moved up 8 bits (7
       instructions where moving the fields and patching subnormals and NaN took 11) */
    const __m512i x = _mm512_cvtepu8_epi16(raw);
    const __m512i *t = (const __m512i *)E4M3_BF16;
    const __m512i lo = _mm512_permutex2var_epi16(_mm512_load_si512(t), x, _mm512_load_si512(t + 1));
    const __m512i hi = _mm512_permutex2var_epi16(_mm512_load_si512(t + 2), x, _mm512_load_si512(t + 3));
    const __m512i mag = _mm512_mask_blend_epi16(_mm512_test_epi16_mask(x, _mm512_set1_epi16(0x40)), lo, hi);
    /* mag | (x << 8 & 0x8000) */
    return _mm512_ternarylogic_epi32(mag, _mm512_slli_epi16(x, 8), _mm512_set1_epi16((short)0x8000), 0xF8);
  }
  const __m512 f0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(raw)));
  const __m512 f1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(raw, 1)));
  return (__m512i)_mm512_cvtne2ps_pbh(f1, f0);
}

/* acc += the pairwise products of a and b's int16 lanes, summed in int32 lanes. By inline asm:
   gcc 12 copies the accumulator of _mm512_dpwssd_epi32 into a fresh register each call (and
   spilled one to the stack in the int8 scores), where the instruction updates it in place. */
#define PD_DPWSSD(acc, a, b) __asm__("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b))

/* fp8 e4m3fn to bf16 by byte tables (ISA_AVX512_VBMI): the low and the high bytes of
   E4M3_BF16's 128 entries, each table in two registers that vpermt2b indexes by a byte's low 7
   bits, so that one instruction looks up 64 codes; the sign joins the high byte. 5 instructions
   convert two rows of 32 codes where key_pairs takes 14 (the interleave of the looked-up bytes
   into words is two more vpermt2b). vpermt2b by inline asm: an intrinsic would need the
   avx512vbmi target on every function it is inlined into, and those run on CPUs without it
   too; the dispatch (paged_decode_isa) takes these instructions only where the CPU has them. */
/* out = the bytes of (a:b) (128 bytes) at idx's low 7 bits, byte by byte */
#define PD_PERMT2B(out, a, idx, b)                                                                \
  do {                                                                                            \
    out = (a);                                                                                    \
    __asm__("vpermt2b %2, %1, %0" : "+v"(out) : "v"(idx), "vm"(b));                                \
  } while (0)
typedef struct {
  __m512i lo0, lo1, hi0, hi1; /* the tables' halves */
} E4M3Bytes;
__attribute__((always_inline)) static inline E4M3Bytes e4m3_bytes(void) {
  const __m512i *t = (const __m512i *)E4M3_BF16_BYTES;
  return (E4M3Bytes){_mm512_load_si512(t), _mm512_load_si512(t + 1), _mm512_load_si512(t + 2),
                     _mm512_load_si512(t + 3)};
}
/* Two rows of 32 fp8 codes from a and b (d on; past D, and row b where with_b is 0: code 0,
   whose bf16 is 0) looked up: the
   low bytes of their bf16 into *lo, the high bytes (sign included) into *hi, row a's in bytes
   0-31, row b's in 32-63. */
__attribute__((always_inline)) static inline void e4m3_lookup(const E4M3Bytes *t, const char *a,
                                                              const char *b, int64_t d, int64_t D,
                                                              int with_b, __m512i *lo,
                                                              __m512i *hi) {
  const __mmask32 m = D - d >= 32 ? ~(__mmask32)0 : (((__mmask32)1 << (D - d)) - 1);
  const __m512i raw = _mm512_inserti64x4(
      _mm512_castsi256_si512(_mm256_maskz_loadu_epi8(m, (const uint8_t *)a + d)),
      _mm256_maskz_loadu_epi8(with_b ? m : 0, (const uint8_t *)b + d), 1);
  __m512i h;
  PD_PERMT2B(*lo, t->lo0, raw, t->lo1);
  PD_PERMT2B(h, t->hi0, raw, t->hi1);
  *hi = _mm512_ternarylogic_epi32(h, raw, _mm512_set1_epi8((char)0x80), 0xF8); /* h | raw & 0x80 */
}
/* vpermt2b indexes that interleave looked-up bytes (lo in 0-63, hi in 64-127) into bf16 words:
   row a's 32 words (PD_ROW_A), row b's (PD_ROW_B); or the two rows' words of dims 0-15
   (PD_PAIRS_LO) and 16-31 (PD_PAIRS_HI) as pairs (a, b), vdpbf16ps's operand over two slots. */
enum { PD_ROW_A, PD_ROW_B, PD_PAIRS_LO, PD_PAIRS_HI };
#define PD_INTERLEAVE_IDX(which) _mm512_load_si512((const __m512i *)PD_INTERLEAVE[which])

/* The scores of a kv head's Rh query rows against ns keys, 4 rows x 4 keys a block, the 16 sums
   reduced by the same shuffle tree as the fp32 blocks.
   i16 = 0: bf16 query rows (pairs, zero-padded to Dq, a multiple of 32) against bf16, int8 or
   fp8 keys (key_pairs) by vdpbf16ps, times `scale` (a bf16 query scaled first would round).
   i16 = 1: int8 keys against the query quantised to int16 (quantise_query: each row, times the
   softmax scale, times 2^e and rounded; qf[r] = 2^-e) by vpdpwssd: a key piece is one sign
   extension (vpmovsxbw), where vdpbf16ps needs it widened, converted and packed (five
   instructions); products and int32 sums exact. A query element rounds by at most 2^-16 of its
   row's largest (about 2^-15 for D > 256), far under the keys' own quantisation step (2^-8 of
   their largest). Fewer instructions than the vdpbf16ps scores on int8 keys. The key
   dequantisation scales multiply the scores afterwards, as on the fp32 path.
   vbmi = 1 (fp8 keys): two keys' pieces converted at once by the byte tables (e4m3_lookup). */
__attribute__((target("avx512bf16,avx512vnni"), always_inline)) static inline void scores_dp_dt(
    const uint16_t *q, int64_t Rh, int64_t Dq, int64_t D, const char *k0, int64_t kstride,
    int64_t ns, float *out, int64_t P, float scale, const float *qf, int kdt, int i16, int vbmi,
    Pf *pf) {
  enum { RB = 4, SB = 4 };
  const int64_t kesz = elem_size(kdt);
  const E4M3Bytes tab = vbmi ? e4m3_bytes() : (E4M3Bytes){0};
  const __m512i row_a = vbmi ? PD_INTERLEAVE_IDX(PD_ROW_A) : _mm512_setzero_si512();
  const __m512i row_b = vbmi ? PD_INTERLEAVE_IDX(PD_ROW_B) : _mm512_setzero_si512();
  int64_t r, s, d;
  Pf cur = pf_local(pf);
  for (r = 0; r < Rh; r += RB) {
    const int64_t nr = Rh - r < RB ? Rh - r : RB;
    /* lane i * SB + j of a block's sums: row r + i's factor (its query's 2^-e, or the scale) */
    const __m512 factor =
        i16 ? _mm512_permutexvar_ps(
                  _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0),
                  _mm512_castps128_ps512(_mm_maskz_loadu_ps((__mmask8)((1u << nr) - 1), qf + r)))
            : _mm512_set1_ps(scale);
    for (s = 0; s < ns; s += SB) {
      const int64_t nk = ns - s < SB ? ns - s : SB;
      const char *k[SB];
      const uint16_t *qr[RB];
      __m512 acc[RB * SB]; /* fp32 sums, or int32 ones (i16) in the same bits */
      int i, j;
      for (j = 0; j < SB; j++) k[j] = k0 + (s + (j < nk ? j : nk - 1)) * kstride;
      for (i = 0; i < RB; i++) qr[i] = q + (r + (i < nr ? i : nr - 1)) * Dq;
      for (i = 0; i < RB * SB; i++) acc[i] = _mm512_setzero_ps();
      for (d = 0; d < Dq; d += 32) {
        __m512i kv[SB];
        for (j = 0; vbmi && j < SB; j += 2) {
          __m512i lo, hi;
          e4m3_lookup(&tab, k[j], k[j + 1], d, D, 1, &lo, &hi);
          PD_PERMT2B(kv[j], lo, row_a, hi);
          PD_PERMT2B(kv[j + 1], lo, row_b, hi);
          if (r == 0) {
            PD_PREFETCH_AT(cur, d * kesz);
            PD_PREFETCH_AT(cur, d * kesz);
          }
        }
        for (j = 0; !vbmi && j < SB; j++) {
          if (i16) {
            const __mmask32 m = D - d >= 32 ? ~(__mmask32)0 : (((__mmask32)1 << (D - d)) - 1);
            kv[j] = _mm512_cvtepi8_epi16(_mm256_maskz_loadu_epi8(m, (const int8_t *)k[j] + d));
          } else {
            kv[j] = key_pairs(k[j], d, D, kdt);
          }
          if (r == 0) PD_PREFETCH_AT(cur, d * kesz);
        }
        for (i = 0; i < RB; i++) {
          const __m512i qv = _mm512_loadu_si512(qr[i] + d);
          for (j = 0; j < SB; j++) {
            if (i16) /* the asm takes the vector's bits, whatever its type */
              PD_DPWSSD(acc[i * SB + j], qv, kv[j]);
            else
              acc[i * SB + j] = _mm512_dpbf16_ps(acc[i * SB + j], (__m512bh)qv, (__m512bh)kv[j]);
          }
        }
      }
      {
        vf_avx512 f[RB * SB];
        for (i = 0; i < RB * SB; i++)
          f[i] = (vf_avx512)(i16 ? _mm512_cvtepi32_ps(_mm512_castps_si512(acc[i])) : acc[i]);
        store_rows_avx512((vf_avx512)_mm512_mul_ps((__m512)reduce_avx512(f), factor),
                          out + r * P + s, P, (int)nr, SB, nk);
      }
    }
  }
  if (pf) *pf = cur;
}
/* bf16, int8 or fp8 keys against a bf16 query, or int8 keys against an int16 one (qf non-NULL;
   one instance each: the loads specialise); vbmi: fp8 keys by the byte tables */
__attribute__((target("avx512bf16,avx512vnni"))) static void scores_bf16dp(
    const uint16_t *q, int64_t Rh, int64_t Dq, int64_t D, const char *k0, int64_t kstride,
    int64_t ns, float *out, int64_t P, float scale, const float *qf, int kdt, int vbmi, Pf *pf) {
  if (qf)
    scores_dp_dt(q, Rh, Dq, D, k0, kstride, ns, out, P, scale, qf, I8, 1, 0, pf);
  else if (kdt == BF16)
    scores_dp_dt(q, Rh, Dq, D, k0, kstride, ns, out, P, scale, NULL, BF16, 0, 0, pf);
  else if (kdt == I8)
    scores_dp_dt(q, Rh, Dq, D, k0, kstride, ns, out, P, scale, NULL, I8, 0, 0, pf);
  else if (vbmi)
    scores_dp_dt(q, Rh, Dq, D, k0, kstride, ns, out, P, scale, NULL, LUT8, 0, 1, pf);
  else
    scores_dp_dt(q, Rh, Dq, D, k0, kstride, ns, out, P, scale, NULL, LUT8, 0, 0, pf);
}

/* The fused page step (page_step) for bf16 or fp8 e4m3 V rows and a bf16 query, the weighted V
   sum by vdpbf16ps: each instruction adds two slots' products (rows s and s + 1, their bf16
   elements interleaved by vpunpckl/hwd; fp8 rows converted to bf16 exactly, by key_pairs) for 16
   dims, half the FMAs of the fp32 block. The weights are
   rounded to bf16 for it (as SDPA's bf16 kernels round the probabilities before P @ V; the
   denominator l keeps the fp32 weights), products exact, sums in fp32. The interleave puts dims
   8L + i (i < 4: lo, else hi, per 128-bit lane L) in lane 4L + i of a 32-dim chunk's lo/hi
   accumulators: permuted from and back to the natural order of acc as they are loaded and stored.
   Dims past the last whole chunk of 32 take the fp32 block. */
/* The lo / hi accumulators of a 32-dim chunk back to the natural order of its two 16-dim halves
   (vpermt2d / vpermt2ps lanes; the second half's, PD_PAIRS_BACK + 8): the V steps' shared
   interleave, page_step_dp_rb's and page_step_i8_rb's. */
#define PD_PAIRS_BACK _mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0)
__attribute__((target("avx512bf16"), always_inline)) static inline void page_step_dp_rb(
    float *acc, int64_t Dv, float *m, float *l, const float *sc, int64_t P, int RB, int64_t ns,
    const float *ksc, const float *vsc, const char *v0, int64_t vstride, int vdt, int vbmi,
    const float *lut, float *wbuf, Pf *pf) {
  const int64_t vesz = elem_size(vdt);
  const E4M3Bytes tab = vbmi ? e4m3_bytes() : (E4M3Bytes){0};
  const __m512i pairs_lo = vbmi ? PD_INTERLEAVE_IDX(PD_PAIRS_LO) : _mm512_setzero_si512();
  const __m512i pairs_hi = vbmi ? PD_INTERLEAVE_IDX(PD_PAIRS_HI) : _mm512_setzero_si512();
  enum { NP = PD_SLOTS / 2 }; /* slot pairs */
  float alpha[4];
  uint32_t wp[4][NP]; /* the weights of slots 2p, 2p + 1 as a bf16 pair */
  int r, p;
  int64_t d;
  const __m512i to_lo = _mm512_set_epi32(27, 26, 25, 24, 19, 18, 17, 16, 11, 10, 9, 8, 3, 2, 1, 0);
  const __m512i to_hi = _mm512_add_epi32(to_lo, _mm512_set1_epi32(4));
  const __m512i back0 = PD_PAIRS_BACK, back1 = _mm512_add_epi32(back0, _mm512_set1_epi32(8));
  page_weights_avx512(m, l, sc, P, RB, ns, ksc, vsc, wbuf, alpha);
  for (r = 0; r < RB; r++) {
    const __m256i w = (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(wbuf + r * PD_SLOTS));
    _mm256_storeu_si256((__m256i *)wp[r], w);
  }
  for (d = 0; d + 32 <= Dv; d += 32) {
    __m512 lo[4], hi[4];
    for (r = 0; r < RB; r++) {
      const __m512 n0 = _mm512_loadu_ps(acc + r * Dv + d), n1 = _mm512_loadu_ps(acc + r * Dv + d + 16);
      const __m512 a = _mm512_set1_ps(alpha[r]);
      lo[r] = _mm512_mul_ps(vbmi ? n0 : _mm512_permutex2var_ps(n0, to_lo, n1), a);
      hi[r] = _mm512_mul_ps(vbmi ? n1 : _mm512_permutex2var_ps(n0, to_hi, n1), a);
    }
    for (p = 0; 2 * p < ns; p++) {
      PD_PREFETCH(pf, d * vesz);
      if (2 * p + 1 < ns) PD_PREFETCH(pf, d * vesz);
      __m512bh vl, vh;
      if (vbmi) { /* the pairs in dims' order (no permute of acc) */
        const char *va = v0 + 2 * p * vstride;
        __m512i lo8, hi8, x, y;
        e4m3_lookup(&tab, va, va + vstride, d, Dv, 2 * p + 1 < ns, &lo8, &hi8);
        PD_PERMT2B(x, lo8, pairs_lo, hi8);
        PD_PERMT2B(y, lo8, pairs_hi, hi8);
        vl = (__m512bh)x, vh = (__m512bh)y;
      } else {
        const __m512i x = key_pairs(v0 + 2 * p * vstride, d, Dv, vdt);
        /* an odd ns: slot ns is past the page's used slots (its weight is 0, its bytes may be
           NaN) */
        const __m512i y = 2 * p + 1 < ns ? key_pairs(v0 + (2 * p + 1) * vstride, d, Dv, vdt)
                                         : _mm512_setzero_si512();
        vl = (__m512bh)_mm512_unpacklo_epi16(x, y);
        vh = (__m512bh)_mm512_unpackhi_epi16(x, y);
      }
      for (r = 0; r < RB; r++) {
        const __m512bh w = (__m512bh)_mm512_set1_epi32((int)wp[r][p]);
        lo[r] = _mm512_dpbf16_ps(lo[r], vl, w);
        hi[r] = _mm512_dpbf16_ps(hi[r], vh, w);
      }
    }
    for (r = 0; r < RB; r++) {
      _mm512_storeu_ps(acc + r * Dv + d, vbmi ? lo[r] : _mm512_permutex2var_ps(lo[r], back0, hi[r]));
      _mm512_storeu_ps(acc + r * Dv + d + 16,
                       vbmi ? hi[r] : _mm512_permutex2var_ps(lo[r], back1, hi[r]));
    }
  }
  for (; d < Dv; d += 16)
    pv_cols_avx512(acc, Dv, wbuf, PD_SLOTS, RB, 1, d, Dv - d < 16 ? Dv - d : 16, v0, vstride, 0,
                   ns, vdt, lut, alpha, pf);
}

__attribute__((target("avx512bf16"))) static void page_step_bf16dp(
    float *acc, int64_t Dv, float *m, float *l, const float *sc, int64_t P, int RB, int64_t ns,
    const float *ksc, const float *vsc, const char *v0, int64_t vstride, int dt, const float *lut,
    float *wbuf, Pf *pf) {
  /* BF16 or LUT8 (fp8 e4m3, exact in bf16): the caller picks this step for those V only */
  if (dt == BF16) {
    PD_WITH_RB(RB, page_step_dp_rb(acc, Dv, m, l, sc, P, RBC, ns, ksc, vsc, v0, vstride, BF16, 0,
                                   lut, wbuf, pf))
  } else {
    PD_WITH_RB(RB, page_step_dp_rb(acc, Dv, m, l, sc, P, RBC, ns, ksc, vsc, v0, vstride, LUT8, 0,
                                   lut, wbuf, pf))
  }
}
/* page_step_bf16dp for fp8 V rows on ISA_AVX512_VBMI: converted by the byte tables */
__attribute__((target("avx512bf16"))) static void page_step_fp8vbmi(
    float *acc, int64_t Dv, float *m, float *l, const float *sc, int64_t P, int RB, int64_t ns,
    const float *ksc, const float *vsc, const char *v0, int64_t vstride, int dt, const float *lut,
    float *wbuf, Pf *pf) {
  (void)dt; /* LUT8: the caller picks this step for fp8 V only */
  PD_WITH_RB(RB, page_step_dp_rb(acc, Dv, m, l, sc, P, RBC, ns, ksc, vsc, v0, vstride, LUT8, 1,
                                 lut, wbuf, pf))
}
/* page_scales for a whole page (ns = PD_SLOTS) of int8 scales (bf16, (slot, head) order from x).
   2, 4 or 8 kv heads: the page's scales loaded whole and each head's picked by word permutes
   (cheaper than the gathers). Other head
   counts: head h's 16 slots by one gather of 32-bit words, each holding the wanted bf16 and a
   neighbour (head 0: the word from its element, the bf16 in the low half; others: the word
   ending with it, the high half), so that no byte outside the page's slots is read. */
__attribute__((target("avx512f,avx512bw"))) static void page_scales_bf16(float *out,
                                                                       const uint16_t *x,
                                                                       int64_t Hkv) {
  if (Hkv == 1) { /* contiguous */
    _mm512_storeu_ps(out, _mm512_castsi512_ps(_mm512_slli_epi32(
                              _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)x)), 16)));
    return;
  }
  if (Hkv == 2 || Hkv == 4 || Hkv == 8) {
    /* the page's 16 Hkv words in whole registers (64, 128 or 256 bytes: the page's own), each
       head's 16 by word permutes (vpermt2w reads an index mod 64: slot j's word j Hkv + h picks
       from z0:z1 for slots 0-7 and, for 8 heads, from z2:z3 for slots 8-15): 4 loads and 2
       permutes a head where a gather loads word by word */
    const int64_t nz = Hkv / 2; /* registers of 32 words */
    __m512i z[4];
    for (int64_t i = 0; i < 4; i++)
      z[i] = _mm512_loadu_si512((const uint16_t *)x + 32 * (i < nz ? i : nz - 1));
    const __m512i words = _mm512_mullo_epi16( /* slot j's first word, j < 16 */
        _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 15, 14, 13, 12, 11, 10, 9,
                         8, 7, 6, 5, 4, 3, 2, 1, 0),
        _mm512_set1_epi16((short)Hkv));
    for (int64_t h = 0; h < Hkv; h++) {
      const __m512i idx = _mm512_add_epi16(words, _mm512_set1_epi16((short)h));
      __m512i v = _mm512_permutex2var_epi16(z[0], idx, z[1]);
      if (Hkv == 8) v = _mm512_mask_mov_epi16(v, 0xff00u, _mm512_permutex2var_epi16(z[2], idx, z[3]));
      _mm512_storeu_ps(out + h * PD_SLOTS,
                       _mm512_castsi512_ps(_mm512_slli_epi32(
                           _mm512_cvtepu16_epi32(_mm512_castsi512_si256(v)), 16)));
    }
    return;
  }
  const __m512i slot = _mm512_mullo_epi32(
      _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), _mm512_set1_epi32((int)Hkv));
  _mm512_storeu_ps(out, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_i32gather_epi32(slot, x, 2), 16)));
  for (int64_t h = 1; h < Hkv; h++) {
    const __m512i w = _mm512_i32gather_epi32(_mm512_add_epi32(slot, _mm512_set1_epi32((int)h - 1)), x, 2);
    _mm512_storeu_ps(out + h * PD_SLOTS,
                     _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32((int)0xFFFF0000u))));
  }
}

/* The fused page step (page_step) for int8 V rows, the weighted V sum by vpdpwssd: each row's
   weights (the V scales folded in) quantised to int16 for this page (times 2^e, the largest in
   [2^14, 2^15), e per row and page), each instruction adds two slots' products (rows s and
   s + 1 sign-extended to words and interleaved by vpunpckl/hwd, as page_step_dp_rb interleaves
   bf16 rows) for 16 dims, exact, in int32 accumulators per page (at most 16 slots x 2^15 x 2^7:
   no overflow), scaled by 2^-e into acc's fp32 as it is rescaled. Half the FMAs of the fp32
   block and one sign extension a piece where that needed a widening and a conversion. A weight
   rounds by at most 2^-16 of the page's largest (bf16 weights, page_step_dp_rb's: 2^-9 of their
   own). A row whose weights 2^e cannot bring into range (all under 2^-112: V scales near
   float32's smallest) takes the fp32 block. Dims past the last whole chunk of 32 take it too.
   It reads all PD_SLOTS slots from v0 (a constant trip count: gcc keeps the accumulators in
   registers and unrolls), which the caller guarantees are the page's (Job.page_part). */
__attribute__((target("avx512bf16,avx512vnni"), always_inline)) static inline void page_step_i8_rb(
    float *acc, int64_t Dv, float *m, float *l, const float *sc, int64_t P, int RB, int64_t ns,
    const float *ksc, const float *vsc, const char *v0, int64_t vstride, const float *lut,
    float *wbuf, Pf *pf) {
  enum { NP = PD_SLOTS / 2 }; /* slot pairs */
  float alpha[4], winv[4];
  uint32_t wp[4][NP]; /* the int16 weights of slots 2p, 2p + 1 as a pair */
  int r, p;
  int64_t d;
  const __m512i back0 = PD_PAIRS_BACK, back1 = _mm512_add_epi32(back0, _mm512_set1_epi32(8));
  Pf cur = pf_local(pf);
  page_weights_avx512(m, l, sc, P, RB, ns, ksc, vsc, wbuf, alpha);
  for (r = 0; r < RB; r++) {
    const __m512 w = _mm512_loadu_ps(wbuf + r * PD_SLOTS);
    /* a NaN or Inf weight (a NaN or Inf V scale: the weights carry the scales, the row's sum l
       does not) must reach acc as the fp32 block carries it, not as a saturated integer */
    const int bad = _mm512_cmp_ps_mask(w, _mm512_set1_ps(FLT_MAX), _CMP_NLE_UQ) != 0;
    const float wmax = _mm512_reduce_max_ps(w); /* weights are >= 0 */
    int e = 0;
    if (wmax > 0.0f) e = 14 - exponent_of(wmax);
    if (bad || e > 126) { /* out of int16's reach: the fp32 block */
      pv_dt_avx512(acc, Dv, wbuf, PD_SLOTS, RB, Dv, v0, vstride, 0, ns, I8, lut, alpha, pf);
      return;
    }
    winv[r] = pow2f(-e);
    const __m512i wi = _mm512_cvtps_epi32(_mm512_mul_ps(w, _mm512_set1_ps(pow2f(e))));
    _mm256_storeu_si256((__m256i *)wp[r], _mm512_cvtsepi32_epi16(wi)); /* saturates 2^15 */
  }
  for (d = 0; d + 32 <= Dv; d += 32) {
    /* the accumulators as named variables: gcc keeps an array's elements that inline asm
       updates in memory (a load and a store around each instruction) */
    __m512i lo0, lo1, lo2, lo3, hi0, hi1, hi2, hi3;
    lo0 = lo1 = lo2 = lo3 = hi0 = hi1 = hi2 = hi3 = _mm512_setzero_si512();
    /* every slot pair of the page: an int8 byte is a finite integer, so the slots past ns (weight
       0, stale bytes) add exactly 0, and the trip count is a constant (unrolled, the accumulators
       in registers) */
    for (p = 0; p < NP; p++) {
      const char *va = v0 + 2 * p * vstride + d;
      const __m512i x = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)va));
      const __m512i y = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(va + vstride)));
      if (2 * p < ns) PD_PREFETCH_AT(cur, d);
      if (2 * p + 1 < ns) PD_PREFETCH_AT(cur, d);
      const __m512i vl = _mm512_unpacklo_epi16(x, y), vh = _mm512_unpackhi_epi16(x, y);
#define PD_ROW(R)                                                                                 \
  if (RB > R) {                                                                                   \
    const __m512i w = _mm512_set1_epi32((int)wp[R][p]);                                           \
    PD_DPWSSD(lo##R, vl, w);                                                                      \
    PD_DPWSSD(hi##R, vh, w);                                                                      \
  }
      PD_ROW(0) PD_ROW(1) PD_ROW(2) PD_ROW(3)
#undef PD_ROW
    }
    const __m512i lo[4] = {lo0, lo1, lo2, lo3}, hi[4] = {hi0, hi1, hi2, hi3};
    for (r = 0; r < RB; r++) {
      const __m512 a = _mm512_set1_ps(alpha[r]), s = _mm512_set1_ps(winv[r]);
      float *o = acc + r * Dv + d;
      const __m512 f0 = _mm512_cvtepi32_ps(_mm512_permutex2var_epi32(lo[r], back0, hi[r]));
      const __m512 f1 = _mm512_cvtepi32_ps(_mm512_permutex2var_epi32(lo[r], back1, hi[r]));
      _mm512_storeu_ps(o, _mm512_fmadd_ps(f0, s, _mm512_mul_ps(_mm512_loadu_ps(o), a)));
      _mm512_storeu_ps(o + 16, _mm512_fmadd_ps(f1, s, _mm512_mul_ps(_mm512_loadu_ps(o + 16), a)));
    }
  }
  if (pf) *pf = cur;
  for (; d < Dv; d += 16)
    pv_cols_avx512(acc, Dv, wbuf, PD_SLOTS, RB, 1, d, Dv - d < 16 ? Dv - d : 16, v0, vstride, 0,
                   ns, I8, lut, alpha, pf);
}

__attribute__((target("avx512bf16,avx512vnni"))) static void page_step_i8dp(
    float *acc, int64_t Dv, float *m, float *l, const float *sc, int64_t P, int RB, int64_t ns,
    const float *ksc, const float *vsc, const char *v0, int64_t vstride, int dt, const float *lut,
    float *wbuf, Pf *pf) {
  (void)dt; /* I8: the caller picks this step for int8 V only */
  PD_WITH_RB(RB, page_step_i8_rb(acc, Dv, m, l, sc, P, RBC, ns, ksc, vsc, v0, vstride, lut, wbuf,
                                 pf))
}
#pragma GCC pop_options
#define HAVE_X86_PATHS 1
#endif

/* The instruction set this CPU runs: the best it has, or `want` where that is lower (a test
   forcing the generic path, a benchmark comparing them). want < 0: the best. */
int paged_decode_isa(int want) {
  int best = ISA_GENERIC;
#ifdef HAVE_X86_PATHS
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
      __builtin_cpu_supports("f16c"))
    best = ISA_AVX2;
  if (best == ISA_AVX2 && __builtin_cpu_supports("avx512f") &&
      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("avx512vl"))
    best = ISA_AVX512;
  if (best == ISA_AVX512 && __builtin_cpu_supports("avx512bf16") &&
      __builtin_cpu_supports("avx512vnni"))
    best = ISA_AVX512_BF16;
  if (best == ISA_AVX512_BF16 && __builtin_cpu_supports("avx512vbmi")) best = ISA_AVX512_VBMI;
#endif
  return want >= 0 && want < best ? want : best;
}

typedef struct {
  const int64_t *a;
  void *const *p;
  float scale;                /* softmax scale, applied to q as it is read */
  float *m, *l, *acc;         /* per item (b, split): running max, sum, weighted V sum */
  int64_t n_items;
  int64_t next; /* work counter, atomic */
  int isa;      /* paged_decode_isa() of the call */
  scores_fn scores;
  pv_fn pv;
  page_fn page;
  /* the page step where PD_SLOTS slots from s0 are not all the page's (s0 + PD_SLOTS > P):
     page_step_i8dp reads PD_SLOTS slots whatever ns is; the others read ns */
  page_fn page_part;
} Job;

/* GCC/Clang vector extension: 8 floats, one AVX register on x86-64 with -march=native, lowered
   to whatever the target has elsewhere. Unaligned loads and stores go through memcpy. */
typedef float v8 __attribute__((vector_size(32)));
static inline v8 ld8(const float *x) {
  v8 r;
  memcpy(&r, x, sizeof r);
  return r;
}
static inline void st8(float *x, v8 r) { memcpy(x, &r, sizeof r); }
static inline float hsum8(v8 x) {
  return ((x[0] + x[4]) + (x[1] + x[5])) + ((x[2] + x[6]) + (x[3] + x[7]));
}
typedef int32_t v8i __attribute__((vector_size(32)));
static inline v8 splat8(float x) { return (v8){x, x, x, x, x, x, x, x}; }

/* The weighted V sum of one kv head's G * Sq rows (row g * Sq + i) over the page slots
   [0, nv) whose rows start at v0: query i's allowed slots are the NI disjoint ranges
   [sa[i * NI + k], sb[i * NI + k]), the same for its G rows, which go through the pv block 4 at
   a time. Keys outside a row's ranges are never read, so garbage (NaN) values of a key a row
   does not attend never reach its sum. */
static void weighted_sum(pv_fn pv, float *acc, int64_t G, int64_t Sq, int64_t Dv,
                         const float *w, int64_t P, const char *v0, int64_t vstride, int dt,
                         const float *lut, const int64_t *sa, const int64_t *sb, int64_t NI) {
  for (int64_t i = 0; i < Sq * NI; i++) {
    const float *wi = w + i / NI * P;
    int64_t g = 0;
    if (sb[i] <= sa[i]) continue;
    for (; g < G; g += 4) {
      const int RB = G - g < 4 ? (int)(G - g) : 4;
      pv(acc + (g * Sq + i / NI) * Dv, Sq * Dv, wi + g * Sq * P, Sq * P, RB, Dv, v0,
              vstride, sa[i], sb[i], dt, lut);
    }
  }
}

/* Where the dequantisation scales are read (the only place): the scale of page `page`'s slot
   `slot`, kv head h; per (token, head) in bfloat16 for int8 pages (mode 1: the high half of a
   float32), per head in float32 for fp8 (mode 2). */
static inline float dequant_scale(const void *scales, int64_t mode, int64_t page, int64_t slot,
                                  int64_t P, int64_t Hkv, int64_t h) {
  float scale;
  if (mode == 1) {
    const uint32_t bits = (uint32_t)((const uint16_t *)scales)[(page * P + slot) * Hkv + h] << 16;
    memcpy(&scale, &bits, 4);
  } else
    scale = ((const float *)scales)[h];
  return scale;
}

/* Multiply the row values of a page's slots [s0, s0 + ns) (rows r * P + s, the Rh rows of kv
   head h contiguous) by their dequantisation scales: each head's ns scales gathered first, so
   that the row loops run over contiguous slots (vectorised). keys: the values are scores, and an
   Inf scale makes them NaN (KEY_SCALE). */
static inline __attribute__((always_inline)) void scale_slots(float *sc, const void *scales,
                                                              int64_t mode, int64_t page,
                                                              int64_t s0, int64_t ns, int64_t P,
                                                              int64_t Hkv, int64_t Rh,
                                                              float *tmp, int keys) {
  int64_t h, s, r;
  for (h = 0; h < Hkv; h++) {
    for (s = 0; s < ns; s++) tmp[s] = dequant_scale(scales, mode, page, s0 + s, P, Hkv, h);
    for (r = h * Rh; r < (h + 1) * Rh; r++)
      if (keys)
        for (s = 0; s < ns; s++) sc[r * P + s] = KEY_SCALE(sc[r * P + s], tmp[s]);
      else
        for (s = 0; s < ns; s++) sc[r * P + s] *= tmp[s];
  }
}

/* The dequantisation scales of a page's slots [s0, s0 + ns), every kv head's: out[h * PD_SLOTS
   + s], 1 past ns (one pass a page in the scales' (slot, head) order, not one a head). */
static void page_scales(float *out, const void *scales, int64_t mode, int64_t page, int64_t s0,
                        int64_t ns, int64_t P, int64_t Hkv, int isa) {
  int64_t h, s;
#ifdef HAVE_X86_PATHS
  if (isa >= ISA_AVX512 && mode == 1 && ns == PD_SLOTS) {
    page_scales_bf16(out, (const uint16_t *)scales + (page * P + s0) * Hkv, Hkv);
    return;
  }
#else
  (void)isa;
#endif
  for (s = 0; s < PD_SLOTS; s++)
    for (h = 0; h < Hkv; h++)
      out[h * PD_SLOTS + s] = s < ns ? dequant_scale(scales, mode, page, s0 + s, P, Hkv, h) : 1.0f;
}

/* How many pages ahead the prefetch asks: 2 or 3 measured the same as 1 or slower (one
   thread, B=32 and B=8 x 4,096 tokens, into L1 and into L2 alike); asking non-temporally, or a
   dense page in address order rather than head by head, measured the same or slower (address
   order: 1.8x bf16). */
#define AHEAD 1

/* Ask for the rows of slots [0, ns) of kv head h of a page (`bytes` each, slot stride st[1])
   ahead of their use: pages lie anywhere in the pool, so the hardware prefetcher cannot know the
   next one. The general path's V rows only, one kv head at a time between the heads' work (a
   whole page asked at once fills the core's miss buffers); the blocks ask for K rows, and the
   fused step for V rows, line by line as they go (PD_PREFETCH). */
static void prefetch_head(const char *base, const int64_t *st, int64_t esz, int64_t page,
                          int64_t ns, int64_t h, int64_t bytes) {
  const char *row = base + (page * st[0] + h * st[2]) * esz;
  for (int64_t s = 0; s < ns; s++, row += st[1] * esz) {
#pragma GCC unroll 4
    for (int64_t o = 0; o < bytes; o += LINE) __builtin_prefetch(row + o, 0, PD_PF_LOCALITY);
  }
}

/* Ask for the per-(token, head) scales of slots [0, n1) of page `page` (bfloat16, mode 1). */
static void prefetch_scales(const void *scales, int64_t page, int64_t n1, int64_t P, int64_t Hkv) {
  const char *x = (const char *)((const uint16_t *)scales + page * P * Hkv);
  for (int64_t o = 0; o < n1 * Hkv * 2; o += LINE) __builtin_prefetch(x + o, 0, 3);
}

/* The prefetch cursor over page jn's used rows [0, n1) (strides st: page, slot, head; rows of
   `row` elements of esz bytes), or NULL where there is none (n1 0) or its rows are not one run
   (their span over 1.5x their bytes: a view with gaps, whose gaps would be fetched for nothing). */
static Pf *next_page(Pf *pf, const char *base, const int64_t *st, int64_t esz,
                     const int32_t *table, int64_t jn, int64_t n1, int64_t H, int64_t row) {
  if (n1 <= 0) return NULL;
  const int64_t span = ((n1 - 1) * st[1] + (H - 1) * st[2] + row) * esz;
  if (st[1] < 0 || st[2] < 0 || 2 * span > 3 * n1 * H * row * esz) return NULL;
  pf->at = base + table[jn] * st[0] * esz;
  pf->end = pf->at + span;
  return pf;
}

/* The R rows' softmax denominators from the fused step's partial sums lv (PD_SLOTS a row) to
   the general path's l (to_l), or back (the whole of l[r] into lv's first lane); the source is
   zeroed. */
static void move_sums(float *l, float *lv, int64_t R, int to_l) {
  for (int64_t r = 0; r < R; r++) {
    float *v = lv + r * PD_SLOTS;
    if (to_l) {
      float sum = 0.0f;
      for (int s = 0; s < PD_SLOTS; s++) sum += v[s];
      l[r] = sum;
      memset(v, 0, sizeof(float) * PD_SLOTS);
    } else {
      v[0] = l[r];
      l[r] = 0.0f;
    }
  }
}

#ifdef HAVE_X86_PATHS
/* The query rows for scores_dp_dt's int16 mode: each of the R rows of q32 (float32, times the
   softmax scale, stride Dp, zero-padded; Dp a multiple of 32) times 2^e, rounded to int16 into qi, e per row such
   that the row's largest |element| lands in [lim / 2, lim], lim = min(2^15 - 1, (2^31 - 1) /
   (2^7 Dp)): a row's sum of Dp products with int8 keys then stays inside int32. qf[r] = 2^-e.
   Returns 0 where a row holds NaN or Inf (scores_bf16dp then carries them into the scores) or Dp
   is too long for a useful lim. */
__attribute__((target("avx512f,avx512bw,avx512dq"))) static int quantise_query(
    int16_t *qi, float *qf, const float *q32, int64_t R, int64_t Dp) {
  enum { MIN_LIM = 1 << 12 };
  const int64_t lim = (INT32_MAX / 128) / Dp < INT16_MAX ? (INT32_MAX / 128) / Dp : INT16_MAX;
  const __m512 sign = _mm512_set1_ps(-0.0f);
  int64_t r, d;
  if (lim < MIN_LIM) return 0;
  for (r = 0; r < R; r++) { /* every row's largest |element| first: nothing written if one fails */
    __m512 mv = _mm512_setzero_ps();
    __mmask16 bad = 0;
    for (d = 0; d < Dp; d += 16) {
      const __m512 x = _mm512_andnot_ps(sign, _mm512_loadu_ps(q32 + r * Dp + d));
      bad |= _mm512_cmp_ps_mask(x, _mm512_set1_ps(FLT_MAX), _CMP_NLE_UQ); /* NaN, Inf */
      mv = _mm512_max_ps(mv, x);
    }
    if (bad) return 0;
    const float mx = _mm512_reduce_max_ps(mv);
    int e = mx > 0.0f ? exponent_of((float)(lim + 1)) - 1 - exponent_of(mx) : 0;
    qf[r] = (float)(e > 126 ? 126 : e); /* |q| under 2^-112: scores ~0 at float32's scale anyway */
  }
  for (r = 0; r < R; r++) {
    const int e = (int)qf[r];
    const __m512 up = _mm512_set1_ps(pow2f(e));
    const __m512i hi = _mm512_set1_epi32((int)lim), lo = _mm512_set1_epi32((int)-lim);
    for (d = 0; d < Dp; d += 16) {
      const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(q32 + r * Dp + d), up);
      const __m512i v = _mm512_min_epi32(_mm512_max_epi32(_mm512_cvtps_epi32(x), lo), hi);
      _mm256_storeu_si256((__m256i *)(qi + r * Dp + d), _mm512_cvtepi32_epi16(v));
    }
    qf[r] = pow2f(-e);
  }
  return 1;
}
#endif

/* Slots [a, b) of one row's scores x into o (times their key scales where ksc is set). */
static inline void record_run(float *o, const float *x, int64_t a, int64_t b, const void *ksc,
                              int64_t mode, int64_t page, int64_t s0, int64_t P, int64_t Hkv,
                              int64_t h) {
  if (b <= a) return;
  if (!ksc) {
    memcpy(o + a, x + a, sizeof(float) * (b - a));
    return;
  }
  for (int64_t s = a; s < b; s++)
    o[s] = KEY_SCALE(x[s], dequant_scale(ksc, mode, page, s0 + s, P, Hkv, h));
}

/* Each attended key's score, as the softmax of this call reads it (the scaled q . k, times the
   key's dequantisation scale), at the key's slot of its row: out[r * L + t0 + s] for the R rows
   of one sequence (row order as run_item's), L = MAXP * P keys a row. Slots a row does not attend
   (outside its intervals, inside its kv head's hole) are left as the caller filled them. Runs
   once a page, on the raw scores, only when the caller passed a score buffer (P_SCORES): H2O and
   TOVA read each step's attention weights as exp(score - lse) from it. */
static void record_scores(float *out, const float *sc, int64_t R, int64_t Sq, int64_t Rh,
                          int64_t P, int64_t L, int64_t t0, int64_t ns, const int64_t *sa,
                          const int64_t *sb, int64_t NI, const int64_t *holes, const void *ksc,
                          int64_t mode, int64_t page, int64_t s0, int64_t Hkv) {
  for (int64_t r = 0; r < R; r++) {
    const int64_t h = r / Rh, i = r % Sq;
    /* the row's allowed runs less its kv head's hole [ha, hb): [a, min(b, ha)) and
       [max(a, hb), b) (an empty hole writes a run twice, the same values) */
    const int64_t ha = holes ? holes[2 * h] - t0 : ns, hb = holes ? holes[2 * h + 1] - t0 : ns;
    float *o = out + r * L + t0;
    for (int64_t k = 0; k < NI; k++) {
      const int64_t a = sa[i * NI + k], b = sb[i * NI + k] < ns ? sb[i * NI + k] : ns;
      record_run(o, sc + r * P, a, b < ha ? b : ha, ksc, mode, page, s0, P, Hkv, h);
      record_run(o, sc + r * P, a > hb ? a : hb, b, ksc, mode, page, s0, P, Hkv, h);
    }
  }
}

/* Work item (b, split): the rows of sequence b (all Hq heads, all Sq queries) against the keys of
   one split of its pages; writes the partial max m, sum l and weighted V sum acc. Rows are
   (Hq, Sq)-ordered: row (h * G + g) * Sq + i, so the G * Sq rows of kv head h are contiguous.
   Per page: the next page is prefetched, then the scores of every row (kv head by kv head, so
   each key row serves its G * Sq query rows), the online softmax update, the weighted V rows. */
static void run_item(const Job *job, int64_t item, float *qbuf, uint16_t *qbh, float *qf, float *sc,
                     float *stmp, int64_t *sa, int64_t *sb) {
  const int64_t *a = job->a;
  void *const *p = job->p;
  const int64_t Hq = a[A_HQ], Hkv = a[A_HKV], Sq = a[A_SQ], D = a[A_D], Dv = a[A_DV];
  const int64_t P = a[A_P], G = Hq / Hkv, R = Hq * Sq, Rh = G * Sq, nsplit = a[A_NSPLIT];
  const int64_t NI = a[A_NI]; /* key intervals per query row */
  const int64_t Dp = (D + QPAD - 1) / QPAD * QPAD, b = item / nsplit, split = item % nsplit;
  const int kdt = (int)a[A_KDT], vdt = (int)a[A_VDT], qdt = (int)a[A_QDT];
  const int64_t kesz = elem_size(kdt), vesz = elem_size(vdt);
  /* bf16 query rows against bf16, int8 or fp8 keys: vdpbf16ps on the raw query (exact products) */
  const int dp =
      job->isa >= ISA_AVX512_BF16 && (kdt == BF16 || kdt == I8 || kdt == LUT8) && qdt == BF16;
  /* The general path's weighted V sum stays in fp32 FMAs for bf16 pages: vdpbf16ps there
     (accumulators kept in the pair layout in memory) is slower. The fused step's
     (page_step_bf16dp: the pair layout in registers only) is faster. */
  const pv_fn pv = job->pv;
  int64_t kmin = INT64_MAX, kmax = 0, r, i, g, h, s, e, j, d, k;
  const int64_t *lo = (const int64_t *)p[P_LO] + b * Sq * NI;
  const int64_t *hi = (const int64_t *)p[P_HI] + b * Sq * NI;
  /* per kv head h, the slots [holes[2h], holes[2h + 1]) that its rows skip (a compacted
     sequence's ragged kept counts), or NULL: none */
  const int64_t *holes = p[P_HOLES] ? (const int64_t *)p[P_HOLES] + b * Hkv * 2 : NULL;
  const int32_t *table = (const int32_t *)p[P_TABLE] + b * a[A_MAXP];
  const void *ksc = p[P_KSCALE], *vsc = p[P_VSCALE];
  const float *lut = (const float *)p[P_LUT];
  const char *kbase = (const char *)p[P_K], *vbase = (const char *)p[P_V];
  float *m = job->m + item * R, *l = job->l + item * R, *acc = job->acc + item * R * Dv;

  /* this sequence's query rows in float32 times the softmax scale (as the PyTorch path), each
     zero-padded to Dp; for vdpbf16ps the raw bf16 rows, unscaled */
  const char *qsrc = (const char *)p[P_Q] + b * R * D * elem_size(qdt);
  for (r = 0; r < R; r++)
    for (d = 0; d < Dp; d++) {
      qbuf[r * Dp + d] = d < D ? to_f32(qsrc, r * D + d, qdt, NULL) * job->scale : 0.0f;
      if (dp) qbh[r * Dp + d] = d < D ? ((const uint16_t *)qsrc)[r * D + d] : 0;
    }
#ifdef HAVE_X86_PATHS
  /* int8 keys: vpdpwssd against the query rows quantised to int16 (scores_dp_dt's int16 mode),
     unless a row holds NaN/Inf (the bf16 rows then, which carry them into the scores) */
  const int i8k = dp && kdt == I8 && quantise_query((int16_t *)qbh, qf, qbuf, R, Dp);
#else
  const int i8k = 0;
#endif
  for (r = 0; r < R; r++) m[r] = -INFINITY, l[r] = 0.0f;
  memset(acc, 0, sizeof(float) * R * Dv);
  /* The denominators as the fused step keeps them (lv: PD_SLOTS partial sums a row, see
     page_weights) or as the general path does (l): one of the two holds them at a time. */
  float *lv = stmp + P + (2 * Hkv + 4) * PD_SLOTS;
  int in_lv = 1;
  memset(lv, 0, sizeof(float) * R * PD_SLOTS);
  for (i = 0; i < Sq * NI; i++)
    if (hi[i] > lo[i]) {
      if (lo[i] < kmin) kmin = lo[i];
      if (hi[i] > kmax) kmax = hi[i];
    }
  if (kmax <= kmin) return;
  const int64_t first = kmin / P, last = (kmax + P - 1) / P, per = a[A_SPLIT_PAGES];
  const int64_t j0 = first + split * per, j1 = j0 + per < last ? j0 + per : last;

  for (j = j0; j < j1; j++) {
    /* this page's slots that some row may attend: [s0, s1), token positions t0 + [0, ns) */
    const int64_t s0 = kmin > j * P ? kmin - j * P : 0;
    const int64_t s1 = kmax < (j + 1) * P ? kmax - j * P : P, ns = s1 - s0, t0 = j * P + s0;
    int used = 0;
    /* each query's allowed slots of this page: [sa, sb) per interval; a page no row attends
       (between a streaming cache's sinks and its window) is skipped unread */
    for (i = 0; i < Sq * NI; i++) {
      sa[i] = lo[i] > t0 ? (lo[i] - t0 < ns ? lo[i] - t0 : ns) : 0;
      sb[i] = hi[i] < t0 + ns ? (hi[i] > t0 ? hi[i] - t0 : 0) : ns;
      used |= sb[i] > sa[i];
    }
    if (!used) continue;
    /* holed: some kv head's hole meets this page's slots (the page leaves the fused step); a
       page inside every head's hole is skipped unread */
    int holed = 0, inside = holes != NULL;
    for (h = 0; holes && h < Hkv; h++) {
      const int64_t ha = holes[2 * h], hb = holes[2 * h + 1];
      holed |= hb > ha && ha < t0 + ns && hb > t0;
      inside &= ha <= t0 && hb >= t0 + ns;
    }
    if (inside) continue;
    const int64_t page = table[j];
    /* the used slots [0, n1) of the page AHEAD pages on (0: none in this item) */
    const int64_t jn = j + AHEAD;
    const int64_t n1 = jn < j1 ? (kmax < (jn + 1) * P ? kmax - jn * P : P) : 0;
    /* the next page's K and V rows, which the blocks prefetch as they go (NULL: no next page) */
    Pf kpf, vpf;
    Pf *pfk = next_page(&kpf, kbase, a + A_KSN, kesz, table, jn, n1, Hkv, D);
    Pf *pfv = next_page(&vpf, vbase, a + A_VSN, vesz, table, jn, n1, Hkv, Dv);
    /* and its int8 scales (a few lines each, asked at once: page_scales gathers them first
       thing, and unasked they were ~9 % of an int8 decode's time, stalled on DRAM) */
    if (n1 && a[A_KSC] == 1) prefetch_scales(ksc, table[jn], n1, P, Hkv);
    if (n1 && a[A_VSC] == 1) prefetch_scales(vsc, table[jn], n1, P, Hkv);
    /* -- scores sc[r * P + s], kv head by kv head */
    for (h = 0; h < Hkv; h++) {
      const char *k0 = kbase + (page * a[A_KSN] + s0 * a[A_KSP] + h * a[A_KSH]) * kesz;
#ifdef HAVE_X86_PATHS
      if (dp) { /* i8k: the rows of qbh are int16, their factors qf */
        scores_bf16dp(qbh + h * Rh * Dp, Rh, Dp, D, k0, a[A_KSP] * kesz, ns, sc + h * Rh * P, P,
                      job->scale, i8k ? qf + h * Rh : NULL, kdt, job->isa >= ISA_AVX512_VBMI,
                      pfk);
        continue;
      }
#endif
      job->scores(qbuf + h * Rh * Dp, Rh, Dp, D, k0, a[A_KSP] * kesz, ns, kdt, lut,
                  sc + h * Rh * P, P, pfk);
    }
    if (p[P_SCORES])
      record_scores((float *)p[P_SCORES] + b * R * a[A_MAXP] * P, sc, R, Sq, Rh, P,
                    a[A_MAXP] * P, t0, ns, sa, sb, NI, holes, ksc, a[A_KSC], page, s0, Hkv);
    /* -- a page every row attends whole (in decode, every page: the first and last ones'
       used slots are [s0, s1)): the softmax and the V sum fused, kv head by kv head, PD_SLOTS
       slots at a time (a page of 32 slots in two steps, not the general path) */
    int whole_all = !holed;
    for (i = 0; i < Sq; i++) {
      int whole = 0;
      for (k = 0; k < NI; k++) whole |= sa[i * NI + k] == 0 && sb[i * NI + k] == ns;
      whole_all &= whole;
    }
    if (whole_all) {
      if (!in_lv) move_sums(l, lv, R, 0), in_lv = 1;
      /* the piece's dequantisation scales, every kv head's (PD_SLOTS a head, 1 past nc) */
      float *kst = a[A_KSC] ? stmp + P : NULL, *vst = a[A_VSC] ? stmp + P + Hkv * PD_SLOTS : NULL;
      float *wbuf = stmp + P + 2 * Hkv * PD_SLOTS;
      for (int64_t c0 = 0; c0 < ns; c0 += PD_SLOTS) {
        const int64_t nc = ns - c0 < PD_SLOTS ? ns - c0 : PD_SLOTS, sc0 = s0 + c0;
        const page_fn step = sc0 + PD_SLOTS <= P ? job->page : job->page_part;
        if (kst) page_scales(kst, ksc, a[A_KSC], page, sc0, nc, P, Hkv, job->isa);
        if (vst) page_scales(vst, vsc, a[A_VSC], page, sc0, nc, P, Hkv, job->isa);
        for (h = 0; h < Hkv; h++) {
          const char *v0 = vbase + (page * a[A_VSN] + sc0 * a[A_VSP] + h * a[A_VSH]) * vesz;
          const float *ksh = kst ? kst + h * PD_SLOTS : NULL;
          const float *vsh = vst ? vst + h * PD_SLOTS : NULL;
          for (r = h * Rh; r < (h + 1) * Rh; r += 4)
            step(acc + r * Dv, Dv, m + r, lv + r * PD_SLOTS, sc + r * P + c0, P,
                 (h + 1) * Rh - r < 4 ? (int)((h + 1) * Rh - r) : 4, nc, ksh, vsh, v0,
                 a[A_VSP] * vesz, vdt, lut, wbuf, r == h * Rh ? pfv : NULL);
        }
      }
      continue;
    }
    if (in_lv) move_sums(l, lv, R, 1), in_lv = 0;
    if (a[A_KSC]) /* dequantise the scores */
      scale_slots(sc, ksc, a[A_KSC], page, s0, ns, P, Hkv, Rh, stmp, 1);
    /* -inf scores outside each query's allowed slots */
    for (i = 0; i < Sq; i++) {
      const int64_t *qa = sa + i * NI, *qb = sb + i * NI;
      int whole = 0;
      for (k = 0; k < NI; k++) whole |= qa[k] == 0 && qb[k] == ns;
      if (whole) continue;
      for (s = 0; s < ns; s++) {
        int in = 0;
        for (k = 0; k < NI; k++) in |= s >= qa[k] && s < qb[k];
        if (!in)
          for (g = 0; g < Hq; g++) sc[(g * Sq + i) * P + s] = -INFINITY; /* all Hq heads */
      }
    }
    /* -inf scores in each kv head's hole, for its G * Sq rows (its keys there are not its own) */
    for (h = 0; holed && h < Hkv; h++) {
      const int64_t ha = holes[2 * h] - t0, hb = holes[2 * h + 1] - t0;
      const int64_t a0 = ha > 0 ? ha : 0, a1 = hb < ns ? hb : ns;
      for (r = h * Rh; a1 > a0 && r < (h + 1) * Rh; r++)
        for (s = a0; s < a1; s++) sc[r * P + s] = -INFINITY;
    }
    /* -- online softmax: rescale each row's running sums to its new max; scores -> weights */
    for (r = 0; r < R; r++) {
      float *row = sc + r * P, mx = -INFINITY, sum = 0.0f;
      if (ns >= 8) { /* 8 lanes at a time; a NaN score never becomes the max, as below */
        v8 mv = splat8(-INFINITY);
        for (s = 0; s + 8 <= ns; s += 8) {
          const v8 x = ld8(row + s);
          const v8i gt = x > mv;
          mv = (v8)(((v8i)x & gt) | ((v8i)mv & ~gt));
        }
        for (e = 0; e < 8; e++) mx = mv[e] > mx ? mv[e] : mx;
      }
      for (s = ns / 8 * 8; s < ns; s++) mx = row[s] > mx ? row[s] : mx;
      if (mx == -INFINITY) { /* no finite allowed score on this page: it adds nothing... */
        for (s = 0; s < ns; s++) /* ...unless one is NaN: then the row's sum is (see merge) */
          if (row[s] != row[s]) l[r] = NAN;
        /* a row whose slots here are all in its hole: zero weights for the V sum, which reads
           its allowed range (compact zeroes the hole's V rows: 0 · 0 adds nothing) */
        if (holed) memset(row, 0, sizeof(float) * ns);
        continue;
      }
      if (mx > m[r]) {
        const float alpha = expf(m[r] - mx); /* 0 while m is -inf: acc and l are 0 then */
        l[r] *= alpha;
        for (e = 0; e < Dv; e++) acc[r * Dv + e] *= alpha;
        m[r] = mx;
      }
      for (s = 0; s + 8 <= ns; s += 8) {
        const v8 w = expv_generic(ld8(row + s) - splat8(m[r]));
        st8(row + s, w);
        sum += hsum8(w);
      }
      for (; s < ns; s++) {
        row[s] = expf(row[s] - m[r]);
        sum += row[s];
      }
      l[r] += sum;
    }
    if (a[A_VSC]) /* dequantisation scales of V folded into the weights */
      scale_slots(sc, vsc, a[A_VSC], page, s0, ns, P, Hkv, Rh, stmp, 0);
    /* -- weighted V rows, kv head by kv head */
    for (h = 0; h < Hkv; h++) {
      if (n1) prefetch_head(vbase, a + A_VSN, vesz, table[jn], n1, h, Dv * vesz);
      const char *v0 = vbase + (page * a[A_VSN] + s0 * a[A_VSP] + h * a[A_VSH]) * vesz;
      weighted_sum(pv, acc + h * Rh * Dv, G, Sq, Dv, sc + h * Rh * P, P, v0, a[A_VSP] * vesz,
                   vdt, lut, sa, sb, NI);
    }
  }
  if (in_lv) move_sums(l, lv, R, 1);
}

/* A participant's scratch (pool_run hands it zeroed, in one piece): the key ranges, the q rows,
   scores, then scratch: P slot scales (general path), or the fused step's page of K and V scales
   (2 Hkv rows of PD_SLOTS) and its weights (4 rows), and its denominators (R rows of PD_SLOTS);
   then the q rows as bf16 or int16, and their int16 factors (R floats). Each part starts on a
   cache line. */
#define PD_ALIGN(x) (((x) + 63) / 64 * 64)
static size_t worker_scratch(const int64_t *a, size_t parts[4]) {
  const int64_t R = a[A_HQ] * a[A_SQ], P = a[A_P], Dp = (a[A_D] + QPAD - 1) / QPAD * QPAD;
  const int64_t fused = (2 * a[A_HKV] + 4) * PD_SLOTS + R * PD_SLOTS;
  parts[0] = PD_ALIGN(sizeof(int64_t) * 2 * a[A_SQ] * a[A_NI]);
  parts[1] = parts[0] + PD_ALIGN(sizeof(float) * (R * Dp + R * P + P + fused));
  parts[2] = parts[1] + PD_ALIGN(sizeof(uint16_t) * R * Dp);
  parts[3] = parts[2] + PD_ALIGN(sizeof(float) * R);
  return parts[3];
}

static int worker(void *arg, void *scratch) {
  Job *job = (Job *)arg;
  const int64_t *a = job->a;
  const int64_t R = a[A_HQ] * a[A_SQ], P = a[A_P], Dp = (a[A_D] + QPAD - 1) / QPAD * QPAD;
  size_t parts[4];
  worker_scratch(a, parts);
  int64_t *ranges = (int64_t *)scratch;
  float *qbuf = (float *)((char *)scratch + parts[0]);
  uint16_t *qbh = (uint16_t *)((char *)scratch + parts[1]);
  float *qf = (float *)((char *)scratch + parts[2]);
  for (;;) {
    const int64_t item = __atomic_fetch_add(&job->next, 1, __ATOMIC_RELAXED);
    if (item >= job->n_items) break;
    run_item(job, item, qbuf, qbh, qf, qbuf + R * Dp, qbuf + R * Dp + R * P, ranges,
             ranges + a[A_SQ] * a[A_NI]);
  }
  return 0;
}

/* -- merge the key splits of each row: rescale each to the common max, then out = acc / l and
   lse = max + log l; a row with no allowed key gets out = 0, lse = -inf. Learned attention sinks
   (float32 (Hq,), or NULL) join here, once per row: the running max and sum start from the
   row's sink, a key with no value (a row with no key then gets out = 0, lse = sink). out is
   written in A_ODT's dtype (q's: float32, bfloat16 or float16), rounded to nearest even as
   PyTorch's conversions round: a conversion by PyTorch after the call would be a parallel op
   of its own, whose OpenMP worker then spins on a core the next call's threads need. */
static inline void store_row(void *out, int64_t at, const float *o, int64_t n, int dt) {
  int64_t d;
  if (dt == BF16) {
    uint16_t *x = (uint16_t *)out + at;
    for (d = 0; d < n; d++) {
      uint32_t bits;
      memcpy(&bits, &o[d], 4);
      x[d] = o[d] != o[d] ? 0x7FC0 : (uint16_t)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
    }
#ifdef __FLT16_MAX__
  } else if (dt == F16) {
    for (d = 0; d < n; d++) ((_Float16 *)out + at)[d] = (_Float16)o[d];
#endif
  } else if ((float *)out + at != o) {
    memcpy((float *)out + at, o, sizeof(float) * n);
  }
}

static int merge(const Job *job) {
  const int64_t *a = job->a;
  const int64_t R = a[A_HQ] * a[A_SQ], Dv = a[A_DV], ns = a[A_NSPLIT], Sq = a[A_SQ];
  const int odt = (int)a[A_ODT];
  void *out = job->p[P_OUT];
  float *lse = (float *)job->p[P_LSE];
  const float *sinks = (const float *)job->p[P_SINKS];
  /* a row's sum in float32: in out itself, or for a narrower out in a buffer stored from */
  float *row = odt == F32 ? NULL : malloc(sizeof(float) * (Dv > 0 ? Dv : 1));
  if (odt != F32 && row == NULL) return 1;
  for (int64_t b = 0; b < a[A_B]; b++)
    for (int64_t r = 0; r < R; r++) {
      const float sink = sinks ? sinks[r / Sq] : -INFINITY; /* row r = head * Sq + query */
      float mx = sink, sum = 0.0f, *o = row ? row : (float *)out + (b * R + r) * Dv;
      int64_t k, d;
      int nan = 0; /* a NaN score of an attended key (its split's sum is NaN): out, lse NaN */
      for (k = 0; k < ns; k++) {
        mx = fmaxf(mx, job->m[(b * ns + k) * R + r]);
        nan |= job->l[(b * ns + k) * R + r] != job->l[(b * ns + k) * R + r];
      }
      if (nan) {
        for (d = 0; d < Dv; d++) o[d] = NAN;
        lse[b * R + r] = NAN;
        store_row(out, (b * R + r) * Dv, o, Dv, odt);
        continue;
      }
      if (sink > -INFINITY) sum = expf(sink - mx);
      memset(o, 0, sizeof(float) * Dv);
      for (k = 0; k < ns && mx > -INFINITY; k++) {
        const int64_t it = b * ns + k;
        const float w = expf(job->m[it * R + r] - mx); /* 0 for a split with no key */
        sum += w * job->l[it * R + r];
        for (d = 0; d < Dv; d++) o[d] += w * job->acc[(it * R + r) * Dv + d];
      }
      if (sum > 0.0f) {
        for (d = 0; d < Dv; d++) o[d] /= sum;
        lse[b * R + r] = mx + logf(sum);
      } else {
        memset(o, 0, sizeof(float) * Dv);
        lse[b * R + r] = -INFINITY;
      }
      store_row(out, (b * R + r) * Dv, o, Dv, odt);
    }
  free(row);
  return 0;
}

/* out (B, Hq, Sq, Dv) in A_ODT's dtype and lse (B, Hq, Sq) float32. Returns 0 on success, 1 when
   scratch memory could not be allocated. */
int paged_decode(const int64_t *iargs, void *const *ptrs, int n_threads, float scale) {
  const int64_t n_items = iargs[A_B] * iargs[A_NSPLIT], R = iargs[A_HQ] * iargs[A_SQ];
  float *part = malloc(sizeof(float) * n_items * R * (iargs[A_DV] + 2));
  Job job = {iargs, ptrs, scale, part, part + n_items * R, part + 2 * n_items * R, n_items, 0,
             paged_decode_isa((int)iargs[A_ISA]), scores_generic, pv_generic, page_step_generic};
  int n = n_threads < 1 ? 1 : n_threads, bad;
  size_t parts[4];
  if (part == NULL) return 1;
#ifdef HAVE_X86_PATHS
  if (job.isa == ISA_AVX2) job.scores = scores_avx2, job.pv = pv_avx2, job.page = page_step_avx2;
  if (job.isa >= ISA_AVX512)
    job.scores = scores_avx512, job.pv = pv_avx512, job.page = page_step_avx512;
  if (job.isa >= ISA_AVX512_BF16 && (iargs[A_VDT] == BF16 || iargs[A_VDT] == LUT8) &&
      iargs[A_QDT] == BF16)
    job.page = page_step_bf16dp;
  if (job.isa >= ISA_AVX512_VBMI && iargs[A_VDT] == LUT8 && iargs[A_QDT] == BF16)
    job.page = page_step_fp8vbmi;
  if (job.isa >= ISA_AVX512_BF16 && iargs[A_VDT] == I8 && iargs[A_QDT] == BF16)
    job.page = page_step_i8dp;
#endif
  job.page_part = job.page;
#ifdef HAVE_X86_PATHS
  if (job.page == page_step_i8dp) job.page_part = page_step_avx512;
#endif
  if (n > n_items) n = n_items > 0 ? (int)n_items : 1;
  bad = pool_run(worker, &job, n, worker_scratch(iargs, parts));
  if (!bad) bad = merge(&job);
  free(part);
  return bad;
}

#else /* PD_SIMD_PASS: the block kernels over VW-float vectors, named ISA(name) */

typedef float ISA(vf) __attribute__((vector_size(VW * 4)));
typedef int32_t ISA(vi) __attribute__((vector_size(VW * 4)));
typedef uint32_t ISA(vu) __attribute__((vector_size(VW * 4)));
#define VF ISA(vf)
#define VI ISA(vi)
#define AI static inline __attribute__((always_inline))

AI VF ISA(splat)(float x) {
#if VW == 16
  return (VF){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x};
#else
  return (VF){x, x, x, x, x, x, x, x};
#endif
}

/* Widening loads: n narrow elements into 32-bit lanes. gcc 12 turns __builtin_convertvector
   from 8- or 16-bit vectors into scalar code (movsbl + vcvtsi2ss per element: int8 pages ran
   slower than bf16 ones until this), so the x86 passes use the instructions by name. */
#if PD_X86 == 512
#define PD_U16(p) ((VI)_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p))))
#define PD_I8(p) ((VI)_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p))))
#define PD_U8(p) ((VI)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p))))
#define PD_F16(p) ((VF)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p))))
#elif PD_X86 == 256
#define PD_U16(p) ((VI)_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))))
#define PD_I8(p) ((VI)_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p))))
#define PD_U8(p) ((VI)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p))))
#define PD_F16(p) ((VF)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p))))
#else /* portable: element by element, which the compiler may vectorise */
AI VI ISA(widen_u16)(const uint16_t *p) {
  VI r;
  for (int e = 0; e < VW; e++) r[e] = p[e];
  return r;
}
AI VI ISA(widen_i8)(const int8_t *p) {
  VI r;
  for (int e = 0; e < VW; e++) r[e] = p[e];
  return r;
}
AI VI ISA(widen_u8)(const uint8_t *p) {
  VI r;
  for (int e = 0; e < VW; e++) r[e] = p[e];
  return r;
}
#define PD_U16(p) ISA(widen_u16)(p)
#define PD_I8(p) ISA(widen_i8)(p)
#define PD_U8(p) ISA(widen_u8)(p)
#ifdef __FLT16_MAX__
AI VF ISA(widen_f16)(const _Float16 *p) {
  VF r;
  for (int e = 0; e < VW; e++) r[e] = (float)p[e];
  return r;
}
#define PD_F16(p) ISA(widen_f16)(p)
#endif
#endif

/* VW elements of a row from element i, as floats, converted in registers. */
AI VF ISA(load)(const void *row, int64_t i, int dt) {
  VF r;
  if (dt == F32) {
    memcpy(&r, (const float *)row + i, sizeof r);
  } else if (dt == BF16) { /* bf16 is the top half of a float32 */
    r = (VF)(PD_U16((const uint16_t *)row + i) << 16);
#ifdef PD_F16
  } else if (dt == F16) {
    r = PD_F16((const _Float16 *)row + i);
#endif
  } else if (dt == I8) {
    r = __builtin_convertvector(PD_I8((const int8_t *)row + i), VF);
  } else { /* fp8 e4m3fn: s eeee mmm, exponent bias 7, no infinities, NaN = s1111111 */
    const VI x = PD_U8((const uint8_t *)row + i), mag = x & 0x7F;
    /* normal: the bits moved into float32's fields, exponent rebased by 127 - 7; subnormal
       (exponent 0): mantissa * 2^-9, exact; neither needs float32 subnormals (DAZ-proof) */
    const VI normal = (mag << 20) + ((127 - 7) << 23);
    const VI sub = (VI)(__builtin_convertvector(mag, VF) * ISA(splat)(1.0f / 512.0f));
    const VI is_sub = mag < 8, is_nan = mag == 0x7F;
    VI bits = (normal & ~is_sub) | (sub & is_sub);
    bits = (bits & ~is_nan) | (0x7FC00000 & is_nan);
    r = (VF)(bits | ((x & 0x80) << 24));
  }
  return r;
}
#undef PD_U16
#undef PD_I8
#undef PD_U8
#undef PD_F16

/* The last n < VW elements of a row from i, zero-filled to a vector (a key's bytes past its row
   may be another head's, or NaN). */
AI VF ISA(load_tail)(const void *row, int64_t i, int64_t n, int dt, const float *lut) {
  VF r = {0};
  for (int64_t e = 0; e < n; e++) r[e] = to_f32(row, i + e, dt, lut);
  return r;
}

/* The sums of VW vectors (lane i of the result: the sum of v[i]'s lanes), by a shuffle tree:
   each level adds the two halves of every partial sum, packing two vectors' partials into one,
   so VW sums take VW - 1 shuffle pairs rather than VW reductions of log2(VW) steps. */
#if VW == 16
#define LVL1 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23
#define LVL1B 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31
#define LVL2 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27
#define LVL2B 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31
#define LVL3 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29
#define LVL3B 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31
#define LVL4 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30
#define LVL4B 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31
#else
#define LVL1 0, 1, 2, 3, 8, 9, 10, 11
#define LVL1B 4, 5, 6, 7, 12, 13, 14, 15
#define LVL2 0, 1, 4, 5, 8, 9, 12, 13
#define LVL2B 2, 3, 6, 7, 10, 11, 14, 15
#define LVL3 0, 2, 4, 6, 8, 10, 12, 14
#define LVL3B 1, 3, 5, 7, 9, 11, 13, 15
#endif
#ifndef PD_SHUFFLE /* two-vector shuffle by constant lane indices */
#if defined(__clang__) || __GNUC__ >= 12
#define PD_SHUFFLE(u, v, ...) __builtin_shufflevector(u, v, __VA_ARGS__)
#else
#define PD_SHUFFLE(u, v, ...) __builtin_shuffle(u, v, (__typeof__(VI)){__VA_ARGS__})
#endif
#endif

AI VF ISA(reduce)(const VF *v) {
  VF t[VW];
  int n = VW, i;
  for (i = 0; i < VW; i++) t[i] = v[i];
/* one level: x takes the first half of each partial sum of u then w, y the second halves, so
   x + y holds twice as many partial sums, each half as long */
#define PD_STEP(A, B)                                                                             \
  for (n /= 2, i = 0; i < n; i++) {                                                               \
    const VF u = t[2 * i], w = t[2 * i + 1];                                                      \
    t[i] = PD_SHUFFLE(u, w, A) + PD_SHUFFLE(u, w, B);                                             \
  }
  PD_STEP(LVL1, LVL1B)
  PD_STEP(LVL2, LVL2B)
  PD_STEP(LVL3, LVL3B)
#if VW == 16
  PD_STEP(LVL4, LVL4B)
#endif
#undef PD_STEP
  return t[0];
}

/* Lanes r * SB + s of v (r < RB, s < SB and s < nk) to out[r * P + s], from the register: the
   vector stored whole and read back a float at a time stalled the reloads (they cannot take their
   data from a wider store still in flight: ~a fifth of the int8 scores' time in perf). */
AI void ISA(store_rows)(VF v, float *out, int64_t P, int RB, int SB, int64_t nk) {
  int r;
#if PD_X86 == 512
  const __mmask16 m = (__mmask16)((1u << (nk < SB ? nk : SB)) - 1);
  /* row r's lanes start at lane r * SB: a masked store from SB lanes before its row (masked
     lanes are neither written nor read, so no fault and no byte outside the row is touched) */
  for (r = 0; r < RB; r++)
    _mm512_mask_storeu_ps((void *)((uintptr_t)(out + r * P) - sizeof(float) * (size_t)(r * SB)),
                          (__mmask16)(m << (r * SB)), (__m512)v);
#else
  for (r = 0; r < RB; r++)
    for (int s = 0; s < SB && s < nk; s++) out[r * P + s] = v[r * SB + s];
#endif
}

/* Scores of RB query rows (fp32, stride Dp, zero-padded) against SB keys (rows k0 + s * kstride,
   s < nk; a block past the last key repeats it, its sums dropped): RB * SB = VW accumulators,
   one FMA chain each, each key vector loaded (and converted) once for the RB rows. */
AI void ISA(score_block)(const float *q, int64_t Dp, int64_t D, const char *k0, int64_t kstride,
                         int64_t nk, int dt, const float *lut, int RB, float *out, int64_t P,
                         Pf *pf) {
  const int SB = VW / RB;
  const int64_t esz = elem_size(dt);
  VF acc[VW];
  const char *k[VW];
  int r, s;
  int64_t d;
  for (s = 0; s < SB; s++) k[s] = k0 + (s < nk ? s : nk - 1) * kstride;
  for (r = 0; r < VW; r++) acc[r] = (VF){0};
  for (d = 0; d + VW <= D; d += VW) {
    VF qv[4];
    for (r = 0; r < RB; r++) memcpy(&qv[r], q + r * Dp + d, sizeof(VF));
    for (s = 0; s < SB; s++) {
      const VF kv = ISA(load)(k[s], d, dt);
      PD_PREFETCH(pf, d * esz);
      for (r = 0; r < RB; r++) acc[r * SB + s] += qv[r] * kv;
    }
  }
  if (d < D) {
    VF qv[4];
    for (r = 0; r < RB; r++) memcpy(&qv[r], q + r * Dp + d, sizeof(VF));
    for (s = 0; s < SB; s++) {
      const VF kv = ISA(load_tail)(k[s], d, D - d, dt, lut);
      for (r = 0; r < RB; r++) acc[r * SB + s] += qv[r] * kv;
    }
  }
  ISA(store_rows)(ISA(reduce)(acc), out, P, RB, SB, nk);
}

/* Scores of a kv head's Rh rows against the ns slots from k0, in blocks of 4, 2 and 1 rows. */
AI void ISA(scores_dt)(const float *q, int64_t Rh, int64_t Dp, int64_t D, const char *k0,
                       int64_t kstride, int64_t ns, int dt, const float *lut, float *out,
                       int64_t P, Pf *pf) {
  int64_t r = 0, s;
  /* the first block of rows asks for the next page's keys, the others find them asked */
  for (; r + 4 <= Rh; r += 4)
    for (s = 0; s < ns; s += VW / 4)
      ISA(score_block)(q + r * Dp, Dp, D, k0 + s * kstride, kstride, ns - s, dt, lut, 4,
                       out + r * P + s, P, r ? NULL : pf);
  if (r + 2 <= Rh) {
    for (s = 0; s < ns; s += VW / 2)
      ISA(score_block)(q + r * Dp, Dp, D, k0 + s * kstride, kstride, ns - s, dt, lut, 2,
                       out + r * P + s, P, r ? NULL : pf);
    r += 2;
  }
  if (r < Rh)
    for (s = 0; s < ns; s += VW)
      ISA(score_block)(q + r * Dp, Dp, D, k0 + s * kstride, kstride, ns - s, dt, lut, 1,
                       out + r * P + s, P, r ? NULL : pf);
}

/* One instance per key dtype: the dtype is a constant inside each, so the loads specialise. */
static void ISA(scores)(const float *q, int64_t Rh, int64_t Dp, int64_t D, const char *k0,
                        int64_t kstride, int64_t ns, int dt, const float *lut, float *out,
                        int64_t P, Pf *pf) {
  switch (dt) {
    case F32: ISA(scores_dt)(q, Rh, Dp, D, k0, kstride, ns, F32, lut, out, P, pf); break;
    case BF16: ISA(scores_dt)(q, Rh, Dp, D, k0, kstride, ns, BF16, lut, out, P, pf); break;
    case F16: ISA(scores_dt)(q, Rh, Dp, D, k0, kstride, ns, F16, lut, out, P, pf); break;
    case I8: ISA(scores_dt)(q, Rh, Dp, D, k0, kstride, ns, I8, lut, out, P, pf); break;
    default: ISA(scores_dt)(q, Rh, Dp, D, k0, kstride, ns, LUT8, lut, out, P, pf); break;
  }
}

/* acc_r += sum_{s in [sa, sb)} w_r[s] * v_s for RB rows (acc stride as, weights stride ws),
   NC vectors of each row's accumulator in registers at a time: each V vector is loaded (and
   converted) once for the RB rows. A last partial vector of Dv goes through a zero-filled one. */
AI void ISA(pv_cols)(float *acc, int64_t as, const float *w, int64_t ws, int RB, int NC,
                     int64_t d, int64_t nd, const char *v0, int64_t vstride, int64_t sa,
                     int64_t sb, int dt, const float *lut, const float *alpha, Pf *pf) {
  const int full = nd == NC * VW;
  const int64_t esz = elem_size(dt);
  VF t[4][4];
  int r, c;
  int64_t s;
  for (r = 0; r < RB; r++)
    for (c = 0; c < NC; c++) {
      t[r][c] = full ? ISA(load)(acc + r * as, d + c * VW, F32)
                     : ISA(load_tail)(acc + r * as, d, nd, F32, lut);
      if (alpha) t[r][c] *= ISA(splat)(alpha[r]); /* the online softmax's rescale, on the way */
    }
  for (s = sa; s < sb; s++) {
    const char *v = v0 + s * vstride;
    VF vv[4];
    for (c = 0; c < NC; c++) {
      vv[c] = full ? ISA(load)(v, d + c * VW, dt) : ISA(load_tail)(v, d, nd, dt, lut);
      PD_PREFETCH(pf, (d + c * VW) * esz);
    }
    for (r = 0; r < RB; r++) {
      const VF wr = ISA(splat)(w[r * ws + s]);
      for (c = 0; c < NC; c++) t[r][c] += wr * vv[c];
    }
  }
  for (r = 0; r < RB; r++)
    for (c = 0; c < NC; c++) {
      if (full)
        memcpy(acc + r * as + d + c * VW, &t[r][c], sizeof(VF));
      else
        for (int64_t e = 0; e < nd; e++) acc[r * as + d + e] = t[r][c][e];
    }
}

AI void ISA(pv_dt)(float *acc, int64_t as, const float *w, int64_t ws, int RB, int64_t Dv,
                   const char *v0, int64_t vstride, int64_t sa, int64_t sb, int dt,
                   const float *lut, const float *alpha, Pf *pf) {
  /* accumulator vectors per row in registers: up to 16 zmm of 32, 8 ymm of avx2's 16 */
  const int NC = (VW == 16 ? 16 : 8) / RB > 4 ? 4 : (VW == 16 ? 16 : 8) / RB;
  int64_t d = 0;
  for (; d + NC * VW <= Dv; d += NC * VW)
    ISA(pv_cols)(acc, as, w, ws, RB, NC, d, NC * VW, v0, vstride, sa, sb, dt, lut, alpha, pf);
  for (; d < Dv; d += VW) {
    const int64_t nd = Dv - d < VW ? Dv - d : VW;
    ISA(pv_cols)(acc, as, w, ws, RB, 1, d, nd, v0, vstride, sa, sb, dt, lut, alpha, pf);
  }
}

static void ISA(pv)(float *acc, int64_t as, const float *w, int64_t ws, int RB, int64_t Dv,
                    const char *v0, int64_t vstride, int64_t sa, int64_t sb, int dt,
                    const float *lut) {
#define PD_PV(DT)                                                                                 \
  PD_WITH_RB(RB, ISA(pv_dt)(acc, as, w, ws, RBC, Dv, v0, vstride, sa, sb, DT, lut, NULL, NULL))
  switch (dt) {
    case F32: PD_PV(F32) break;
    case BF16: PD_PV(BF16) break;
    case F16: PD_PV(F16) break;
    case I8: PD_PV(I8) break;
    default: PD_PV(LUT8) break;
  }
#undef PD_PV
}

/* exp of VW floats: x = n ln2 + r with |r| <= ln2 / 2, exp(r) by the Cephes expf polynomial
   (about 1 ulp), times 2^n built in the exponent bits. x below -87.3 (exp under FLT_MIN; -inf for
   a masked key) gives exactly 0; callers pass x <= PD_MAX_SLACK (scores minus their running
   max). Libm's
   scalar expf is ~20x slower per value and, without -ffast-math, never vectorised. */
AI VF ISA(expv)(VF x) {
  const VF lo = ISA(splat)(-87.33654f);
  const VI under = x < lo;
  x = (VF)(((VI)lo & under) | ((VI)x & ~under));
  const VF magic = ISA(splat)(12582912.0f); /* 1.5 * 2^23: adding it rounds to an integer */
  const VF n = (x * ISA(splat)(1.44269504f) + magic) - magic;
  const VF r = x - n * ISA(splat)(0.693359375f) - n * ISA(splat)(-2.12194440e-4f);
  VF y = ISA(splat)(1.9875691500e-4f);
  y = y * r + ISA(splat)(1.3981999507e-3f);
  y = y * r + ISA(splat)(8.3334519073e-3f);
  y = y * r + ISA(splat)(4.1665795894e-2f);
  y = y * r + ISA(splat)(1.6666665459e-1f);
  y = y * r + ISA(splat)(5.0000001201e-1f);
  y = y * r * r + r + ISA(splat)(1.0f);
  const VI e = (__builtin_convertvector(n, VI) + 127) << 23;
  return (VF)((VI)(y * (VF)e) & ~under);
}

/* Lane-wise select and the horizontal max and sum of a vector, by a butterfly of lane swaps
   (every lane ends holding the result). The max never picks a NaN lane (x > y is false). */
AI VF ISA(select)(VI take_a, VF a, VF b) { return (VF)(((VI)a & take_a) | ((VI)b & ~take_a)); }
#if VW == 16
#define PD_SWAPS(F, x)                                                                            \
  F(x, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7)                                      \
  F(x, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11)                                      \
  F(x, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13)                                      \
  F(x, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14)
#else
#define PD_SWAPS(F, x)                                                                            \
  F(x, 4, 5, 6, 7, 0, 1, 2, 3)                                                                    \
  F(x, 2, 3, 0, 1, 6, 7, 4, 5)                                                                    \
  F(x, 1, 0, 3, 2, 5, 4, 7, 6)
#endif
#define PD_MAX_STEP(x, ...)                                                                       \
  {                                                                                               \
    const VF y = PD_SHUFFLE(x, x, __VA_ARGS__);                                                   \
    x = ISA(select)(x > y, x, y);                                                                 \
  }
#define PD_ADD_STEP(x, ...) x += PD_SHUFFLE(x, x, __VA_ARGS__);
AI float ISA(hmax)(VF x) {
  PD_SWAPS(PD_MAX_STEP, x)
  return x[0];
}
AI float ISA(hsum)(VF x) {
  PD_SWAPS(PD_ADD_STEP, x)
  return x[0];
}
#undef PD_MAX_STEP
#undef PD_ADD_STEP
#undef PD_SWAPS

/* Whether any lane of a comparison's result is true. */
AI int ISA(any)(VI v) {
#if PD_X86 == 512
  return _mm512_test_epi32_mask((__m512i)v, (__m512i)v) != 0;
#elif PD_X86 == 256
  return !_mm256_testz_si256((__m256i)v, (__m256i)v);
#else
  int r = 0;
  for (int e = 0; e < VW; e++) r |= v[e] != 0;
  return r;
#endif
}

/* One page's whole step for RB <= 4 rows of a kv head (rows r: acc + r * Dv, m[r], scores
   sc + r * P, and the softmax denominator as the VW partial sums of the PD_SLOTS floats at
   l + r * PD_SLOTS, summed when the item ends: no horizontal sum a page) that all attend every
   one of the page's ns <= PD_SLOTS slots. page_weights: each row's scores as PD_SLOTS / VW
   vectors (lanes past ns: -inf), dequantised by ksc (per slot, or NULL); the online softmax
   update in registers; the weights times the V scales vsc (or NULL) into wbuf (RB x PD_SLOTS, 0
   past ns), each row's rescale factor into alpha. The running max m moves only when a score
   exceeds it by more than PD_MAX_SLACK (then to the page's max): the weights stay <= e^slack,
   and the common page (no new max) takes one vector compare instead of a horizontal max and an
   expf. page_step: then the weighted V sum, the accumulators rescaled as the V block loads them
   (no separate pass over acc). */
AI void ISA(page_weights)(float *m, float *l, const float *sc, int64_t P, int RB, int64_t ns,
                          const float *ksc, const float *vsc, float *wbuf, float *alpha) {
  enum { NV = PD_SLOTS / VW };
  VI lane;
  int r, c, e;
  for (e = 0; e < VW; e++) lane[e] = e;
  for (r = 0; r < RB; r++) {
    VF x[NV], mv = ISA(splat)(-INFINITY), lr;
    VI over = {0};
    memcpy(&lr, l + r * PD_SLOTS, sizeof lr);
    for (c = 0; c < NV; c++) {
      const VI in = lane + c * VW < (VI){0} + (int32_t)ns;
      VF y;
      if ((c + 1) * VW <= ns)
        memcpy(&y, sc + r * P + c * VW, sizeof y);
      else
        for (e = 0; e < VW; e++) y[e] = c * VW + e < ns ? sc[r * P + c * VW + e] : 0.0f;
      if (ksc) { /* an Inf key scale: a NaN score (KEY_SCALE) */
        const VF k = ISA(load)(ksc, c * VW, F32);
        y = KEY_SCALE(y, k);
      }
      x[c] = y = ISA(select)(in, y, ISA(splat)(-INFINITY));
      mv = ISA(select)(y > mv, y, mv);
      over |= y > ISA(splat)(m[r] + PD_MAX_SLACK);
    }
    alpha[r] = 1.0f;
    if (m[r] == -INFINITY || ISA(any)(over)) { /* the first page, or a new max past the slack */
      const float mx = ISA(hmax)(mv);
      if (mx == -INFINITY) { /* no finite score: this page adds nothing to the row... */
        for (c = 0; c < NV; c++) /* ...but a NaN one makes its sum NaN (see merge) */
          for (e = 0; e < VW; e++)
            if (x[c][e] != x[c][e]) lr = ISA(splat)(NAN);
        memcpy(l + r * PD_SLOTS, &lr, sizeof lr);
        for (c = 0; c < NV; c++) memset(wbuf + r * PD_SLOTS + c * VW, 0, sizeof(VF));
        continue;
      }
      if (mx > m[r]) {
        alpha[r] = expf(m[r] - mx); /* 0 while m is -inf: acc, l are 0 */
        m[r] = mx;
        lr *= ISA(splat)(alpha[r]);
      }
    }
    for (c = 0; c < NV; c++) {
      VF w = ISA(expv)(x[c] - ISA(splat)(m[r]));
      lr += w;
      if (vsc) w *= ISA(load)(vsc, c * VW, F32);
      memcpy(wbuf + r * PD_SLOTS + c * VW, &w, sizeof w);
    }
    memcpy(l + r * PD_SLOTS, &lr, sizeof lr);
  }
}

AI void ISA(page_step_dt)(float *acc, int64_t Dv, float *m, float *l, const float *sc, int64_t P,
                          int RB, int64_t ns, const float *ksc, const float *vsc, const char *v0,
                          int64_t vstride, int dt, const float *lut, float *wbuf, Pf *pf) {
  float alpha[4];
  ISA(page_weights)(m, l, sc, P, RB, ns, ksc, vsc, wbuf, alpha);
  ISA(pv_dt)(acc, Dv, wbuf, PD_SLOTS, RB, Dv, v0, vstride, 0, ns, dt, lut, alpha, pf);
}

static void ISA(page_step)(float *acc, int64_t Dv, float *m, float *l, const float *sc,
                           int64_t P, int RB, int64_t ns, const float *ksc, const float *vsc,
                           const char *v0, int64_t vstride, int dt, const float *lut,
                           float *wbuf, Pf *pf) {
#define PD_STEP_RB(DT)                                                                            \
  PD_WITH_RB(RB, ISA(page_step_dt)(acc, Dv, m, l, sc, P, RBC, ns, ksc, vsc, v0, vstride, DT, lut,  \
                                   wbuf, pf))
  switch (dt) {
    case F32: PD_STEP_RB(F32) break;
    case BF16: PD_STEP_RB(BF16) break;
    case F16: PD_STEP_RB(F16) break;
    case I8: PD_STEP_RB(I8) break;
    default: PD_STEP_RB(LUT8) break;
  }
#undef PD_STEP_RB
}

#undef LVL1
#undef LVL1B
#undef LVL2
#undef LVL2B
#undef LVL3
#undef LVL3B
#undef LVL4
#undef LVL4B
#undef VF
#undef VI
#undef AI
#endif /* PD_SIMD_PASS */
