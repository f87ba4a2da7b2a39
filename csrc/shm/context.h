/* The engine's private state of one attached segment (struct jl_ctx) and its layout constants:
 * shared by the files that map the segment, run steps and run collectives. */
#ifndef JL_CONTEXT_H
#define JL_CONTEXT_H

#include <poll.h>
#include <stdatomic.h>
#include <stdint.h>

#include "copy.h"
#include "engine.h"

#define JL_CONTROL 128       /* bytes per control block */
#define JL_SLEEPERS 0        /* in block 0: the sleepers mask */
#define JL_ARRIVALS 64       /* in block 0: the arrival word */
#define JL_COUNTER 0         /* in a member's block: its step counter */
#define JL_BROKEN 8          /* "left after an error": 0, else JL_BROKEN_BASE + blamed rank (-1: itself) */
#define JL_HEADER 16         /* two headers by step parity */
#define JL_BROKEN_BASE 2
#define JL_PAGE 4096
#define JL_MAX_WATCHED 64
#define JL_BEYOND UINT64_MAX /* a step no member reaches */

typedef _Atomic uint64_t jl_word;

struct jl_ctx {
    unsigned char *base;
    size_t bytes;
    int32_t member, size;
    size_t chunk;
    uint64_t step;
    /* The group's collectives so far (the sequence number in every header): the one count that
     * the Python paths, the binding's fast path and C++ callers read and advance (engine.h). */
    uint64_t sequence;
    jl_word *sleepers, *arrivals;
    jl_word *counter[JL_MAX_RANKS];
    jl_word *broken[JL_MAX_RANKS];
    unsigned char *header[JL_MAX_RANKS][2];
    unsigned char *buf[JL_MAX_RANKS][2];
    int32_t names[JL_MAX_RANKS];
    int32_t pids[JL_MAX_RANKS];
    /* Polled without blocking between sleeps: the peers' pidfds, then the watched sockets. */
    struct pollfd polls[JL_MAX_RANKS + JL_MAX_WATCHED];
    int32_t poll_member[JL_MAX_RANKS + JL_MAX_WATCHED]; /* pidfd: its member; socket: -1 */
    int32_t poll_rank[JL_MAX_RANKS + JL_MAX_WATCHED];   /* socket: its peer's rank (or -1) */
    int npolls;
    jl_settings settings;
    /* The CPUs this process may run on; until yields_off_until (CLOCK_MONOTONIC ns), waits sleep
     * without yielding first: a yield lately handed the CPU to work outside the job (step.c). */
    int cpus;
    int64_t yields_off_until;
    /* Plain or non-temporal stores, timed apart per collective (copy.c): chunked all-reduces,
     * one-step all-reduces, all-gathers and reduce-scatters. A broadcast's root cannot time its
     * peers' reads, so it follows the all-gathers' choice (the same copy in, copies out). */
    jl_stores stores;
    jl_stores stores_one_step;
    jl_stores stores_gather;
    jl_stores stores_scatter;
};

static inline size_t jl_data_offset(int32_t size) {
    size_t control = (size_t)JL_CONTROL * (size_t)(size + 1);
    return (control + JL_PAGE - 1) / JL_PAGE * JL_PAGE;
}

static inline void jl_status_clear(jl_status *st) {
    st->code = JL_OK;
    st->peer = -1;
    st->culprit = -1;
    st->fd = -1;
    st->sys_errno = 0;
    st->reserved = 0;
    st->step = 0;
    st->peer_step = 0;
}

#endif
