/* Decode attention over the quantized store on CPU: the native twin of
 * kvquant.kernels.chunked.decode_attention_torch (same operands, same numbers up to fp32 rounding).
 *
 * One (batch row, KV head) at a time: its G query heads share every key and value row read. Tokens
 * go in blocks of BLOCK_T: each key row is unpacked into a D-wide float buffer (codes -> levels ->
 * times scale plus zero point), dotted with the G queries; an online softmax updates the running
 * max / sum once per block; then each value row is unpacked the same way and accumulated with its
 * G probabilities. Nothing larger than one row per operand is ever widened: no full-precision copy
 * of the history exists at any time.
 *
 * Built at first use by kernels/cpu/build.py (cc -O3 -march=native -shared); no Python or torch
 * headers, called through ctypes with raw pointers and element strides.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kvq_common.h"
#if defined(__F16C__)
#include <immintrin.h>
#endif

#define BLOCK_T 64

/* Every float8 e4m3fn byte's fp32 value (e4m3_to_f32): a scale row converts by one load per entry,
 * no branches (filled when the library loads). */
static float e4m3_table[256];

__attribute__((constructor)) static void fill_e4m3_table(void) {
    for (int i = 0; i < 256; i++) e4m3_table[i] = e4m3_to_f32((uint8_t)i);
}

/* n scale / zero entries starting at element i of p (stored as `dtype`) -> fp32 dst. */
static inline void load_f32(const void *p, int dtype, int64_t i, int n, float *restrict dst) {
    if (dtype == 3) {
        const uint8_t *u = (const uint8_t *)p + i;
        for (int k = 0; k < n; k++) dst[k] = e4m3_table[u[k]];
    } else if (dtype == 0) {
        memcpy(dst, (const float *)p + i, sizeof(float) * (size_t)n);
    } else if (dtype == 1) {
        const _Float16 *hp = (const _Float16 *)p + i;
        int k = 0;
#if defined(__F16C__)
        for (; k + 8 <= n; k += 8) /* eight at a time (a block's per-token scales: one or two of these) */
            _mm256_storeu_ps(dst + k, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(hp + k))));
#endif
        for (; k < n; k++) dst[k] = (float)hp[k];
    } else {
        const uint16_t *u = (const uint16_t *)p + i;
        for (int k = 0; k < n; k++) {
            const uint32_t w = (uint32_t)u[k] << 16;
            memcpy(dst + k, &w, sizeof(w));
        }
    }
}

/* The scale (and zero) row of token t: D entries (channel axis) or n_groups (token axis). */
static inline void load_scales(const kvq_operand *o, int64_t b, int64_t h, int64_t t, int D,
                               float *restrict s, float *restrict z) {
    const int64_t r = o->channel_axis ? t / o->group : t;
    const int n = o->channel_axis ? D : o->n_groups;
    load_f32(o->scale, o->scale_dtype, b * o->scale_sb + h * o->scale_sh + r * o->scale_st, n, s);
    if (o->zero) load_f32(o->zero, o->scale_dtype, b * o->zero_sb + h * o->zero_sh + r * o->zero_st, n, z);
}

/* load_scales for token t, unless the channel-axis scale row in s / z (*row: its index, -1 none)
 * already is t's: a block of rows converts each row of per-channel scales once. */
static inline void load_scales_once(const kvq_operand *o, int64_t b, int64_t h, int64_t t, int D,
                                    float *restrict s, float *restrict z, int64_t *row) {
    if (o->channel_axis && t / o->group == *row) return;
    load_scales(o, b, h, t, D, s, z);
    *row = o->channel_axis ? t / o->group : -1;
}

/* exp for x <= 0 (scores minus their running max): 2^n * p(r), |rel err| < 2e-7; vectorizes. */
static inline float exp_nonpos(float x) {
    if (x == 0.0f) return 1.0f; /* (what the polynomial gives: the usual case, a running max unchanged) */
    const int underflow = x < -87.0f;
    x = underflow ? -87.0f : x;
    const float log2e = 1.44269504088896341f;
    float n = floorf(x * log2e + 0.5f);
    float r = x - n * 0.693359375f + n * 2.12194440e-4f; /* Cody-Waite split of ln 2 */
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union { float f; int32_t i; } u;
    u.i = ((int32_t)n + 127) << 23;
    return underflow ? 0.0f : p * u.f;
}

/* Codes of one token -> code indices idx[D]. */
static void unpack_row(const uint8_t *restrict c, int bits, int D, uint8_t *restrict idx) {
    if (bits == 8) {
        memcpy(idx, c, (size_t)D);
    } else if (bits == 4) {
        const int w = D / 2;
        for (int j = 0; j < w; j++) { idx[j] = c[j] & 15; idx[j + w] = c[j] >> 4; }
    } else if (bits == 2) {
        const int w = D / 4;
        for (int k = 0; k < 4; k++)
            for (int j = 0; j < w; j++) idx[j + k * w] = (c[j] >> (2 * k)) & 3;
    } else if (bits == 1) { /* channel j + k D/8: bit k of byte j */
        const int w = D / 8;
        for (int k = 0; k < 8; k++)
            for (int j = 0; j < w; j++) idx[j + k * w] = (c[j] >> k) & 1;
    } else { /* 3: an int2 plane (D/4 bytes), then the high bits eight per byte (D/8 bytes) */
        const int w = D / 4, w1 = D / 8;
        for (int k = 0; k < 4; k++)
            for (int j = 0; j < w; j++) idx[j + k * w] = (c[j] >> (2 * k)) & 3;
        for (int k = 0; k < 8; k++)
            for (int j = 0; j < w1; j++) idx[j + k * w1] |= ((c[w + j] >> k) & 1) << 2;
    }
}

/* One token's dequantized row out[D] (token t of the slice, batch row b, head h). Integer codes
 * go straight from bytes to floats (loops the compiler vectorizes at D/2 .. D/4 lanes); fp8 and
 * codebook codes go through the operand's table. */
static inline void load_row(const kvq_operand *o, int64_t b, int64_t h, int64_t t, int D,
                            uint8_t *restrict idx, float *restrict out) {
    const uint8_t *restrict c = o->codes + b * o->code_sb + h * o->code_sh + t * o->code_st;
    if (o->bits == 32) { /* full-precision rows (sink / residual / new tokens): fp32 as they are */
        memcpy(out, c, sizeof(float) * (size_t)D);
        return;
    }
    if (o->state_codes) { /* trellis: the state of channel d is its code and the m-1 before it, circularly */
        unpack_row(c, o->bits, D, idx);
        const int m = o->state_codes, k = o->bits;
        for (int d = 0; d < D; d++) {
            uint32_t s = 0;
            for (int j = 0; j < m; j++) s |= (uint32_t)idx[d - j >= 0 ? d - j : d - j + D] << (j * k);
            out[d] = o->lut[s];
        }
    } else if (o->lut) {
        unpack_row(c, o->bits, D, idx);
        for (int d = 0; d < D; d++) out[d] = o->lut[idx[d]];
    } else if (o->bits == 8) {
        if (o->is_signed) {
            for (int d = 0; d < D; d++) out[d] = (float)(int8_t)c[d];
        } else {
            for (int d = 0; d < D; d++) out[d] = (float)c[d];
        }
    } else if (o->bits == 4) {
        const int w = D / 2;
        float *restrict hi = out + w; /* separate loops: one output stream each vectorizes */
        for (int j = 0; j < w; j++) out[j] = (float)(c[j] & 15);
        for (int j = 0; j < w; j++) hi[j] = (float)(c[j] >> 4);
    } else if (o->bits == 2) {
        const int w = D / 4;
        for (int k = 0; k < 4; k++)
            for (int j = 0; j < w; j++) out[j + k * w] = (float)((c[j] >> (2 * k)) & 3);
    } else { /* 3: int2 plane (D/4 bytes) + high bits eight per byte (D/8 bytes) */
        const int w = D / 4, w1 = D / 8;
        for (int k = 0; k < 4; k++)
            for (int j = 0; j < w; j++) out[j + k * w] = (float)((c[j] >> (2 * k)) & 3);
        for (int k = 0; k < 8; k++)
            for (int j = 0; j < w1; j++) out[j + k * w1] += (float)(((c[w + j] >> k) & 1) << 2);
    }
    if (!o->scale) return;
    float s[512], zb[512];
    load_scales(o, b, h, t, D, s, zb);
    const float *z = o->zero ? zb : NULL;
    if (o->channel_axis) {
        if (z) {
            for (int d = 0; d < D; d++) out[d] = out[d] * s[d] + z[d];
        } else {
            for (int d = 0; d < D; d++) out[d] *= s[d];
        }
        return;
    }
    const int gs = D / o->n_groups;
    for (int n = 0; n < o->n_groups; n++) {
        float *x = out + n * gs;
        const float sn = s[n];
        if (z) {
            const float zn = z[n];
            for (int d = 0; d < gs; d++) x[d] = x[d] * sn + zn;
        } else {
            for (int d = 0; d < gs; d++) x[d] *= sn;
        }
    }
}

#if defined(__AVX2__) && defined(__FMA__) /* (so with AVX-512 too: -mavx512f implies both) */
#include <immintrin.h>

/* What the AVX-512 and AVX2 paths share: which operands their block loaders read, where each
 * chunk of a row lies in the packed bytes, and the scalar side of the one-scale-per-token fold. */

/* Can load_block16 / load_block8 read this operand in chunks of `lanes` channels? (every chunk lies
 * in one bit plane and one scale group). Otherwise the row-by-row load_row is used (full-precision
 * rows too: there it is one memcpy). */
static int avx_loadable(const kvq_operand *o, int64_t D, int lanes) {
    if (D % lanes || D > 512 || o->bits == 32) return 0;
    if (o->state_codes) /* (trellis_row8: states of up to 16 bits) */
        return o->bits * o->state_codes <= 16 && !(o->scale && !o->channel_axis && (D / o->n_groups) % lanes);
    if (o->bits == 4 && (D / 2) % lanes) return 0;
    if (o->bits == 2 && (D / 4) % lanes) return 0;
    if (o->bits == 3 && (D / 8) % lanes) return 0;
    if (o->scale && !o->channel_axis && (D / o->n_groups) % lanes) return 0;
    return 1;
}

/* Where chunk c (channels lanes c .. lanes c + lanes - 1) of a row lies: its code bytes from
 * off[c], its field at bit shift[c] of each; int3: its high bits at bit shift1[c] of the bytes from
 * off1[c]. Needs avx_loadable. */
static void chunk_planes(const kvq_operand *o, int64_t D, int lanes, int *off, int *shift, int *off1,
                         int *shift1) {
    const int w = o->bits == 8 ? (int)D : (int)(o->bits == 4 ? D / 2 : D / 4);
    for (int c = 0; c < (int)(D / lanes); c++) {
        const int k = lanes * c / w; /* bit plane of the chunk (int3: of its low bits) */
        off[c] = lanes * c - k * w;
        shift[c] = o->bits == 8 ? 0 : (o->bits == 4 ? 4 : 2) * k;
        if (o->bits == 3) {
            const int w1 = (int)(D / 8), k1 = lanes * c / w1;
            off1[c] = w + lanes * c - k1 * w1;
            shift1[c] = k1;
        }
    }
}

/* One scale (and zero point) per token: the block loaders leave the codes raw and the heads fold
 * the scales in. Scores are s_t (q . c_t) + z_t sum(q), so qsum[g] = sum(q_g); values accumulate
 * (p_t s_t) c_t, and sum_t p_t z_t per query head on the side (zacc, zeroed here). */
static int one_scale_per_token(const kvq_operand *o, int fast) {
    return fast && o->scale && !o->channel_axis && o->n_groups == 1;
}

/* qsum[g * stride + j] = sum of q_g over scale group j's channels, j < ng (ng <= 1: one sum of all D
 * channels), the other slots 0; zacc zeroed. (fold_groups: ng groups of D / ng channels.) */
