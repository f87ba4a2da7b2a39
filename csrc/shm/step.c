/* The step protocol: release-publish a counter, wake the sleepers once per completed step, wait
 * for the peers (pause spin, sched_yield checks, then a futex sleep on the arrival word), and
 * the checks between sleeps: deadline, peers that left, exited processes, hung-up sockets.
 *
 * No lost wake-up: a sleeper sets its bit in the sleepers mask (seq_cst), reads the arrival
 * word, re-reads the counter it waits for, then sleeps while the arrival word is unchanged; the
 * member completing a step adds to the arrival word (seq_cst) after its counter store and then
 * reads the mask (seq_cst). In the single total order of those seq_cst operations either the
 * sleeper's counter read comes after the store, or the completer's mask read comes after the bit;
 * FUTEX_WAIT refuses to sleep once the word moved. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "crowding.h"
#include "step.h"

#define LIVENESS_FIRST_NS 2000000LL  /* first check for dead peers after 2 ms of sleep */
#define LIVENESS_MAX_NS 50000000LL   /* then backing off to every 50 ms */

int64_t jl_now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000LL + t.tv_nsec;
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* FUTEX_WAIT compares 32 bits: the arrival word's low half (little or big endian). */
static uint32_t *low_half(jl_word *word) {
    unsigned char *at = (unsigned char *)word;
#if __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    at += 4;
#endif
    return (uint32_t *)at;
}

/* 0, or -1 with errno (EINTR: a signal; ETIMEDOUT, EAGAIN: the word moved). */
static int futex_wait(jl_ctx *ctx, uint64_t expected, int64_t ns) {
    if (ns < 0)
        ns = 0;
    struct timespec t = {.tv_sec = ns / 1000000000LL, .tv_nsec = ns % 1000000000LL};
    /* Shared (not FUTEX_PRIVATE): keyed by the mapping's page, so other processes wake it. */
    return (int)syscall(SYS_futex, low_half(ctx->arrivals), FUTEX_WAIT, (uint32_t)expected, &t, NULL, 0);
}

static void futex_wake(jl_ctx *ctx) {
    syscall(SYS_futex, low_half(ctx->arrivals), FUTEX_WAKE, 0x7FFFFFFF, NULL, NULL, 0);
}

/* Peer q left after an error (its broken word): whom to blame, a rank of the whole group. */
static int left(jl_ctx *ctx, int32_t q, uint64_t broken, jl_status *st) {
    int64_t culprit = (int64_t)broken - JL_BROKEN_BASE;
    int32_t name = ctx->names[q];
    st->code = JL_PEER_LEFT;
    st->peer = q;
    /* A relayed death names the rank q blamed, unless that is q itself. When q blamed this rank,
     * q gave up waiting for it (this process was stopped or starved): naming live q would get it
     * excluded by a shrink, so nobody is named (-1) and Python words it as such. */
    if (culprit == ctx->names[ctx->member])
        st->culprit = -1;
    else
        st->culprit = (culprit >= 0 && culprit != name) ? (int32_t)culprit : name;
    return -1;
}

/* 1 when peer q reached step, 0 when not yet, -1 (status filled) when q left after an error.
 * The broken word is separate from the counter: a peer that published a step and then found a
 * mismatch still lets this member read its header. */
static int reached(jl_ctx *ctx, int32_t q, uint64_t step, jl_status *st) {
    /* acquire: pairs with the peer's counter store, so its buffer and header are visible */
    if (atomic_load_explicit(ctx->counter[q], memory_order_acquire) >= step)
        return 1;
    uint64_t broken = atomic_load_explicit(ctx->broken[q], memory_order_acquire);
    if (broken)
        return left(ctx, q, broken, st);
    return 0;
}

/* A poll event on entry i: fill *st with what it means (a peer marked broken before it closed
 * its links or exited names the rank it blamed). */
