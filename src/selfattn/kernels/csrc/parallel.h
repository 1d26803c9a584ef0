/* Running a kernel's worker on n threads: PyTorch's own OpenMP threads where the build links the
   OpenMP runtime PyTorch loaded, POSIX threads started for the call elsewhere. Included by each
   kernel source (static functions: one copy per library); the build hashes this file with them.

   Why PyTorch's threads (session 8, 2-core Zen 5 EPYC, torch 2.13 linking GNU libgomp): after a
   parallel PyTorch op, libgomp's worker spins for milliseconds waiting for the next one
   (GOMP_SPINCOUNT; OMP_WAIT_POLICY unset). A thread of ours started in that window shares a
   core with the spinning worker: a bf16 window-256 forward at S=16384 run right after PyTorch
   ops took ~1.7x its time (OMP_WAIT_POLICY=PASSIVE, which stops the spin, measured 48-64 ms
   against 92-122 ms on a busy host), a bf16 decode 1.19x. Run on the same runtime, the kernel's
   parallel region takes over those spinning workers: no second set of threads, and no
   pthread_create and join per call. The build adds -fopenmp only where PyTorch's runtime is
   libgomp (kernels/build.py: openmp_flags); the loader then binds our libgomp.so.1 to the copy
   already in the process (one soname, loaded once), so there is one thread pool.

   libgomp's threads do not survive fork: a child of a process that ran a parallel region hangs
   in its next one (PyTorch's own ops too). A child therefore runs the POSIX-threads path here
   (pthread_atfork marks it). Nested inside another parallel region, OpenMP gives the inner
   region one thread; the work is then done on the calling thread, as the result is the same
   for any thread count. */
#ifndef SELFATTN_PARALLEL_H
#define SELFATTN_PARALLEL_H

#include <pthread.h>

#ifdef _OPENMP
#include <omp.h>
#endif

/* POSIX threads beyond which a call runs with fewer (the caller works too). */
#define PARALLEL_MAX_THREADS 256

typedef void *(*parallel_worker)(void *);

#ifdef _OPENMP
static int parallel_forked; /* set in a child process after fork: libgomp unusable there */
static pthread_once_t parallel_once = PTHREAD_ONCE_INIT;
static void parallel_on_fork_child(void) { parallel_forked = 1; }
static void parallel_init(void) { pthread_atfork(NULL, NULL, parallel_on_fork_child); }
#endif

/* 1 where this build runs its workers on PyTorch's OpenMP threads (the host reports it). */
static int parallel_is_openmp(void) {
#ifdef _OPENMP
  pthread_once(&parallel_once, parallel_init);
  return !parallel_forked;
#else
  return 0;
#endif
}

/* worker(arg) on n threads (the caller one of them), each pulling work items until none is
   left; returns 1 when any worker returned non-NULL (its scratch memory ran out), else 0. */
static int parallel_run(parallel_worker worker, void *arg, int n) {
  int bad = 0, started = 0, t;
  pthread_t tid[PARALLEL_MAX_THREADS];
  if (n > PARALLEL_MAX_THREADS) n = PARALLEL_MAX_THREADS;
  if (n <= 1) return worker(arg) != NULL;
#ifdef _OPENMP
  if (parallel_is_openmp()) {
#pragma omp parallel num_threads(n)
    {
      if (worker(arg) != NULL) __atomic_store_n(&bad, 1, __ATOMIC_RELAXED);
    }
    return bad;
  }
#endif
  for (t = 1; t < n; t++)
    if (pthread_create(&tid[started], NULL, worker, arg) == 0) started++;
  bad |= worker(arg) != NULL;
  for (t = 0; t < started; t++) {
    void *ret;
    pthread_join(tid[t], &ret);
    bad |= ret != NULL;
  }
  return bad;
}

#endif
