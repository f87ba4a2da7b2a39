/* Reduction kernels: dst = parts[0] op parts[1] op ... in list order, elementwise, with numpy's
 * results bit for bit (float16/bfloat16 in float32, rounded once). */
#ifndef JL_REDUCE_H
#define JL_REDUCE_H

#include <stddef.h>

/* JL_OK, or JL_INVALID for an unknown dtype/op or an op the dtype has no meaning for. */
int jl_reducible(int dtype, int op);
/* dst may alias parts[0], never a later part. nparts >= 1. Call jl_reducible first. */
void jl_reduce(void *dst, const void *const *parts, int nparts, size_t count, int dtype, int op);
/* The same into a shared buffer that the peers read, with non-temporal stores (copy.h), fenced:
 * the caller may publish right after. dst aliases no part. */
void jl_reduce_stream(void *dst, const void *const *parts, int nparts, size_t count, int dtype, int op);

#endif
