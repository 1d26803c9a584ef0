/* Throughput of the dot-product instructions the paged decode kernel can use, on 512-bit
   registers: nanoseconds per instruction with 8 independent accumulator chains (enough to hide
   their latency), so the figure is the issue rate. Why int8 pages cost the kernel what bf16
   pages do in arithmetic: with the query and the softmax
   weights kept at 16 bits, int8 keys and values take vpdpwssd (32 int16 products) where bf16
   takes vdpbf16ps (32 bf16 products), the same count for a page; vpdpbusd's 64 int8 products
   need an 8-bit operand on both sides.

     gcc -O2 -mavx512f -mavx512vnni -mavx512bf16 benchmarks/dot_throughput.c -o /tmp/dots
     /tmp/dots */
#include <immintrin.h>
#include <stdio.h>
#include <time.h>

#define N 200000000L /* instructions per measurement */

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

/* 8 chains of one instruction, N in all; the accumulators' sum keeps them live */
#define CHAINS(INSN)                                                                              \
  do {                                                                                            \
    __m512i a0 = one, a1 = one, a2 = one, a3 = one, a4 = one, a5 = one, a6 = one, a7 = one;       \
    const double t = now();                                                                       \
    for (long i = 0; i < N / 8; i++) {                                                            \
      __asm__ volatile(INSN " %8, %9, %0\n\t" INSN " %8, %9, %1\n\t" INSN " %8, %9, %2\n\t" INSN  \
                            " %8, %9, %3\n\t" INSN " %8, %9, %4\n\t" INSN " %8, %9, %5\n\t" INSN  \
                            " %8, %9, %6\n\t" INSN " %8, %9, %7"                                  \
                       : "+v"(a0), "+v"(a1), "+v"(a2), "+v"(a3), "+v"(a4), "+v"(a5), "+v"(a6),    \
                         "+v"(a7)                                                                 \
                       : "v"(b), "v"(c));                                                         \
    }                                                                                             \
    const double dt = now() - t;                                                                  \
    const __m512i s = _mm512_add_epi32(_mm512_add_epi32(_mm512_add_epi32(a0, a1),                 \
                                                        _mm512_add_epi32(a2, a3)),                \
                                       _mm512_add_epi32(_mm512_add_epi32(a4, a5),                 \
                                                        _mm512_add_epi32(a6, a7)));               \
    sink += _mm512_reduce_add_epi32(s);                                                           \
    printf("%-12s %.3f ns per instruction\n", INSN, dt / N * 1e9);                                \
  } while (0)

int main(void) {
  const __m512i one = _mm512_set1_epi32(1), b = _mm512_set1_epi32(3), c = _mm512_set1_epi32(5);
  int sink = 0;
  CHAINS("vpdpwssd");
  CHAINS("vpdpbusd");
  CHAINS("vdpbf16ps");
  CHAINS("vfmadd231ps");
  return sink == 12345;
}
