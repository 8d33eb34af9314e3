/* What the kernels (decode_cpu.c, quantize_cpu.c, rotate_cpu.c) share: the float8 e4m3fn scale
 * dtype read into fp32, the Hadamard rotation of a row. */
#ifndef KVQ_COMMON_H
#define KVQ_COMMON_H

#include <math.h>
#include <stdint.h>

/* One float8 e4m3fn value (bias 7, no infinities, 0x7f / 0xff NaN) -> fp32. */
static inline float e4m3_to_f32(uint8_t b) {
    const int e = (b >> 3) & 15, m = b & 7;
    float v;
    if (e == 15 && m == 7) v = NAN;
    else if (e == 0) v = ldexpf((float)m, -9);      /* subnormal: m / 8 * 2^-6 */
    else v = ldexpf((float)(8 + m), e - 10);        /* (1 + m / 8) * 2^(e - 7) */
    return (b & 0x80) ? -v : v;
}

/* The normalized Walsh-Hadamard transform of one row r[0..d) in place, block-diagonal in blocks of
 * n = d & -d channels (the largest power of two dividing d; all of d when d is one), as
 * kvquant.kernels.reference.rotate_ref: for h = 1, 2, ..., n / 2, each block of 2h channels turns
 * its pairs (j, j + h) into (a + b, a - b); then every value times scale (1 / sqrt(n) in fp32). */
static inline void fwht_row(float *r, int64_t d, float scale) {
    for (int64_t h = 1; h < (d & -d); h *= 2)
        for (int64_t b = 0; b < d; b += 2 * h)
            for (int64_t j = b; j < b + h; j++) {
                const float u = r[j], v = r[j + h];
                r[j] = u + v;
                r[j + h] = u - v;
            }
    for (int64_t j = 0; j < d; j++) r[j] *= scale;
}

#endif
