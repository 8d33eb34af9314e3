/* What the decode and quantize kernels (decode_cpu.c, quantize_cpu.c) share: the float8 e4m3fn
 * scale dtype read into fp32. */
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

#endif