static void fold_init(const float *qh, int64_t G, int64_t D, int ng, int stride, float *qsum, float *zacc) {
    const int n = ng > 1 ? ng : 1;
    for (int64_t g = 0; g < G; g++)
        for (int j = 0; j < stride; j++) {
            float t = 0.0f;
            for (int64_t d = j * (D / n); j < n && d < (j + 1) * (D / n); d++) t += qh[g * D + d];
            qsum[g * stride + j] = t;
            zacc[g * stride + j] = 0.0f;
        }
}

/* The end of the fold: each query head's sum_t p_t z_tj (zacc[g * stride + j]) added to group j's
 * channels (ng groups; 0: no fold), rows not poisoned. */
static void fold_zero_points(const kvq_operand *v, int ng, int stride, int64_t G, int64_t D, const float *zacc,
                             const float *m, float *acc) {
    if (!ng || !v->zero) return;
    const int64_t gs = D / ng;
    for (int64_t g = 0; g < G; g++)
        if (!isnan(m[g]))
            for (int64_t d = 0; d < D; d++) acc[g * D + d] += zacc[g * stride + d / gs];
}

/* Scales sv[i] and zero points zv[i] of tokens t0 + i, i < lanes (one per token; 0 from nt on and
 * zero points 0 without them). Consecutive per-token entries (the usual layout) convert as one run
 * (load_f32: F16C eight at a time, the e4m3 table), strided ones token by token. */
static void token_scales(const kvq_operand *o, int64_t b, int64_t h, int64_t t0, int64_t nt, int lanes,
                         float *sv, float *zv) {
    for (int i = 0; i < lanes; i++) sv[i] = zv[i] = 0.0f;
    if (o->scale_st == 1 && (!o->zero || o->zero_st == 1)) {
        load_f32(o->scale, o->scale_dtype, b * o->scale_sb + h * o->scale_sh + t0, (int)nt, sv);
        if (o->zero) load_f32(o->zero, o->scale_dtype, b * o->zero_sb + h * o->zero_sh + t0, (int)nt, zv);
        return;
    }
    for (int64_t i = 0; i < nt; i++) load_scales(o, b, h, t0 + i, 1, sv + i, zv + i);
}

/* Token-axis scale groups per row when the AVX2 head folds an operand's scales out of its dots
 * (fast: every group a whole number of 8-channel chunks; at most FOLD_GROUPS groups); 0: the block
 * loader applies them. Scores are sum_j s_tj (q_j . c_tj) + z_tj sum(q_j) over the groups j; values
 * accumulate (p_t s_tj) c_t on group j's channels, and sum_t p_t z_tj per query head and group on
 * the side. One group: one_scale_per_token's fold. */
#define FOLD_GROUPS 8
static int fold_groups(const kvq_operand *o, int fast) {
    if (!fast || !o->scale || o->channel_axis || o->n_groups > FOLD_GROUPS) return 0;
    /* (trellis levels take their scale where they are formed, at no cost the fold would save) */
    return o->n_groups == 1 || !o->state_codes ? o->n_groups : 0;
}

/* Scales sv[j * 16 + i] and zero points zv[j * 16 + i] of group j of tokens t0 + i, i < 16 (0 from
 * nt on, and zero points 0 without them), ng groups per token. Rows of ng consecutive entries (the
 * usual [T, ng] layout) convert as one run. */
static void token_group_scales(const kvq_operand *o, int64_t b, int64_t h, int64_t t0, int64_t nt, int ng,
                               float *sv, float *zv) {
    float s[16 * FOLD_GROUPS], z[16 * FOLD_GROUPS];
    for (int i = 0; i < 16 * ng; i++) sv[i] = zv[i] = 0.0f;
    if (o->scale_st == ng && (!o->zero || o->zero_st == ng)) {
        load_f32(o->scale, o->scale_dtype, b * o->scale_sb + h * o->scale_sh + t0 * ng, (int)(nt * ng), s);
        if (o->zero) load_f32(o->zero, o->scale_dtype, b * o->zero_sb + h * o->zero_sh + t0 * ng, (int)(nt * ng), z);
    } else {
        for (int64_t i = 0; i < nt; i++) load_scales(o, b, h, t0 + i, 0, s + i * ng, z + i * ng);
    }
    for (int64_t i = 0; i < nt; i++)
        for (int j = 0; j < ng; j++) {
            sv[j * 16 + i] = s[i * ng + j];
            if (o->zero) zv[j * 16 + i] = z[i * ng + j];
        }
}

/* softcap tanh(s / softcap) softcap on n scores in place. */
static void softcap_scores(float *s, int n, float softcap) {
    for (int i = 0; i < n; i++) s[i] = softcap * tanhf(s[i] / softcap);
}
#endif

#if defined(__AVX512F__)

/* Lane sums of 16 vectors: result lane i = sum of v[i]'s 16 lanes (a shuffle-and-add tree,
 * 15 merges instead of 16 separate horizontal reductions). */
