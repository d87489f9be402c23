/* tripwire's native quiet tick.
 *
 * Why this exists: the Python reader thread shares the GIL with the engine. A Python tick that wakes on a cold core
 * holds the GIL even when nothing happened, and that time is taken from the engine's Python (benchmarks/RESULTS.md,
 * q3, has what it costs a step loop). Nearly every tick is quiet (the counters did not move), so this thread
 * does the quiet ones without Python: query the event of the copy in flight, compare the landed rows with the rows the
 * monitor processed last (memcmp), start the next copy. Only a change (or an error) hands the device back to Python,
 * which then runs its normal tick: the decode, the confirmation and the report stay in one place (monitor.py).
 *
 * What this thread never does: wait on the GPU (the event is only queried), allocate, take the GIL, or call into
 * Python. It calls the driver through the function pointers Python hands it (resolved from the libcuda.so.1 already
 * loaded), so it is built without CUDA headers or libraries; CPU arenas get plain memcpy "drivers" from this file.
 *
 * Ownership: while "engaged", this thread alone touches the devices' copy state. The mutex guards only the state
 * words (engaged, ticking, stop, kicked, reason), never a tick: a tick runs with "ticking" set and the mutex free, so
 * a driver call that blocks (an enqueue behind a hung stream) never blocks tw_kick, tw_wait or interpreter exit.
 * tw_pause ends the engagement and waits (with a limit, if asked) until no tick is running; a change or an error
 * ends it when the tick is over. Either way Python touches the devices only once no tick runs. Python reads the
 * counters (copies, ticks...) racily: aligned 8-byte loads, which are whole on every target torch supports.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define TW_NOT_READY 600 /* CUDA_ERROR_NOT_READY */
#define TW_TRACE 8192    /* tick spans kept for the benchmark's attribution (a ring) */

/* Reasons an engagement ended, as tw_wait reports them. */
#define TW_TIMEOUT 0
#define TW_CHANGED 1
#define TW_ERROR 2
#define TW_KICKED 3

typedef int (*query_fn)(void *event);
typedef int (*copy_fn)(void *dst, uint64_t src, size_t nbytes, void *stream);
typedef int (*record_fn)(void *event, void *stream);
typedef int (*push_fn)(void *ctx);
typedef int (*pop_fn)(void **ctx);
typedef int (*mode_fn)(int *mode);

/* One device. Mirrors tripwire._runtime.native._Dev field for field. */
typedef struct {
    query_fn query;
    copy_fn copy;
    record_fn record;
    push_fn push;
    pop_fn pop;
    void *ctx; /* NULL: no context to push (CPU arenas) */
    void *stream;
    void *event;
    uint64_t src;       /* the arena (a device pointer, or a host address for CPU arenas) */
    char *mirror;       /* where copies land (pinned host memory for CUDA) */
    char *ref;          /* the rows Python processed last, zero past them (capacity rows) */
    int64_t row_bytes;
    int64_t has_ref;    /* 0: any landed copy is a change (Python has processed nothing yet) */
    int64_t pending;    /* rows of the copy in flight; 0 when none (shared with Python's reader) */
    int64_t copies;     /* statistics, written here, read by Python */
    int64_t bytes;
    int64_t quiet;
    int64_t err;        /* the driver error that ended the engagement */
    int64_t err_call;   /* 1 query, 2 copy, 3 record, 4 push */
} tw_dev;

/* The shared configuration and state. Mirrors tripwire._runtime.native._Cfg. */
typedef struct {
    int64_t interval_ns;
    int64_t idle_tail_ns;
    int64_t n_rows;        /* rows to copy: written by Python when sites are registered */
    uint8_t *active;       /* the byte check() sets: consumed here while engaged (exchange to 0) */
    int64_t last_active_ns;/* CLOCK_MONOTONIC; in at engage, out at the end */
    int64_t ndev;
    tw_dev *devs;
    mode_fn relax;         /* cuThreadExchangeStreamCaptureMode, or NULL when no CUDA device is read */
    int64_t relax_err;     /* -1 not tried yet, else its result */
    int64_t ticks;         /* statistics */
    int64_t idle_skips;
    int64_t last_tick_ns;  /* CLOCK_MONOTONIC start of the latest tick (0: none yet), for Monitor.health() */
    int64_t reason;        /* why the last engagement ended */
    int64_t changed_dev;   /* the device that ended it (CHANGED or ERROR; -1: the capture-mode exchange) */
    int64_t trace_on;
    int64_t trace_n;       /* spans written so far (the ring holds the last TW_TRACE) */
    int64_t trace[2 * TW_TRACE];
} tw_cfg;

typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t to_native; /* engage, pause, stop */
    pthread_cond_t to_python; /* an engagement ended (tw_wait) */
    pthread_cond_t tick_done; /* ticking went to 0 (tw_pause) */
    pthread_t thread;
    int started;
    int joined;
    int stop;
    int engaged;
    int ticking;
    int kicked;
    int64_t next_ns;
    tw_cfg *cfg;
} tw_ticker;

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static struct timespec abs_ts(int64_t ns) {
    struct timespec ts;
    ts.tv_sec = ns / 1000000000LL;
    ts.tv_nsec = ns % 1000000000LL;
    return ts;
}

/* now + ns without overflow (Python clamps its values to 2**61 ns; this keeps C safe on its own). */
static int64_t deadline(int64_t ns) {
    int64_t now = now_ns();
    return ns > INT64_MAX - now ? INT64_MAX : now + ns;
}

/* Host "drivers" for CPU arenas (and the CPU tests): a copy is a memcpy that has landed at once. */
int tw_host_query(void *event) { (void)event; return 0; }
int tw_host_copy(void *dst, uint64_t src, size_t n, void *stream) { (void)stream; memcpy(dst, (const void *)src, n); return 0; }
int tw_host_record(void *event, void *stream) { (void)event; (void)stream; return 0; }

static int dev_error(tw_dev *d, int64_t i, int rc, int call, int64_t *dev) {
    d->err = rc;
    d->err_call = call;
    *dev = i;
    return TW_ERROR;
}

/* One quiet tick over every device, run WITHOUT the mutex (ticking is set). Touches only the devices and the
 * statistics; returns 0 to go on, else why the engagement must end (and *dev says where). */
static int tick(tw_cfg *c, int64_t *dev) {
    int64_t start = now_ns();
    c->ticks++;
    c->last_tick_ns = start;
    if (__atomic_exchange_n(c->active, 0, __ATOMIC_RELAXED)) c->last_active_ns = start;
    /* Python's rule (monitor._poll): idle = no check() for idle_tail (no confirmation can be pending while engaged). */
    if (start - c->last_active_ns > c->idle_tail_ns) {
        c->idle_skips++;
        return 0;
    }
    if (c->relax && c->relax_err == -1) {
        /* The capture mode is per thread: relax this one before its first CUDA call, like the Python reader. */
        int mode = 2; /* CU_STREAM_CAPTURE_MODE_RELAXED */
        c->relax_err = c->relax(&mode);
    }
    if (c->relax && c->relax_err != 0) {
        *dev = -1;
        return TW_ERROR;
    }
    int64_t n = __atomic_load_n(&c->n_rows, __ATOMIC_RELAXED);
    int ended = 0;
    for (int64_t i = 0; i < c->ndev && !ended; i++) {
        tw_dev *d = &c->devs[i];
        int rc;
        if (d->ctx && (rc = d->push(d->ctx)) != 0) {
            ended = dev_error(d, i, rc, 4, dev);
            break;
        }
        if (d->pending) {
            rc = d->query(d->event); /* returns at once: never a wait on the GPU */
            if (rc == TW_NOT_READY) goto next;
            if (rc != 0) { ended = dev_error(d, i, rc, 1, dev); goto next; }
            if (!d->has_ref || memcmp(d->mirror, d->ref, (size_t)(d->pending * d->row_bytes)) != 0) {
                /* Something moved: Python's tick picks up this landed copy (pending stays set) and decodes it. */
                *dev = i;
                ended = TW_CHANGED;
                goto next;
            }
            d->quiet++;
            d->pending = 0;
        }
        if (n > 0) {
            size_t nbytes = (size_t)(n * d->row_bytes);
            if ((rc = d->copy(d->mirror, d->src, nbytes, d->stream)) != 0) { ended = dev_error(d, i, rc, 2, dev); goto next; }
            if ((rc = d->record(d->event, d->stream)) != 0) { ended = dev_error(d, i, rc, 3, dev); goto next; }
            d->pending = n;
            d->copies++;
            d->bytes += (int64_t)nbytes;
        }
    next:
        if (d->ctx) { void *old; d->pop(&old); }
    }
    if (c->trace_on) {
        int64_t k = c->trace_n % TW_TRACE;
        c->trace[2 * k] = start;
        c->trace[2 * k + 1] = now_ns();
        c->trace_n++;
    }
    return ended;
}

