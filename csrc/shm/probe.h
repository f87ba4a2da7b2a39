/* The placement probe: how far apart two CPUs are, as a cache line's round trip between them. */
#ifndef JL_PROBE_H
#define JL_PROBE_H

#include <stdint.h>

/* Nanoseconds of one round trip of a cache line between a thread on cpu_a and one on
 * cpu_b (each waits for the other's store, then stores), in the fastest of `rounds` (at most 64) batches of `trips`
 * (on a loaded host most batches also time the scheduler).
 * Returns a negative errno when a thread cannot be pinned or started. */
double jl_cache_line_round_trip(int cpu_a, int cpu_b, int rounds, int trips);

#endif