static inline __m512 hsum16(const __m512 *v) {
    __m512 x[8], y[4], z[2];
    for (int k = 0; k < 8; k++) /* per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] */
        x[k] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * k], v[2 * k + 1]),
                             _mm512_unpackhi_ps(v[2 * k], v[2 * k + 1]));
    for (int k = 0; k < 4; k++) /* per 128-bit lane: the lane's sum of 4 sources */
        y[k] = _mm512_add_ps(_mm512_shuffle_ps(x[2 * k], x[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(x[2 * k], x[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int k = 0; k < 2; k++)
        z[k] = _mm512_add_ps(_mm512_shuffle_f32x4(y[2 * k], y[2 * k + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(y[2 * k], y[2 * k + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(z[0], z[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(z[0], z[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

/* Rows t0 .. t0+nt-1 dequantized into out[nt][D], 16 channels per step: bytes -> 16 int32 codes
 * (one shift and mask per chunk, the int3 high bit from its plane) -> levels (int convert, or a
 * 16-entry permute for codebooks) -> times scale plus zero point. Integer and codebook codes only
 * (reads16). */
static void load_block16(const kvq_operand *o, int64_t b, int64_t h, int64_t t0, int64_t nt,
                         int64_t D, float *out, int raw) {
    const int nc = (int)(D / 16);
    int off[32], shift[32], off1[32], shift1[32];
    chunk_planes(o, D, 16, off, shift, off1, shift1);
    const int w = o->bits == 4 ? (int)(D / 2) : 0;
    const __m512i mask = _mm512_set1_epi32(o->bits == 8 ? 255 : (o->bits == 4 ? 15 : 3));
    const int small_lut = o->lut && o->bits < 8;
    const __m512 lut16 = small_lut ? _mm512_loadu_ps(o->lut) : _mm512_setzero_ps();
    const int gs = o->scale && !o->channel_axis ? (int)(D / o->n_groups) : 16;
    float sb[512], zb[512];
    int64_t scale_row = -1; /* channel axis: the scale row in sb / zb (one per `group` tokens) */
    for (int64_t i = 0; i < nt; i++) {
        const int64_t t = t0 + i;
        const uint8_t *row = o->codes + b * o->code_sb + h * o->code_sh + t * o->code_st;
        const float *s = NULL, *z = NULL;
        if (o->scale && !raw) {
            load_scales_once(o, b, h, t, (int)D, sb, zb, &scale_row);
            s = sb;
            if (o->zero) z = zb;
        }
        float *dst = out + i * D;
        if (raw && o->bits == 4 && !o->lut) { /* both nibbles of each byte from one load */
            for (int j = 0; j < w; j += 16) {
                const __m512i ci = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(row + j)));
                _mm512_storeu_ps(dst + j, _mm512_cvtepi32_ps(_mm512_and_si512(ci, mask)));
                _mm512_storeu_ps(dst + w + j, _mm512_cvtepi32_ps(_mm512_srli_epi32(ci, 4)));
            }
            continue;
        }
        for (int c = 0; c < nc; c++) {
            const __m128i bytes = _mm_loadu_si128((const __m128i *)(row + off[c]));
            __m512i ci;
            __m512 x;
            if (o->bits == 8 && o->is_signed) {
                x = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
            } else {
                ci = _mm512_and_si512(_mm512_srl_epi32(_mm512_cvtepu8_epi32(bytes), _mm_cvtsi32_si128(shift[c])), mask);
                if (o->bits == 3) {
                    const __m128i hb = _mm_loadu_si128((const __m128i *)(row + off1[c]));
                    __m512i hi = _mm512_srl_epi32(_mm512_cvtepu8_epi32(hb), _mm_cvtsi32_si128(shift1[c]));
                    ci = _mm512_or_si512(ci, _mm512_slli_epi32(_mm512_and_si512(hi, _mm512_set1_epi32(1)), 2));
                }
                x = small_lut ? _mm512_permutexvar_ps(ci, lut16) : _mm512_cvtepi32_ps(ci);
            }
            if (s) {
                if (o->channel_axis) {
                    x = z ? _mm512_fmadd_ps(x, _mm512_loadu_ps(s + 16 * c), _mm512_loadu_ps(z + 16 * c))
                          : _mm512_mul_ps(x, _mm512_loadu_ps(s + 16 * c));
                } else {
                    const int n = 16 * c / gs;
                    x = z ? _mm512_fmadd_ps(x, _mm512_set1_ps(s[n]), _mm512_set1_ps(z[n]))
                          : _mm512_mul_ps(x, _mm512_set1_ps(s[n]));
                }
            }
            _mm512_storeu_ps(dst + 16 * c, x);
        }
    }
}

/* exp(x) for x <= 0, 16 lanes (same polynomial as exp_nonpos; lanes below -87 give 0). */
static inline __m512 exp16(__m512 x) {
    const __mmask16 under = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_LT_OQ);
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_maskz_mov_ps((__mmask16)~under, _mm512_scalef_ps(p, n));
}

/* Scale and zero point of tokens t0 .. t0+nt-1 for a one-scale-per-token operand, as 16 lanes
 * (0 beyond nt; zero 0 without zero points). */
static inline void token_scales16(const kvq_operand *o, int64_t b, int64_t h, int64_t t0, int64_t nt,
                                  __m512 *s, __m512 *z) {
    float sv[16], zv[16];
    token_scales(o, b, h, t0, nt, 16, sv, zv);
    *s = _mm512_loadu_ps(sv);
    *z = o->zero ? _mm512_loadu_ps(zv) : _mm512_setzero_ps();
}

/* One (batch row, KV head), tokens [t_begin, T) in blocks of 16: each block's key and value rows
 * are dequantized into kb / vb [16, D] (L1-resident), scores for 16 tokens come out of one
 * hsum16, the softmax runs on 16 lanes, and each query head's accumulator chunk stays in a
 * register across the block's 16 value rows. Needs D % 16 == 0. */
static void decode_head_avx512(const float *qh, int64_t G, int64_t D, const kvq_operand *k,
                               const kvq_operand *v, int64_t b, int64_t h, int64_t t_begin,
                               int64_t T, float scaling, float softcap, float *kb, float *vb,
                               uint8_t *idx, float *m, float *l, float *acc) {
    const int64_t nc = D / 16;
    const int k_fast = avx_loadable(k, D, 16), v_fast = avx_loadable(v, D, 16);
    const int k_fold = one_scale_per_token(k, k_fast), v_fold = one_scale_per_token(v, v_fast);
    float p_all[16 * 64]; /* probabilities of the block, [G][16]; G <= 64 checked by the caller */
    float qsum[64], zacc[64];
    fold_init(qh, G, D, 1, 1, qsum, zacc);
    for (int64_t t0 = t_begin; t0 < T; t0 += 16) {
        const int64_t nt = T - t0 < 16 ? T - t0 : 16;
        if (k_fast) load_block16(k, b, h, t0, nt, D, kb, k_fold);
        else for (int64_t i = 0; i < nt; i++) load_row(k, b, h, t0 + i, (int)D, idx, kb + i * D);
        if (v_fast) load_block16(v, b, h, t0, nt, D, vb, v_fold);
        else for (int64_t i = 0; i < nt; i++) load_row(v, b, h, t0 + i, (int)D, idx, vb + i * D);
        __m512 ks16 = _mm512_setzero_ps(), kz16 = ks16, vs16 = ks16, vz16 = ks16;
        if (k_fold) token_scales16(k, b, h, t0, nt, &ks16, &kz16);
        if (v_fold) token_scales16(v, b, h, t0, nt, &vs16, &vz16);
        const __mmask16 valid = (__mmask16)((1u << nt) - 1u);
        for (int64_t g = 0; g < G; g++) {
            const float *qg = qh + g * D;
            __m512 part[16];
            for (int64_t i = 0; i < 16; i++) {
                if (i >= nt) { part[i] = _mm512_setzero_ps(); continue; }
                const float *row = kb + i * D;
                __m512 a = _mm512_mul_ps(_mm512_loadu_ps(qg), _mm512_loadu_ps(row));
                for (int64_t c = 1; c < nc; c++)
                    a = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 16 * c), _mm512_loadu_ps(row + 16 * c), a);
                part[i] = a;
            }
            __m512 s = hsum16(part);
            if (k_fold) s = _mm512_fmadd_ps(s, ks16, _mm512_mul_ps(kz16, _mm512_set1_ps(qsum[g])));
            s = _mm512_mul_ps(s, _mm512_set1_ps(scaling));
            if (softcap > 0.0f) {
                float tmp[16];
                _mm512_storeu_ps(tmp, s);
                softcap_scores(tmp, 16, softcap);
                s = _mm512_loadu_ps(tmp);
            }
            float *pg = p_all + g * 16;
            if (isnan(m[g]) || _mm512_mask_cmp_ps_mask(valid, s, s, _CMP_UNORD_Q)) {
                m[g] = NAN; /* a NaN score poisons the row, as in torch */
                _mm512_storeu_ps(pg, _mm512_setzero_ps());
                continue;
            }
            s = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), valid, s);
            const float bmax = _mm512_reduce_max_ps(s);
            const float mx = bmax > m[g] ? bmax : m[g];
            const float corr = m[g] == -INFINITY ? 0.0f : exp_nonpos(m[g] - mx);
            const __m512 p = _mm512_maskz_mov_ps(valid, exp16(_mm512_sub_ps(s, _mm512_set1_ps(mx))));
            l[g] = l[g] * corr + _mm512_reduce_add_ps(p);
            m[g] = mx;
            if (v_fold) {
                zacc[g] = zacc[g] * corr + _mm512_reduce_add_ps(_mm512_mul_ps(p, vz16));
                _mm512_storeu_ps(pg, _mm512_mul_ps(p, vs16));
            } else {
                _mm512_storeu_ps(pg, p);
            }
            float *ag = acc + g * D;
            const __m512 vc = _mm512_set1_ps(corr);
            for (int64_t c = 0; c < nc; c++) {
                __m512 a = _mm512_mul_ps(_mm512_loadu_ps(ag + 16 * c), vc);
                for (int64_t i = 0; i < nt; i++)
                    a = _mm512_fmadd_ps(_mm512_set1_ps(pg[i]), _mm512_loadu_ps(vb + i * D + 16 * c), a);
                _mm512_storeu_ps(ag + 16 * c, a);
            }
        }
    }
    fold_zero_points(v, v_fold, 1, G, D, zacc, m, acc);
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
/* The AVX2 + FMA twin of the AVX-512 path (8-lane vectors, blocks of 8 tokens): what CPUs without
 * AVX-512 run (AMD EPYC before Zen 4, older Intel cores), and, on any CPU, the full-precision tokens
 * and heads with D % 16 != 0. */

/* Lane sums of 8 vectors: result lane i = sum of v[i]'s 8 lanes (transpose-and-add, 7 merges). */
static inline __m256 hsum8(const __m256 *v) {
    __m256 x[4], y[2];
    for (int k = 0; k < 4; k++) /* per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] */
        x[k] = _mm256_add_ps(_mm256_unpacklo_ps(v[2 * k], v[2 * k + 1]),
                             _mm256_unpackhi_ps(v[2 * k], v[2 * k + 1]));
    for (int k = 0; k < 2; k++) /* per 128-bit lane: the lane's sum of 4 sources */
        y[k] = _mm256_add_ps(_mm256_shuffle_ps(x[2 * k], x[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm256_shuffle_ps(x[2 * k], x[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    return _mm256_add_ps(_mm256_permute2f128_ps(y[0], y[1], 0x20), _mm256_permute2f128_ps(y[0], y[1], 0x31));
}

/* Sum and max of one vector's 8 lanes. */
static inline float reduce_add8(__m256 x) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

static inline float reduce_max8(__m256 x) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

/* exp(x) for x <= 0, 8 lanes (same polynomial as exp_nonpos; lanes below -87 give 0). 2^n is built
 * in the exponent bits (n >= -126 here: a normal float). */
static inline __m256 exp8(__m256 x) {
    const __m256 under = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_LT_OQ);
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

/* softcap tanh(x / softcap) softcap of 8 scores (lane by lane, through memory). */
static inline __m256 softcap8(__m256 x, float softcap) {
    float tmp[8];
    _mm256_storeu_ps(tmp, x);
    softcap_scores(tmp, 8, softcap);
    return _mm256_loadu_ps(tmp);
}

/* 8 bytes -> 8 int32 lanes (zero-extended). */
static inline __m256i bytes8(const uint8_t *p) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
}

/* Store chunk c (channels 8c .. 8c+7) of a row, times its scale plus its zero point: per channel
 * (channel axis: s, z hold the row's D), or the chunk's group grp[c] (token axis); s NULL: as it is. */
static inline void put8(float *dst, int c, __m256 x, const float *s, const float *z, int channel_axis, const int *grp) {
    if (s) {
        if (channel_axis) {
            x = z ? _mm256_fmadd_ps(x, _mm256_loadu_ps(s + 8 * c), _mm256_loadu_ps(z + 8 * c))
                  : _mm256_mul_ps(x, _mm256_loadu_ps(s + 8 * c));
        } else {
            const int n = grp[c];
            x = z ? _mm256_fmadd_ps(x, _mm256_set1_ps(s[n]), _mm256_set1_ps(z[n])) : _mm256_mul_ps(x, _mm256_set1_ps(s[n]));
        }
    }
    _mm256_storeu_ps(dst + 8 * c, x);
}

/* The levels of 8 codes 0..15 of a 16-entry codebook held in two registers: entry c & 7 of the half
 * that bit 3 picks. */
static inline __m256 levels16(__m256 lo, __m256 hi, __m256i c) {
    return _mm256_blendv_ps(_mm256_permutevar8x32_ps(lo, c), _mm256_permutevar8x32_ps(hi, c),
                            _mm256_castsi256_ps(_mm256_slli_epi32(c, 28)));
}

/* unpack_row for 2- and 3-bit planar codes, 16 bytes of the low plane and 8 of the high plane per
 * step (16-bit shifts; the bits a shift brings in from the next byte are masked off), scalar tails. */
static inline void unpack_row_sse(const uint8_t *restrict c, int bits, int D, uint8_t *restrict idx) {
    if (bits != 2 && bits != 3) {
        unpack_row(c, bits, D, idx);
        return;
    }
    const int w = D / 4;
    const __m128i three = _mm_set1_epi8(3), one = _mm_set1_epi8(1);
    int j = 0;
    for (; j + 16 <= w; j += 16) { /* channel j + k w: bits 2k .. 2k+1 of byte j */
        const __m128i v = _mm_loadu_si128((const __m128i *)(c + j));
        for (int k = 0; k < 4; k++)
            _mm_storeu_si128((__m128i *)(idx + j + k * w), _mm_and_si128(_mm_srli_epi16(v, 2 * k), three));
    }
    for (; j < w; j++)
        for (int k = 0; k < 4; k++) idx[j + k * w] = (c[j] >> (2 * k)) & 3;
    if (bits == 2) return;
    const int w1 = D / 8; /* the high bit of channel j + k w1 is bit k of byte w + j */
    for (j = 0; j + 8 <= w1; j += 8) {
        const __m128i v = _mm_loadl_epi64((const __m128i *)(c + w + j));
        for (int k = 0; k < 8; k++) {
            uint8_t *dst = idx + j + k * w1;
            const __m128i hi = _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(v, k), one), 2);
            _mm_storel_epi64((__m128i *)dst, _mm_or_si128(_mm_loadl_epi64((const __m128i *)dst), hi));
        }
    }
    for (; j < w1; j++)
        for (int k = 0; k < 8; k++) idx[j + k * w1] |= ((c[w + j] >> k) & 1) << 2;
}

/* Trellis rows without gathers: on AVX2 machines a gather of 8 costs about as much as 8 scalar loads
 * with their index arithmetic, and the states are cheaper formed 16 at a time. Each channel's state
 * (its code and the m-1 before it; bits * m <= 16) is formed for a whole row with byte or 16-bit
 * lane shifts of the unpacked codes, then the levels are read by scalar loads, 8 per vector. Codes
 * with 8-bit states (tcq2, tcq1) read two channels per load from a table of level pairs. */

/* The level pairs of a trellis table with 8-bit states, 2-bit codes (tcq2) or 1-bit codes (tcq1)
 * (NULL for any other code): entry i = (state_d >> (8 - k)) | state_{d+1} << k (the 8 + k distinct
 * bits of two neighbouring states) holds (level of d, level of d+1). 2**(8 + k) x 8 bytes (8 KB,
 * 4 KB), built once per thread, code size and table (one per code size: keys and values of a call
 * may hold one each). */
static const uint64_t *trellis_pairs(const kvq_operand *o) {
    static __thread uint64_t pairs[2][1024];
    static __thread float key[2][256];
    static __thread int built[2];
    const int k = o->bits;
    if (!o->lut || k * o->state_codes != 8 || (k != 1 && k != 2)) return NULL;
    uint64_t *pk = pairs[k - 1];
    if (built[k - 1] && memcmp(key[k - 1], o->lut, sizeof key[0]) == 0) return pk;
    memcpy(key[k - 1], o->lut, sizeof key[0]);
    for (int i = 0; i < 1 << (8 + k); i++) {
        const int next = i >> k, cur = ((i & ((1 << k) - 1)) << (8 - k)) | (next >> k);
        const float ab[2] = {o->lut[cur], o->lut[next]};
        memcpy(&pk[i], ab, sizeof pk[i]);
    }
    built[k - 1] = 1;
    return pk;
}

/* The level pairs of a 3-bit, 3-code trellis table (NULL for any other code): entry i = state_{d+1}
 * | (state_d >> 6) << 9 (the 12 distinct bits of two neighbouring states, d even) holds (level of d,
 * level of d+1). 4,096 x 8 bytes, built once per thread and table. */
static const uint64_t *trellis_pairs3(const kvq_operand *o) {
    static __thread uint64_t pairs[4096];
    static __thread float key[512];
    static __thread int built;
    if (o->bits != 3 || o->state_codes != 3 || !o->lut) return NULL;
    if (built && memcmp(key, o->lut, sizeof key) == 0) return pairs;
    memcpy(key, o->lut, sizeof key);
    for (int i = 0; i < 4096; i++) {
        const float ab[2] = {o->lut[i >> 3], o->lut[i & 511]};
        memcpy(&pairs[i], ab, sizeof pairs[i]);
    }
    built = 1;
    return pairs;
}

/* Levels of a trellis row of k-bit codes (2 or 1) from its 8-bit states st[0..D): two channels per
 * load from the pair table (trellis_pairs), times s[channel / gs] (s NULL: raw). */
static inline void trellis_pair_levels(const uint8_t *st, int D, int k, const uint64_t *pairs, const float *s,
                                       int gs, float *out) {
    const int sh = 8 - k;
    const uint64_t mask = (1u << (8 + k)) - 1;
    for (int c = 0; c < D; c += 8) { /* 4 pairs: the 8 + k bits from bit 8 - k of each 16 */
        uint64_t u;
        memcpy(&u, st + c, 8);
        __m256 x = _mm256_castsi256_ps(_mm256_setr_epi64x(
            (long long)pairs[(u >> sh) & mask], (long long)pairs[(u >> (sh + 16)) & mask],
            (long long)pairs[(u >> (sh + 32)) & mask], (long long)pairs[(u >> (sh + 48)) & mask]));
        if (s) x = _mm256_mul_ps(x, _mm256_set1_ps(s[c / gs]));
        _mm256_storeu_ps(out + c, x);
    }
}

/* The level pairs of a 1-bit trellis table with 8-bit states (tcq1), indexed by a window of 9
 * codes (NULL for any other code): entry w, bit j of w = the code of channel d - 7 + j, holds (level
 * of d, level of d+1), whose states are the window's low 8 bits and its high 8 bits, each reversed
 * (a state holds its own code in bit 0, the code j channels back in bit j). 512 x 8 bytes, built once
 * per thread and table. */
static const uint64_t *trellis_windows1(const kvq_operand *o) {
    static __thread uint64_t pairs[512];
    static __thread float key[256];
    static __thread int built;
    if (o->bits != 1 || o->state_codes != 8 || !o->lut) return NULL;
    if (built && memcmp(key, o->lut, sizeof key) == 0) return pairs;
    memcpy(key, o->lut, sizeof key);
    for (int w = 0; w < 512; w++) {
        int cur = 0, next = 0;
        for (int j = 0; j < 8; j++) {
            cur |= ((w >> (7 - j)) & 1) << j;
            next |= ((w >> (8 - j)) & 1) << j;
        }
        const float ab[2] = {o->lut[cur], o->lut[next]};
        memcpy(&pairs[w], ab, sizeof pairs[w]);
    }
    built = 1;
    return pairs;
}

/* Levels of a packed 1-bit trellis row (D % 64 == 0; channel j + k D/8 is bit k of byte j) without
 * unpacking it: the row becomes the bit string of its codes in channel order, D / 64 words, each
 * word 8 movemasks of one 8-byte chunk shifted per plane; then every pair of channels (d, d+1) is one
 * table load at the 9-bit window of codes d-7 .. d+1 (the word before wraps around: the code
 * string is circular), times s[channel / gs] (s NULL: raw). */
static void tcq1_levels_packed(const uint8_t *row, int D, const uint64_t *win, const float *s, int gs,
                               float *out) {
    const int w = D / 8, nq = D / 64;
    uint64_t bits[8] = {0}; /* bit i of bits[q]: the code of channel 64 q + i */
    for (int j = 0; j < w; j += 8) {
        const __m128i x = _mm_loadl_epi64((const __m128i *)(row + j));
        for (int k = 0; k < 8; k++) { /* plane k of bytes j .. j + 7: channels j + k w .. + 7 */
            const int c = j + k * w;
            const uint64_t m = (uint64_t)(_mm_movemask_epi8(_mm_slli_epi16(x, 7 - k)) & 0xFF);
            bits[c / 64] |= m << (c % 64);
        }
    }
    for (int q = 0; q < nq; q++) {
        const unsigned __int128 x = (unsigned __int128)bits[q] << 64 | bits[q ? q - 1 : nq - 1];
        float *o = out + 64 * q;
        for (int c = 0; c < 64; c += 8) { /* channel 64 q + i is bit 64 + i of x: window d at bit 57 + d */
            __m256 v = _mm256_castsi256_ps(_mm256_setr_epi64x(
                (long long)win[(uint64_t)(x >> (57 + c)) & 511], (long long)win[(uint64_t)(x >> (59 + c)) & 511],
                (long long)win[(uint64_t)(x >> (61 + c)) & 511], (long long)win[(uint64_t)(x >> (63 + c)) & 511]));
            if (s) v = _mm256_mul_ps(v, _mm256_set1_ps(s[(64 * q + c) / gs]));
            _mm256_storeu_ps(o + c, v);
        }
    }
}

/* Where the codes of channels 16 i .. 16 i + 15 lie in a packed 2- or 3-bit row (D % 64 == 0): the
 * low two bits at byte lo_off[i], bit lo_sh[i]; 3-bit: the high bit at byte hi_off[i], bit hi_sh[i]
 * (hi_split: D == 64, channels 8 .. 15 of the vector one plane further, the same 8 bytes). */
typedef struct {
    int nv, hi_split;
    int lo_off[32], lo_sh[32], hi_off[32], hi_sh[32];
} packed_layout;

static void plan_packed(int bits, int D, packed_layout *pk) {
    const int w = D / 4, w1 = D / 8;
    pk->nv = D / 16;
    pk->hi_split = bits == 3 && w1 < 16;
    for (int i = 0; i < pk->nv; i++) {
        const int d0 = 16 * i, k = d0 / w, k1 = d0 / w1;
        pk->lo_off[i] = d0 - k * w, pk->lo_sh[i] = 2 * k;
        pk->hi_off[i] = w + d0 - k1 * w1, pk->hi_sh[i] = k1;
    }
}

/* The 8-bit states of a 2-bit, 4-code trellis row straight from its packed bytes (D % 64 == 0: each
 * of the 4 bit planes holds D / 4 channels, whole vectors of 16), in registers: each vector of 16
 * codes is one plane's shift and mask of 16 bytes, and the codes 1, 2, 3 channels back are byte
 * alignments of it with the vector before (circularly: the last one before the first). */
static void tcq2_states_packed(const uint8_t *row, const packed_layout *pk, uint8_t *st) {
    const int nv = pk->nv;
    const __m128i three = _mm_set1_epi8(3);
    __m128i prev = _mm_and_si128(_mm_srl_epi16(_mm_loadu_si128((const __m128i *)(row + pk->lo_off[nv - 1])),
                                               _mm_cvtsi32_si128(pk->lo_sh[nv - 1])), three);
    for (int i = 0; i < nv; i++) {
        const __m128i cur = _mm_and_si128(_mm_srl_epi16(_mm_loadu_si128((const __m128i *)(row + pk->lo_off[i])),
                                                        _mm_cvtsi32_si128(pk->lo_sh[i])), three);
        __m128i x = cur;
        x = _mm_or_si128(x, _mm_slli_epi16(_mm_alignr_epi8(cur, prev, 15), 2));
        x = _mm_or_si128(x, _mm_slli_epi16(_mm_alignr_epi8(cur, prev, 14), 4));
        x = _mm_or_si128(x, _mm_slli_epi16(_mm_alignr_epi8(cur, prev, 13), 6));
        _mm_storeu_si128((__m128i *)(st + 16 * i), x);
        prev = cur;
    }
}

/* Levels of a trellis row from its 16-bit states st[0..D) (the low bits `mask` of each), 8 scalar
 * loads per vector, times s[channel / gs] (s NULL: raw). */
static inline void trellis_levels16(const uint16_t *st, int D, uint64_t mask, const float *lut, const float *s,
                                    int gs, float *out) {
    for (int c = 0; c < D; c += 8) {
        uint64_t u, w;
        memcpy(&u, st + c, 8);
        memcpy(&w, st + c + 4, 8);
        __m256 x = _mm256_setr_ps(lut[u & mask], lut[(u >> 16) & mask], lut[(u >> 32) & mask], lut[(u >> 48) & mask],
                                  lut[w & mask], lut[(w >> 16) & mask], lut[(w >> 32) & mask], lut[(w >> 48) & mask]);
        if (s) x = _mm256_mul_ps(x, _mm256_set1_ps(s[c / gs]));
        _mm256_storeu_ps(out + c, x);
    }
}

/* Levels of a 3-bit, 3-code trellis row from its pair indices pi[0..D/2) (tcq3_pairs_packed): two
 * channels per load from trellis_pairs3, times s[channel / gs] (s NULL: raw). */
static inline void trellis_pair3_levels(const uint32_t *pi, int D, const uint64_t *pairs, const float *s, int gs,
                                        float *out) {
    for (int c = 0; c < D; c += 8) {
        uint64_t u, w;
        memcpy(&u, pi + c / 2, 8);
        memcpy(&w, pi + c / 2 + 2, 8);
        __m256 x = _mm256_castsi256_ps(_mm256_setr_epi64x((long long)pairs[(uint32_t)u], (long long)pairs[u >> 32],
                                                          (long long)pairs[(uint32_t)w], (long long)pairs[w >> 32]));
        if (s) x = _mm256_mul_ps(x, _mm256_set1_ps(s[c / gs]));
        _mm256_storeu_ps(out + c, x);
    }
}

/* The pair indices (trellis_pairs3) of a 3-bit, 3-code trellis row straight from its packed bytes
 * (D % 64 == 0; see tcq2_states_packed): each vector of 16 codes is its low bits (one of the 4 two-bit
 * planes of D / 4 bytes) or'ed with its high bits (the 8 one-bit planes of D / 8 bytes: one plane per
 * 16 channels, or two of 8 when D is 64), then the 9-bit states with the codes 1 and 2 channels back
 * by byte alignment with the vector before, widened to 16-bit lanes for the shifts, then each pair of
 * channels' 12 distinct bits in a 32-bit lane: pi[j] for channels 2j, 2j+1. */
static void tcq3_pairs_packed(const uint8_t *row, const packed_layout *pk, uint32_t *pi) {
    const int nv = pk->nv;
    const __m128i three = _mm_set1_epi8(3), one = _mm_set1_epi8(1);
    __m128i cv[32]; /* the codes of channels 16 i .. 16 i + 15, one per byte */
    for (int i = 0; i < nv; i++) {
        const __m128i lo = _mm_and_si128(_mm_srl_epi16(_mm_loadu_si128((const __m128i *)(row + pk->lo_off[i])),
                                                       _mm_cvtsi32_si128(pk->lo_sh[i])), three);
        __m128i hi;
        if (!pk->hi_split) {
            hi = _mm_and_si128(_mm_srl_epi16(_mm_loadu_si128((const __m128i *)(row + pk->hi_off[i])),
                                             _mm_cvtsi32_si128(pk->hi_sh[i])), one);
        } else { /* channels 0 .. 7 of the vector in plane hi_sh, 8 .. 15 in the next, both the same 8 bytes */
            const __m128i x = _mm_loadl_epi64((const __m128i *)(row + pk->hi_off[i]));
            hi = _mm_unpacklo_epi64(_mm_and_si128(_mm_srl_epi16(x, _mm_cvtsi32_si128(pk->hi_sh[i])), one),
                                    _mm_and_si128(_mm_srl_epi16(x, _mm_cvtsi32_si128(pk->hi_sh[i] + 1)), one));
        }
        cv[i] = _mm_or_si128(lo, _mm_slli_epi16(hi, 2)); /* (hi <= 1 shifted by 2: stays in its byte) */
    }
    for (int i = 0; i < nv; i++) {
        const __m128i cur = cv[i], prev = cv[i ? i - 1 : nv - 1];
        __m256i x = _mm256_cvtepu8_epi16(cur);
        x = _mm256_or_si256(x, _mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_alignr_epi8(cur, prev, 15)), 3));
        x = _mm256_or_si256(x, _mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_alignr_epi8(cur, prev, 14)), 6));
        /* 32-bit lane j = state_2j | state_2j+1 << 16 -> state_2j+1 | (state_2j >> 6) << 9 */
        _mm256_storeu_si256((__m256i *)(pi + 8 * i),
                            _mm256_or_si256(_mm256_srli_epi32(x, 16),
                                            _mm256_and_si256(_mm256_slli_epi32(x, 3), _mm256_set1_epi32(0xE00))));
    }
}

/* One trellis row: unpacked codes p[0..D) (p[-(m-1) .. -1]: the last m-1 codes, wrapped; p[D ..
 * D+16): defined bytes) -> out[D] = the level of each channel's state times s[channel / gs] (s NULL:
 * raw levels). pairs: trellis_pairs of this table, or NULL. D % 8 == 0, D <= 512. */
static void trellis_row8(const uint8_t *p, int k, int m, int D, const float *lut, const uint64_t *pairs,
                         const float *s, int gs, float *out) {
    if (pairs) { /* 8-bit states, 16 per step (codes < 2**k shifted by <= 8 - k: no bit leaves its byte) */
        uint8_t st[512 + 16];
        for (int c = 0; c < D; c += 16) {
            __m128i x = _mm_loadu_si128((const __m128i *)(p + c));
            for (int j = 1; j < m; j++)
                x = _mm_or_si128(x, _mm_sll_epi16(_mm_loadu_si128((const __m128i *)(p + c - j)), _mm_cvtsi32_si128(j * k)));
            _mm_storeu_si128((__m128i *)(st + c), x);
        }
        trellis_pair_levels(st, D, k, pairs, s, gs, out);
        return;
    }
    uint16_t st[512 + 16]; /* states of up to 16 bits, 16 per step */
    const uint64_t mask = (1u << (k * m)) - 1;
    for (int c = 0; c < D; c += 16) {
        __m256i x = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(p + c)));
        for (int j = 1; j < m; j++)
            x = _mm256_or_si256(x, _mm256_sll_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(p + c - j))),
                                                    _mm_cvtsi32_si128(j * k)));
        _mm256_storeu_si256((__m256i *)(st + c), x);
    }
    trellis_levels16(st, D, mask, lut, s, gs, out);
}

