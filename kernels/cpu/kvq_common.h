/* What the kernels (decode_cpu.c, quantize_cpu.c, rotate_cpu.c) share: the operand a store's
 * buffers are read through, the float8 e4m3fn scale dtype read into fp32, the Hadamard rotation of
 * a row. */
#ifndef KVQ_COMMON_H
#define KVQ_COMMON_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

/* One quantized operand as a store holds it (mirrored by Operand in build.py). */
typedef struct {
    const uint8_t *codes;             /* [B, H, T, W] bytes, rows start at token 0 of the slice */
    int64_t code_sb, code_sh, code_st;/* byte strides of batch, head, token (the W bytes are contiguous) */
    const void *scale;                /* token axis: [B, H, T, ng]; channel axis: [B, H, T/group, D]; NULL: none */
    int64_t scale_sb, scale_sh, scale_st; /* element strides */
    const void *zero;                 /* same layout and dtype as scale, or NULL */
    int64_t zero_sb, zero_sh, zero_st;
    const float *lut;                 /* code -> level table (fp8, codebooks; trellis: state -> level), or NULL */
    int32_t bits;                     /* 8, 4, 3 or 2 */
    int32_t is_signed;                /* 8-bit codes read as int8 (symmetric int8) */
    int32_t n_groups;                 /* token axis: scale groups per head vector */
    int32_t channel_axis;             /* 1: one scale row per `group` tokens, D entries per row */
    int32_t group;                    /* channel axis: tokens per scale row */
    int32_t scale_dtype;              /* scale / zero storage: 0 fp32, 1 fp16, 2 bf16, 3 fp8 e4m3fn */
    int32_t state_codes;              /* trellis: codes per state m (lut has 2^(m*bits) entries); 0: one code per element */
    int32_t fp8;                      /* 1: float8 e4m3fn codes, 2: e5m2 (lut holds their values too); 0: not fp8 */
} kvq_operand;

/* Dequantized rows out [B, H, n, D] of tokens [t0, t0 + n) of o (decode_cpu.c). */
void kvq_dequantize(const kvq_operand *o, int64_t B, int64_t H, int64_t t0, int64_t n, int64_t D, float *out);

/* One float8 e4m3fn value (bias 7, no infinities, 0x7f / 0xff NaN) -> fp32, exactly: a normal
 * value's fields moved into fp32's, a subnormal m / 8 * 2^-6 as m * 2^-9 (no libm call: decode
 * converts one per scale row). */
static inline float e4m3_to_f32(uint8_t b) {
    const uint32_t e = (b >> 3) & 15, m = b & 7;
    float v;
    if (e == 0) {
        v = (float)m * 0.001953125f;
    } else if (e == 15 && m == 7) {
        v = NAN;
    } else {
        const uint32_t w = ((e + 120u) << 23) | (m << 20); /* (1 + m / 8) * 2^(e - 7) */
        memcpy(&v, &w, sizeof(v));
    }
    return (b & 0x80) ? -v : v;
}

/* The normalized Walsh-Hadamard transform of one row r[0..d) in place, block-diagonal in blocks of
 * n = d & -d channels (the largest power of two dividing d; all of d when d is one), as
 * kvquant.kernels.reference.rotate_ref: for h = 1, 2, ..., n / 2, each block of 2h channels turns
 * its pairs (j, j + h) into (a + b, a - b); then every value times scale (1 / sqrt(n) in fp32).
 * Rows of 16-channel vectors (AVX-512, d % 16 == 0): the passes h = 1, 2, 4, 8 inside each vector
 * (its lanes' partners j ^ h by a permute, a + b on the lower lanes of each pair and a - b on the
 * upper: the same IEEE operations, so the same bits), AVX2 (d % 8 == 0) h = 1, 2, 4 with 8 lanes;
 * the wider passes and the scale by the loops every build runs. */
static inline void fwht_row(float *r, int64_t d, float scale) {
    const int64_t n = d & -d;
    int64_t h0 = 1; /* the first pass left to the loops below */
#if defined(__AVX512F__)
    if (d % 16 == 0) { /* (blocks of n >= 16: every pass inside a vector applies) */
        for (int64_t c = 0; c < d; c += 16) {
            __m512 x = _mm512_loadu_ps(r + c);
            __m512 p = _mm512_permute_ps(x, 0xB1); /* h = 1: lanes 2i <-> 2i + 1 */
            x = _mm512_mask_sub_ps(_mm512_add_ps(x, p), 0xAAAA, p, x);
            p = _mm512_permute_ps(x, 0x4E); /* h = 2: lane pairs */
            x = _mm512_mask_sub_ps(_mm512_add_ps(x, p), 0xCCCC, p, x);
            p = _mm512_shuffle_f32x4(x, x, 0xB1); /* h = 4: 128-bit quarters 0 <-> 1, 2 <-> 3 */
            x = _mm512_mask_sub_ps(_mm512_add_ps(x, p), 0xF0F0, p, x);
            p = _mm512_shuffle_f32x4(x, x, 0x4E); /* h = 8: 256-bit halves */
            x = _mm512_mask_sub_ps(_mm512_add_ps(x, p), 0xFF00, p, x);
            _mm512_storeu_ps(r + c, x);
        }
        h0 = 16;
    }
#elif defined(__AVX2__)
    if (d % 8 == 0) { /* (blocks of n >= 8) h = 1, 2, 4: sums and differences blended */
        for (int64_t c = 0; c < d; c += 8) {
            __m256 x = _mm256_loadu_ps(r + c);
            __m256 p = _mm256_permute_ps(x, 0xB1);
            x = _mm256_blend_ps(_mm256_add_ps(x, p), _mm256_sub_ps(p, x), 0xAA);
            p = _mm256_permute_ps(x, 0x4E);
            x = _mm256_blend_ps(_mm256_add_ps(x, p), _mm256_sub_ps(p, x), 0xCC);
            p = _mm256_permute2f128_ps(x, x, 0x01);
            x = _mm256_blend_ps(_mm256_add_ps(x, p), _mm256_sub_ps(p, x), 0xF0);
            _mm256_storeu_ps(r + c, x);
        }
        h0 = 8;
    }
#endif
    for (int64_t h = h0; h < n; h *= 2) /* (from h0 = 8 or 16 on: whole vectors, which the compiler forms) */
        for (int64_t b = 0; b < d; b += 2 * h)
            for (int64_t j = b; j < b + h; j++) {
                const float u = r[j], v = r[j + h];
                r[j] = u + v;
                r[j + h] = u - v;
            }
    for (int64_t j = 0; j < d; j++) r[j] *= scale;
}

#endif
