/* The collectives over a segment, each a sequence of steps (write my buffer, exchange, read the
 * peers' buffers); the first step carries the header, so a mismatch fails on every rank before
 * any data is used. Reductions run in member order: every rank gets bit-identical results.
 *
 * all_reduce, small (one chunk, up to settings.small_bytes): one step, every member reduces the
 * whole message itself. Large: every member copies the slices of its input that the others
 * reduce into its buffer, then reduces its own 1/n slice straight out of the peers' buffers (its
 * own input read in place) and publishes the result (writing it to its output at once), and
 * finally everyone copies the others' reduced slices out. A buffer holds member q's reduced
 * slice of chunk k at slot q and the inputs of chunk k+1 at the other slots, so chunk k's result
 * and chunk k+1's inputs travel in one step (pipelined): a message of c chunks costs c + 1 steps.
 *
 * Writes into a member's own buffer (the lines its peers read in the last steps) may use
 * non-temporal stores for messages from JL_STREAM_MIN_BYTES on (one-step all-reduces: from
 * JL_STREAM_ONE_STEP_MIN_BYTES), as the context's timing of that collective chose (copy.c says
 * why); writes into the caller's memory keep plain stores. */
#include <string.h>

#include "copy.h"
#include "reduce.h"
#include "step.h"

/* On any error: tell the peers at once (they fail now, not at their deadline). */
static int failed(jl_ctx *ctx, jl_status *st) {
    jl_mark_broken(ctx, st->culprit);
    return st->code;
}

static int invalid(jl_status *st) {
    st->code = JL_INVALID;
    return JL_INVALID;
}

static inline void copy(void *dst, const void *src, size_t bytes) {
    if (dst != src && bytes)
        memmove(dst, src, bytes);
}

/* A collective's trial of store kinds (copy.c): which kind it uses, and the member's own work
 * (its copies and reductions, not its waits for the peers) timed when the message is large
 * enough to choose for. */
typedef struct {
    jl_stores *stores; /* NULL: not timed (plain stores) */
    int stream;
    int64_t start, work;
} trial;

static void trial_begin(trial *t, jl_stores *stores, size_t bytes, size_t min_bytes) {
    t->stores = bytes >= min_bytes ? stores : NULL;
    t->stream = t->stores ? jl_stores_pick(stores) : 0;
    t->work = 0;
    t->start = t->stores ? jl_now_ns() : 0;
}

static inline void trial_wait(trial *t) { /* before an exchange */
    if (t->stores)
        t->work += jl_now_ns() - t->start;
}

static inline void trial_go(trial *t) { /* after it */
    if (t->stores)
        t->start = jl_now_ns();
}

static void trial_end(trial *t, size_t bytes) {
    if (t->stores)
        jl_stores_took(t->stores, t->stream, t->work + jl_now_ns() - t->start, bytes);
}

/* The start of block q when count elements are split in n blocks differing by at most one (the
 * first count % n are the larger): elements.block_bounds. */
static inline size_t bound(size_t count, int32_t n, int32_t q) {
    size_t base = count / (size_t)n, extra = count % (size_t)n;
    return (size_t)q * base + ((size_t)q < extra ? (size_t)q : extra);
}

static int small_all_reduce(jl_ctx *ctx, const void *src, void *dst, size_t count, int dtype, int op,
                            const unsigned char *header, int64_t deadline_ns, jl_status *st) {
    size_t bytes = count * jl_dtype_size(dtype);
    int parity = (int)(ctx->step & 1);
    trial t;
    trial_begin(&t, &ctx->stores_one_step, bytes, JL_STREAM_ONE_STEP_MIN_BYTES);
    jl_copy_shared(ctx->buf[ctx->member][parity], src, bytes, t.stream);
    trial_wait(&t);
    if (jl_exchange(ctx, header, deadline_ns, st) < 0)
        return failed(ctx, st);
    trial_go(&t);
    const void *parts[JL_MAX_RANKS];
    for (int32_t q = 0; q < ctx->size; q++)
        parts[q] = ctx->buf[q][parity];
    jl_reduce(dst, parts, ctx->size, count, dtype, op);
    trial_end(&t, bytes);
    return JL_OK;
}