/* What load_block8 needs of an operand that does not change from block to block: where each chunk
 * of 8 channels lies in a row's bytes (chunk_planes), the level registers of small codebooks, the
 * trellis pair table. Made once per (row, head) call: divisions and table checks stay out of the
 * per-block loop. */
typedef struct {
    int off[64], shift[64], off1[64], shift1[64];
    int grp[64]; /* token-axis scale group of each chunk */
    int nc, w, small_lut, n_lut, gs;
    __m256i mask;
    __m256 lut_lo, lut_hi;
    const uint64_t *pairs; /* trellis_pairs, or NULL */
    const uint64_t *pairs3; /* trellis_pairs3 (packed == 2) */
    int packed;            /* trellis states from the packed bytes: 1 tcq2, 2 tcq3, 3 tcq1 (D % 64 == 0), 0 no */
    const uint64_t *win1;  /* trellis_windows1 (packed == 3) */
    packed_layout pk;      /* where each vector of 16 codes lies (packed != 0) */
} block8_plan;

static void plan_block8(const kvq_operand *o, int64_t D, block8_plan *pl) {
    pl->nc = (int)(D / 8);
    chunk_planes(o, D, 8, pl->off, pl->shift, pl->off1, pl->shift1);
    pl->w = o->bits == 4 ? (int)(D / 2) : 0;
    pl->mask = _mm256_set1_epi32(o->bits == 8 ? 255 : (o->bits == 4 ? 15 : 3));
    pl->small_lut = o->lut && o->bits < 8 && !o->state_codes;
    pl->n_lut = pl->small_lut ? 1 << o->bits : 0; /* its entries; read no further */
    const __m256i first = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    pl->lut_lo = pl->small_lut ? _mm256_maskload_ps(o->lut, _mm256_cmpgt_epi32(_mm256_set1_epi32(pl->n_lut), first))
                               : _mm256_setzero_ps();
    pl->lut_hi = pl->n_lut > 8 ? _mm256_loadu_ps(o->lut + 8) : _mm256_setzero_ps();
    pl->gs = o->scale && !o->channel_axis ? (int)(D / o->n_groups) : 8;
    for (int c = 0; c < pl->nc; c++) pl->grp[c] = 8 * c / pl->gs;
    pl->pairs = o->state_codes ? trellis_pairs(o) : NULL;
    pl->pairs3 = o->state_codes ? trellis_pairs3(o) : NULL;
    pl->win1 = o->state_codes && D % 64 == 0 ? trellis_windows1(o) : NULL;
    pl->packed = D % 64 ? 0 : (pl->pairs && o->bits == 2 ? 1 : (pl->pairs3 ? 2 : (pl->win1 ? 3 : 0)));
    if (pl->packed == 1 || pl->packed == 2) plan_packed(o->bits, (int)D, &pl->pk);
}

