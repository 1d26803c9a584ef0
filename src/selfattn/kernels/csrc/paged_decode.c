/* Paged decode on CPU: attention of a few query rows per sequence over a paged KV cache, each
   page read in place, once (why, and the build: selfattn/kernels/paged_decode.py, its host).

   Entry point: paged_decode(iargs, ptrs, n_threads, scale). iargs holds the integers and ptrs the
   data pointers, in the order of the A_* and P_* enums below; the host fills both by name from
   the same lists (INT_ARGS, PTR_ARGS), and a test checks that they match these enums. Plain C11
   with GNU vector extensions and POSIX threads: no PyTorch headers. */

#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { F32 = 0, BF16 = 1, F16 = 2, I8 = 3, LUT8 = 4 };

/* iargs, in order */
enum {
  A_B, A_HQ, A_HKV, A_SQ, A_D, A_DV, A_P, A_MAXP, A_NSPLIT, A_SPLIT_PAGES,
  A_KSN, A_KSP, A_KSH, A_VSN, A_VSP, A_VSH, A_KDT, A_VDT, A_KSC, A_VSC, A_QDT, A_NARGS
};
/* ptrs, in order */
enum { P_Q, P_K, P_V, P_KSCALE, P_VSCALE, P_LUT, P_TABLE, P_LO, P_HI, P_OUT, P_LSE, P_SINKS, P_NPTRS };

typedef struct {
  const int64_t *a;
  void *const *p;
  float scale;                /* softmax scale, applied to q as it is read */
  float *m, *l, *acc;         /* per item (b, split): running max, sum, weighted V sum */
  int64_t n_items;
  int64_t next; /* work counter, atomic */
} Job;

int has_f16(void) {
#ifdef __FLT16_MAX__
  return 1;
#else
  return 0;
#endif
}

/* One key/value row (n elements of dtype dt) as float32 in out; returns a pointer to the floats
   (the row itself for float32 pages: no copy). */
static const float *row_f32(const void *base, int64_t off, int dt, int64_t n, const float *lut,
                            float *out) {
  int64_t i;
  if (dt == F32) return (const float *)base + off;
  if (dt == BF16) {
    const uint16_t *x = (const uint16_t *)base + off;
    for (i = 0; i < n; i++) {
      uint32_t bits = (uint32_t)x[i] << 16;
      memcpy(out + i, &bits, 4);
    }
  } else if (dt == F16) {
#ifdef __FLT16_MAX__
    const _Float16 *x = (const _Float16 *)base + off;
    for (i = 0; i < n; i++) out[i] = (float)x[i];
#endif
  } else if (dt == I8) {
    const int8_t *x = (const int8_t *)base + off;
    for (i = 0; i < n; i++) out[i] = (float)x[i];
  } else { /* LUT8: float8 bytes through a 256-entry table */
    const uint8_t *x = (const uint8_t *)base + off;
    for (i = 0; i < n; i++) out[i] = lut[x[i]];
  }
  return out;
}

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

/* exp of 8 floats: x = n ln2 + r with |r| <= ln2 / 2, exp(r) by the Cephes expf polynomial
   (about 1 ulp), times 2^n built in the exponent bits. x below -87.3 (exp under FLT_MIN; -inf for a
   masked key) gives exactly 0; callers pass x <= 0 (scores minus their running max). Libm's
   scalar expf is ~20x slower per value and, without -ffast-math, never vectorised. */
static inline v8 exp8(v8 x) {
  const v8 lo = splat8(-87.33654f);
  const v8i under = x < lo;
  x = (v8)(((v8i)lo & under) | ((v8i)x & ~under));
  const v8 magic = splat8(12582912.0f); /* 1.5 * 2^23: adding it rounds to an integer */
  const v8 n = (x * splat8(1.44269504f) + magic) - magic;
  const v8 r = x - n * splat8(0.693359375f) - n * splat8(-2.12194440e-4f);
  v8 y = splat8(1.9875691500e-4f);
  y = y * r + splat8(1.3981999507e-3f);
  y = y * r + splat8(8.3334519073e-3f);
  y = y * r + splat8(4.1665795894e-2f);
  y = y * r + splat8(1.6666665459e-1f);
  y = y * r + splat8(5.0000001201e-1f);
  y = y * r * r + r + splat8(1.0f);
  const v8i e = (__builtin_convertvector(n, v8i) + 127) << 23;
  return (v8)((v8i)(y * (v8)e) & ~under);
}