int jl_all_reduce(jl_ctx *ctx, const void *src, void *dst, size_t count, int dtype, int op,
                  const unsigned char *header, int64_t deadline_ns, jl_status *st) {
    jl_status_clear(st);
    if (jl_reducible(dtype, op) != JL_OK)
        return invalid(st);
    size_t item = jl_dtype_size(dtype), cap = ctx->chunk / item;
    int32_t n = ctx->size, r = ctx->member;
    if (count * item <= ctx->settings.small_bytes && count <= cap)
        return small_all_reduce(ctx, src, dst, count, dtype, op, header, deadline_ns, st);
    const unsigned char *in = src;
    unsigned char *out = dst;
    size_t w = cap / (size_t)n; /* elements per slot */
    size_t per = w * (size_t)n;
    size_t chunks = (count + per - 1) / per;
    /* The chunk whose inputs travelled in the last step: its start, length and parity. */
    int pending = 0;
    size_t p_lo = 0, p_len = 0;
    int p_parity = 0;
    const void *parts[JL_MAX_RANKS];
    trial t;
    trial_begin(&t, &ctx->stores, count * item, JL_STREAM_MIN_BYTES);
    int stream = t.stream;
    for (size_t k = 0; k <= chunks; k++) {
        unsigned char *mine = ctx->buf[r][ctx->step & 1];
        if (pending) {
            size_t a = bound(p_len, n, r), b = bound(p_len, n, r + 1);
            for (int32_t q = 0; q < n; q++)
                parts[q] = q == r ? in + (p_lo + a) * item : ctx->buf[q][p_parity] + (size_t)r * w * item;
            /* into out too: in place, out's slice r of this chunk is in's, read block by block
             * before it is written, and no later step reads it */
            jl_reduce_out(mine + (size_t)r * w * item, out + (p_lo + a) * item, parts, n, b - a, dtype, op, stream);
        }
        size_t lo = k * per, len = 0;
        if (k < chunks) {
            len = count - lo < per ? count - lo : per;
            for (int32_t q = 0; q < n; q++) {
                if (q == r)
                    continue;
                size_t a = bound(len, n, q), b = bound(len, n, q + 1);
                jl_copy_shared(mine + (size_t)q * w * item, in + (lo + a) * item, (b - a) * item, stream);
            }
        }
        trial_wait(&t);
        int p = jl_exchange(ctx, k == 0 ? header : NULL, deadline_ns, st);
        if (p < 0)
            return failed(ctx, st);
        trial_go(&t);
        if (pending) {
            for (int32_t q = 0; q < n; q++) {
                if (q == r)
                    continue; /* written by the reduce */
                size_t a = bound(p_len, n, q), b = bound(p_len, n, q + 1);
                copy(out + (p_lo + a) * item, ctx->buf[q][p] + (size_t)q * w * item, (b - a) * item);
            }
        }
        pending = k < chunks;
        p_lo = lo;
        p_len = len;
        p_parity = p;
    }
    trial_end(&t, count * item);
    return JL_OK;
}

