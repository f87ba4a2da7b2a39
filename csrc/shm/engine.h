/* jacklring's same-host shared-memory engine: the C interface.
 *
 * A group's ranks on one host share one segment (a memfd that Python's local/shm.py creates on
 * the host's first rank and every member opens). This engine maps it and runs whole collectives
 * over it: the headers' check, the step numbering, the deadline and the watch of the peers, with
 * no Python on the way. Every call returns a jl_code and fills a jl_status; the Python binding
 * turns a status into today's exceptions in one place (adapter/backends/local/engine.py), a C++
 * caller words it as it likes.
 *
 * Segment layout (unchanged from the Python engine it replaces, so mixed versions fail loudly on
 * the size check rather than silently):
 *   control block 0 (128 bytes): the sleepers mask (offset 0), the arrival word (offset 64);
 *   control block 1 + q, member q: step counter (0), "left after an error" word (8), two 24-byte
 *     headers by step parity (16, 40);
 *   data at the first page boundary after the control blocks: per member q, two buffers of
 *     chunk_bytes (even and odd steps), member-major.
 *
 * Step protocol: write my buffer of the step's parity (and my header), store my counter with
 * release order, add one to the arrival word (the addition that brings it to a multiple of the
 * size wakes every futex sleeper), then wait for every peer's counter (acquire): a short spin of
 * pause instructions, then sched_yield() checks, then FUTEX_WAIT on the arrival word. Between
 * sleeps: the deadline, the peers' "left after an error" words, their pidfds and the watched
 * sockets (a peer that hung up broke the group).
 *
 * Threads: a context runs one collective at a time (the caller serializes); jl_mark_broken may be
 * called from any thread at any time.
 *
 * Reaching the engine from a C++ extension at run time (numpy-C-API style): the Python module
 * adapter.backends.local._engine exports a PyCapsule named "adapter.backends.local._engine.API"
 * (attribute `API`) whose pointer is a `const jl_api *`. Check `api->abi_version ==
 * JL_ABI_VERSION` and `api->struct_size >= sizeof(jl_api)` before use. An attached segment
 * object (`_engine.Segment`) hands out its context with `segment.context()`: a PyCapsule named
 * "jl_ctx" holding the `jl_ctx *`, valid while the Segment object lives and is not closed (keep a
 * reference to the Segment). Calling the table's functions needs no GIL; a wait releases nothing
 * it does not hold.
 */
#ifndef JL_ENGINE_H
#define JL_ENGINE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define JL_ABI_VERSION 2
#define JL_HEADER_BYTES 24
#define JL_MAX_RANKS 64
#define JL_NO_DEADLINE INT64_MAX /* deadline_ns meaning "none" */

/* Outcome of a call. Python maps each to today's exception:
 * MISMATCH -> MismatchError, PEER_LEFT / PEER_EXITED / LINK_CLOSED / SELF_BROKEN -> PeerError,
 * TIMEOUT -> CollectiveTimeout, INVALID -> ValueError/TypeError, SYSTEM -> OSError,
 * INTERRUPTED -> whatever the signal handler raised (KeyboardInterrupt). */
typedef enum {
    JL_OK = 0,
    JL_MISMATCH = 1,    /* peer `peer` published a different header (in status.header) */
    JL_PEER_LEFT = 2,   /* peer `peer` left after an error; culprit: the rank it blamed, or itself, or -1 when it blamed this rank */
    JL_PEER_EXITED = 3, /* peer `peer`'s process exited while this rank waited for it */
    JL_LINK_CLOSED = 4, /* watched socket `fd` (peer rank `culprit`) hung up */
    JL_TIMEOUT = 5,     /* the deadline passed while peer `peer` was at `peer_step` < `step` */
    JL_SELF_BROKEN = 6, /* this rank gave the group up (jl_mark_broken) while the call waited */
    JL_INVALID = 7,     /* bad argument: unknown dtype/op, op not defined for the dtype, ... */
    JL_SYSTEM = 8,      /* a system call failed: sys_errno */
    JL_INTERRUPTED = 9, /* settings.interrupted said so after a signal woke a wait */
} jl_code;

