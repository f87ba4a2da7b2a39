/* The placement probe (probe.h). A virtual machine's two CPUs may be hyperthreads of one core or
 * sit on different sockets: writing lines the other CPU just read costs several times more in
 * the far case, which every same-host collective pays; benchmarks print this before they run. */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "probe.h"
#include "step.h"

typedef struct {
    _Alignas(64) _Atomic uint64_t ping;
    _Alignas(64) _Atomic uint64_t pong;
    int cpu, total;
} probe_state;

static int pin(int cpu) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    return pthread_setaffinity_np(pthread_self(), sizeof set, &set);
}

static void *responder(void *arg) {
    probe_state *s = arg;
    if (pin(s->cpu) != 0)
        atomic_store_explicit(&s->pong, UINT64_MAX, memory_order_release);
    for (uint64_t i = 1; i <= (uint64_t)s->total; i++) {
        /* acquire/release: each side's store is what the other waits for, nothing else. */
        while (atomic_load_explicit(&s->ping, memory_order_acquire) != i)
            ;
        atomic_store_explicit(&s->pong, i, memory_order_release);
    }
    return NULL;
}

static int by_value(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

double jl_cache_line_round_trip(int cpu_a, int cpu_b, int rounds, int trips) {
    if (rounds < 1 || rounds > 64 || trips < 1)
        return -EINVAL;
    cpu_set_t saved;
    if (sched_getaffinity(0, sizeof saved, &saved) != 0)
        return -errno;
    probe_state *s = aligned_alloc(64, sizeof *s);
    if (s == NULL)
        return -ENOMEM;
    memset(s, 0, sizeof *s);
    s->cpu = cpu_b;
    s->total = rounds * trips;
    double result = -EINVAL;
    pthread_t thread;
    int err = pin(cpu_a);
    if (err == 0)
        err = pthread_create(&thread, NULL, responder, s);
    if (err != 0) {
        free(s);
        sched_setaffinity(0, sizeof saved, &saved);
        return -err;
    }
    double times[64];
    uint64_t i = 0;
    for (int r = 0; r < rounds; r++) {
        int64_t start = jl_now_ns();
        for (int t = 0; t < trips; t++) {
            i++;
            atomic_store_explicit(&s->ping, i, memory_order_release);
            uint64_t seen;
            while ((seen = atomic_load_explicit(&s->pong, memory_order_acquire)) != i && seen != UINT64_MAX)
                ;
            if (seen == UINT64_MAX)
                break;
        }
        times[r] = (double)(jl_now_ns() - start) / trips;
    }
    if (atomic_load_explicit(&s->pong, memory_order_acquire) == UINT64_MAX) {
        result = -EINVAL; /* the responder could not be pinned and has returned */
    } else {
        /* The fastest batch: on a loaded host most batches also time the scheduler. */
        qsort(times, (size_t)rounds, sizeof times[0], by_value);
        result = times[0];
    }
    pthread_join(thread, NULL);
    free(s);
    sched_setaffinity(0, sizeof saved, &saved);
    return result;
}
