/* A persistent worker pool for the C kernels (fused_attention.c, paged_decode.c each include it
   and get a pool of their own).

   Why: the kernels used to pthread_create and join their threads on every call. That cost tens
   of µs a call, and on a busy host the joined thread could wait a scheduler slice for a core, so
   kernels/threads.py gave a second thread only to calls of >= 0.3 ms. Here the workers are
   started once (on the first call that wants them), park between calls, and are woken per call;
   the calling thread works too (participant 0).

   pool_run(task, ctx, n, scratch_bytes) runs task(ctx, scratch) on n participants at once and
   returns the OR of their results (a task returns 0, or 1 when it failed). The tasks pull work
   items from a counter of their own (ctx), so the result never depends on n or on who ran what.
   Each participant gets scratch_bytes of zeroed scratch (calloc's guarantee, which the kernels
   rely on: padding columns no pack writes are zero), kept per participant across calls (grown
   on demand, zeroed again before each use, freed past POOL_KEEP_SCRATCH) instead of allocated
   per call; a participant whose scratch cannot be allocated runs nothing and reports 1, as
   before.

   One call at a time uses the workers: a call that finds them busy (another Python thread's
   call, or a call from inside a task) runs on its calling thread alone, with scratch of its
   own. A worker spins for at most POOL_SPIN_NS after its task for the next call (the next
   layer's call follows within µs), then parks on its condition variable: no core is burnt while
   idle. After fork() the child has none of the parent's threads: pthread_atfork resets the pool
   there, and the child's first multi-thread call starts its own workers. */

/* PyTorch's OpenMP threads first (PyTorch builds linking GNU libgomp):
   after a parallel PyTorch op, libgomp's worker spins for milliseconds waiting for the next one
   (GOMP_SPINCOUNT with OMP_WAIT_POLICY unset: 4-7 ms of CPU burnt after one op, measured). A
   thread of ours woken in that window shares a core with the spinning worker, and in a model or
   a benchmark PyTorch ops run between our calls all the time. Where the build links the OpenMP
   runtime PyTorch loaded (kernels/build.py: openmp_flags adds -fopenmp; the loader then binds
   the build's libgomp.so.1 to the copy already in the process: one runtime, one set of
   threads), pool_run runs its participants as an OpenMP parallel region instead: those spinning
   workers take the call at once. The workers below then serve only builds without it (another
   runtime or compiler, SELFATTN_KERNEL_OPENMP=0) and a forked child: libgomp's threads do not
   survive fork (a child of a process that ran a parallel region hangs in its next one, PyTorch's
   own ops too), so pthread_atfork marks the child and it takes the workers. Nested inside
   another parallel region, OpenMP gives the inner region one thread: the caller does the work,
   with the same result. Participant i's scratch is slot i's in either case. */

#ifndef SELFATTN_THREAD_POOL_H
#define SELFATTN_THREAD_POOL_H

#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#ifdef __linux__
/* glibc and musl have it; its declaration in pthread.h needs _GNU_SOURCE before every include */
int pthread_setname_np(pthread_t thread, const char *name);
#endif

#ifndef POOL_NAME
#define POOL_NAME "selfattn" /* thread name prefix (Linux shows 15 characters) */
#endif
#define POOL_MAX_THREADS 256 /* participants of one call at most (the caller included) */
/* Scratch a participant keeps between calls; larger (the one-pass backward's dK, dV: up to
   64 MiB) is freed after the call, as the per-call calloc did. */
#define POOL_KEEP_SCRATCH ((size_t)8 << 20)
/* How long a worker polls for the next call before parking: back-to-back calls (a decode step's
   layers, pack then work in one attention call) find it awake, while an idle process burns at
   most this much CPU time per worker after its last call. */
#define POOL_SPIN_NS 50000
/* Polls between looks at the clock, each with a sched_yield: a poller that shares its core
   with a runnable thread (the scheduler may wake a worker on its caller's core) lets it run
   instead of holding the core for the whole spin. */