/* Element types: the wire codes of adapter/backends/elements.py DTYPE_CODES. */
typedef enum {
    JL_BOOL = 1, JL_INT8 = 2, JL_INT16 = 3, JL_INT32 = 4, JL_INT64 = 5,
    JL_UINT8 = 6, JL_UINT16 = 7, JL_UINT32 = 8, JL_UINT64 = 9,
    JL_FLOAT16 = 10, JL_BFLOAT16 = 11, JL_FLOAT32 = 12, JL_FLOAT64 = 13,
    JL_COMPLEX64 = 14, JL_COMPLEX128 = 15,
} jl_dtype;

/* Reductions. Bool: SUM/MAX/BOR = or, PROD/MIN/BAND = and, BXOR = xor. float16/bfloat16 are
 * reduced in float32 over all ranks (rank order) and rounded once per step. Bitwise ops need
 * integers or bool, MAX/MIN are not defined for complex (JL_INVALID). */
typedef enum {
    JL_SUM = 0, JL_PROD = 1, JL_MAX = 2, JL_MIN = 3, JL_BAND = 4, JL_BOR = 5, JL_BXOR = 6,
} jl_op;

typedef struct {
    int32_t code;        /* a jl_code */
    int32_t peer;        /* the segment member concerned, -1 when none */
    int32_t culprit;     /* rank of the whole group to blame (names[]), -1 when none */
    int32_t fd;          /* JL_LINK_CLOSED: the watched socket */
    int32_t sys_errno;   /* JL_SYSTEM: errno */
    int32_t reserved;
    uint64_t step;       /* the step this rank waited for or checked */
    uint64_t peer_step;  /* JL_TIMEOUT: the step the peer was at */
    unsigned char header[JL_HEADER_BYTES]; /* JL_MISMATCH: the peer's header */
} jl_status;

typedef struct jl_ctx jl_ctx;

/* How a context waits (all in nanoseconds). */
typedef struct {
    int64_t spin_ns;         /* pause-instruction spin before yielding (about 1000) */
    int64_t yield_ns;        /* sched_yield() checks before the futex sleep */
    int64_t stall_report_ns; /* call stall_report once after this long in one wait; 0: never */
    size_t small_bytes;      /* all_reduce up to this size (and one chunk) runs in one step */
    /* Called (from the waiting thread, without the GIL) when a wait stalls; may be NULL. */
    void (*stall_report)(void *arg, int32_t peer);
    void *stall_arg;
    /* Called (same thread, no GIL) when a signal interrupted a futex sleep, and at each liveness
     * check of a long wait; nonzero ends the call with JL_INTERRUPTED (Python: a signal handler
     * raised, e.g. KeyboardInterrupt). May be NULL. */
    int (*interrupted)(void *arg);
} jl_settings;

/* Attach: map the segment open at fd (the caller keeps and closes its fd; the mapping stays),
 * check its size, open a pidfd per peer. member/size count the segment's members; names[q] is
 * member q's rank in the whole group (culprits and messages use it); pids[q] its process.
 * Returns JL_OK with *out set, or an error (status says which) and *out NULL. */
int jl_attach(int fd, int32_t member, int32_t size, size_t chunk_bytes, const int32_t *names,
              const int32_t *pids, const jl_settings *settings, jl_ctx **out, jl_status *st);
/* Unmap and close the pidfds. Safe on NULL. */
void jl_detach(jl_ctx *ctx);
void jl_configure(jl_ctx *ctx, const jl_settings *settings);
/* Also fail a wait when this socket's peer (rank `peer` of the whole group, -1 unknown) hangs up. */
int jl_watch(jl_ctx *ctx, int fd, int32_t peer, jl_status *st);
/* Tell every peer that this rank left after an error, blaming rank `culprit` (-1: itself). */
void jl_mark_broken(jl_ctx *ctx, int32_t culprit);