/* Rows t0 .. t0+nt-1 dequantized into out[nt][D], 8 channels per step: bytes -> 8 int32 codes (one
 * shift and mask per chunk, the int3 high bit from its plane) -> levels (int convert; codebooks of
 * up to 16 levels: two 8-entry permutes blended on bit 3; fp8: F16C or a gather; trellis states:
 * trellis_row8) -> times scale plus zero point. raw: codes without the scales (the head folds them:
 * one_scale_per_token, fold_groups). pl: plan_block8 of this operand and D. */
static void load_block8(const kvq_operand *o, const block8_plan *pl, int64_t b, int64_t h, int64_t t0, int64_t nt,
                        int64_t D, float *out, int raw) {
    const int nc = pl->nc, w = pl->w, small_lut = pl->small_lut, n_lut = pl->n_lut, gs = pl->gs;
    const int *off = pl->off, *shift = pl->shift, *off1 = pl->off1, *shift1 = pl->shift1, *grp = pl->grp;
    const __m256i mask = pl->mask;
    const __m256 lut_lo = pl->lut_lo, lut_hi = pl->lut_hi;
    const uint64_t *pairs = pl->pairs;
    float sb[512], zb[512];
    /* trellis: every row's codes unpacked first, each with the m-1 codes that wrap around before
     * channel 0 (the state loads below then read bytes whose stores have completed: reading a
     * row's bytes right after writing them stalls on store forwarding) */
    uint8_t ib[8][16 + 512 + 16];
    for (int64_t i = 0; o->state_codes && !pl->packed && i < nt; i++) {
        const uint8_t *row = o->codes + b * o->code_sb + h * o->code_sh + (t0 + i) * o->code_st;
        const int m = o->state_codes;
        unpack_row_sse(row, o->bits, (int)D, ib[i] + 16);
        if (m <= 5 && D >= 4) /* the last 4 codes before channel 0 (a fixed-size copy: no call) */
            memcpy(ib[i] + 16 - 4, ib[i] + 16 + D - 4, 4);
        else
            memcpy(ib[i] + 16 - (m - 1), ib[i] + 16 + D - (m - 1), (size_t)(m - 1));
        memset(ib[i] + 16 + D, 0, 16); /* (states are formed 16 at a time: defined bytes past D) */
    }
    int64_t scale_row = -1; /* channel axis: the scale row in sb / zb (one per `group` tokens) */
    for (int64_t i = 0; i < nt; i++) {
        const uint8_t *row = o->codes + b * o->code_sb + h * o->code_sh + (t0 + i) * o->code_st;
        const float *s = NULL, *z = NULL;
        if (o->scale && !raw) {
            load_scales_once(o, b, h, t0 + i, (int)D, sb, zb, &scale_row);
            s = sb;
            if (o->zero) z = zb;
        }
        float *dst = out + i * D;
        if (pl->packed == 1) { /* states from the packed bytes: no unpacked copy */
            uint8_t st[512];
            tcq2_states_packed(row, &pl->pk, st);
            trellis_pair_levels(st, (int)D, 2, pairs, s, gs, dst);
            continue;
        }
        if (pl->packed == 3) {
            tcq1_levels_packed(row, (int)D, pl->win1, s, gs, dst);
            continue;
        }
        if (pl->packed == 2) {
            uint32_t pi[256];
            tcq3_pairs_packed(row, &pl->pk, pi);
            trellis_pair3_levels(pi, (int)D, pl->pairs3, s, gs, dst);
            continue;
        }
        if (o->state_codes) {
            trellis_row8(ib[i] + 16, o->bits, o->state_codes, (int)D, o->lut, pairs, s, gs, dst);
            continue;
        }
        /* packed codes of 4 and 2 bits (3: their low fields): every field of 8 bytes from one load,
         * each chunk of 8 channels scaled (unless raw) as it is stored (put8) */
        if (raw && o->bits == 4 && !o->lut) { /* (raw: no scale to apply; the common case) */
            for (int j = 0; j < w; j += 8) {
                const __m256i ci = bytes8(row + j);
                _mm256_storeu_ps(dst + j, _mm256_cvtepi32_ps(_mm256_and_si256(ci, mask)));
                _mm256_storeu_ps(dst + w + j, _mm256_cvtepi32_ps(_mm256_srli_epi32(ci, 4)));
            }
            continue;
        }
        if (o->bits == 4 && !o->lut) { /* both nibbles of each byte from one load */
            for (int j = 0; j < w; j += 8) {
                const __m256i ci = bytes8(row + j);
                put8(dst, j / 8, _mm256_cvtepi32_ps(_mm256_and_si256(ci, mask)), s, z, o->channel_axis, grp);
                put8(dst, (w + j) / 8, _mm256_cvtepi32_ps(_mm256_srli_epi32(ci, 4)), s, z, o->channel_axis, grp);
            }
            continue;
        }
        if (o->bits == 4 && n_lut > 8) { /* codebook of 16: both nibbles from one load */
            for (int j = 0; j < w; j += 8) {
                const __m256i ci = bytes8(row + j), hi = _mm256_srli_epi32(ci, 4);
                put8(dst, j / 8, levels16(lut_lo, lut_hi, _mm256_and_si256(ci, mask)), s, z, o->channel_axis, grp);
                put8(dst, (w + j) / 8, levels16(lut_lo, lut_hi, hi), s, z, o->channel_axis, grp);
            }
            continue;
        }
        if (o->bits == 2 && !o->fp8) { /* the four 2-bit fields of each byte from one load */
            const int w2 = (int)(D / 4);
            for (int j = 0; j < w2; j += 8) {
                const __m256i ci = bytes8(row + j);
                const __m256i f[4] = {_mm256_and_si256(ci, mask), _mm256_and_si256(_mm256_srli_epi32(ci, 2), mask),
                                      _mm256_and_si256(_mm256_srli_epi32(ci, 4), mask), _mm256_srli_epi32(ci, 6)};
                for (int k = 0; k < 4; k++)
                    put8(dst, (k * w2 + j) / 8, small_lut ? _mm256_permutevar8x32_ps(lut_lo, f[k]) : _mm256_cvtepi32_ps(f[k]),
                         s, z, o->channel_axis, grp);
            }
            continue;
        }
#if defined(__F16C__)
        if (raw && o->fp8 && D % 16 == 0) { /* fp8 -> fp16 bits 16 at a time (exact), then F16C */
            for (int64_t j = 0; j < D; j += 16) {
                const __m256i w16 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(row + j)));
                __m256i h;
                if (o->fp8 == 2) { /* e5m2 is the high byte of an fp16 */
                    h = _mm256_slli_epi16(w16, 8);
                } else { /* e4m3fn: |x| bits at fp16's place are x / 2^8; 0x7f is NaN (an fp16 NaN here) */
                    const __m256i mag = _mm256_and_si256(w16, _mm256_set1_epi16(0x7f));
                    h = _mm256_or_si256(_mm256_slli_epi16(_mm256_xor_si256(w16, mag), 8), _mm256_slli_epi16(mag, 7));
                    h = _mm256_blendv_epi8(h, _mm256_set1_epi16(0x7e00), _mm256_cmpeq_epi16(mag, _mm256_set1_epi16(0x7f)));
                }
                __m256 x0 = _mm256_cvtph_ps(_mm256_castsi256_si128(h)), x1 = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
                if (o->fp8 == 1) {
                    x0 = _mm256_mul_ps(x0, _mm256_set1_ps(256.0f));
                    x1 = _mm256_mul_ps(x1, _mm256_set1_ps(256.0f));
                }
                _mm256_storeu_ps(dst + j, x0);
                _mm256_storeu_ps(dst + j + 8, x1);
            }
            continue;
        }