#define POOL_SPIN_CHECK 64

typedef int (*pool_task)(void *ctx, void *scratch);

/* A slot's state. The caller asks a worker (IDLE -> ASKED) and wakes it; the worker takes the
   call (ASKED -> RUNNING, back to IDLE when done) unless the caller, its own share done and the
   work all claimed, took the request back first (ASKED -> IDLE): a call never waits for a parked
   worker's wake-up (~30 µs from futex to running on an idle core here) when there was no work
   left for it. */
enum { POOL_IDLE = 0, POOL_ASKED = 1, POOL_RUNNING = 2 };

typedef struct {
  pthread_mutex_t mu; /* guards the wake-up: gen changes under it */
  pthread_cond_t cv;
  unsigned gen;       /* bumped for each call this worker is asked to (atomic): the wake-up */
  int state;          /* POOL_IDLE, POOL_ASKED, POOL_RUNNING (atomic): who owns the slot */
  void *scratch;      /* kept scratch and its size */
  size_t scratch_bytes;
  int status;         /* this participant's result in the last call */
} PoolSlot;

static struct {
  pthread_mutex_t call; /* held by the one call using the workers */
  int n_workers;        /* started; slot[1..n_workers] */
  int failed_allocs;    /* test hook: this many scratch allocations fail (pool_fail_allocs) */
  pool_task task;       /* the current call's */
  void *ctx;
  size_t scratch_bytes;
  int pending; /* workers still running the current call (atomic) */
  pthread_mutex_t done_mu;
  pthread_cond_t done_cv;
  PoolSlot slot[POOL_MAX_THREADS]; /* slot 0: the calling thread's scratch */
} tpool = {.call = PTHREAD_MUTEX_INITIALIZER, .done_mu = PTHREAD_MUTEX_INITIALIZER,
          .done_cv = PTHREAD_COND_INITIALIZER};

static pthread_once_t pool_once = PTHREAD_ONCE_INIT;

static inline uint64_t pool_now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

static inline void pool_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  __asm__ __volatile__("yield");
#endif
}

/* The test hook (pool_fail_allocs): whether this allocation is to fail. */
static int pool_alloc_fails(void) {
  return __atomic_load_n(&tpool.failed_allocs, __ATOMIC_RELAXED) > 0 &&
         __atomic_fetch_sub(&tpool.failed_allocs, 1, __ATOMIC_RELAXED) > 0;
}

/* Zeroed scratch of `bytes` for slot s (kept), or NULL when it cannot be allocated. */
static void *pool_scratch(PoolSlot *s, size_t bytes) {
  if (bytes == 0) return s; /* any non-NULL pointer: the task asked for none */
  if (pool_alloc_fails()) return NULL;
  if (s->scratch_bytes >= bytes) {
    memset(s->scratch, 0, bytes);
    return s->scratch;
  }
  free(s->scratch);
  s->scratch = calloc(bytes, 1); /* fresh: zeroed, by the OS where it is large */
  s->scratch_bytes = s->scratch ? bytes : 0;
  return s->scratch;
}

static void pool_trim(PoolSlot *s) {
  if (s->scratch_bytes > POOL_KEEP_SCRATCH) free(s->scratch), s->scratch = NULL, s->scratch_bytes = 0;
}

static int pool_participate(PoolSlot *s) {
  void *scratch = pool_scratch(s, tpool.scratch_bytes);
  const int status = scratch == NULL ? 1 : tpool.task(tpool.ctx, scratch);
  pool_trim(s);
  return status;
}