int jl_reduce_scatter(jl_ctx *ctx, const void *src, void *dst, size_t count, int dtype, int op,
                      const unsigned char *header, int64_t deadline_ns, jl_status *st) {
    jl_status_clear(st);
    if (jl_reducible(dtype, op) != JL_OK)
        return invalid(st);
    size_t item = jl_dtype_size(dtype), w = ctx->chunk / item / (size_t)ctx->size, m = count;
    int32_t n = ctx->size, r = ctx->member;
    const unsigned char *in = src;
    unsigned char *out = dst;
    const void *parts[JL_MAX_RANKS];
    trial t;
    trial_begin(&t, &ctx->stores_scatter, m * item * (size_t)n, JL_STREAM_MIN_BYTES);
    for (size_t lo = 0; lo < (m ? m : 1); lo += w) {
        size_t len = m - lo < w ? m - lo : w;
        unsigned char *mine = ctx->buf[r][ctx->step & 1];
        for (int32_t q = 0; q < n; q++)
            if (q != r)
                jl_copy_shared(mine + (size_t)q * w * item, in + ((size_t)q * m + lo) * item, len * item, t.stream);
        trial_wait(&t);
        int p = jl_exchange(ctx, lo == 0 ? header : NULL, deadline_ns, st);
        if (p < 0)
            return failed(ctx, st);
        trial_go(&t);
        for (int32_t q = 0; q < n; q++)
            parts[q] = q == r ? in + ((size_t)r * m + lo) * item : ctx->buf[q][p] + (size_t)r * w * item;
        if (len)
            jl_reduce(out + lo * item, parts, n, len, dtype, op);
    }
    trial_end(&t, m * item * (size_t)n);
    return JL_OK;
}

int jl_all_gather(jl_ctx *ctx, const void *src, void *dst, size_t count, int dtype,
                  const unsigned char *header, int64_t deadline_ns, jl_status *st) {
    jl_status_clear(st);
    size_t item = jl_dtype_size(dtype);
    if (item == 0)
        return invalid(st);
    size_t cap = ctx->chunk / item, m = count;
    int32_t n = ctx->size, r = ctx->member;
    const unsigned char *in = src;
    unsigned char *out = dst;
    trial t;
    trial_begin(&t, &ctx->stores_gather, m * item, JL_STREAM_MIN_BYTES);
    for (size_t lo = 0; lo < (m ? m : 1); lo += cap) {
        size_t hi = lo + cap < m ? lo + cap : m;
        jl_copy_shared(ctx->buf[r][ctx->step & 1], in + lo * item, (hi - lo) * item, t.stream);
        trial_wait(&t);
        int p = jl_exchange(ctx, lo == 0 ? header : NULL, deadline_ns, st);
        if (p < 0)
            return failed(ctx, st);
        trial_go(&t);
        for (int32_t q = 0; q < n; q++) {
            const unsigned char *from = q == r ? in + lo * item : ctx->buf[q][p];
            copy(out + ((size_t)q * m + lo) * item, from, (hi - lo) * item);
        }
    }
    trial_end(&t, m * item);
    return JL_OK;
}

int jl_broadcast(jl_ctx *ctx, void *buf, size_t count, int dtype, int32_t root,
                 const unsigned char *header, int64_t deadline_ns, jl_status *st) {
    jl_status_clear(st);
    size_t item = jl_dtype_size(dtype);
    if (item == 0 || root < 0 || root >= ctx->size)
        return invalid(st);
    size_t cap = ctx->chunk / item;
    unsigned char *data = buf;
    int stream = count * item >= JL_STREAM_MIN_BYTES && ctx->stores_gather.chosen;
    for (size_t lo = 0; lo < (count ? count : 1); lo += cap) {
        size_t hi = lo + cap < count ? lo + cap : count;
        if (ctx->member == root)
            jl_copy_shared(ctx->buf[root][ctx->step & 1], data + lo * item, (hi - lo) * item, stream);
        int p = jl_exchange(ctx, lo == 0 ? header : NULL, deadline_ns, st);
        if (p < 0)
            return failed(ctx, st);
        if (ctx->member != root)
            copy(data + lo * item, ctx->buf[root][p], (hi - lo) * item);
    }
    return JL_OK;
}

int jl_barrier(jl_ctx *ctx, const unsigned char *header, int64_t deadline_ns, jl_status *st) {
    jl_status_clear(st);
    if (jl_exchange(ctx, header, deadline_ns, st) < 0)
        return failed(ctx, st);
    return JL_OK;
}