#endif
        if (o->bits == 3 && !o->fp8) { /* low fields as above; each chunk's high bits from its plane */
            const int w3 = (int)(D / 4), q = w3 / 8; /* chunk of channels j + k w3: 8 (j / 8 + k q) */
            const __m256i one = _mm256_set1_epi32(1);
            for (int j = 0; j < w3; j += 8) {
                const __m256i ci = bytes8(row + j);
                const __m256i f[4] = {_mm256_and_si256(ci, mask), _mm256_and_si256(_mm256_srli_epi32(ci, 2), mask),
                                      _mm256_and_si256(_mm256_srli_epi32(ci, 4), mask), _mm256_srli_epi32(ci, 6)};
                for (int k = 0; k < 4; k++) {
                    const int c = j / 8 + k * q;
                    const __m256i hi = _mm256_srl_epi32(bytes8(row + off1[c]), _mm_cvtsi32_si128(shift1[c]));
                    const __m256i code = _mm256_or_si256(f[k], _mm256_slli_epi32(_mm256_and_si256(hi, one), 2));
                    put8(dst, c, small_lut ? _mm256_permutevar8x32_ps(lut_lo, code) : _mm256_cvtepi32_ps(code), s, z,
                         o->channel_axis, grp);
                }
            }
            continue;
        }
        for (int c = 0; c < nc; c++) {
            __m256 x;
            if (o->bits == 8 && o->is_signed) {
                x = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(row + off[c]))));
            } else {
                __m256i ci = _mm256_and_si256(_mm256_srl_epi32(bytes8(row + off[c]), _mm_cvtsi32_si128(shift[c])), mask);
                if (o->bits == 3) {
                    const __m256i hi = _mm256_srl_epi32(bytes8(row + off1[c]), _mm_cvtsi32_si128(shift1[c]));
                    ci = _mm256_or_si256(ci, _mm256_slli_epi32(_mm256_and_si256(hi, _mm256_set1_epi32(1)), 2));
                }
#if defined(__F16C__)
                if (o->fp8 && o->bits == 8) { /* fp8 -> fp16 bits (exact), then F16C: no gather */
                    const __m128i w = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)(row + off[c])));
                    if (o->fp8 == 2) { /* e5m2 is the high byte of an fp16 */
                        x = _mm256_cvtph_ps(_mm_slli_epi16(w, 8));
                    } else { /* e4m3fn: |x| bits at fp16's place are x / 2^8; 0x7f is NaN */
                        const __m128i mag = _mm_and_si128(w, _mm_set1_epi16(0x7f));
                        const __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_xor_si128(w, mag), 8), _mm_slli_epi16(mag, 7));
                        x = _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.0f));
                        const __m128i nan = _mm_cmpeq_epi16(mag, _mm_set1_epi16(0x7f));
                        x = _mm256_blendv_ps(x, _mm256_set1_ps(NAN), _mm256_castsi256_ps(_mm256_cvtepi16_epi32(nan)));
                    }
                } else
#endif
                if (n_lut > 8) /* the level of code c: entry c & 7 of the half that bit 3 picks */
                    x = _mm256_blendv_ps(_mm256_permutevar8x32_ps(lut_lo, ci), _mm256_permutevar8x32_ps(lut_hi, ci),
                                         _mm256_castsi256_ps(_mm256_slli_epi32(ci, 28)));
                else if (small_lut) x = _mm256_permutevar8x32_ps(lut_lo, ci);
                else if (o->lut) x = _mm256_i32gather_ps(o->lut, ci, 4);
                else x = _mm256_cvtepi32_ps(ci);
            }
            if (s) {
                if (o->channel_axis) {
                    x = z ? _mm256_fmadd_ps(x, _mm256_loadu_ps(s + 8 * c), _mm256_loadu_ps(z + 8 * c))
                          : _mm256_mul_ps(x, _mm256_loadu_ps(s + 8 * c));
                } else {
                    const int n = grp[c];
                    x = z ? _mm256_fmadd_ps(x, _mm256_set1_ps(s[n]), _mm256_set1_ps(z[n]))
                          : _mm256_mul_ps(x, _mm256_set1_ps(s[n]));
                }
            }
            _mm256_storeu_ps(dst + 8 * c, x);
        }
    }
}

/* One (batch row, KV head), tokens [t_begin, T) in blocks of 16: each block's key and value rows are
 * dequantized into kb / vb [16, D] (L1-resident; 8 rows per load_block8, load_row for an operand
 * load_block8 cannot read), scores for 8 tokens come out of one hsum8, the softmax bookkeeping
 * (running max, rescale, sum) runs once per 16 tokens, and each query head's accumulator chunk stays
 * in a register across the block's 16 value rows. valid (NULL: all): token t attends only where
 * valid[t] is 1 (the full-precision tokens). Needs D % 8 == 0. Scales folded out of the dots where
 * fold_groups allows (one per token, or up to FOLD_GROUPS groups per row); grouped: a compile-time 0
 * or 1 in its two callers, decode_head_avx2 (0: the paths of at most one scale per token alone) and
 * decode_head_avx2_groups (1). */
static inline __attribute__((always_inline)) void
decode_head_avx2_body(const float *qh, int64_t G, int64_t D, const kvq_operand *k, const kvq_operand *v, int64_t b,
                      int64_t h, int64_t t_begin, int64_t T, float scaling, float softcap, float *kb, float *vb,
                      uint8_t *idx, float *m, float *l, float *acc, const uint8_t *valid, const int grouped) {
    const int64_t nc = D / 8;
    const int k_fast = avx_loadable(k, D, 8), v_fast = avx_loadable(v, D, 8);
    const int k_fold = fold_groups(k, k_fast), v_fold = fold_groups(v, v_fast); /* scale groups folded, or 0 */
    const int k_cpg = k_fold ? (int)(nc / k_fold) : 0; /* 8-channel chunks per key scale group */
    const int NG = grouped ? FOLD_GROUPS : 1; /* qsum / zacc slots per query head, scale rows per block */
    int v_grp[grouped ? 64 : 1]; /* value chunk c's scale group */
    for (int c = 0; grouped && c < nc; c++) v_grp[c] = v_fold ? (int)(c / (nc / v_fold)) : 0;
    float p_all[16 * 64]; /* probabilities of the block, [G][16]; G <= 64 checked by the caller */
    float pgv[16 * NG]; /* one query head's probabilities times each value group's scales */
    float qsum[64 * NG], zacc[64 * NG]; /* [G][NG] */
    fold_init(qh, G, D, grouped ? k_fold : 1, NG, qsum, zacc);
    block8_plan k_plan, v_plan;
    if (k_fast) plan_block8(k, D, &k_plan);
    if (v_fast) plan_block8(v, D, &v_plan);
    for (int64_t t0 = t_begin; t0 < T; t0 += 16) {
        const int64_t nt = T - t0 < 16 ? T - t0 : 16;
        for (int64_t h0 = 0; h0 < nt; h0 += 8) { /* the block's two halves of 8 rows */
            const int64_t n8 = nt - h0 < 8 ? nt - h0 : 8;
            if (k_fast) load_block8(k, &k_plan, b, h, t0 + h0, n8, D, kb + h0 * D, k_fold);
            else for (int64_t i = 0; i < n8; i++) load_row(k, b, h, t0 + h0 + i, (int)D, idx, kb + (h0 + i) * D);
            if (v_fast) load_block8(v, &v_plan, b, h, t0 + h0, n8, D, vb + h0 * D, v_fold);
            else for (int64_t i = 0; i < n8; i++) load_row(v, b, h, t0 + h0 + i, (int)D, idx, vb + (h0 + i) * D);
        }
        if (nt < 16) { /* the last block: rows beyond it zero, so that all 16 rows can be read */
            memset(kb + nt * D, 0, sizeof(float) * (size_t)((16 - nt) * D));
            memset(vb + nt * D, 0, sizeof(float) * (size_t)((16 - nt) * D));
        }
        /* key scales, key zeros, value scales, value zeros: [group][16 tokens] (0 beyond nt) */
        float sc[4][16 * NG];
        for (int hh = 0; hh < 2; hh++) {
            const int64_t h0 = 8 * hh, n8 = nt - h0 < 0 ? 0 : (nt - h0 < 8 ? nt - h0 : 8);
            if (k_fold == 1) token_scales(k, b, h, t0 + h0, n8, 8, sc[0] + h0, sc[1] + h0);
            if (v_fold == 1) token_scales(v, b, h, t0 + h0, n8, 8, sc[2] + h0, sc[3] + h0);
        }
        if (grouped && k_fold > 1) token_group_scales(k, b, h, t0, nt, k_fold, sc[0], sc[1]);
        if (grouped && v_fold > 1) token_group_scales(v, b, h, t0, nt, v_fold, sc[2], sc[3]);
        int32_t live[16]; /* lanes that attend: in the block and not masked out */
        for (int64_t i = 0; i < 16; i++) live[i] = i < nt && (!valid || valid[t0 + i]) ? -1 : 0;
        const __m256 attend[2] = {_mm256_castsi256_ps(_mm256_loadu_si256((const __m256i *)live)),
                                  _mm256_castsi256_ps(_mm256_loadu_si256((const __m256i *)(live + 8)))};
        const int halves = nt > 8 ? 2 : 1;
        for (int64_t g = 0; g < G; g++) {
            const float *qg = qh + g * D;
            __m256 s[2];
            for (int hh = 0; hh < halves; hh++) {
                const float *kh = kb + 8 * hh * D;
                __m256 part[8]; /* one FMA chain per row, side by side (a chain per row in turn waits on FMA latency) */
                __m256 x;
                if (grouped && k_fold > 1) { /* each scale group's dots, then times its scales; the zero points' sums */
                    x = _mm256_setzero_ps();
                    for (int j = 0; j < k_fold; j++) {
                        for (int i = 0; i < 8; i++) part[i] = _mm256_setzero_ps();
                        for (int64_t c = j * k_cpg; c < (j + 1) * k_cpg; c++) {
                            const __m256 qc = _mm256_loadu_ps(qg + 8 * c);
                            for (int i = 0; i < 8; i++) part[i] = _mm256_fmadd_ps(qc, _mm256_loadu_ps(kh + i * D + 8 * c), part[i]);
                        }
                        x = _mm256_fmadd_ps(hsum8(part), _mm256_loadu_ps(sc[0] + 16 * j + 8 * hh), x);
                    }
                    for (int j = 0; k->zero && j < k_fold; j++)
                        x = _mm256_fmadd_ps(_mm256_loadu_ps(sc[1] + 16 * j + 8 * hh),
                                            _mm256_set1_ps(qsum[g * NG + j]), x);
                } else {
                    for (int i = 0; i < 8; i++) part[i] = _mm256_setzero_ps();
                    for (int64_t c = 0; c < nc; c++) {
                        const __m256 qc = _mm256_loadu_ps(qg + 8 * c);
                        for (int i = 0; i < 8; i++) part[i] = _mm256_fmadd_ps(qc, _mm256_loadu_ps(kh + i * D + 8 * c), part[i]);
                    }
                    x = hsum8(part);
                    if (k_fold)
                        x = _mm256_fmadd_ps(x, _mm256_loadu_ps(sc[0] + 8 * hh),
                                            _mm256_mul_ps(_mm256_loadu_ps(sc[1] + 8 * hh), _mm256_set1_ps(qsum[g * NG])));
                }
                x = _mm256_mul_ps(x, _mm256_set1_ps(scaling));
                if (softcap > 0.0f) x = softcap8(x, softcap);
                s[hh] = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), x, attend[hh]); /* masked: weight exactly 0 */
            }
            if (halves == 1) s[1] = _mm256_set1_ps(-INFINITY);
            const __m256 unord = _mm256_or_ps(_mm256_cmp_ps(s[0], s[0], _CMP_UNORD_Q), _mm256_cmp_ps(s[1], s[1], _CMP_UNORD_Q));
            if (isnan(m[g]) || _mm256_movemask_ps(unord)) {
                m[g] = NAN; /* a NaN score poisons the row, as in torch */
                continue;
            }
            const float bmax = reduce_max8(_mm256_max_ps(s[0], s[1]));
            const float mx = bmax > m[g] ? bmax : m[g];
            if (mx == -INFINITY) continue; /* every token so far masked: no weight */
            const float corr = m[g] == -INFINITY ? 0.0f : exp_nonpos(m[g] - mx);
            const __m256 p0 = exp8(_mm256_sub_ps(s[0], _mm256_set1_ps(mx))); /* -inf lanes: 0 */
            const __m256 p1 = exp8(_mm256_sub_ps(s[1], _mm256_set1_ps(mx)));
            l[g] = l[g] * corr + reduce_add8(_mm256_add_ps(p0, p1));
            m[g] = mx;
            float *pg = p_all + g * 16;
            if (grouped && v_fold > 1) { /* each value group: p_t s_tj, and sum_t p_t z_tj on the side */
                for (int j = 0; j < v_fold; j++) {
                    const __m256 vs0 = _mm256_loadu_ps(sc[2] + 16 * j), vs1 = _mm256_loadu_ps(sc[2] + 16 * j + 8);
                    const __m256 vz0 = _mm256_loadu_ps(sc[3] + 16 * j), vz1 = _mm256_loadu_ps(sc[3] + 16 * j + 8);
                    float *zj = zacc + g * NG + j;
                    *zj = *zj * corr + reduce_add8(_mm256_add_ps(_mm256_mul_ps(p0, vz0), _mm256_mul_ps(p1, vz1)));
                    _mm256_storeu_ps(pgv + 16 * j, _mm256_mul_ps(p0, vs0));
                    _mm256_storeu_ps(pgv + 16 * j + 8, _mm256_mul_ps(p1, vs1));
                }
            } else if (v_fold) {
                const __m256 vs0 = _mm256_loadu_ps(sc[2]), vs1 = _mm256_loadu_ps(sc[2] + 8);
                const __m256 vz0 = _mm256_loadu_ps(sc[3]), vz1 = _mm256_loadu_ps(sc[3] + 8);
                float *z0 = zacc + g * NG;
                *z0 = *z0 * corr + reduce_add8(_mm256_add_ps(_mm256_mul_ps(p0, vz0), _mm256_mul_ps(p1, vz1)));
                _mm256_storeu_ps(pg, _mm256_mul_ps(p0, vs0));
                _mm256_storeu_ps(pg + 8, _mm256_mul_ps(p1, vs1));
            } else {
                _mm256_storeu_ps(pg, p0);
                _mm256_storeu_ps(pg + 8, p1);
            }
            float *ag = acc + g * D;
            const __m256 vc = _mm256_set1_ps(corr);
            const int rows = 8 * halves;
            for (int64_t c = 0; c < nc; c++) { /* the block's rows (p 0 beyond nt) in two FMA chains */
                const float *pc = grouped && v_fold > 1 ? pgv + 16 * v_grp[c] : pg; /* (value groups: its group's p_t s_tj) */
                __m256 a = _mm256_mul_ps(_mm256_loadu_ps(ag + 8 * c), vc), a1 = _mm256_setzero_ps();
                for (int i = 0; i < rows; i += 2) {
                    a = _mm256_fmadd_ps(_mm256_set1_ps(pc[i]), _mm256_loadu_ps(vb + i * D + 8 * c), a);
                    a1 = _mm256_fmadd_ps(_mm256_set1_ps(pc[i + 1]), _mm256_loadu_ps(vb + (i + 1) * D + 8 * c), a1);
                }
                _mm256_storeu_ps(ag + 8 * c, _mm256_add_ps(a, a1));
            }
        }
    }
    fold_zero_points(v, v_fold, NG, G, D, zacc, m, acc);
}