static void *pool_worker(void *arg) {
  PoolSlot *s = (PoolSlot *)arg;
  unsigned seen = 0; /* a new slot's gen: the first call may bump it before this line runs */
  for (;;) {
    /* -- wait for the next call: poll for POOL_SPIN_NS, then park */
    if (__atomic_load_n(&s->gen, __ATOMIC_ACQUIRE) == seen) {
      const uint64_t until = pool_now_ns() + POOL_SPIN_NS;
      for (int k = 1; __atomic_load_n(&s->gen, __ATOMIC_ACQUIRE) == seen; k++) {
        pool_relax();
        if (k % POOL_SPIN_CHECK == 0 && (sched_yield(), pool_now_ns() > until)) break;
      }
      pthread_mutex_lock(&s->mu);
      while (__atomic_load_n(&s->gen, __ATOMIC_ACQUIRE) == seen) pthread_cond_wait(&s->cv, &s->mu);
      pthread_mutex_unlock(&s->mu);
    }
    seen = __atomic_load_n(&s->gen, __ATOMIC_ACQUIRE);
    int asked = POOL_ASKED;
    if (!__atomic_compare_exchange_n(&s->state, &asked, POOL_RUNNING, 0, __ATOMIC_ACQ_REL,
                                     __ATOMIC_ACQUIRE))
      continue; /* the caller took the request back: nothing was left to do */
    s->status = pool_participate(s);
    __atomic_store_n(&s->state, POOL_IDLE, __ATOMIC_RELEASE);
    /* -- the last one done wakes the caller (under done_mu: it cannot miss the signal) */
    if (__atomic_sub_fetch(&tpool.pending, 1, __ATOMIC_ACQ_REL) == 0) {
      pthread_mutex_lock(&tpool.done_mu);
      pthread_cond_signal(&tpool.done_cv);
      pthread_mutex_unlock(&tpool.done_mu);
    }
  }
  return NULL;
}

static int pool_forked; /* set in a child after fork: libgomp is unusable there */

/* In a child after fork(): none of the workers exist there, nor libgomp's. Forget ours (their
   scratch is the child's copy, unused: free it), re-create every lock, as a call may have held
   one, and take the pool's own workers from now on. */
static void pool_after_fork_child(void) {
  for (int t = 0; t <= tpool.n_workers && t < POOL_MAX_THREADS; t++) free(tpool.slot[t].scratch);
  memset(&tpool, 0, sizeof tpool);
  pthread_mutex_init(&tpool.call, NULL);
  pthread_mutex_init(&tpool.done_mu, NULL);
  pthread_cond_init(&tpool.done_cv, NULL);
  pool_forked = 1;
}

static void pool_register_fork(void) { pthread_atfork(NULL, NULL, pool_after_fork_child); }

/* 1 where calls run on PyTorch's OpenMP threads (a -fopenmp build, not in a forked child). */
static int pool_is_openmp(void) {
#ifdef _OPENMP
  pthread_once(&pool_once, pool_register_fork);
  return !pool_forked;
#else
  return 0;
#endif
}

/* Start workers until slot[1..want] exist (held: tpool.call). Signals are blocked in them, so
   the process's signals go to its own threads (Python's handlers run on the main thread). */
static void pool_grow(int want) {
  sigset_t all, old;
  sigfillset(&all);
  pthread_sigmask(SIG_SETMASK, &all, &old);
  while (tpool.n_workers < want) {
    PoolSlot *s = &tpool.slot[tpool.n_workers + 1];
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv, NULL);
    pthread_attr_t attr;
    pthread_t tid;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    const int failed = pthread_create(&tid, &attr, pool_worker, s);
    pthread_attr_destroy(&attr);
    if (failed) break; /* fewer threads: the call runs on those there are */
#ifdef __linux__
    char name[16]; /* as ps, top and /proc show it (15 characters) */
    snprintf(name, sizeof name, "%s-%d", POOL_NAME, tpool.n_workers + 1);
    pthread_setname_np(tid, name);
#endif
    tpool.n_workers++;
  }
  pthread_sigmask(SIG_SETMASK, &old, NULL);
}

/* Run task(ctx, scratch) on n participants (the caller and n - 1 workers); the OR of their
   results. */
