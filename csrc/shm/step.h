/* One step of the step protocol (see engine.h): publish, wait for every peer, check headers. */
#ifndef JL_STEP_H
#define JL_STEP_H

#include "context.h"

/* Publish this member's buffer of the current step (and header, when not NULL), wait until every
 * peer has published the same step, check the headers. Returns the parity exchanged (0 or 1),
 * or -1 with *st filled. */
int jl_exchange(jl_ctx *ctx, const unsigned char *header, int64_t deadline_ns, jl_status *st);

/* Nanoseconds of CLOCK_MONOTONIC (the clock of Python's time.monotonic). */
int64_t jl_now_ns(void);

#endif