/* The AVX2 head for operands with at most one scale per token (compiled without the group paths:
 * they cost these a few percent when in the same code) ... */
static void decode_head_avx2(const float *qh, int64_t G, int64_t D, const kvq_operand *k,
                             const kvq_operand *v, int64_t b, int64_t h, int64_t t_begin, int64_t T,
                             float scaling, float softcap, float *kb, float *vb, uint8_t *idx, float *m,
                             float *l, float *acc, const uint8_t *valid) {
    decode_head_avx2_body(qh, G, D, k, v, b, h, t_begin, T, scaling, softcap, kb, vb, idx, m, l, acc, valid, 0);
}

/* ... and for those with token-axis scale groups it folds (fold_groups > 1). */
static void decode_head_avx2_groups(const float *qh, int64_t G, int64_t D, const kvq_operand *k,
                                    const kvq_operand *v, int64_t b, int64_t h, int64_t t_begin, int64_t T,
                                    float scaling, float softcap, float *kb, float *vb, uint8_t *idx, float *m,
                                    float *l, float *acc, const uint8_t *valid) {
    decode_head_avx2_body(qh, G, D, k, v, b, h, t_begin, T, scaling, softcap, kb, vb, idx, m, l, acc, valid, 1);
}
#endif

/* One (batch row, KV head), tokens [t_begin, T), any D: row by row in blocks of BLOCK_T. */
static void decode_head_generic(const float *qh, int64_t G, int64_t D, const kvq_operand *k,
                                const kvq_operand *v, int64_t b, int64_t h, int64_t t_begin,
                                int64_t T, float scaling, float softcap, float *kf, float *vf,
                                uint8_t *idx, float *sc, float *m, float *l, float *acc,
                                const uint8_t *valid) {
    for (int64_t t0 = t_begin; t0 < T; t0 += BLOCK_T) {
        const int64_t nt = T - t0 < BLOCK_T ? T - t0 : BLOCK_T;
        for (int64_t i = 0; i < nt; i++) {
            load_row(k, b, h, t0 + i, (int)D, idx, kf);
            for (int64_t g = 0; g < G; g++) {
                const float *qg = qh + g * D;
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int64_t d = 0; d < D; d++) dot += qg[d] * kf[d];
                dot *= scaling;
                if (softcap > 0.0f) dot = softcap * tanhf(dot / softcap);
                if (valid && !valid[t0 + i]) dot = -INFINITY; /* masked: weight exactly 0 */
                sc[g * BLOCK_T + i] = dot;
            }
        }
        for (int64_t g = 0; g < G; g++) {
            float *sg = sc + g * BLOCK_T;
            float mx = m[g];
            int nan_seen = isnan(mx);
            for (int64_t i = 0; i < nt; i++) {
                nan_seen |= isnan(sg[i]);
                mx = sg[i] > mx ? sg[i] : mx;
            }
            if (nan_seen) { m[g] = NAN; continue; } /* a NaN score poisons the row, as in torch */
            if (mx == -INFINITY) { /* every token of the block masked so far: no weight */
                for (int64_t i = 0; i < nt; i++) sg[i] = 0.0f;
                continue;
            }
            const float corr = m[g] == -INFINITY ? 0.0f : exp_nonpos(m[g] - mx);
            float sum = 0.0f;
            for (int64_t i = 0; i < nt; i++) { sg[i] = exp_nonpos(sg[i] - mx); sum += sg[i]; }
            l[g] = l[g] * corr + sum;
            if (corr != 1.0f) {
                float *ag = acc + g * D;
                for (int64_t d = 0; d < D; d++) ag[d] *= corr;
            }
            m[g] = mx;
        }
        for (int64_t i = 0; i < nt; i++) {
            load_row(v, b, h, t0 + i, (int)D, idx, vf);
            for (int64_t g = 0; g < G; g++) {
                const float p = isnan(m[g]) ? 0.0f : sc[g * BLOCK_T + i];
                float *ag = acc + g * D;
                for (int64_t d = 0; d < D; d++) ag[d] += p * vf[d];
            }
        }
    }
}

#if defined(__AVX512F__)
/* Does the AVX-512 head read this operand well? Full-precision rows, or codes it loads 16 channels
 * at a time without a gather. The others take the AVX2 head: 3-bit codes of 64-wide heads (their
 * high-bit planes of 8 bytes: row by row here), fp8 (a 256-entry gather here, bit tricks there),
 * trellis codes (a gather per 16 states here, two levels per load from a pair table there). */
static int reads16(const kvq_operand *o, int64_t D) {
    if (o->bits == 32) return 1;
    const int levels16 = o->bits <= 4 && !o->state_codes; /* a table load_block16 holds in a register */
    return avx_loadable(o, D, 16) && (!o->lut || levels16);
}
#endif

/* One (batch row, KV head), tokens [t_begin, T): the widest path this build and shape allow. */
static void decode_head(const float *qh, int64_t G, int64_t D, const kvq_operand *k, const kvq_operand *v,
                        int64_t b, int64_t h, int64_t t_begin, int64_t T, float scaling, float softcap,
                        float *kf, float *vf, uint8_t *idx, float *sc, float *m, float *l, float *acc,
                        const uint8_t *valid) {
#if defined(__AVX512F__)
    if (D % 16 == 0 && G <= 64 && !valid && reads16(k, D) && reads16(v, D)) {
        decode_head_avx512(qh, G, D, k, v, b, h, t_begin, T, scaling, softcap, kf, vf, idx, m, l, acc);
        return;
    }
#endif
#if defined(__AVX2__) && defined(__FMA__)
    if (D % 8 == 0 && G <= 64) {
        if (fold_groups(k, avx_loadable(k, D, 8)) > 1 || fold_groups(v, avx_loadable(v, D, 8)) > 1)
            decode_head_avx2_groups(qh, G, D, k, v, b, h, t_begin, T, scaling, softcap, kf, vf, idx, m, l, acc, valid);
        else
            decode_head_avx2(qh, G, D, k, v, b, h, t_begin, T, scaling, softcap, kf, vf, idx, m, l, acc, valid);
        return;
    }
#endif
    decode_head_generic(qh, G, D, k, v, b, h, t_begin, T, scaling, softcap, kf, vf, idx, sc, m, l, acc, valid);
}

/* What a decode attends besides the stores: full-precision tokens in n_seg segments (the sinks,
 * the residual tail, the new token), read in place, in the same softmax; and the key smoothing the
 * stores were written with. */
typedef struct {
    const kvq_operand *k, *v; /* [n_seg] fp32 rows (bits 32), in token order */
    const int64_t *len;       /* [n_seg] tokens of each segment */
    int64_t n_seg, n;         /* n: the tokens of every segment */
    const uint8_t *valid;     /* [B, n]: 1 = attend; NULL: all */
    const float *mean, *std;  /* [B, Hkv, D] fp32, or NULL: the stores hold keys (k - mean) / std while
                                 q and the fp tokens are the model's own: q is multiplied by std, the
                                 fp keys have mean taken out and are divided by std (the lse is that
                                 of the scores q . (k - mean)) */
} kvq_fp;

typedef struct {
    const float *q;
    int64_t B, Hkv, G, D;
    const kvq_operand *k, *v;
    const int64_t *start;
    int64_t r0, r1; /* this worker's token range of the slice */
    float scaling, softcap;
    float *acc, *m, *l; /* partials: [B, Hkv, G, D], [B, Hkv, G], [B, Hkv, G] */
    const kvq_fp *fp;              /* full-precision tokens and key smoothing, or NULL */
    int64_t n_fp;                  /* fp tokens this job reads: fp->n for the first job, else 0 */
    const kvq_operand *xk, *xv;    /* more quantized segments (first job only): [n_x] each */
    const int64_t *xstart, *xend;  /* [n_x, B] first token per row, [n_x] exclusive ends */
    int64_t n_x;
    float rot_scale; /* > 0: the stores hold rotated vectors; rotate q and the fp tokens in (and, in
                        kvq_decode, the output back) with fwht_row(., D, rot_scale) */
    int status;
} kvq_job;