static int pool_run(pool_task task, void *ctx, int n, size_t scratch_bytes) {
  if (n > POOL_MAX_THREADS) n = POOL_MAX_THREADS;
  if (n < 1) n = 1;
  if (pthread_mutex_trylock(&tpool.call) != 0) {
    /* alone: the workers and slot 0 are another call's (no waiting, no nesting) */
    PoolSlot own = {.scratch = NULL};
    void *scratch = pool_scratch(&own, scratch_bytes);
    const int status = scratch == NULL ? 1 : task(ctx, scratch);
    free(own.scratch);
    return status;
  }
#ifdef _OPENMP
  if (n > 1 && pool_is_openmp()) {
    int status = 0;
#pragma omp parallel num_threads(n)
    {
      PoolSlot *s = &tpool.slot[omp_get_thread_num()];
      void *scratch = pool_scratch(s, scratch_bytes);
      if (scratch == NULL || task(ctx, scratch)) __atomic_store_n(&status, 1, __ATOMIC_RELAXED);
      pool_trim(s);
    }
    pthread_mutex_unlock(&tpool.call);
    return status;
  }
#endif
  pthread_once(&pool_once, pool_register_fork);
  if (tpool.n_workers < n - 1) pool_grow(n - 1); /* the first multi-thread call starts them */
  if (n > tpool.n_workers + 1) n = tpool.n_workers + 1;
  tpool.task = task, tpool.ctx = ctx, tpool.scratch_bytes = scratch_bytes;
  __atomic_store_n(&tpool.pending, n - 1, __ATOMIC_RELEASE);
  /* -- wake workers 1..n-1 (a polling one sees gen move; a parked one gets the signal) */
  for (int t = 1; t < n; t++) {
    PoolSlot *s = &tpool.slot[t];
    s->status = 0;
    __atomic_store_n(&s->state, POOL_ASKED, __ATOMIC_RELEASE);
    pthread_mutex_lock(&s->mu);
    __atomic_add_fetch(&s->gen, 1, __ATOMIC_RELEASE);
    pthread_cond_signal(&s->cv);
    pthread_mutex_unlock(&s->mu);
  }
  int status = pool_participate(&tpool.slot[0]);
  /* -- the work is all claimed: take back the requests no worker has taken yet */
  for (int t = 1; t < n; t++) {
    int asked = POOL_ASKED;
    if (__atomic_compare_exchange_n(&tpool.slot[t].state, &asked, POOL_IDLE, 0, __ATOMIC_ACQ_REL,
                                    __ATOMIC_ACQUIRE))
      __atomic_sub_fetch(&tpool.pending, 1, __ATOMIC_ACQ_REL);
  }
  /* -- wait for the workers: poll for as long as a worker would, then park */
  const uint64_t until = pool_now_ns() + POOL_SPIN_NS;
  for (int k = 1; __atomic_load_n(&tpool.pending, __ATOMIC_ACQUIRE) != 0; k++) {
    pool_relax();
    if (k % POOL_SPIN_CHECK == 0 && (sched_yield(), pool_now_ns() > until)) break;
  }
  pthread_mutex_lock(&tpool.done_mu);
  while (__atomic_load_n(&tpool.pending, __ATOMIC_ACQUIRE) != 0)
    pthread_cond_wait(&tpool.done_cv, &tpool.done_mu);
  pthread_mutex_unlock(&tpool.done_mu);
  for (int t = 1; t < n; t++) status |= tpool.slot[t].status;
  pthread_mutex_unlock(&tpool.call);
  return status;
}

/* -- exported for tests: workers started so far, and make the next n scratch allocations of
   pool calls fail (a worker's failing allocation must still fail the call) */
int pool_workers(void) { return __atomic_load_n(&tpool.n_workers, __ATOMIC_RELAXED); }
/* 1 where calls run on PyTorch's OpenMP threads, 0 on the pool's own workers */
int pool_openmp(void) { return pool_is_openmp(); }
void pool_fail_allocs(int n) { __atomic_store_n(&tpool.failed_allocs, n, __ATOMIC_RELAXED); }

#endif /* SELFATTN_THREAD_POOL_H */
