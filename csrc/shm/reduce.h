/* Reduction kernels: dst = parts[0] op parts[1] op ... in list order, elementwise, with numpy's
 * results bit for bit (float16/bfloat16 in float32, rounded once). */
#ifndef JL_REDUCE_H
#define JL_REDUCE_H

#include <stddef.h>

/* JL_OK, or JL_INVALID for an unknown dtype/op or an op the dtype has no meaning for. */
int jl_reducible(int dtype, int op);
/* dst may alias parts[0], never a later part. nparts >= 1. Call jl_reducible first. */
void jl_reduce(void *dst, const void *const *parts, int nparts, size_t count, int dtype, int op);
/* The same into both a shared buffer that the peers read (non-temporal stores when stream is
 * nonzero, see copy.h, then fenced: the caller may publish right after) and out. Block by block:
 * out may be parts[0] itself (each block is read before it is written); shared aliases nothing. */
void jl_reduce_out(void *shared, void *out, const void *const *parts, int nparts, size_t count, int dtype, int op,
                   int stream);

#endif
