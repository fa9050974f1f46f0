/* The worker threads of the native CPU kernels.
 *
 * OpenMP with passive waits (the default of the engine's processes) puts its threads to sleep at the
 * end of every parallel region, so the next region starts by waking them: ~50 us on this project's
 * 2-vCPU machines, and a decode step of a small model runs some 40 regions. With spinning waits the
 * wake-up is gone, but a spinning thread keeps its core from anything else, and on a busy 2-core
 * machine (the scheduler's own thread, the detokenizer, the HTTP process) a thread that spins while
 * its partner is descheduled wastes whole time slices (a bs-1 decode step 2x slower under one busy
 * process). The pool's threads wait for the next job by yielding spins: sched_yield between checks,
 * so a waiting thread takes a core only while nobody else wants it, and the next job starts within
 * microseconds. After ENGINE_CPU_POOL_SPIN_US (default 2000) without a job a thread sleeps on a
 * futex (an idle server costs nothing). The caller runs share 0 of every job itself. Where the
 * machine has more runnable threads than cores the pool notices and runs jobs on the caller alone
 * for a while (note_contention). Measured on the 2-core AMD EPYC, small Llama bf16, decode steps at
 * batch 1 / 16 / 64: 6.6 / 11.1 / 29.7 ms against 7.9-10.5 / 12.6-13.3 / 31.5-41.7 with OpenMP's
 * passive waits; beside one busy process 11.7 / 19.8 / 56.5 against 8.3-9.7 / 17.6-19.7 / 55.6-65.
 *
 * pool_run(fn, ctx, n) runs fn(ctx, tid, n) for tid 0..n-1 and returns when all are done; one job at
 * a time (a second caller, or a job started from inside a job, runs alone on its own thread).
 * pool_barrier(n) waits for all n threads of the current job.
 */
#define _GNU_SOURCE
#include "cpu_common.h"

#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define POOL_MAX_THREADS 256

static long pool_spin_us = -1; /* ENGINE_CPU_POOL_SPIN_US, default 2000 */

static struct {
    pthread_mutex_t run_lock;
    _Atomic uint32_t generation; /* bumped per job; the futex the idle threads sleep on */
    _Atomic int pending;         /* started threads that have not finished the current job */
    _Atomic int sleepers;
    pool_fn fn;
    void *ctx;
    int nthreads;
    int started; /* worker threads (tids 1..started) */
    uint32_t start_generation; /* the generation a new worker waits past (set before it starts) */
    _Atomic int bar_count;
    _Atomic uint32_t bar_generation;
} P = {.run_lock = PTHREAD_MUTEX_INITIALIZER};

static double now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e6 + (double)ts.tv_nsec * 1e-3;
}

static double thread_cpu_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (double)ts.tv_sec * 1e6 + (double)ts.tv_nsec * 1e-3;
}

/* On a machine with more runnable threads than cores a spinning worker still looks busy to the
 * kernel's load balancer, which then leaves the caller sharing a core with someone else: measured on
 * 2 cores beside one busy process, a bs-16 decode step took 32 ms with the pool against 18 ms on one
 * thread. So the pool watches for it: a job whose caller was descheduled during its own share (wall
 * time well above its CPU time), or waited far longer for the workers than its share took, is
 * suspect. A virtual machine's own jitter makes some jobs suspect anyway, so only a run of them
 * (a decaying score past CONTENTION_SCORE) counts: then jobs run on the caller alone for
 * CONTENTION_HOLD_US, after which the pool tries again. */
#define CONTENTION_SCORE 4.
#define CONTENTION_HOLD_US 200000.
static double contended_until = 0., suspect_score = 0.;

static void note_contention(double share_wall, double share_cpu, double wait) {
    const int preempted = share_wall > 30. && share_wall > 1.5 * share_cpu + 10.;
    const int left_waiting = wait > 50. && wait > 2. * share_wall;
    suspect_score = 0.9 * suspect_score + (preempted || left_waiting ? 1. : 0.);
    if (suspect_score > CONTENTION_SCORE) {
        contended_until = now_us() + CONTENTION_HOLD_US;
        suspect_score = 0.;
    }
}

static inline void relax(void) {
#if defined(__x86_64__)
    __builtin_ia32_pause();
#endif
}

