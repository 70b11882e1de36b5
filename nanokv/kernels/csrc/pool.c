/* The kernels' own threads: a small pool that runs a parallel region's chunks on the calling
 * thread and on whichever workers show up, built to stay steady on a machine whose cores
 * other processes also want (OpenMP's team waits at a barrier for every thread, so one
 * descheduled thread stalls every region, and its idle threads busy-wait for milliseconds).
 *
 * A region (nk_parallel) cuts n items into chunks and publishes them in one 64-bit ticket:
 * (generation, chunk count, next chunk). The caller and the workers claim chunks by
 * compare-and-swap on that ticket and count each finished chunk in `done`; the caller runs
 * the task itself and then waits for the chunks that were claimed to finish, never for a
 * worker that has not shown up: with every worker descheduled the caller runs all chunks,
 * which is one thread's speed at worst. A worker claims its first chunk before it reads the
 * region's task, so a late worker can only claim inside the region it read (the generation
 * is in the ticket), and a region cannot end while one of its chunks is held.
 *
 * A worker with no work spins for SPIN_NS (the gaps between one step's regions are a few
 * microseconds of C or tens of microseconds of Python), on `pause` and then on sched_yield
 * (which hands the core to a thread that wants it, and costs nothing on an idle machine),
 * then sleeps on a futex that the next region wakes (the gaps between steps are
 * milliseconds). The caller waits for claimed chunks the same way: spins, then sleeps until
 * the last chunk's worker wakes it.
 *
 * A worker descheduled while it holds a chunk still stalls its region, for as long as the
 * machine keeps it off a core (milliseconds when every core is taken). So a caller that
 * waited for its workers longer than its own chunks took (where running every chunk alone
 * would have been sooner) runs its next FIRST_BACKOFF regions alone, twice as many after
 * each stall in a row (at most MAX_BACKOFF, a few decode steps), and shares again after a
 * region without one: a busy machine gets about one thread's speed rather than a stall per
 * region, a quiet one never stalls.
 *
 * One region at a time: a second thread calling while a region runs, or a task calling
 * nk_parallel (nested), runs its chunks itself. Which thread runs a chunk never changes what
 * it computes; tasks keep per-thread scratch by allocating it before their first chunk.
 * Workers start at the first region that wants them; a forked child starts its own. */
#define _GNU_SOURCE /* sched_getaffinity, CPU_COUNT */
#include "common.h"

#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define MAX_THREADS 256             /* workers + the caller: far above any core count we run on */
#define IDX_BITS 20                 /* the ticket: generation (24 bits), chunk count, next chunk */
#define MAX_CHUNKS ((1L << IDX_BITS) - 1)
#define IDX(t) ((long)((t) & MAX_CHUNKS))
#define COUNT(t) ((long)(((t) >> IDX_BITS) & MAX_CHUNKS))
#define GEN(t) ((uint32_t)((t) >> (2 * IDX_BITS)))
#define SPIN_NS 100000L             /* how long an idle thread spins before it sleeps */
#define PAUSES 64                   /* spin rounds on `pause` before the rest on sched_yield */
#define STALL_SLACK_NS 200000L      /* a caller waiting this much longer than its own chunks took: a stall */
#define FIRST_BACKOFF 8             /* regions run alone after a stall, doubled after each stall in a row */
#define MAX_BACKOFF 1024
#define CHUNKS_PER_THREAD 2         /* nk_chunk: finer than one share per thread, so a slow thread's share moves */

struct nk_team {
    long n, chunk, count;  /* the region's items, items per chunk, chunks */
    uint32_t gen;
    int tid;               /* 0: the caller; 1..: a worker */
    int serial;            /* the caller runs every chunk: no ticket */
    long held;             /* the chunk this thread holds (-1: none) */
    int first;             /* a worker's first chunk, claimed before the task began */
};

