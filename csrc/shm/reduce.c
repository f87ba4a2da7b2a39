/* Reduction kernels for every dtype and op (see reduce.h). Integers wrap (computed unsigned, as
 * numpy's do); float max/min propagate NaN the way numpy's maximum/minimum do; complex products
 * use numpy's formula; bool ops are the logical ones. Elementwise in rank order, so the order of
 * the loops over elements does not change any result. */
#include <stdint.h>
#include <string.h>

#include "copy.h"
#include "engine.h"
#include "reduce.h"

size_t jl_dtype_size(int dtype) {
    switch (dtype) {
    case JL_BOOL: case JL_INT8: case JL_UINT8: return 1;
    case JL_INT16: case JL_UINT16: case JL_FLOAT16: case JL_BFLOAT16: return 2;
    case JL_INT32: case JL_UINT32: case JL_FLOAT32: return 4;
    case JL_INT64: case JL_UINT64: case JL_FLOAT64: case JL_COMPLEX64: return 8;
    case JL_COMPLEX128: return 16;
    default: return 0;
    }
}

int jl_reducible(int dtype, int op) {
    if (jl_dtype_size(dtype) == 0 || op < JL_SUM || op > JL_BXOR)
        return JL_INVALID;
    int integer = dtype <= JL_UINT64;
    int complex = dtype == JL_COMPLEX64 || dtype == JL_COMPLEX128;
    if (op >= JL_BAND && !integer)
        return JL_INVALID;
    if ((op == JL_MAX || op == JL_MIN) && complex)
        return JL_INVALID;
    return JL_OK;
}

/* ---- float16 and bfloat16 <-> float32 ------------------------------------------------------ */

static inline float bits_float(uint32_t b) { float f; memcpy(&f, &b, 4); return f; }
static inline uint32_t float_bits(float f) { uint32_t b; memcpy(&b, &f, 4); return b; }

static inline float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = h & 0x7c00u, sig = h & 0x03ffu;
    if (exp == 0x7c00u)
        return bits_float(sign | 0x7f800000u | (sig << 13));
    if (exp != 0)
        return bits_float(sign | (((uint32_t)(h & 0x7fffu) + 0x1c000u) << 13));
    if (sig == 0)
        return bits_float(sign);
    int e = -1; /* a subnormal half: normalize */
    do { sig <<= 1; e++; } while (!(sig & 0x400u));
    return bits_float(sign | ((uint32_t)(127 - 15 - e) << 23) | ((sig & 0x3ffu) << 13));
}

/* Round to nearest even; NaNs keep their top payload bits (numpy's conversion). */
static inline uint16_t float_to_half(float value) {
    uint32_t f = float_bits(value);
    uint16_t sign = (uint16_t)((f & 0x80000000u) >> 16);
    uint32_t exp = f & 0x7f800000u, sig = f & 0x007fffffu;
    if (exp >= 0x47800000u) {
        if (exp == 0x7f800000u && sig) {
            uint16_t nan = (uint16_t)(0x7c00u + (sig >> 13));
            return (uint16_t)(sign + (nan == 0x7c00u ? nan + 1 : nan));
        }
        return (uint16_t)(sign + 0x7c00u);
    }
    if (exp <= 0x38000000u) {
        if (exp < 0x33000000u)
            return sign;
        uint32_t e = exp >> 23;
        uint32_t s = 0x00800000u + sig;
        s >>= (113 - e);
        if (((s & 0x3fffu) != 0x1000u) || (f & 0x7ffu))
            s += 0x1000u;
        return (uint16_t)(sign + (s >> 13));
    }
    uint32_t h_exp = (exp - 0x38000000u) >> 13;
    if ((sig & 0x3fffu) != 0x1000u)
        sig += 0x1000u;
    return (uint16_t)(sign + h_exp + (sig >> 13)); /* a carry into the exponent is right, up to inf */
}

static inline float bf16_to_float(uint16_t h) { return bits_float((uint32_t)h << 16); }

static inline uint16_t float_to_bf16(float value) {
    uint32_t f = float_bits(value);
    if (value != value)
        return (f & 0x80000000u) ? 0xffc0u : 0x7fc0u;
    return (uint16_t)((f + 0x7fffu + ((f >> 16) & 1u)) >> 16);
}

