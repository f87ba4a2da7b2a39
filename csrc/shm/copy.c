/* Writes into the shared buffers with non-temporal stores.
 *
 * Why: a member's buffer is read by its peers every step, so when it writes there again the
 * lines are cached on the peers' CPUs. A plain store must first take each line back (a read
 * for ownership across CPUs); when the host places the two CPUs far apart that costs ~4x the
 * near placement and dominates a large all-reduce. A non-temporal store writes whole lines
 * through write-combining buffers without reading them first, which costs about the same in
 * either placement. Small writes keep plain stores: their lines are then still in cache when the
 * peers read them, and the round trip of a few lines is cheap.
 *
 * Non-temporal stores send the data to memory, though, and the peers then read it from there:
 * in the near placement that costs more than the plain stores' cache-to-cache transfers, so
 * neither kind wins everywhere. Placement is fixed for a process's life (it changes between
 * jobs), so each context times its large all-reduces: early in every ROUND, a run of calls with
 * plain stores and a run with non-temporal ones (a call's cost depends on the state the previous
 * call left its lines in, so the kinds are not alternated call by call, and each run's first call
 * is not counted), and the rest of the round uses the kind whose fastest trial was faster (per
 * byte; the fastest, because a loaded host only ever adds time). A trial's time is the member's
 * own work (copies and reduction: where both the plain stores' and the peers' streamed reads'
 * costs fall), not its waits for the peers, which are mostly the scheduler's when ranks outnumber
 * CPUs or skew from member to member. Members decide alone:
 * either kind gives the same bytes, so they need not agree; they run their trials in the same
 * calls, since every member runs the same collectives in the same order.
 *
 * The host may also move the CPUs while a job runs, and a round of large messages lasts seconds:
 * so when calls in a row cost more than twice the chosen kind's trial, the next round starts at
 * once. Load slows calls too, without making the other kind better: a round started early that
 * keeps the same kind doubles the slow calls needed to start the next one early.
 *
 * Non-temporal stores are weakly ordered: a later plain or release store (the step counter that
 * publishes the buffer) may become visible before them. So every streaming copy ends with an
 * sfence, which makes them globally visible first; the counter's store then publishes data that
 * is really there. */
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#ifdef JL_STORES_TRACE
#include <stdio.h>
#endif

#include "copy.h"

#ifndef ROUND
#define ROUND 1024 /* timed calls between two choices */
#endif
#define WARM 2     /* a round's first calls are not trials (the first ones fault pages in) */
#define RUN 6      /* then RUN calls with plain stores and RUN streamed: the trials */
#define TRIALS (2 * RUN)
#define MARGIN 10  /* streaming must be this many percent faster (its fence and memory traffic) */
#define SLOW_CALLS 8 /* calls in a row over twice the chosen trial's cost that start a round early */

int jl_stores_pick(const jl_stores *s) {
#ifdef JL_STORES_FORCE /* measurement builds: one kind only */
    (void)s;
    return JL_STORES_FORCE;
#else
    uint64_t phase = s->calls % ROUND;
    return phase >= WARM && phase < WARM + TRIALS ? (int)((phase - WARM) / RUN) : s->chosen;
#endif
}

/* A call with the chosen kind (outside the trials): start the next round now after enough slow
 * calls in a row. */
static void watch(jl_stores *s, uint64_t cost) {
    if (s->chosen_cost == 0 || cost <= 2 * s->chosen_cost) {
        s->slow = 0;
        return;
    }
    if (s->patience == 0)
        s->patience = SLOW_CALLS;
    if (++s->slow < s->patience)
        return;
    s->slow = 0;
    s->calls += ROUND - s->calls % ROUND; /* the next call is the new round's first */
    s->chosen_cost = 0;                   /* marks the round as started early (below) */
}