#define LINE __attribute__((aligned(64)))
static struct {
    LINE uint64_t ticket;                 /* (generation, chunks, next chunk) */
    LINE uint32_t done;                   /* chunks finished in this region (a futex) */
    uint32_t waiting;                     /* the caller sleeps on done */
    LINE uint32_t wake;                   /* bumped to wake sleeping workers (a futex) */
    uint32_t sleepers;                    /* workers asleep, or about to be */
    LINE nk_task fn;                      /* the region's task, its argument, items, chunk, threads */
    void *ctx;
    long n, chunk;
    int limit;
    LINE int busy;                        /* a region runs */
    uint32_t held;                        /* nk_pool_test: workers kept from joining (a futex) */
    int workers;                          /* started */
    long serial_left, backoff;            /* regions to run alone after a stall, and the next such run */
    long stalls, regions;                 /* counted, for nk_pool_stats */
    pthread_mutex_t start;
} pool = {.start = PTHREAD_MUTEX_INITIALIZER};

static __thread int wanted;     /* this thread's count for its regions (nk_set_threads); 0: one per core */
static __thread int in_region;  /* a task runs on this thread (a worker's always): nested regions run serially */

#define LOAD(x, o) __atomic_load_n(&(x), __ATOMIC_##o)
#define STORE(x, v, o) __atomic_store_n(&(x), v, __ATOMIC_##o)

static void futex_wait(uint32_t *word, uint32_t value) {
    syscall(SYS_futex, word, FUTEX_WAIT_PRIVATE, value, NULL, NULL, 0);
}

static void futex_wake(uint32_t *word, int count) {
    syscall(SYS_futex, word, FUTEX_WAKE_PRIVATE, count, NULL, NULL, 0);
}

static inline void relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ volatile("yield");
#endif
}

static long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000000000L + ts.tv_nsec;
}

static void set_range(struct nk_team *t, long c, long *begin, long *end) {
    *begin = c * t->chunk;
    *end = *begin + t->chunk < t->n ? *begin + t->chunk : t->n;
}

static void finish(struct nk_team *t) {
    uint32_t d = __atomic_add_fetch(&pool.done, 1, __ATOMIC_SEQ_CST);
    if ((long)d == t->count && LOAD(pool.waiting, SEQ_CST)) futex_wake(&pool.done, 1);
    t->held = -1;
}

/* the next chunk of this region, claimed from the ticket: -1 when none is left */
static long claim(uint32_t gen) {
    uint64_t t = LOAD(pool.ticket, ACQUIRE);
    do {
        if (GEN(t) != gen || IDX(t) >= COUNT(t)) return -1;
    } while (!__atomic_compare_exchange_n(&pool.ticket, &t, t + 1, 1, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE));
    return IDX(t);
}

/* [*begin, *end): the next chunk of items for this thread; 0 when the region has none left
 * (the chunk returned before is finished then; a task touches its argument no more). */
int nk_next(struct nk_team *t, long *begin, long *end) {
    if (t->serial) {
        if (t->held >= t->count) return 0;
        set_range(t, t->held++, begin, end);
        return 1;
    }
    if (t->first) {
        t->first = 0;
        set_range(t, t->held, begin, end);
        return 1;
    }
    if (t->held >= 0) finish(t);
    long c = claim(t->gen);
    if (c < 0) return 0;
    t->held = c;
    set_range(t, c, begin, end);
    return 1;
}

int nk_team_id(const struct nk_team *t) { return t->tid; }

/* a worker's wait for a region newer than `seen`: spin, then sleep until woken */
static uint64_t await_region(uint32_t seen) {
    for (;;) {
        long deadline = now_ns() + SPIN_NS;
        for (int i = 1;; i++) {
            uint64_t t = LOAD(pool.ticket, ACQUIRE);
            if (GEN(t) != seen) return t;
            if (i % 64 == 0 && now_ns() > deadline) break;
            if (i > PAUSES) sched_yield(); /* a core another thread wants is handed over */
            else relax();
        }
        uint32_t w = LOAD(pool.wake, SEQ_CST);
        __atomic_add_fetch(&pool.sleepers, 1, __ATOMIC_SEQ_CST);
        if (GEN(LOAD(pool.ticket, SEQ_CST)) == seen) futex_wait(&pool.wake, w);
        __atomic_sub_fetch(&pool.sleepers, 1, __ATOMIC_SEQ_CST);
    }
}