static void *run(void *arg) {
    tw_ticker *t = (tw_ticker *)arg;
    pthread_mutex_lock(&t->mu);
    while (!t->stop) {
        if (!t->engaged) {
            pthread_cond_wait(&t->to_native, &t->mu);
            continue;
        }
        struct timespec due = abs_ts(t->next_ns);
        int rc = pthread_cond_timedwait(&t->to_native, &t->mu, &due);
        if (t->stop || !t->engaged) continue;
        if (rc != ETIMEDOUT && now_ns() < t->next_ns) continue; /* a spurious or unrelated wake-up */
        t->ticking = 1;
        pthread_mutex_unlock(&t->mu);
        int64_t dev = -1;
        int ended = tick(t->cfg, &dev);
        pthread_mutex_lock(&t->mu);
        t->ticking = 0;
        if (ended) {
            /* Recorded even when a pause came first: Python's detach reads the reason (an error is reported). */
            t->engaged = 0;
            t->cfg->reason = ended;
            t->cfg->changed_dev = dev;
            pthread_cond_broadcast(&t->to_python);
        }
        pthread_cond_broadcast(&t->tick_done);
        int64_t now = now_ns();
        t->next_ns += t->cfg->interval_ns;
        if (t->next_ns <= now) t->next_ns = now + t->cfg->interval_ns; /* fell behind: no burst of catch-up ticks */
    }
    pthread_mutex_unlock(&t->mu);
    return NULL;
}

void *tw_new(tw_cfg *cfg) {
    tw_ticker *t = (tw_ticker *)calloc(1, sizeof(tw_ticker));
    if (!t) return NULL;
    pthread_condattr_t a;
    pthread_condattr_init(&a);
    pthread_condattr_setclock(&a, CLOCK_MONOTONIC);
    pthread_mutex_init(&t->mu, NULL);
    pthread_cond_init(&t->to_native, &a);
    pthread_cond_init(&t->to_python, &a);
    pthread_cond_init(&t->tick_done, &a);
    pthread_condattr_destroy(&a);
    t->cfg = cfg;
    /* Every signal blocked in the new thread (it inherits this mask): Ctrl-C and friends go to Python's threads. */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    int rc = pthread_create(&t->thread, NULL, run, t);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (rc != 0) {
        free(t);
        return NULL;
    }
    t->started = 1;
    pthread_setname_np(t->thread, "tripwire-native"); /* how ps, py-spy and the tests tell it apart */
    return t;
}

/* Hand the devices to the native thread; its first tick is one interval from now. */
void tw_engage(tw_ticker *t) {
    pthread_mutex_lock(&t->mu);
    t->engaged = 1; /* kicked is not cleared: a stop that raced this engage must still end the next tw_wait */
    t->cfg->reason = TW_TIMEOUT;
    t->cfg->changed_dev = -1;
    t->next_ns = deadline(t->cfg->interval_ns);
    pthread_cond_broadcast(&t->to_native);
    pthread_mutex_unlock(&t->mu);
}

/* End the engagement and wait until no tick runs (never for the GPU: a tick only queries and enqueues). With
 * timeout_ns >= 0, give up after that long: returns 1 if a tick is still running (Python must then NOT touch the
 * devices), else 0. */
int tw_pause(tw_ticker *t, int64_t timeout_ns) {
    pthread_mutex_lock(&t->mu);
    t->engaged = 0;
    pthread_cond_broadcast(&t->to_native);
    pthread_cond_broadcast(&t->to_python);
    struct timespec due = abs_ts(deadline(timeout_ns < 0 ? 0 : timeout_ns));
    while (t->ticking) {
        if (timeout_ns < 0) pthread_cond_wait(&t->tick_done, &t->mu);
        else if (pthread_cond_timedwait(&t->tick_done, &t->mu, &due) != 0) break;
    }
    int busy = t->ticking;
    pthread_mutex_unlock(&t->mu);
    return busy;
}