/* -- scores of RB query rows against SB keys at once: RB * SB independent FMA chains hide the FMA
   latency that a single dot product's chain is bound by. out[r * P + s] = q_r . k_s. */
static inline __attribute__((always_inline)) void dot_block(const float *q, int64_t D,
                                                            const float *const *k, int RB, int SB,
                                                            float *out, int64_t P) {
  v8 acc[4][8];
  int r, s;
  int64_t d;
  for (r = 0; r < RB; r++)
    for (s = 0; s < SB; s++) acc[r][s] = (v8){0, 0, 0, 0, 0, 0, 0, 0};
  for (d = 0; d + 8 <= D; d += 8) {
    v8 qv[4];
    for (r = 0; r < RB; r++) qv[r] = ld8(q + r * D + d);
    for (s = 0; s < SB; s++) {
      const v8 kv = ld8(k[s] + d);
      for (r = 0; r < RB; r++) acc[r][s] += qv[r] * kv;
    }
  }
  for (r = 0; r < RB; r++)
    for (s = 0; s < SB; s++) {
      float sum = hsum8(acc[r][s]);
      for (int64_t e = d; e < D; e++) sum += q[r * D + e] * k[s][e];
      out[r * P + s] = sum;
    }
}

/* Scores of nr rows (stride D) against ns keys, in register blocks of rows x keys. */
static void dots(const float *q, int64_t nr, int64_t D, const float *const *k, int64_t ns,
                 float *out, int64_t P) {
  int64_t r = 0, s;
  for (; r + 4 <= nr; r += 4) {
    for (s = 0; s + 2 <= ns; s += 2) dot_block(q + r * D, D, k + s, 4, 2, out + r * P + s, P);
    for (; s < ns; s++) dot_block(q + r * D, D, k + s, 4, 1, out + r * P + s, P);
  }
  for (; r < nr; r++) {
    for (s = 0; s + 8 <= ns; s += 8) dot_block(q + r * D, D, k + s, 1, 8, out + r * P + s, P);
    for (; s < ns; s++) dot_block(q + r * D, D, k + s, 1, 1, out + r * P + s, P);
  }
}

/* acc_r += sum_{s in [sa, sb)} w_r[s] * v_s for RB rows (acc stride as, weights stride ws) that
   share one slot range: the rows of one query position across a GQA group. RB * 2 accumulator
   registers, and each V load serves all RB rows. Keys outside [sa, sb) are never read, so
   garbage (NaN) values of a key a row does not attend never reach its sum. */
static inline __attribute__((always_inline)) void pv_block(float *acc, int64_t as,
                                                           const float *w, int64_t ws, int RB,
                                                           int64_t Dv, const float *const *v,
                                                           int64_t sa, int64_t sb) {
  int64_t d = 0, s;
  int r;
  for (; d + 16 <= Dv; d += 16) {
    v8 t[4][2];
    for (r = 0; r < RB; r++) t[r][0] = ld8(acc + r * as + d), t[r][1] = ld8(acc + r * as + d + 8);
    for (s = sa; s < sb; s++) {
      const v8 v0 = ld8(v[s] + d), v1 = ld8(v[s] + d + 8);
      for (r = 0; r < RB; r++) {
        const v8 wr = splat8(w[r * ws + s]);
        t[r][0] += wr * v0, t[r][1] += wr * v1;
      }
    }
    for (r = 0; r < RB; r++) st8(acc + r * as + d, t[r][0]), st8(acc + r * as + d + 8, t[r][1]);
  }
  for (; d < Dv; d++)
    for (r = 0; r < RB; r++)
      for (s = sa; s < sb; s++) acc[r * as + d] += w[r * ws + s] * v[s][d];
}

/* Keys per weighted-V step: the rows' accumulators are loaded and stored once per step. */
#define VSTEP 4

/* The weighted V sum of one kv head's G * Sq rows (row g * Sq + i) over the page slots
   [s, s + nv), whose values v[0..nv) hold: query i's allowed slots are [sa[i], sb[i]), the same
   for its G rows, which go through pv_block 4 at a time. */