static void event(jl_ctx *ctx, int i, jl_status *st) {
    int32_t q = ctx->poll_member[i];
    int32_t peer = ctx->poll_rank[i];
    int32_t member = q;
    if (member < 0)
        for (int32_t m = 0; m < ctx->size; m++)
            if (ctx->names[m] == peer)
                member = m;
    if (member >= 0) {
        uint64_t broken = atomic_load_explicit(ctx->broken[member], memory_order_acquire);
        if (broken) {
            left(ctx, member, broken, st);
            return;
        }
    }
    if (q >= 0) {
        st->code = JL_PEER_EXITED;
        st->peer = q;
        st->culprit = ctx->names[q];
        return;
    }
    st->code = JL_LINK_CLOSED;
    st->fd = ctx->polls[i].fd;
    st->peer = member;
    st->culprit = peer;
}

/* A look (never a wait) at the pidfds and watched sockets while waiting for q. */
static int check_alive(jl_ctx *ctx, int32_t q, uint64_t step, jl_status *st) {
    if (poll(ctx->polls, (nfds_t)ctx->npolls, 0) <= 0)
        return 0;
    for (int i = 0; i < ctx->npolls; i++) {
        if (!ctx->polls[i].revents)
            continue;
        /* A peer that exited after finishing its part is no error: re-check first. */
        int r = reached(ctx, q, step, st);
        if (r != 0)
            return r < 0 ? -1 : 0;
        event(ctx, i, st);
        return -1;
    }
    return 0;
}

static int sleep_for(jl_ctx *ctx, int32_t q, uint64_t step, int64_t deadline_ns, jl_status *st) {
    uint64_t bit = 1ULL << ctx->member;
    atomic_fetch_or_explicit(ctx->sleepers, bit, memory_order_seq_cst);
    int64_t now = jl_now_ns();
    int64_t stall_at = ctx->settings.stall_report_ns > 0 ? now + ctx->settings.stall_report_ns : INT64_MAX;
    int64_t every = LIVENESS_FIRST_NS;
    int64_t check_at = now + every;
    int rc = 0;
    for (;;) {
        /* The arrival word before the counter: see the file's comment. */
        uint64_t arrivals = atomic_load_explicit(ctx->arrivals, memory_order_seq_cst);
        uint64_t v = atomic_load_explicit(ctx->counter[q], memory_order_seq_cst);
        if (v >= step)
            break;
        int r = reached(ctx, q, step, st);
        if (r != 0) {
            rc = r > 0 ? 0 : -1;
            break;
        }
        for (int32_t other = 0; other < ctx->size && rc == 0; other++) /* any member that gave up dooms this step */
            if (other != q && other != ctx->member && atomic_load_explicit(ctx->broken[other], memory_order_acquire))
                rc = reached(ctx, other, JL_BEYOND, st);
        if (rc)
            break;
        now = jl_now_ns();
        if (now >= check_at) {
            if ((rc = check_alive(ctx, q, step, st)) != 0)
                break;
            /* A signal may have gone to another thread (no EINTR here): ask now and then too. */
            if (ctx->settings.interrupted && ctx->settings.interrupted(ctx->settings.stall_arg)) {
                st->code = JL_INTERRUPTED;
                st->peer = q;
                rc = -1;
                break;
            }
            every = every * 2 < LIVENESS_MAX_NS ? every * 2 : LIVENESS_MAX_NS;
            check_at = now + every;
        }
        if (now >= deadline_ns) {
            st->code = JL_TIMEOUT;
            st->peer = q;
            st->culprit = ctx->names[q]; /* the member waited for is to blame, not this live one */
            st->step = step;
            st->peer_step = v;
            rc = -1;
            break;
        }
        int64_t wait = (deadline_ns < check_at ? deadline_ns : check_at) - now;
        if (stall_at != INT64_MAX) {
            if (now >= stall_at) {
                if (ctx->settings.stall_report)
                    ctx->settings.stall_report(ctx->settings.stall_arg, q);
                stall_at = INT64_MAX;
            } else if (stall_at - now < wait) {
                wait = stall_at - now;
            }
        }
        if (atomic_load_explicit(ctx->broken[ctx->member], memory_order_acquire)) {
            st->code = JL_SELF_BROKEN; /* another thread gave the group up */
            st->peer = q;
            rc = -1;
            break;
        }
        if (futex_wait(ctx, arrivals, wait) != 0 && errno == EINTR && ctx->settings.interrupted &&
            ctx->settings.interrupted(ctx->settings.stall_arg)) {
            st->code = JL_INTERRUPTED;
            st->peer = q;
            rc = -1;
            break;
        }
    }
    atomic_fetch_and_explicit(ctx->sleepers, ~bit, memory_order_seq_cst);
    return rc;
}

