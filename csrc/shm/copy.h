/* Stores into a member's shared buffer: the lines its peers read in the last steps. */
#ifndef JL_COPY_H
#define JL_COPY_H

#include <stddef.h>
#include <stdint.h>

/* Collectives of messages from this many bytes on write into the shared buffers with
 * non-temporal stores (docs/shared-memory.md "Placement"); smaller ones keep plain stores, whose
 * lines stay in cache for the peers' reads. */
#ifndef JL_STREAM_MIN_BYTES
#define JL_STREAM_MIN_BYTES (256 * 1024)
#endif
/* The same for an all-reduce that runs in one step (up to settings.small_bytes, 128 KiB by
 * default): its copy-in is the only write into the shared buffer. */
#ifndef JL_STREAM_ONE_STEP_MIN_BYTES
#define JL_STREAM_ONE_STEP_MIN_BYTES (64 * 1024)
#endif

/* Which stores a context's large collectives use, chosen by timing them (copy.c says why and
 * how). All zero: nothing measured yet. */
typedef struct {
    uint64_t calls;       /* timed all-reduces of JL_STREAM_MIN_BYTES and more */
    uint64_t best[2];     /* this round's fastest trial, ns per KiB, by mode (0: none yet) */
    uint64_t chosen_cost; /* the chosen kind's fastest trial, ns per KiB (0: none yet) */
    uint32_t slow;        /* calls in a row since then that cost over twice that */
    uint32_t patience;    /* how many such calls start the next round early (grows when one
                           * changes nothing) */
    int chosen;           /* 1: non-temporal stores, 0: plain */
} jl_stores;

/* The stores for the next timed all-reduce (1: non-temporal), and what it took. */
int jl_stores_pick(const jl_stores *s);
void jl_stores_took(jl_stores *s, int stream, int64_t ns, size_t bytes);

/* dst (a shared buffer peers read) = src, bytes long, not overlapping: streamed and fenced when
 * stream is nonzero (the caller may then publish with a release store right after), else plain. */
void jl_copy_shared(void *dst, const void *src, size_t bytes, int stream);

/* The non-temporal copy itself whatever the size (plain stores for partial lines), NOT fenced:
 * call jl_stream_fence after the last one, before publishing. */
void jl_stream(void *dst, const void *src, size_t bytes);
void jl_stream_fence(void);

#endif