/* Wait for a job after generation `seen`: pause-spin, then yield-spin, then sleep on the futex. */
static uint32_t wait_generation(uint32_t seen) {
    uint32_t g;
    int spins = 0;
    double start = 0.;
    while ((g = atomic_load_explicit(&P.generation, memory_order_acquire)) == seen) {
        if (++spins < 128) {
            relax();
            continue;
        }
        if (start == 0.) start = now_us();
        if (now_us() - start < (double)pool_spin_us) {
            sched_yield();
            continue;
        }
        atomic_fetch_add(&P.sleepers, 1);
        syscall(SYS_futex, (uint32_t *)&P.generation, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
        atomic_fetch_sub(&P.sleepers, 1);
        spins = 0;
        start = 0.;
    }
    return g;
}

static void *worker_main(void *arg) {
    const int tid = (int)(intptr_t)arg;
    uint32_t seen = P.start_generation; /* read before the job that started it was published */
    for (;;) {
        seen = wait_generation(seen);
        if (tid < P.nthreads) P.fn(P.ctx, tid, P.nthreads);
        atomic_fetch_sub_explicit(&P.pending, 1, memory_order_release);
    }
    return NULL;
}

static void reset_after_fork(void) { /* the child has none of the parent's threads */
    pthread_mutex_init(&P.run_lock, NULL);
    P.started = 0;
    atomic_store(&P.pending, 0);
    atomic_store(&P.sleepers, 0);
}

static void start_workers(int upto) {
    if (pool_spin_us < 0) {
        const char *env = getenv("ENGINE_CPU_POOL_SPIN_US");
        pool_spin_us = env != NULL ? atol(env) : 2000;
        pthread_atfork(NULL, NULL, reset_after_fork);
    }
    P.start_generation = atomic_load(&P.generation);
    while (P.started < upto - 1) {
        pthread_t th;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        const int ok = pthread_create(&th, &attr, worker_main, (void *)(intptr_t)(P.started + 1)) == 0;
        pthread_attr_destroy(&attr);
        if (!ok) break;
        P.started++;
    }
}

void pool_run(pool_fn fn, void *ctx, int nthreads) {
    if (nthreads > POOL_MAX_THREADS) nthreads = POOL_MAX_THREADS;
    if (nthreads <= 1 || pthread_mutex_trylock(&P.run_lock) != 0) {
        fn(ctx, 0, 1);
        return;
    }
    start_workers(nthreads);
    if (P.started + 1 < nthreads) nthreads = P.started + 1; /* thread creation failed */
    if (nthreads <= 1) {
        pthread_mutex_unlock(&P.run_lock);
        fn(ctx, 0, 1);
        return;
    }
    const double t0 = now_us();
    if (t0 < contended_until) { /* see note_contention */
        pthread_mutex_unlock(&P.run_lock);
        fn(ctx, 0, 1);
        return;
    }
    P.fn = fn;
    P.ctx = ctx;
    P.nthreads = nthreads;
    atomic_store(&P.bar_count, 0);
    atomic_store_explicit(&P.pending, P.started, memory_order_relaxed);
    atomic_fetch_add_explicit(&P.generation, 1, memory_order_release);
    if (atomic_load(&P.sleepers) > 0)
        syscall(SYS_futex, (uint32_t *)&P.generation, FUTEX_WAKE_PRIVATE, INT32_MAX, NULL, NULL, 0);
    const double c0 = thread_cpu_us();
    fn(ctx, 0, nthreads);
    const double t1 = now_us(), c1 = thread_cpu_us();
    int spins = 0;
    while (atomic_load_explicit(&P.pending, memory_order_acquire) > 0) {
        if (++spins < 128) relax();
        else sched_yield();
    }
    note_contention(t1 - t0, c1 - c0, now_us() - t1);
    pthread_mutex_unlock(&P.run_lock);
}

void pool_barrier(int nthreads) {
    if (nthreads <= 1) return;
    const uint32_t gen = atomic_load_explicit(&P.bar_generation, memory_order_acquire);
    if (atomic_fetch_add(&P.bar_count, 1) == nthreads - 1) { /* the last one in opens it */
        atomic_store(&P.bar_count, 0);
        atomic_fetch_add_explicit(&P.bar_generation, 1, memory_order_release);
        return;
    }
    int spins = 0;
    while (atomic_load_explicit(&P.bar_generation, memory_order_acquire) == gen) {
        if (++spins < 128) relax();
        else sched_yield();
    }
}

/* Rows [lo, hi) of n for thread tid of nt: contiguous, balanced ranges. */
void pool_range(int64_t n, int tid, int nt, int64_t *lo, int64_t *hi) {
    *lo = n * tid / nt;
    *hi = n * (tid + 1) / nt;
}