/* A sched_yield() that returned this much later handed the CPU to something that kept it: a
 * member of the job with long work (a peer computing between collectives), or work outside the
 * job. With more members than CPUs, yielding then feeds the outside work while the members wait
 * behind it (milliseconds per small collective), so waits sleep instead for a while when that is
 * what happened: enough runnable tasks besides the members to take every CPU (/proc/loadavg,
 * read only after such a yield). A member's long work is no reason, and with a CPU per member
 * yielding beside busy loops measured faster than sleeping (docs/shared-memory.md, "Waiting"). */
#define LONG_YIELD_NS 1000000LL    /* a time slice: a member's part of a small step takes microseconds */
#define YIELDS_OFF_NS 250000000LL  /* then sleep at once for 250 ms before trying again */

/* Runnable tasks on the machine now (the caller among them), or -1 when unreadable. */
static int runnable_tasks(void) {
    int fd = open("/proc/loadavg", O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return -1;
    char text[128];
    ssize_t n = read(fd, text, sizeof text - 1);
    close(fd);
    if (n <= 0)
        return -1;
    text[n] = '\0';
    return jl_runnable_in_loadavg(text);
}

/* More members than CPUs, and runnable tasks besides the members that may be runnable
 * (those not asleep in the futex: the sleepers mask; relaxed, an estimate) fill every CPU. */
static int outside_work_fills_the_cpus(jl_ctx *ctx) {
    if (ctx->size <= ctx->cpus)
        return 0;  /* before reading /proc: the common case costs nothing */
    uint64_t asleep = atomic_load_explicit(ctx->sleepers, memory_order_relaxed);
    return jl_outside_work_fills_the_cpus(ctx->size, __builtin_popcountll(asleep), ctx->cpus, runnable_tasks());
}

/* Spin (pause instructions: the peer runs elsewhere and is about to publish), then check while
 * giving the CPU away (the peer may wait for this very CPU), then sleep. */
static int wait_for(jl_ctx *ctx, int32_t q, uint64_t step, int64_t deadline_ns, jl_status *st) {
    int r;
    int64_t start = jl_now_ns();
    int64_t spin_until = start + ctx->settings.spin_ns;
    int64_t yield_until = start < ctx->yields_off_until ? spin_until : spin_until + ctx->settings.yield_ns;
    int64_t now = start;
    while (now < yield_until) {
        for (int i = 0; i < 64; i++) {
            if ((r = reached(ctx, q, step, st)) != 0)
                return r > 0 ? 0 : -1;
            if (now >= spin_until)
                break;
            cpu_relax();
        }
        int64_t before = now;
        if (now >= spin_until)
            sched_yield();
        now = jl_now_ns();
        if (now >= spin_until && now - before >= LONG_YIELD_NS && outside_work_fills_the_cpus(ctx)) {
            ctx->yields_off_until = now + YIELDS_OFF_NS;
            break;
        }
    }
    if ((r = reached(ctx, q, step, st)) != 0)
        return r > 0 ? 0 : -1;
    return sleep_for(ctx, q, step, deadline_ns, st);
}

static int check_headers(jl_ctx *ctx, const unsigned char *header, int parity, uint64_t step, int only_reached,
                         jl_status *st) {
    for (int32_t q = 0; q < ctx->size; q++) {
        if (q == ctx->member)
            continue;
        if (only_reached && atomic_load_explicit(ctx->counter[q], memory_order_acquire) < step)
            continue;
        if (memcmp(ctx->header[q][parity], header, JL_HEADER_BYTES) != 0) {
            st->code = JL_MISMATCH;
            st->peer = q;
            st->culprit = -1;
            st->step = step;
            memcpy(st->header, ctx->header[q][parity], JL_HEADER_BYTES);
            return -1;
        }
    }
    return 0;
}

static int is_peer_error(int code) {
    return code == JL_PEER_LEFT || code == JL_PEER_EXITED || code == JL_LINK_CLOSED || code == JL_SELF_BROKEN;
}

int jl_exchange(jl_ctx *ctx, const unsigned char *header, int64_t deadline_ns, jl_status *st) {
    int parity = (int)(ctx->step & 1);
    /* By parity, like the data: a peer may start the next step (and write its next header)
     * before this member has read this one. */
    if (header != NULL)
        memcpy(ctx->header[ctx->member][parity], header, JL_HEADER_BYTES);
    uint64_t step = ++ctx->step;
    /* seq_cst: part of the no-lost-wake-up argument (above); also releases the buffer writes. */
    atomic_store_explicit(ctx->counter[ctx->member], step, memory_order_seq_cst);
    /* The addition that brings the arrival word to a multiple of the size completes a step (not
     * necessarily this one): its member wakes the sleepers, nobody else makes a system call. */
    uint64_t arrived = atomic_fetch_add_explicit(ctx->arrivals, 1, memory_order_seq_cst) + 1;
    if (arrived % (uint64_t)ctx->size == 0 &&
        (atomic_load_explicit(ctx->sleepers, memory_order_seq_cst) & ~(1ULL << ctx->member)))
        futex_wake(ctx);
    for (int32_t q = 0; q < ctx->size; q++) {
        if (q == ctx->member)
            continue;
        if (atomic_load_explicit(ctx->counter[q], memory_order_acquire) >= step)
            continue;
        if (wait_for(ctx, q, step, deadline_ns, st) != 0) {
            if (st->step == 0)
                st->step = step;
            /* A peer that left after seeing a mismatch: report the mismatch when a peer that
             * published this step called something else. */
            if (header != NULL && is_peer_error(st->code)) {
                jl_status mismatch;
                jl_status_clear(&mismatch);
                if (check_headers(ctx, header, parity, step, 1, &mismatch) != 0)
                    *st = mismatch;
            }
            return -1;
        }
    }
    if (header != NULL && check_headers(ctx, header, parity, step, 0, st) != 0)
        return -1;
    return parity;
}

void jl_mark_broken(jl_ctx *ctx, int32_t culprit) {
    if (ctx == NULL)
        return;
    /* The first blame that names a rank stays: a later mark without one (the group given up
     * after the error, break_links) must not turn "rank 2 died" into "this rank left" for a peer
     * that reads the word only now. seq_cst, as the store it replaces (the file's comment). */
    uint64_t want = (uint64_t)(JL_BROKEN_BASE + (culprit < -1 ? -1 : culprit));
    uint64_t have = atomic_load_explicit(ctx->broken[ctx->member], memory_order_seq_cst);
    while (have == 0 || (have == JL_BROKEN_BASE - 1 && want != have))
        if (atomic_compare_exchange_weak_explicit(ctx->broken[ctx->member], &have, want, memory_order_seq_cst,
                                                  memory_order_seq_cst))
            break;
    /* Move the arrival word by a multiple of the size (which keeps the completion rule): a peer
     * about to sleep on it returns at once instead of sleeping through this. */
    atomic_fetch_add_explicit(ctx->arrivals, (uint64_t)ctx->size, memory_order_seq_cst);
    futex_wake(ctx);
}