/* ---- elementwise operations ---------------------------------------------------------------- */

#define ADD_WRAP(T, a, b) ((T)((uint64_t)(a) + (uint64_t)(b)))
#define MUL_WRAP(T, a, b) ((T)((uint64_t)(a) * (uint64_t)(b)))
#define MAX_INT(a, b) ((a) >= (b) ? (a) : (b))
#define MIN_INT(a, b) ((a) <= (b) ? (a) : (b))
/* numpy's maximum/minimum: a NaN propagates (the first one when both are), and of two equal
 * values (+0.0 and -0.0) the second is returned, as numpy's float32/float64 loops (a SIMD max, then
 * the NaNs blended in) and ml_dtypes' bfloat16 do. numpy's float16 loop returns the first of two
 * equal values: float16 reduces in float32 with the _FIRST forms. */
#define MAX_FLT(a, b) ((a) != (a) ? (a) : ((a) > (b) ? (a) : (b)))
#define MIN_FLT(a, b) ((a) != (a) ? (a) : ((a) < (b) ? (a) : (b)))
#define MAX_FLT_FIRST(a, b) (((a) >= (b) || (a) != (a)) ? (a) : (b))
#define MIN_FLT_FIRST(a, b) (((a) <= (b) || (a) != (a)) ? (a) : (b))

/* dst[i] = a[i] OP b[i] for one type, no two of them overlapping, and the in-place form
 * dst[i] = dst[i] OP b[i] (restrict lets the compiler vectorize without overlap checks). Typed
 * through void pointers so that one table holds every type's kernels. */
#define BINARY(NAME, T, EXPR)                                                                   \
    static void NAME(void *restrict out, const void *restrict in0, const void *restrict in1,    \
                     size_t n) {                                                                \
        T *restrict dst = out;                                                                  \
        const T *restrict a = in0, *restrict b = in1;                                           \
        for (size_t i = 0; i < n; i++) {                                                        \
            T x = a[i], y = b[i];                                                               \
            dst[i] = (EXPR);                                                                    \
        }                                                                                       \
    }                                                                                           \
    INPLACE_ONLY(NAME, T, EXPR)

#define INPLACE_ONLY(NAME, T, EXPR)                                                             \
    static void NAME##_in(void *restrict out, const void *restrict in1, size_t n) {             \
        T *restrict dst = out;                                                                  \
        const T *restrict b = in1;                                                              \
        for (size_t i = 0; i < n; i++) {                                                        \
            T x = dst[i], y = b[i];                                                             \
            dst[i] = (EXPR);                                                                    \
        }                                                                                       \
    }