/* Collectives. header: JL_HEADER_BYTES checked against every peer's at the first step (NULL: no
 * check, for inner stages). deadline_ns: CLOCK_MONOTONIC nanoseconds, JL_NO_DEADLINE for none.
 * On any error the context marks this rank broken (so waiting peers fail at once) and returns
 * the status. Results are bit-identical on every rank (reductions in member order). src and dst
 * may be the same buffer (in place); otherwise they must not overlap. */
int jl_all_reduce(jl_ctx *ctx, const void *src, void *dst, size_t count, int dtype, int op,
                  const unsigned char *header, int64_t deadline_ns, jl_status *st);
/* src: size * count elements; dst: count, this member's block reduced. */
int jl_reduce_scatter(jl_ctx *ctx, const void *src, void *dst, size_t count, int dtype, int op,
                      const unsigned char *header, int64_t deadline_ns, jl_status *st);
/* src: count elements; dst: size * count, member q's block at q * count. */
int jl_all_gather(jl_ctx *ctx, const void *src, void *dst, size_t count, int dtype,
                  const unsigned char *header, int64_t deadline_ns, jl_status *st);
/* buf: count elements; member root's buffer is copied to every other member's. */
int jl_broadcast(jl_ctx *ctx, void *buf, size_t count, int dtype, int32_t root,
                 const unsigned char *header, int64_t deadline_ns, jl_status *st);
int jl_barrier(jl_ctx *ctx, const unsigned char *header, int64_t deadline_ns, jl_status *st);

/* Facts about an attached context. */
int32_t jl_member(const jl_ctx *ctx);
int32_t jl_size(const jl_ctx *ctx);
size_t jl_chunk_bytes(const jl_ctx *ctx);
uint64_t jl_step(const jl_ctx *ctx);
size_t jl_dtype_size(int dtype); /* 0 for an unknown dtype */

/* The group's sequence number: how many collectives it has run, the number every header carries
 * (the ring's "<HBBIQq" header packs it, truncated to 32 bits). ONE count per attached segment,
 * shared by every caller (Python's ring and JACCL paths, the binding's fast path, a C++ backend),
 * so a collective has the same number whichever path runs it. Plain memory, not atomic: callers
 * serialize, as they do for collectives (the Python side holds the group's collective lock; a C++
 * caller runs its collectives on the same lock or the same thread). */
uint64_t jl_sequence(const jl_ctx *ctx);
void jl_set_sequence(jl_ctx *ctx, uint64_t sequence);
/* Start a collective: returns the count so far (what its header carries) and counts it. */
uint64_t jl_next_sequence(jl_ctx *ctx);

/* The table the PyCapsule "adapter.backends.local._engine.API" points to. New entries are only
 * ever appended (struct_size grows); a changed meaning bumps JL_ABI_VERSION. */
typedef struct {
    uint32_t abi_version;
    uint32_t struct_size;
    int (*all_reduce)(jl_ctx *, const void *, void *, size_t, int, int, const unsigned char *, int64_t, jl_status *);
    int (*reduce_scatter)(jl_ctx *, const void *, void *, size_t, int, int, const unsigned char *, int64_t, jl_status *);
    int (*all_gather)(jl_ctx *, const void *, void *, size_t, int, const unsigned char *, int64_t, jl_status *);
    int (*broadcast)(jl_ctx *, void *, size_t, int, int32_t, const unsigned char *, int64_t, jl_status *);
    int (*barrier)(jl_ctx *, const unsigned char *, int64_t, jl_status *);
    void (*mark_broken)(jl_ctx *, int32_t);
    int32_t (*member)(const jl_ctx *);
    int32_t (*size)(const jl_ctx *);
    uint64_t (*step)(const jl_ctx *);
    size_t (*dtype_size)(int);
    /* ABI 2 */
    uint64_t (*sequence)(const jl_ctx *);
    void (*set_sequence)(jl_ctx *, uint64_t);
    uint64_t (*next_sequence)(jl_ctx *);
} jl_api;

#ifdef __cplusplus
}
#endif
#endif /* JL_ENGINE_H */