void jl_stores_took(jl_stores *s, int stream, int64_t ns, size_t bytes) {
    uint64_t phase = s->calls++ % ROUND;
    if (bytes == 0)
        return;
    uint64_t cost = (uint64_t)(ns < 1 ? 1 : ns) * 1024 / bytes + 1; /* + 1: never "none yet" */
    if (phase < WARM || phase >= WARM + TRIALS) {
        if (phase >= WARM + TRIALS)
            watch(s, cost);
        return;
    }
    /* A run's first call pays for the lines the other kind left behind: not counted. */
    if ((phase - WARM) % RUN != 0 && (s->best[stream] == 0 || cost < s->best[stream]))
        s->best[stream] = cost;
    if (phase == WARM + TRIALS - 1) {
        int chosen = s->best[1] * 100 < s->best[0] * (100 - MARGIN);
        /* Early (chosen_cost 0 after a first round) and the same kind again: load, not placement. */
        int early = s->chosen_cost == 0 && s->patience != 0;
        if (early && chosen == s->chosen)
            s->patience = s->patience < ROUND / 2 ? s->patience * 2 : ROUND;
        else if (chosen != s->chosen)
            s->patience = SLOW_CALLS; /* the placement moved: watch closely again */
        s->chosen = chosen;
        s->chosen_cost = s->best[chosen];
#ifdef JL_STORES_TRACE /* measurement builds: each choice on stderr */
        fprintf(stderr, "jl-stores plain %llu stream %llu ns/KiB -> %s\n", (unsigned long long)s->best[0],
                (unsigned long long)s->best[1], s->chosen ? "stream" : "plain");
#endif
        s->best[0] = s->best[1] = 0;
    }
}

#if defined(__x86_64__)
#include <immintrin.h>

/* 64-byte lines: SSE2 is part of x86-64, so this needs no check. */
static void stream_lines_sse2(unsigned char *dst, const unsigned char *src, size_t lines) {
    for (size_t i = 0; i < lines; i++, dst += 64, src += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)src), b = _mm_loadu_si128((const __m128i *)(src + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + 32)), d = _mm_loadu_si128((const __m128i *)(src + 48));
        _mm_stream_si128((__m128i *)dst, a);
        _mm_stream_si128((__m128i *)(dst + 16), b);
        _mm_stream_si128((__m128i *)(dst + 32), c);
        _mm_stream_si128((__m128i *)(dst + 48), d);
    }
}

__attribute__((target("avx2"))) static void stream_lines_avx2(unsigned char *dst, const unsigned char *src,
                                                              size_t lines) {
    for (size_t i = 0; i < lines; i++, dst += 64, src += 64) {
        __m256i a = _mm256_loadu_si256((const __m256i *)src), b = _mm256_loadu_si256((const __m256i *)(src + 32));
        _mm256_stream_si256((__m256i *)dst, a);
        _mm256_stream_si256((__m256i *)(dst + 32), b);
    }
}

static void stream_lines(unsigned char *dst, const unsigned char *src, size_t lines) {
    /* Relaxed: threads that race on the first use all store the same value, and it orders nothing. */
    static _Atomic int avx2 = -1;
    int have = atomic_load_explicit(&avx2, memory_order_relaxed);
    if (have < 0) {
        have = __builtin_cpu_supports("avx2") ? 1 : 0;
        atomic_store_explicit(&avx2, have, memory_order_relaxed);
    }
    if (have)
        stream_lines_avx2(dst, src, lines);
    else
        stream_lines_sse2(dst, src, lines);
}

static inline void stream_fence(void) { _mm_sfence(); }
#define JL_HAVE_STREAM 1
#else
#define JL_HAVE_STREAM 0
#endif

void jl_stream(void *to, const void *from, size_t bytes) {
#if JL_HAVE_STREAM
    unsigned char *dst = to;
    const unsigned char *src = from;
    /* Plain stores up to dst's next line boundary and after its last whole line: a partly
     * streamed line would be written to memory in pieces. */
    size_t head = (size_t)(-(uintptr_t)dst & 63);
    if (head > bytes)
        head = bytes;
    memcpy(dst, src, head);
    dst += head, src += head, bytes -= head;
    size_t lines = bytes / 64;
    stream_lines(dst, src, lines);
    memcpy(dst + lines * 64, src + lines * 64, bytes - lines * 64);
#else
    memcpy(to, from, bytes); /* portable: plain stores, ordered by the release store */
#endif
}

void jl_stream_fence(void) {
#if JL_HAVE_STREAM
    stream_fence(); /* before the release store that publishes (see above) */
#endif
}

void jl_copy_shared(void *dst, const void *src, size_t bytes, int stream) {
    if (stream) {
        jl_stream(dst, src, bytes);
        jl_stream_fence();
    } else if (bytes) {
        memcpy(dst, src, bytes);
    }
}