static void weighted_sum(float *acc, int64_t G, int64_t Sq, int64_t Dv, const float *w, int64_t P,
                         const float *const *v, int64_t s, int64_t nv, const int64_t *sa,
                         const int64_t *sb) {
  for (int64_t i = 0; i < Sq; i++) {
    const int64_t a0 = sa[i] > s ? sa[i] - s : 0, b0 = sb[i] < s + nv ? sb[i] - s : nv;
    const float *wi = w + i * P + s;
    int64_t g = 0;
    if (b0 <= a0) continue;
    for (; g + 4 <= G; g += 4)
      pv_block(acc + (g * Sq + i) * Dv, Sq * Dv, wi + g * Sq * P, Sq * P, 4, Dv, v, a0, b0);
    for (; g < G; g++)
      pv_block(acc + (g * Sq + i) * Dv, 0, wi + g * Sq * P, 0, 1, Dv, v, a0, b0);
  }
}

/* Rows of n consecutive slots from slot, kv head h, of a page laid out (P, Hkv, width) with
   strides st = {page, slot, head} (the A_*SN, A_*SP, A_*SH arguments), as float32 pointers in
   out; rows of other dtypes are converted into buf, width floats each. */
static inline __attribute__((always_inline)) void slot_rows(const float **out, const void *pages,
                                                            const int64_t *st, int64_t page,
                                                            int64_t slot, int64_t h, int64_t n,
                                                            int dt, int64_t width,
                                                            const float *lut, float *buf) {
  int64_t e;
  for (e = 0; e < n; e++)
    out[e] = row_f32(pages, page * st[0] + (slot + e) * st[1] + h * st[2], dt, width, lut,
                     buf + e * width);
}

/* Multiply the row values of a page's slots [s0, s0 + ns) (rows r * P + s, the Rh rows of kv
   head h contiguous) by their dequantisation scales: per (token, head) in bfloat16 for int8
   pages (mode 1), per head in float32 for fp8. */
static inline __attribute__((always_inline)) void scale_slots(float *sc, const void *scales,
                                                              int64_t mode, int64_t page,
                                                              int64_t s0, int64_t ns, int64_t P,
                                                              int64_t Hkv, int64_t Rh) {
  int64_t h, s, r;
  for (h = 0; h < Hkv; h++)
    for (s = 0; s < ns; s++) {
      float scale;
      if (mode == 1) { /* bfloat16: the high half of a float32 */
        const uint32_t bits = (uint32_t)((const uint16_t *)scales)[(page * P + s0 + s) * Hkv + h]
                              << 16;
        memcpy(&scale, &bits, 4);
      } else
        scale = ((const float *)scales)[h];
      for (r = h * Rh; r < (h + 1) * Rh; r++) sc[r * P + s] *= scale;
    }
}

/* Work item (b, split): the rows of sequence b (all Hq heads, all Sq queries) against the keys of
   one split of its pages; writes the partial max m, sum l and weighted V sum acc. Rows are
   (Hq, Sq)-ordered: row (h * G + g) * Sq + i, so the G * Sq rows of kv head h are contiguous.
   A page is walked in memory order, slot by slot and kv head by kv head (a page is (P, Hkv, D)),
   so the hardware prefetcher streams it; scores of a whole page come before its softmax update,
   which comes before its weighted V rows. */
