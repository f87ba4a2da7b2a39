/* Attaching to a segment: map the memfd Python created, locate the control words and buffers,
 * open a pidfd per peer; detaching; the watched sockets. */
#define _GNU_SOURCE
#include <errno.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "context.h"

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif

static int fail(jl_status *st, int code, int err) {
    st->code = code;
    st->sys_errno = err;
    return code;
}

int jl_attach(int fd, int32_t member, int32_t size, size_t chunk_bytes, const int32_t *names,
              const int32_t *pids, const jl_settings *settings, jl_ctx **out, jl_status *st) {
    jl_status_clear(st);
    *out = NULL;
    if (size < 1 || size > JL_MAX_RANKS || member < 0 || member >= size || chunk_bytes % 64)
        return fail(st, JL_INVALID, 0);
    size_t total = jl_data_offset(size) + (size_t)size * 2 * chunk_bytes;
    struct stat info;
    if (fstat(fd, &info) != 0)
        return fail(st, JL_SYSTEM, errno);
    if ((size_t)info.st_size != total) {
        st->step = (uint64_t)info.st_size; /* what the size check found, for the message */
        st->peer_step = total;
        return fail(st, JL_INVALID, 0);
    }
    jl_ctx *ctx = calloc(1, sizeof *ctx);
    if (ctx == NULL)
        return fail(st, JL_SYSTEM, ENOMEM);
    void *base = mmap(NULL, total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (base == MAP_FAILED) {
        int err = errno;
        free(ctx);
        return fail(st, JL_SYSTEM, err);
    }
    ctx->base = base;
    ctx->bytes = total;
    ctx->member = member;
    ctx->size = size;
    /* The CPUs this process may run on (step.c: when yielding pauses). */
    cpu_set_t cpus;
    int ncpus = sched_getaffinity(0, sizeof cpus, &cpus) == 0 ? CPU_COUNT(&cpus) : 1;
    ctx->cpus = ncpus > 0 ? ncpus : 1;
    ctx->chunk = chunk_bytes;
    ctx->sleepers = (jl_word *)(ctx->base + JL_SLEEPERS);
    ctx->arrivals = (jl_word *)(ctx->base + JL_ARRIVALS);
    size_t data = jl_data_offset(size);
    for (int32_t q = 0; q < size; q++) {
        unsigned char *block = ctx->base + (size_t)JL_CONTROL * (size_t)(q + 1);
        ctx->counter[q] = (jl_word *)(block + JL_COUNTER);
        ctx->broken[q] = (jl_word *)(block + JL_BROKEN);
        for (int p = 0; p < 2; p++) {
            ctx->header[q][p] = block + JL_HEADER + p * JL_HEADER_BYTES;
            ctx->buf[q][p] = ctx->base + data + ((size_t)q * 2 + (size_t)p) * chunk_bytes;
        }
        ctx->names[q] = names ? names[q] : q;
        ctx->pids[q] = pids[q];
    }
    ctx->step = 0;
    ctx->sequence = 0;
    for (int32_t q = 0; q < size; q++) {
        if (q == member)
            continue;
        long pidfd = syscall(SYS_pidfd_open, (pid_t)pids[q], 0);
        if (pidfd < 0) {
            int err = errno;
            st->peer = q;
            jl_detach(ctx);
            return fail(st, JL_SYSTEM, err);
        }
        ctx->polls[ctx->npolls] = (struct pollfd){.fd = (int)pidfd, .events = POLLIN};
        ctx->poll_member[ctx->npolls] = q;
        ctx->poll_rank[ctx->npolls] = ctx->names[q];
        ctx->npolls++;
    }
    if (settings != NULL)
        ctx->settings = *settings;
    *out = ctx;
    return JL_OK;
}

void jl_detach(jl_ctx *ctx) {
    if (ctx == NULL)
        return;
    for (int i = 0; i < ctx->npolls; i++)
        if (ctx->poll_member[i] >= 0)
            close(ctx->polls[i].fd); /* the pidfds are ours; the watched sockets are the caller's */
    munmap(ctx->base, ctx->bytes);
    free(ctx);
}

void jl_configure(jl_ctx *ctx, const jl_settings *settings) { ctx->settings = *settings; }

int jl_watch(jl_ctx *ctx, int fd, int32_t peer, jl_status *st) {
    jl_status_clear(st);
    if (ctx->npolls >= JL_MAX_RANKS + JL_MAX_WATCHED)
        return fail(st, JL_INVALID, 0);
    ctx->polls[ctx->npolls] = (struct pollfd){.fd = fd, .events = POLLRDHUP};
    ctx->poll_member[ctx->npolls] = -1;
    ctx->poll_rank[ctx->npolls] = peer;
    ctx->npolls++;
    return JL_OK;
}

int32_t jl_member(const jl_ctx *ctx) { return ctx->member; }
int32_t jl_size(const jl_ctx *ctx) { return ctx->size; }
size_t jl_chunk_bytes(const jl_ctx *ctx) { return ctx->chunk; }
uint64_t jl_step(const jl_ctx *ctx) { return ctx->step; }
uint64_t jl_sequence(const jl_ctx *ctx) { return ctx->sequence; }
void jl_set_sequence(jl_ctx *ctx, uint64_t sequence) { ctx->sequence = sequence; }
uint64_t jl_next_sequence(jl_ctx *ctx) { return ctx->sequence++; }