/* Python's reader waits here (GIL released) until the engagement ends, timeout_ns passes, or tw_kick. */
int64_t tw_wait(tw_ticker *t, int64_t timeout_ns) {
    pthread_mutex_lock(&t->mu);
    struct timespec due = abs_ts(deadline(timeout_ns < 0 ? 0 : timeout_ns));
    /* Any error (ETIMEDOUT, or EINVAL for a deadline out of range) ends the wait: looping on it would spin. */
    while (t->engaged && !t->kicked && pthread_cond_timedwait(&t->to_python, &t->mu, &due) == 0) {}
    int64_t reason = t->kicked ? TW_KICKED : (t->engaged ? TW_TIMEOUT : t->cfg->reason);
    t->kicked = 0;
    pthread_mutex_unlock(&t->mu);
    return reason;
}

void tw_kick(tw_ticker *t) {
    pthread_mutex_lock(&t->mu);
    t->kicked = 1;
    pthread_cond_broadcast(&t->to_python);
    pthread_mutex_unlock(&t->mu);
}

/* Stop the thread and join it, waiting at most timeout_ns (< 0: no limit). Returns 0 once joined, 1 if a tick is
 * still running past the limit (a driver call that blocks): the thread is then left to finish on its own and the
 * ticker must never be freed. */
int tw_stop(tw_ticker *t, int64_t timeout_ns) {
    pthread_mutex_lock(&t->mu);
    t->stop = 1;
    t->engaged = 0;
    t->kicked = 1;
    pthread_cond_broadcast(&t->to_native);
    pthread_cond_broadcast(&t->to_python);
    pthread_mutex_unlock(&t->mu);
    if (!t->started || t->joined) return 0;
    int rc;
    if (timeout_ns < 0) {
        rc = pthread_join(t->thread, NULL);
    } else {
        struct timespec due;
        clock_gettime(CLOCK_REALTIME, &due); /* pthread_timedjoin_np takes a CLOCK_REALTIME deadline */
        int64_t ns = (int64_t)due.tv_nsec + (timeout_ns % 1000000000LL);
        due.tv_sec += (time_t)(timeout_ns / 1000000000LL + ns / 1000000000LL);
        due.tv_nsec = (long)(ns % 1000000000LL);
        rc = pthread_timedjoin_np(t->thread, NULL, &due);
    }
    if (rc == 0) t->joined = 1;
    return rc == 0 ? 0 : 1;
}

/* Free a ticker whose thread was joined (tw_stop returned 0). Only once nothing can call into it again. */
void tw_free(tw_ticker *t) {
    if (!t || (t->started && !t->joined)) return; /* a thread still running keeps its ticker: leaked, not freed */
    pthread_cond_destroy(&t->to_native);
    pthread_cond_destroy(&t->to_python);
    pthread_cond_destroy(&t->tick_done);
    pthread_mutex_destroy(&t->mu);
    free(t);
}

/* The CPU time the native thread has used (ns), for the benchmarks' reader-CPU figures; -1 if unavailable. */
int64_t tw_cpu_ns(tw_ticker *t) {
    clockid_t cid;
    struct timespec ts;
    if (!t->started || t->joined || pthread_getcpuclockid(t->thread, &cid) != 0 || clock_gettime(cid, &ts) != 0) return -1;
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* The struct layout (sizes and the offsets of the last fields), so the loader refuses a library whose layout differs
 * from its ctypes mirror. */
#include <stddef.h>
void tw_layout(int64_t *out) {
    out[0] = (int64_t)sizeof(tw_dev);
    out[1] = (int64_t)sizeof(tw_cfg);
    out[2] = (int64_t)offsetof(tw_dev, pending);
    out[3] = (int64_t)offsetof(tw_dev, err_call);
    out[4] = (int64_t)offsetof(tw_cfg, relax);
    out[5] = (int64_t)offsetof(tw_cfg, trace);
}