static void run_item(const Job *job, int64_t item, float *qbuf, float *sc, float *kbuf,
                     float *vbuf, const float **kp, const float **vp, int64_t *sa, int64_t *sb) {
  const int64_t *a = job->a;
  void *const *p = job->p;
  const int64_t Hq = a[A_HQ], Hkv = a[A_HKV], Sq = a[A_SQ], D = a[A_D], Dv = a[A_DV];
  const int64_t P = a[A_P], G = Hq / Hkv, R = Hq * Sq, Rh = G * Sq, nsplit = a[A_NSPLIT];
  const int64_t b = item / nsplit, split = item % nsplit;
  int64_t kmin = INT64_MAX, kmax = 0, r, i, g, h, s, e, j;
  /* this sequence's query rows in float32, times the softmax scale (as the PyTorch path) */
  const float *q = row_f32(p[P_Q], b * R * D, (int)a[A_QDT], R * D, NULL, qbuf);
  if (q != qbuf) q = (const float *)memcpy(qbuf, q, sizeof(float) * R * D);
  for (r = 0; r < R * D; r++) qbuf[r] *= job->scale;
  const int64_t *lo = (const int64_t *)p[P_LO] + b * Sq, *hi = (const int64_t *)p[P_HI] + b * Sq;
  const int32_t *table = (const int32_t *)p[P_TABLE] + b * a[A_MAXP];
  const void *ksc = p[P_KSCALE], *vsc = p[P_VSCALE];
  const float *lut = (const float *)p[P_LUT];
  const int kdt = (int)a[A_KDT], vdt = (int)a[A_VDT];
  /* keys per dots() call: enough register blocks (rows x keys) to hide the FMA latency */
  const int64_t kstep = Rh >= 4 ? 2 : (Rh >= 2 ? 4 : 8);
  float *m = job->m + item * R, *l = job->l + item * R, *acc = job->acc + item * R * Dv;

  for (r = 0; r < R; r++) m[r] = -INFINITY, l[r] = 0.0f;
  memset(acc, 0, sizeof(float) * R * Dv);
  for (i = 0; i < Sq; i++)
    if (hi[i] > lo[i]) {
      if (lo[i] < kmin) kmin = lo[i];
      if (hi[i] > kmax) kmax = hi[i];
    }
  if (kmax <= kmin) return;
  const int64_t first = kmin / P, last = (kmax + P - 1) / P, per = a[A_SPLIT_PAGES];
  const int64_t j0 = first + split * per, j1 = j0 + per < last ? j0 + per : last;

  for (j = j0; j < j1; j++) {
    const int64_t page = table[j];
    /* this page's slots that some row may attend: [s0, s1), token positions t0 + [0, ns) */
    const int64_t s0 = kmin > j * P ? kmin - j * P : 0;
    const int64_t s1 = kmax < (j + 1) * P ? kmax - j * P : P, ns = s1 - s0, t0 = j * P + s0;
    /* -- scores sc[r * P + s]: float32 pages are read where they lie, others are converted
       into kbuf a few key rows at a time */
    for (s = 0; s < ns; s += kstep) {
      const int64_t nk = ns - s < kstep ? ns - s : kstep;
      for (h = 0; h < Hkv; h++) {
        slot_rows(kp, p[P_K], a + A_KSN, page, s0 + s, h, nk, kdt, D, lut, kbuf);
        dots(q + h * Rh * D, Rh, D, kp, nk, sc + h * Rh * P + s, P);
      }
    }
    if (a[A_KSC]) /* dequantise the scores */
      scale_slots(sc, ksc, a[A_KSC], page, s0, ns, P, Hkv, Rh);
    /* each query's allowed slots of this page: [sa[i], sb[i]); -inf scores outside */
    for (i = 0; i < Sq; i++) {
      sa[i] = lo[i] > t0 ? (lo[i] - t0 < ns ? lo[i] - t0 : ns) : 0;
      sb[i] = hi[i] < t0 + ns ? (hi[i] > t0 ? hi[i] - t0 : 0) : ns;
      if (sa[i] > 0 || sb[i] < ns)
        for (g = 0; g < Hq; g++) /* g runs over all Hq heads here */
          for (s = 0; s < ns; s++)
            if (s < sa[i] || s >= sb[i]) sc[(g * Sq + i) * P + s] = -INFINITY;
    }
    /* -- online softmax: rescale each row's running sums to its new max; scores -> weights */
    for (r = 0; r < R; r++) {
      float *row = sc + r * P, mx = -INFINITY, sum = 0.0f;
      for (s = 0; s < ns; s++) mx = row[s] > mx ? row[s] : mx;
      if (mx == -INFINITY) continue; /* no allowed key on this page: its slot range is empty */
      if (mx > m[r]) {
        const float alpha = expf(m[r] - mx); /* 0 while m is -inf: acc and l are 0 then */
        l[r] *= alpha;
        for (e = 0; e < Dv; e++) acc[r * Dv + e] *= alpha;
        m[r] = mx;
      }
      for (s = 0; s + 8 <= ns; s += 8) {
        const v8 w = exp8(ld8(row + s) - splat8(m[r]));
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
      scale_slots(sc, vsc, a[A_VSC], page, s0, ns, P, Hkv, Rh);
    /* -- weighted V rows, VSTEP slots at a time across the kv heads (memory order again) */
    for (s = 0; s < ns; s += VSTEP) {
      const int64_t nv = ns - s < VSTEP ? ns - s : VSTEP;
      for (h = 0; h < Hkv; h++) {
        slot_rows(vp, p[P_V], a + A_VSN, page, s0 + s, h, nv, vdt, Dv, lut, vbuf);
        weighted_sum(acc + h * Rh * Dv, G, Sq, Dv, sc + h * Rh * P, P, vp, s, nv, sa, sb);
      }
    }
  }
}

static void *worker(void *arg) {
  Job *job = (Job *)arg;
  const int64_t *a = job->a;
  const int64_t R = a[A_HQ] * a[A_SQ], P = a[A_P];
  float *qbuf = malloc(sizeof(float) * (R * a[A_D] + R * P + P * (a[A_D] + a[A_DV])));
  const float **ptrs = malloc(sizeof(float *) * 2 * P);
  int64_t *ranges = malloc(sizeof(int64_t) * 2 * a[A_SQ]);
  void *ret = NULL;
  if (qbuf == NULL || ptrs == NULL || ranges == NULL) {
    ret = (void *)1;
  } else {
    float *sc = qbuf + R * a[A_D], *kbuf = sc + R * P, *vbuf = kbuf + P * a[A_D];
    for (;;) {
      const int64_t item = __atomic_fetch_add(&job->next, 1, __ATOMIC_RELAXED);
      if (item >= job->n_items) break;
      run_item(job, item, qbuf, sc, kbuf, vbuf, ptrs, ptrs + P, ranges, ranges + a[A_SQ]);
    }
  }
  free(qbuf);
  free(ptrs);
  free(ranges);
  return ret;
}

/* -- merge the key splits of each row: rescale each to the common max, then out = acc / l and
   lse = max + log l; a row with no allowed key gets out = 0, lse = -inf. Learned attention sinks
   (float32 (Hq,), or NULL) join here, once per row: the running max and sum start from the
   row's sink, a key with no value (a row with no key then gets out = 0, lse = sink). */
static void merge(const Job *job) {
  const int64_t *a = job->a;
  const int64_t R = a[A_HQ] * a[A_SQ], Dv = a[A_DV], ns = a[A_NSPLIT], Sq = a[A_SQ];
  float *out = (float *)job->p[P_OUT], *lse = (float *)job->p[P_LSE];
  const float *sinks = (const float *)job->p[P_SINKS];
  for (int64_t b = 0; b < a[A_B]; b++)
    for (int64_t r = 0; r < R; r++) {
      const float sink = sinks ? sinks[r / Sq] : -INFINITY; /* row r = head * Sq + query */
      float mx = sink, sum = 0.0f, *o = out + (b * R + r) * Dv;
      int64_t k, d;
      for (k = 0; k < ns; k++) mx = fmaxf(mx, job->m[(b * ns + k) * R + r]);
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
    }
}

/* out (B, Hq, Sq, Dv) and lse (B, Hq, Sq), float32. Returns 0 on success, 1 when scratch memory
   could not be allocated. */
int paged_decode(const int64_t *iargs, void *const *ptrs, int n_threads, float scale) {
  const int64_t n_items = iargs[A_B] * iargs[A_NSPLIT], R = iargs[A_HQ] * iargs[A_SQ];
  float *part = malloc(sizeof(float) * n_items * R * (iargs[A_DV] + 2));
  Job job = {iargs, ptrs, scale, part, part + n_items * R, part + 2 * n_items * R, n_items, 0};
  pthread_t tid[64];
  int n = n_threads < 1 ? 1 : (n_threads > 64 ? 64 : n_threads), started = 0, t, bad = 0;
  if (part == NULL) return 1;
  if (n > n_items) n = n_items > 0 ? (int)n_items : 1;
  for (t = 1; t < n; t++)
    if (pthread_create(&tid[started], NULL, worker, &job) == 0) started++;
  bad |= worker(&job) != NULL;
  for (t = 0; t < started; t++) {
    void *ret;
    pthread_join(tid[t], &ret);
    bad |= ret != NULL;
  }
  if (!bad) merge(&job);
  free(part);
  return bad;
}