#define INTEGER_OPS(T, S)                                                                       \
    BINARY(sum_##S, T, ADD_WRAP(T, x, y))                                                       \
    BINARY(prod_##S, T, MUL_WRAP(T, x, y))                                                      \
    BINARY(max_##S, T, MAX_INT(x, y))                                                           \
    BINARY(min_##S, T, MIN_INT(x, y))                                                           \
    BINARY(band_##S, T, (T)(x & y))                                                             \
    BINARY(bor_##S, T, (T)(x | y))                                                              \
    BINARY(bxor_##S, T, (T)(x ^ y))

INTEGER_OPS(int8_t, i8)
INTEGER_OPS(int16_t, i16)
INTEGER_OPS(int32_t, i32)
INTEGER_OPS(int64_t, i64)
INTEGER_OPS(uint8_t, u8)
INTEGER_OPS(uint16_t, u16)
INTEGER_OPS(uint32_t, u32)
INTEGER_OPS(uint64_t, u64)

BINARY(or_b, uint8_t, (uint8_t)((x != 0) | (y != 0)))
BINARY(and_b, uint8_t, (uint8_t)((x != 0) & (y != 0)))
BINARY(xor_b, uint8_t, (uint8_t)((x != 0) ^ (y != 0)))

#define FLOAT_OPS(T, S)                                                                         \
    BINARY(sum_##S, T, x + y)                                                                   \
    BINARY(prod_##S, T, x * y)                                                                  \
    BINARY(max_##S, T, MAX_FLT(x, y))                                                           \
    BINARY(min_##S, T, MIN_FLT(x, y))

FLOAT_OPS(float, f32)
FLOAT_OPS(double, f64)
INPLACE_ONLY(max_f32_first, float, MAX_FLT_FIRST(x, y))
INPLACE_ONLY(min_f32_first, float, MIN_FLT_FIRST(x, y))

/* Complex as (re, im) pairs of T; n counts complex elements. The product is numpy's formula (no
 * C99 Annex G special cases), fused as numpy fuses it: its SIMD loop computes re = fma(ar, br,
 * -(ai bi)) and im = fma(ar, bi, ai br) wherever it runs with FMA (x86-64-v3 and up, ARM), which
 * differs in the last bit from the unfused product. dst may alias a (each element is read before
 * it is written). */
#if defined(__x86_64__) || defined(__i386__)
#define FUSED_TARGET __attribute__((target("avx2,fma")))
static int fused_complex_product(void) { return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"); }
#else
#define FUSED_TARGET
static int fused_complex_product(void) { return 1; }
#endif
#define FMA(a, b, c) _Generic((a), float: __builtin_fmaf, double: __builtin_fma)(a, b, c)
#define COMPLEX_OPS(T, S)                                                                       \
    BINARY(sum_##S##_parts, T, x + y)                                                           \
    static void sum_##S(void *restrict out, const void *restrict a, const void *restrict b, size_t n) { \
        sum_##S##_parts(out, a, b, 2 * n);                                                      \
    }                                                                                           \
    static void sum_##S##_in(void *restrict out, const void *restrict b, size_t n) {            \
        sum_##S##_parts_in(out, b, 2 * n);                                                      \
    }                                                                                           \
    static void prod_##S##_plain(void *out, const void *in0, const void *in1, size_t n) {       \
        T *dst = out;                                                                           \
        const T *a = in0, *b = in1;                                                             \
        for (size_t i = 0; i < n; i++) {                                                        \
            T ar = a[2 * i], ai = a[2 * i + 1], br = b[2 * i], bi = b[2 * i + 1];               \
            dst[2 * i] = ar * br - ai * bi;                                                     \
            dst[2 * i + 1] = ar * bi + ai * br;                                                 \
        }                                                                                       \
    }                                                                                           \
    FUSED_TARGET static void prod_##S##_fused(void *out, const void *in0, const void *in1, size_t n) { \
        T *dst = out;                                                                           \
        const T *a = in0, *b = in1;                                                             \
        for (size_t i = 0; i < n; i++) {                                                        \
            T ar = a[2 * i], ai = a[2 * i + 1], br = b[2 * i], bi = b[2 * i + 1];               \
            dst[2 * i] = FMA(ar, br, -(ai * bi));                                               \
            dst[2 * i + 1] = FMA(ar, bi, ai * br);                                              \
        }                                                                                       \
    }                                                                                           \
    static void prod_##S(void *out, const void *in0, const void *in1, size_t n) {               \
        if (fused_complex_product())                                                            \
            prod_##S##_fused(out, in0, in1, n);                                                 \
        else                                                                                    \
            prod_##S##_plain(out, in0, in1, n);                                                 \
    }                                                                                           \
    static void prod_##S##_in(void *out, const void *in1, size_t n) { prod_##S(out, out, in1, n); }

COMPLEX_OPS(float, c64)
COMPLEX_OPS(double, c128)

typedef void (*binary_fn)(void *restrict, const void *restrict, const void *restrict, size_t);
typedef void (*inplace_fn)(void *restrict, const void *restrict, size_t);

#define OPS7(S, X) {X(sum_##S), X(prod_##S), X(max_##S), X(min_##S), X(band_##S), X(bor_##S), X(bxor_##S)}
#define OPS4(S, X) {X(sum_##S), X(prod_##S), X(max_##S), X(min_##S), 0, 0, 0}
#define OPS2(S, X) {X(sum_##S), X(prod_##S), 0, 0, 0, 0, 0}
#define BOOL(X) {X(or_b), X(and_b), X(or_b), X(and_b), X(and_b), X(or_b), X(xor_b)}
#define PLAIN(f) f
#define IN(f) f##_in
#define TABLE_OF(X)                                                                             \
    {[JL_BOOL] = BOOL(X),                                                                       \
     [JL_INT8] = OPS7(i8, X), [JL_INT16] = OPS7(i16, X), [JL_INT32] = OPS7(i32, X), [JL_INT64] = OPS7(i64, X), \
     [JL_UINT8] = OPS7(u8, X), [JL_UINT16] = OPS7(u16, X), [JL_UINT32] = OPS7(u32, X), [JL_UINT64] = OPS7(u64, X), \
     [JL_FLOAT32] = OPS4(f32, X), [JL_FLOAT64] = OPS4(f64, X),                                  \
     [JL_COMPLEX64] = OPS2(c64, X), [JL_COMPLEX128] = OPS2(c128, X)}

/* By dtype code, then op (float16/bfloat16 go through float32's). */
static const binary_fn TABLE[16][7] = TABLE_OF(PLAIN);
static const inplace_fn INPLACE[16][7] = TABLE_OF(IN);

#define WIDE_BLOCK 512 /* float32 accumulator on the stack: nothing allocated */

static void reduce_widened(void *dst, const void *const *parts, int nparts, size_t count, int dtype, int op) {
    int half = dtype == JL_FLOAT16;
    inplace_fn fn = !half ? INPLACE[JL_FLOAT32][op] : op == JL_MAX ? max_f32_first_in
                  : op == JL_MIN ? min_f32_first_in : INPLACE[JL_FLOAT32][op];
    float acc[WIDE_BLOCK], next[WIDE_BLOCK];
    for (size_t lo = 0; lo < count; lo += WIDE_BLOCK) {
        size_t n = count - lo < WIDE_BLOCK ? count - lo : WIDE_BLOCK;
        const uint16_t *first = (const uint16_t *)parts[0] + lo;
        for (size_t i = 0; i < n; i++)
            acc[i] = half ? half_to_float(first[i]) : bf16_to_float(first[i]);
        for (int p = 1; p < nparts; p++) {
            const uint16_t *part = (const uint16_t *)parts[p] + lo;
            for (size_t i = 0; i < n; i++)
                next[i] = half ? half_to_float(part[i]) : bf16_to_float(part[i]);
            fn(acc, next, n);
        }
        uint16_t *out = (uint16_t *)dst + lo;
        for (size_t i = 0; i < n; i++)
            out[i] = half ? float_to_half(acc[i]) : float_to_bf16(acc[i]);
    }
}

void jl_reduce(void *dst, const void *const *parts, int nparts, size_t count, int dtype, int op) {
    size_t size = jl_dtype_size(dtype);
    if (dtype == JL_FLOAT16 || dtype == JL_BFLOAT16) {
        reduce_widened(dst, parts, nparts, count, dtype, op);
        return;
    }
    if (nparts == 1) {
        if (dst != parts[0])
            memmove(dst, parts[0], count * size);
        return;
    }
    inplace_fn in = INPLACE[dtype][op];
    if (dst == parts[0])
        in(dst, parts[1], count);
    else
        TABLE[dtype][op](dst, parts[0], parts[1], count);
    for (int p = 2; p < nparts; p++)
        in(dst, parts[p], count);
}

/* Reduced block by block into a small buffer on the stack (in L1), then written to the shared
 * buffer (streamed or plain, see copy.c) and to out: the member's own reduced slice never has to
 * be read back from the shared buffer, where a streamed one is no longer in cache. */
#define OUT_BLOCK 8192 /* bytes: a multiple of every element size */

void jl_reduce_out(void *shared, void *out, const void *const *parts, int nparts, size_t count, int dtype, int op,
                   int stream) {
    size_t size = jl_dtype_size(dtype);
    _Alignas(64) unsigned char block[OUT_BLOCK];
    const void *at[JL_MAX_RANKS];
    size_t per = OUT_BLOCK / size;
    for (size_t lo = 0; lo < count; lo += per) {
        size_t n = count - lo < per ? count - lo : per;
        for (int p = 0; p < nparts; p++)
            at[p] = (const unsigned char *)parts[p] + lo * size;
        jl_reduce(block, at, nparts, n, dtype, op);
        if (stream)
            jl_stream((unsigned char *)shared + lo * size, block, n * size);
        else
            memcpy((unsigned char *)shared + lo * size, block, n * size);
        memcpy((unsigned char *)out + lo * size, block, n * size);
    }
    if (stream)
        jl_stream_fence();
}
