/* Drives the store-kind choice (csrc/shm/copy.c) with made-up costs per call and checks what it
 * picks: plain stores where they are cheaper, a switch to non-temporal stores within a few
 * calls once plain ones cost five times as much (the host moved the CPUs apart), back to plain
 * stores at the next regular round (the streamed calls cost no more than before), and, when load
 * comes and goes, slowing every call without changing which kind is cheaper, early rounds that
 * grow rarer instead of one per burst.
 * Prints one line per check; exits 1 at the first that fails. */
#include <stdio.h>

#include "copy.h"

#define BYTES (1 << 20)

static jl_stores s;
static long calls;

/* One call: the kind the choice picks, charged cost[kind] ns per KiB. Returns the kind. */
static int call(const int cost[2]) {
    int kind = jl_stores_pick(&s);
    jl_stores_took(&s, kind, (long long)cost[kind] * (BYTES / 1024), BYTES);
    calls++;
    return kind;
}

/* Calls until the choice has picked `kind` `run` times in a row (at most `limit` calls): how many. */
static long until(const int cost[2], int kind, int run, long limit) {
    long start = calls;
    int in_row = 0;
    while (calls - start < limit && in_row < run)
        in_row = call(cost) == kind ? in_row + 1 : 0;
    return in_row == run ? calls - start : -1;
}

/* Trial runs (a switch to the other kind and back) in `n` calls; with `other`, the costs
 * alternate between the two every 16 calls (bursts of load). */
static long trials_in(const int cost[2], long n, int kind, const int *other) {
    long trials = 0;
    int last = kind;
    for (long i = 0; i < n; i++) {
        int k = call(other != NULL && (i / 16) % 2 ? other : cost);
        trials += k != kind && last == kind;
        last = k;
    }
    return trials;
}

/* Calls until the middle of a round (far from a regular one), so a switch seen soon is the
 * early round's. */
static void to_mid_round(const int cost[2]) {
    while (s.calls % 1024 != 512)
        call(cost);
}

static int check(int ok, const char *what, long value) {
    printf("%s %s: %ld\n", ok ? "ok" : "FAILED", what, value);
    return ok;
}

int main(void) {
    const int near[2] = {60, 100}, far[2] = {500, 110}, loaded[2] = {200, 330};
    long n = until(near, 0, 100, 200);
    if (!check(n > 0 && n <= 114, "near: plain stores within the first round's trials (calls)", n))
        return 1;
    long quiet = trials_in(near, 5000, 0, NULL);
    if (!check(quiet <= 5, "near: trial runs in 5000 quiet calls (one per round)", quiet))
        return 1;
    to_mid_round(near);
    n = until(far, 1, 50, 200);
    if (!check(n > 0 && n <= 8 + 2 + 12 + 50, "moved apart: non-temporal stores after (calls)", n))
        return 1;
    n = until(near, 0, 50, 1024 + 100);
    if (!check(n > 0, "moved back: plain stores again after (calls)", n))
        return 1;
    long steady = trials_in(loaded, 5000, 0, NULL);
    if (!check(steady <= 6, "steady load: trial runs in 5000 calls", steady))
        return 1;
    until(near, 0, 50, 1024 + 100);
    long bursts = trials_in(loaded, 8000, 0, near); /* 250 bursts of 16 slow calls */
    if (!check(bursts <= 8 + 6, "load in bursts: trial runs in 8000 calls", bursts))
        return 1;
    to_mid_round(near);
    n = until(far, 1, 50, 2 * 1024 + 100);
    if (!check(n > 0, "moved apart after the load: non-temporal stores after (calls)", n))
        return 1;
    return 0;
}