static void *worker(void *arg) {
    int tid = (int)(intptr_t)arg;
    in_region = 1;
    uint32_t seen = GEN(LOAD(pool.ticket, ACQUIRE));
    for (;;) {
        uint64_t t = await_region(seen);
        seen = GEN(t);
        while (LOAD(pool.held, ACQUIRE)) futex_wait(&pool.held, 1);
        if (tid >= LOAD(pool.limit, RELAXED)) continue; /* (a later region's limit: the claim fails) */
        long c = claim(seen);
        if (c < 0) continue;
        /* the chunk is held, so the region is this one until it is finished */
        struct nk_team team = {.n = LOAD(pool.n, RELAXED), .chunk = LOAD(pool.chunk, RELAXED), .count = COUNT(t),
                               .gen = seen, .tid = tid, .held = c, .first = 1};
        LOAD(pool.fn, RELAXED)(LOAD(pool.ctx, RELAXED), &team);
    }
    return NULL;
}

static void forked_child(void) { /* the workers did not come along */
    pool.workers = 0;
    pool.busy = 0;
    pool.sleepers = 0;
    pthread_mutex_init(&pool.start, NULL);
}

/* workers 1..n-1 started, if not yet (as many as can be: fewer only means fewer helpers) */
static void start_workers(int n) {
    static int registered;
    pthread_mutex_lock(&pool.start);
    if (!registered) registered = !pthread_atfork(NULL, NULL, forked_child);
    if (pool.workers < n - 1) {
        sigset_t all, old;
        sigfillset(&all);
        pthread_sigmask(SIG_SETMASK, &all, &old); /* signals stay with the application's threads */
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        while (pool.workers < n - 1) {
            pthread_t th;
            if (pthread_create(&th, &attr, worker, (void *)(intptr_t)(pool.workers + 1))) break;
            pool.workers++;
        }
        pthread_attr_destroy(&attr);
        pthread_sigmask(SIG_SETMASK, &old, NULL);
    }
    pthread_mutex_unlock(&pool.start);
}

static int cores(void) {
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0) return CPU_COUNT(&set);
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? (int)n : 1;
}

void nk_set_threads(int n) { wanted = n < 1 ? 1 : n > MAX_THREADS ? MAX_THREADS : n; }

int nk_threads(void) {
    if (!wanted) nk_set_threads(cores());
    return wanted;
}

long nk_chunk(long n) {
    long c = n / (CHUNKS_PER_THREAD * nk_threads());
    return c > 0 ? c : 1;
}

int nk_pool_workers(void) { return LOAD(pool.workers, RELAXED); }

/* regions shared with the workers so far, and how many of them stalled */
void nk_pool_stats(long *regions, long *stalls) {
    *regions = pool.regions;
    *stalls = pool.stalls;
}

/* fn(ctx, team) on this thread and on the workers that join, each taking chunks of `chunk`
 * items of [0, n) with nk_next until none is left; parallel == 0 (a region too small to
 * share): this thread alone. Returns when every chunk is finished. */