/* Unnormalized partial attention of every (row, head) over tokens [r0, r1) of the slice. */
static void *run_job(void *arg) {
    kvq_job *j = arg;
    const int64_t G = j->G, D = j->D, n_fp = j->n_fp;
    const int64_t rows = BLOCK_T > 16 ? BLOCK_T : 16;
    const kvq_fp *fp = j->fp;
    const float *mean = fp ? fp->mean : NULL, *std = fp ? fp->std : NULL;
    float *kf = malloc(sizeof(float) * (size_t)(rows * D));
    float *vf = malloc(sizeof(float) * (size_t)(rows * D));
    uint8_t *idx = malloc((size_t)D);
    float *sc = malloc(sizeof(float) * (size_t)(G * BLOCK_T));
    const int rot = j->rot_scale > 0.0f, fold = rot || std;
    float *qr = fold ? malloc(sizeof(float) * (size_t)(G * D)) : NULL;              /* [G, D] */
    float *fkr = n_fp ? malloc(sizeof(float) * (size_t)(2 * n_fp * D)) : NULL;      /* [2, n_fp, D] */
    j->status = (!kf || !vf || !idx || !sc || (fold && !qr) || (n_fp && !fkr)) ? -1 : 0;
    for (int64_t b = 0; b < j->B && j->status == 0; b++) {
        for (int64_t h = 0; h < j->Hkv; h++) {
            const int64_t bh = b * j->Hkv + h;
            const float *qh = j->q + bh * G * D;
            float *acc = j->acc + bh * G * D, *m = j->m + bh * G, *l = j->l + bh * G;
            for (int64_t i = 0; i < G * D; i++) acc[i] = 0.0f;
            for (int64_t g = 0; g < G; g++) { m[g] = -INFINITY; l[g] = 0.0f; }
            if (fold) { /* the query into the stores' space: times the keys' divisors, then rotated */
                memcpy(qr, qh, sizeof(float) * (size_t)(G * D));
                if (std)
                    for (int64_t g = 0; g < G; g++)
                        for (int64_t d = 0; d < D; d++) qr[g * D + d] *= std[bh * D + d];
                if (rot)
                    for (int64_t g = 0; g < G; g++) fwht_row(qr + g * D, D, j->rot_scale);
                qh = qr;
            }
            if (n_fp) { /* the full-precision tokens, once (first job): gathered into the stores' space */
                float *rk_rows = fkr, *rv_rows = fkr + n_fp * D;
                int64_t t = 0;
                for (int64_t s = 0; s < fp->n_seg; s++)
                    for (int64_t i = 0; i < fp->len[s]; i++, t++) {
                        float *xk = rk_rows + t * D, *xv = rv_rows + t * D;
                        load_row(&fp->k[s], b, h, i, (int)D, idx, xk);
                        load_row(&fp->v[s], b, h, i, (int)D, idx, xv);
                        if (mean)
                            for (int64_t d = 0; d < D; d++) xk[d] = xk[d] - mean[bh * D + d];
                        if (std)
                            for (int64_t d = 0; d < D; d++) xk[d] = xk[d] / std[bh * D + d];
                        if (rot) {
                            fwht_row(xk, D, j->rot_scale);
                            fwht_row(xv, D, j->rot_scale);
                        }
                    }
                kvq_operand rk = fp->k[0], rv; /* [n_fp, D] rows, the same for every (row, head) */
                rk.codes = (const uint8_t *)rk_rows;
                rk.code_sb = rk.code_sh = 0;
                rk.code_st = (int64_t)sizeof(float) * D;
                rv = rk;
                rv.codes = (const uint8_t *)rv_rows;
                decode_head(qh, G, D, &rk, &rv, b, h, 0, n_fp, j->scaling, j->softcap, kf, vf, idx, sc, m, l,
                            acc, fp->valid ? fp->valid + b * n_fp : NULL);
            }
            for (int64_t x = 0; x < j->n_x; x++) { /* more segments (e.g. the recent window), once */
                const int64_t s0 = j->xstart[x * j->B + b];
                decode_head(qh, G, D, &j->xk[x], &j->xv[x], b, h, s0 > 0 ? s0 : 0, j->xend[x], j->scaling,
                            j->softcap, kf, vf, idx, sc, m, l, acc, NULL);
            }
            const int64_t t_begin = j->start[b] > j->r0 ? j->start[b] : j->r0;
            decode_head(qh, G, D, j->k, j->v, b, h, t_begin, j->r1, j->scaling, j->softcap, kf, vf, idx, sc,
                        m, l, acc, NULL);
        }
    }
    free(kf); free(vf); free(idx); free(sc); free(qr); free(fkr);
    return NULL;
}

/* The earliest of the rows' first tokens start[0..B) (negative: 0), at most `end`. */
static int64_t first_start(const int64_t *start, int64_t B, int64_t end) {
    int64_t lo = end;
    for (int64_t b = 0; b < B; b++) {
        const int64_t s = start[b] < 0 ? 0 : start[b];
        lo = s < lo ? s : lo;
    }
    return lo;
}

/* q [B, Hkv, G, D] fp32 contiguous; start [B]: first token of each row in the slice; T: slice length.
 * Writes out [B, Hkv, G, D] and lse [B, Hkv, G] (natural log; -inf and zeros for an empty row).
 * softcap <= 0: none. fp (NULL: none): full-precision tokens attended in the same softmax (see
 * kvq_fp), and the key smoothing the stores were written with (folded into q and the fp keys). xk / xv
 * [n_x]: more quantized segments in the same softmax (the recent window), tokens [xstart[x, b],
 * xend[x]) of each; read by the first thread like the full-precision tokens (they are short).
 * rot_scale > 0 (1 / sqrt(D & -D): see fwht_row): the stores hold Hadamard-rotated vectors (the key
 * transform's rotation) and q, the fp tokens and out are in the model's space: q and the fp tokens
 * are rotated in (fwht_row), out rotated back; 0: no rotation.
 * n_threads > 1 splits the main slice into that many ranges (split-KV, one thread each, OpenMP;
 * the first range shorter by the fp and other-segment tokens its thread reads too), merged by
 * log-sum-exp. Returns 0, or -1 when out of memory. */
int kvq_decode(const float *q, int64_t B, int64_t Hkv, int64_t G, int64_t D,
               const kvq_operand *k, const kvq_operand *v, const int64_t *start, int64_t T,
               float scaling, float softcap, float *out, float *lse, int n_threads,
               const kvq_fp *fp,
               const kvq_operand *xk, const kvq_operand *xv, const int64_t *xstart, const int64_t *xend,
               int64_t n_x, float rot_scale) {
    if (n_threads < 1) n_threads = 1;
    if (n_threads > 64) n_threads = 64;
    const int64_t lo = first_start(start, B, T);
    /* the first thread also reads the fp tokens and the other segments: it takes that many fewer
     * tokens of the main slice (ranges of whole 16-token blocks; one thread: the whole slice) */
    const int64_t n_fp = fp ? fp->n : 0;
    int64_t first_extra = n_fp;
    for (int64_t x = 0; x < n_x; x++) first_extra += xend[x] - first_start(xstart + x * B, B, xend[x]);
    const int64_t per = ((T - lo + first_extra + n_threads - 1) / n_threads + 15) / 16 * 16;
    const int64_t first = per > first_extra ? (per - first_extra) / 16 * 16 : 0;
    const int64_t n_part = B * Hkv * G;
    kvq_job jobs[64];
    int rc = 0;
    for (int w = 0; w < n_threads; w++) {
        kvq_job *j = &jobs[w];
        j->q = q; j->B = B; j->Hkv = Hkv; j->G = G; j->D = D; j->k = k; j->v = v; j->start = start;
        const int64_t r0 = w == 0 ? lo : lo + first + (w - 1) * per;
        const int64_t r1 = w == n_threads - 1 ? T : lo + first + w * per;
        j->r0 = r0 < T ? r0 : T;
        j->r1 = r1 < T ? r1 : T;
        j->scaling = scaling; j->softcap = softcap;
        j->status = 0;
        j->fp = fp; j->n_fp = w == 0 ? n_fp : 0;
        j->xk = xk; j->xv = xv; j->xstart = xstart; j->xend = xend; j->n_x = w == 0 ? n_x : 0;
        j->rot_scale = rot_scale;
        if (w == 0) {
            j->acc = out; j->m = lse; j->l = malloc(sizeof(float) * (size_t)n_part);
        } else {
            j->acc = malloc(sizeof(float) * (size_t)(n_part * D));
            j->m = malloc(sizeof(float) * (size_t)n_part);
            j->l = malloc(sizeof(float) * (size_t)n_part);
        }
        if (!j->acc || !j->m || !j->l) { rc = -1; n_threads = w + 1; break; }
    }
    if (rc == 0) {
        /* OpenMP from the libgomp torch already loaded (same soname): torch's own thread pool */
#pragma omp parallel for num_threads(n_threads) schedule(static, 1)
        for (int w = 0; w < n_threads; w++) run_job(&jobs[w]);
    }
    for (int w = 0; w < n_threads && rc == 0; w++) rc = jobs[w].status;
    if (rc == 0) {
        for (int64_t p = 0; p < n_part; p++) { /* merge the ranges' partials, then normalize */
            float *acc = out + p * D;
            float mx = -INFINITY;
            int nan_seen = 0;
            for (int w = 0; w < n_threads; w++) {
                nan_seen |= isnan(jobs[w].m[p]);
                mx = jobs[w].m[p] > mx ? jobs[w].m[p] : mx;
            }
            float l = 0.0f;
            if (!nan_seen && mx != -INFINITY) {
                for (int w = 0; w < n_threads; w++) {
                    if (jobs[w].m[p] == -INFINITY) {
                        if (w == 0) for (int64_t d = 0; d < D; d++) acc[d] = 0.0f;
                        continue;
                    }
                    const float c = exp_nonpos(jobs[w].m[p] - mx);
                    l += jobs[w].l[p] * c;
                    if (w == 0) {
                        for (int64_t d = 0; d < D; d++) acc[d] *= c;
                    } else {
                        const float *aw = jobs[w].acc + p * D;
                        for (int64_t d = 0; d < D; d++) acc[d] += c * aw[d];
                    }
                }
            }
            if (nan_seen) {
                for (int64_t d = 0; d < D; d++) acc[d] = NAN;
                lse[p] = NAN;
            } else if (l > 0.0f) {
                const float inv = 1.0f / l;
                for (int64_t d = 0; d < D; d++) acc[d] *= inv;
                lse[p] = mx + logf(l);
            } else {
                for (int64_t d = 0; d < D; d++) acc[d] = 0.0f;
                lse[p] = -INFINITY;
            }
            if (rot_scale > 0.0f) fwht_row(acc, D, rot_scale); /* the output back from the rotated space */
        }
    }
    free(jobs[0].l);
    for (int w = 1; w < n_threads; w++) { free(jobs[w].acc); free(jobs[w].m); free(jobs[w].l); }
    return rc;
}

/* Dequantized rows out [B, H, n, D] (fp32, contiguous) of tokens [t0, t0 + n) of operand o, as
 * kvquant.formats.dequantize forms them: each code's value (integer, table level, trellis state
 * level, fp8 value), times its scale, then plus its zero point, two roundings (nothing fused), so
 * the result equals the torch twin bit for bit. One thread: a segment moves a few tokens at a time. */
__attribute__((optimize("fp-contract=off"))) void kvq_dequantize(const kvq_operand *o, int64_t B, int64_t H,
                                                                 int64_t t0, int64_t n, int64_t D, float *out) {
    kvq_operand raw = *o; /* the codes' values alone: load_row applies no scale */
    raw.scale = NULL;
    raw.zero = NULL;
    uint8_t idx[512];
    float s[512], z[512];
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < H; h++)
            for (int64_t i = 0; i < n; i++) {
                float *row = out + ((b * H + h) * n + i) * D;
                load_row(&raw, b, h, t0 + i, (int)D, idx, row);
                if (!o->scale) continue;
                load_scales(o, b, h, t0 + i, (int)D, s, z);
                const int64_t gs = o->channel_axis ? 1 : D / o->n_groups; /* channels per scale */
                for (int64_t d = 0; d < D; d++) row[d] = row[d] * s[o->channel_axis ? d : d / gs];
                if (o->zero)
                    for (int64_t d = 0; d < D; d++) row[d] = row[d] + z[o->channel_axis ? d : d / gs];
            }
}