void nk_parallel(long n, long chunk, int parallel, nk_task fn, void *ctx) {
    if (n <= 0) return;
    if (chunk < 1) chunk = 1;
    if ((n + chunk - 1) / chunk > MAX_CHUNKS) chunk = (n + MAX_CHUNKS - 1) / MAX_CHUNKS;
    long count = (n + chunk - 1) / chunk;
    int threads = nk_threads();
    int expected = 0;
    if (!parallel || threads < 2 || count < 2 || in_region ||
        !__atomic_compare_exchange_n(&pool.busy, &expected, 1, 0, __ATOMIC_ACQUIRE, __ATOMIC_RELAXED)) {
        struct nk_team team = {.n = n, .chunk = chunk, .count = count, .serial = 1, .held = 0};
        fn(ctx, &team);
        return;
    }
    if (pool.serial_left > 0) {
        pool.serial_left--;
        STORE(pool.busy, 0, RELEASE);
        struct nk_team team = {.n = n, .chunk = chunk, .count = count, .serial = 1, .held = 0};
        fn(ctx, &team);
        return;
    }
    if (pool.workers < threads - 1) start_workers(threads);
    STORE(pool.fn, fn, RELAXED);
    STORE(pool.ctx, ctx, RELAXED);
    STORE(pool.n, n, RELAXED);
    STORE(pool.chunk, chunk, RELAXED);
    STORE(pool.limit, threads, RELAXED);
    STORE(pool.done, 0, RELAXED);
    STORE(pool.waiting, 0, RELAXED);
    uint32_t gen = (GEN(LOAD(pool.ticket, RELAXED)) + 1) & 0xffffff;
    STORE(pool.ticket, (uint64_t)gen << (2 * IDX_BITS) | (uint64_t)count << IDX_BITS, SEQ_CST);
    if (LOAD(pool.sleepers, SEQ_CST)) {
        __atomic_add_fetch(&pool.wake, 1, __ATOMIC_SEQ_CST);
        futex_wake(&pool.wake, threads - 1);
    }
    struct nk_team team = {.n = n, .chunk = chunk, .count = count, .gen = gen, .held = -1};
    pool.regions++;
    long t0 = now_ns();
    in_region = 1;
    fn(ctx, &team);
    in_region = 0;
    /* every chunk is claimed now: wait for those still running elsewhere */
    long t1 = now_ns(), deadline = t1 + SPIN_NS;
    for (int i = 1; (long)LOAD(pool.done, ACQUIRE) < count; i++) {
        if (i % 64 == 0 && now_ns() > deadline) {
            STORE(pool.waiting, 1, SEQ_CST);
            uint32_t d;
            while ((long)(d = LOAD(pool.done, SEQ_CST)) < count) futex_wait(&pool.done, d);
            break;
        }
        relax();
    }
    if (now_ns() - t1 > t1 - t0 + STALL_SLACK_NS) { /* a stall: the caller alone would have been done sooner */
        pool.backoff = pool.backoff ? (2 * pool.backoff < MAX_BACKOFF ? 2 * pool.backoff : MAX_BACKOFF) : FIRST_BACKOFF;
        pool.serial_left = pool.backoff;
        pool.stalls++;
    } else {
        pool.backoff = 0;
    }
    STORE(pool.busy, 0, RELEASE);
}

/* ---- for tests (tests/kernels/test_pool.py) ---- */
struct test_call {
    int32_t *runs, *tids;
    long inner;
};

static void count_task(void *ctx, struct nk_team *team) {
    int32_t *runs = ctx;
    for (long b, e; nk_next(team, &b, &e);)
        for (long i = b; i < e; i++) __atomic_add_fetch(runs, 1, __ATOMIC_RELAXED);
}

static void test_task(void *ctx, struct nk_team *team) {
    const struct test_call *c = ctx;
    for (long b, e; nk_next(team, &b, &e);)
        for (long i = b; i < e; i++) {
            __atomic_add_fetch(c->runs + i, 1, __ATOMIC_RELAXED);
            c->tids[i] = nk_team_id(team);
            if (c->inner) nk_parallel(c->inner, 1, 1, count_task, c->runs + i); /* nested: this thread alone */
        }
}

/* `regions` regions of n items in chunks of `chunk`: item i adds 1 to runs[i] (and `inner`
 * more from a nested region) and writes the id of the thread that ran it to tids[i] (0: the
 * caller). hold: the workers are kept from joining, as if the machine never ran them. */
void nk_pool_test(long n, long chunk, long regions, int32_t *runs, int32_t *tids, long inner, int hold) {
    struct test_call c = {runs, tids, inner};
    if (hold) STORE(pool.held, 1, SEQ_CST);
    for (long r = 0; r < regions; r++) nk_parallel(n, chunk, 1, test_task, &c);
    if (hold) {
        STORE(pool.held, 0, SEQ_CST);
        futex_wake(&pool.held, INT_MAX);
    }
}
