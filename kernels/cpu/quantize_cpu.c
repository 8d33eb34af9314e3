/* Quantize-and-append on CPU, and the trellis search: the twins of kvquant.formats.quantize for
 * the integer formats, the codebooks (nuq*) and fp8 along the token axis, writing codes, scales and
 * zero points straight into the store's buffers, and of kvquant.formats.trellis.trellis_encode.
 *
 * Built together with decode_cpu.c into one library (kernels/cpu/build.py); no Python or torch
 * headers, called through ctypes with raw pointers and element strides.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kvq_common.h"

#if defined(__AVX__)
#include <immintrin.h>
#endif

/* ------------------------------------------------------------------------------------------------
 * The integer formats along the token axis (int8 symmetric; int4 / int3 / int2 with a zero point), writing codes, scales and
 * zero points straight into the store's buffers. Bit-exact with the torch spec: min / max / |max|
 * per group in fp32, scale and zero point rounded to their storage dtype in the directed way the
 * spec uses (zero point down, scale up), codes by round-half-even of (x - zero) / scale.
 */

/* fp32 -> fp16 / bf16 bits rounded to nearest even, then one step toward `direction` when that
 * went the wrong way (exactly formats.round_to_dtype). dtype 1: fp16, 2: bf16. */
static uint16_t round_half(float x, int dtype, int direction) {
    uint16_t y;
    float back;
    if (dtype == 1) {
        const _Float16 hv = (_Float16)x;
        memcpy(&y, &hv, sizeof(y));
        back = (float)hv;
    } else {
        uint32_t u;
        memcpy(&u, &x, sizeof(u));
        y = (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
        const uint32_t w = (uint32_t)y << 16;
        memcpy(&back, &w, sizeof(back));
    }
    const int wrong = direction > 0 ? back < x : back > x;
    if (!wrong) return y;
    /* fp16 and bf16 both keep the sign in bit 15: one step is +-1 on the magnitude bits */
    if ((y & 0x7FFF) == 0) return direction > 0 ? 0x0001 : 0x8001; /* from +-0: smallest subnormal */
    const int positive = !(y & 0x8000);
    return (positive == (direction > 0)) ? (uint16_t)(y + 1) : (uint16_t)(y - 1);
}

static float half_to_float(uint16_t y, int dtype) {
    if (dtype == 1) {
        _Float16 hv;
        memcpy(&hv, &y, sizeof(hv));
        return (float)hv;
    }
    const uint32_t w = (uint32_t)y << 16;
    float f;
    memcpy(&f, &w, sizeof(f));
    return f;
}

/* Every finite float8 e4m3fn value ascending (-0 merged into +0) and its byte: the grid of
 * formats.rounding._fp8_grid. */
static float e4m3_grid[253];
static uint8_t e4m3_bytes[253];
static int e4m3_n;

static void e4m3_init(void) {
    if (e4m3_n) return;
    int n = 0;
    for (int i = 0xFE; i >= 0x81; i--) /* negatives, most negative first (0xFF is NaN) */
        if (i != 0xFF) e4m3_grid[n] = e4m3_to_f32((uint8_t)i), e4m3_bytes[n++] = (uint8_t)i;
    for (int i = 0x00; i <= 0x7E; i++) e4m3_grid[n] = e4m3_to_f32((uint8_t)i), e4m3_bytes[n++] = (uint8_t)i;
    e4m3_n = n; /* (written once, the same bytes by any thread) */
}

/* fp32 -> e4m3fn byte rounded up (direction > 0: the least grid value >= x) or down (the greatest
 * <= x); the NaN byte 0x7F beyond the grid or for NaN (exactly formats.round_to_dtype). */
static uint8_t round_e4m3(float x, int direction) {
    e4m3_init();
    if (isnan(x)) return 0x7F;
    int lo = 0, hi = e4m3_n; /* first index with grid >= x (up) or > x (down) */
    while (lo < hi) {
        const int mid = (lo + hi) / 2;
        if (direction > 0 ? e4m3_grid[mid] < x : e4m3_grid[mid] <= x) lo = mid + 1;
        else hi = mid;
    }
    const int i = direction > 0 ? lo : lo - 1;
    return i < 0 || i >= e4m3_n ? 0x7F : e4m3_bytes[i];
}

/* Round v to the storage dtype in `direction` (3: float8 e4m3fn); store it at element i of p;
 * return it as fp32. */
static float store_scalar(void *p, int64_t i, int dtype, float v, int direction) {
    if (dtype == 0) {
        ((float *)p)[i] = v;
        return v;
    }
    if (dtype == 3) {
        const uint8_t y = round_e4m3(v, direction);
        ((uint8_t *)p)[i] = y;
        return e4m3_to_f32(y);
    }
    const uint16_t y = round_half(v, dtype, direction);
    ((uint16_t *)p)[i] = y;
    return half_to_float(y, dtype);
}

/* One head vector's codes q[D] (one per byte) -> its stored bytes c (formats/packing.py: planar). */
static void pack_row(const uint8_t *restrict q, int bits, int64_t D, uint8_t *restrict c) {
    if (bits == 8) {
        memcpy(c, q, (size_t)D);
    } else if (bits == 4) {
        const int64_t w = D / 2;
        for (int64_t j = 0; j < w; j++) c[j] = (uint8_t)(q[j] | (q[j + w] << 4));
    } else if (bits == 2) {
        const int64_t w = D / 4;
        for (int64_t j = 0; j < w; j++)
            c[j] = (uint8_t)(q[j] | (q[j + w] << 2) | (q[j + 2 * w] << 4) | (q[j + 3 * w] << 6));
    } else if (bits == 1) { /* channel j + k D/8: bit k of byte j */
        const int64_t w = D / 8;
        for (int64_t j = 0; j < w; j++) {
            uint8_t byte = 0;
            for (int k = 0; k < 8; k++) byte |= (uint8_t)((q[j + k * w] & 1) << k);
            c[j] = byte;
        }
    } else { /* 3: int2 plane of the low bits, then the high bits eight per byte */
        const int64_t w = D / 4, w1 = D / 8;
        for (int64_t j = 0; j < w; j++)
            c[j] = (uint8_t)((q[j] & 3) | ((q[j + w] & 3) << 2) | ((q[j + 2 * w] & 3) << 4) | ((q[j + 3 * w] & 3) << 6));
        for (int64_t j = 0; j < w1; j++) {
            uint8_t byte = 0;
            for (int k = 0; k < 8; k++) byte |= (uint8_t)(((q[j + k * w1] >> 2) & 1) << k);
            c[w + j] = byte;
        }
    }
}

/* One scale group of the integer formats: the gs elements xg[0], xg[xs], ... -> codes qg[0], qg[qs],
 * ... (one per byte), the scale (and, asymmetric, the zero point) rounded into element si of scale /
 * zero. bits 8 + is_signed: int8 symmetric; bits 4 / 3 / 2: asymmetric. Returns 1 when an element
 * or a rounded statistic is not finite, else 0. */
static int int_group(const float *xg, int64_t xs, int64_t gs, uint8_t *qg, int64_t qs, void *scale, void *zero,
                     int64_t si, int scale_dtype, float qmax, int is_signed) {
    int bad = 0;
    if (is_signed) {
        float amax = 0.0f;
        for (int64_t d = 0; d < gs; d++) {
            const float v = xg[d * xs];
            if (!isfinite(v)) bad = 1;
            const float a = fabsf(v);
            amax = a > amax ? a : amax;
        }
        float raw = amax / qmax;
        if (raw == 0.0f) raw = 1.0f;
        const float s = store_scalar(scale, si, scale_dtype, raw, +1);
        if (!isfinite(s)) bad = 1;
        for (int64_t d = 0; d < gs; d++) {
            float y = xg[d * xs] / s;
            y = y < -qmax ? -qmax : (y > qmax ? qmax : y);
            qg[d * qs] = (uint8_t)(int8_t)nearbyintf(y);
        }
        return bad;
    }
    float mn = xg[0], mx = xg[0];
    for (int64_t d = 0; d < gs; d++) {
        const float v = xg[d * xs];
        if (!isfinite(v)) bad = 1;
        mn = v < mn ? v : mn;
        mx = v > mx ? v : mx;
    }
    const float z = store_scalar(zero, si, scale_dtype, mn, -1);
    float raw = (mx - z) / qmax;
    if (raw == 0.0f) raw = 1.0f;
    const float s = store_scalar(scale, si, scale_dtype, raw, +1);
    if (!isfinite(s) || !isfinite(z)) bad = 1;
    for (int64_t d = 0; d < gs; d++) {
        float y = nearbyintf((xg[d * xs] - z) / s);
        y = y < 0.0f ? 0.0f : (y > qmax ? qmax : y);
        qg[d * qs] = (uint8_t)y;
    }
    return bad;
}

/* x [B, H, n, D] fp32 (element strides, D contiguous) -> codes / scale / zero at the store's
 * position (pointers already offset there; codes byte strides, scale/zero element strides).
 * Token axis (block 1): scale / zero [.., n, n_groups], one per n_groups channels of a token.
 * Channel axis (block G > 1, KIVI's keys): scale / zero [.., n / G, D], one per channel of a block
 * of G tokens; n a multiple of G (the ops check it). Returns 0, 1 when an input or a rounded scale
 * / zero point is not finite (nothing useful written: the caller re-runs the torch path, which
 * raises its message), -1 when out of memory. */
int kvq_quantize(const float *x, int64_t B, int64_t H, int64_t n, int64_t D, int64_t xsb, int64_t xsh,
                 int64_t xst, uint8_t *codes, int64_t csb, int64_t csh, int64_t cst, void *scale,
                 void *zero, int64_t ssb, int64_t ssh, int64_t sst, int scale_dtype, int bits,
                 int is_signed, int n_groups, int64_t block) {
    const float qmax = bits == 8 ? 127.0f : (float)((1 << bits) - 1);
    const int64_t rows = block > 1 ? block : 1; /* tokens quantized together */
    uint8_t *q = malloc((size_t)(rows * D));    /* [rows, D] codes, one per byte */
    if (!q) return -1;
    int bad = 0;
    for (int64_t b = 0; b < B && !bad; b++)
        for (int64_t h = 0; h < H && !bad; h++)
            for (int64_t t = 0; t < n && !bad; t += rows) {
                const float *row = x + b * xsb + h * xsh + t * xst;
                const int64_t si = b * ssb + h * ssh + (t / rows) * sst;
                if (rows > 1) {
                    for (int64_t d = 0; d < D; d++)
                        bad |= int_group(row + d, xst, rows, q + d, D, scale, zero, si + d, scale_dtype, qmax,
                                         is_signed);
                } else {
                    const int64_t gs = D / n_groups;
                    for (int64_t g = 0; g < n_groups; g++)
                        bad |= int_group(row + g * gs, 1, gs, q + g * gs, 1, scale, zero, si + g, scale_dtype,
                                         qmax, is_signed);
                }
                for (int64_t j = 0; j < rows; j++)
                    pack_row(q + j * D, bits, D, codes + b * csb + h * csh + (t + j) * cst);
            }
    free(q);
    return bad;
}

/* ---------------------------------------------------------------------------------------------
 * Codebooks (nuq*) and fp8 along the token axis: Codebook.encode_groups and Fp8 (_AbsMaxScaled)
 * of kvquant/formats/families.py, step for step in fp32, nothing fused. The sums of squares run
 * in torch's order for a contiguous inner reduction (four accumulators of eight lanes, chunk c into
 * accumulator c % 4, a tail of chunks into the first; the accumulators then the lanes added in
 * order). Square roots are correctly rounded here; torch's vectorized sqrt is not always (about
 * 0.6% of fp32 inputs land one ulp away), so a scale can differ by a step of its dtype, rarely,
 * with the codes its own scale picks: the tests hold those groups to equal squared error.
 */

/* sum of a[0..n) in torch's inner-reduction order (see above). */
__attribute__((optimize("fp-contract=off"))) static float torch_sum(const float *a, int64_t n) {
    float acc[4][8] = {{0}};
    const int64_t chunks = n / 8, full = chunks / 4 * 4;
#if defined(__AVX__)
    if (chunks >= 4) { /* the same lane-wise adds, four chunks per step */
        __m256 v[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
        for (int64_t c = 0; c < full; c += 4)
            for (int j = 0; j < 4; j++) v[j] = _mm256_add_ps(v[j], _mm256_loadu_ps(a + 8 * (c + j)));
        for (int64_t c = full; c < chunks; c++) v[0] = _mm256_add_ps(v[0], _mm256_loadu_ps(a + 8 * c));
        for (int j = 0; j < 4; j++) _mm256_storeu_ps(acc[j], v[j]);
    } else
#endif
    for (int64_t c = 0; c < chunks; c++) {
        float *ac = acc[c < full ? c % 4 : 0];
        for (int i = 0; i < 8; i++) ac[i] += a[8 * c + i];
    }
    float lanes[8], s = 0.0f;
    for (int i = 0; i < 8; i++) lanes[i] = ((acc[0][i] + acc[1][i]) + acc[2][i]) + acc[3][i];
    for (int i = 0; i < 8; i++) s += lanes[i];
    for (int64_t i = 8 * chunks; i < n; i++) s += a[i]; /* (group sizes are multiples of 8) */
    return s;
}

/* The squares of xg[0..gs) into sq (for torch_sum) and max|x| into *amax; 1 when an element is
 * not finite (NaN / Inf: the spec refuses the input), else 0. */
__attribute__((optimize("fp-contract=off"))) static int group_squares(const float *xg, int64_t gs, float *sq, float *amax) {
    int bad = 0;
    float m = 0.0f;
    for (int64_t d = 0; d < gs; d++) {
        bad |= !isfinite(xg[d]);
        const float a = fabsf(xg[d]);
        m = a > m ? a : m;
        sq[d] = xg[d] * xg[d];
    }
    *amax = m;
    return bad;
}

/* Nearest level by the midpoints, as torch.bucketize(v, edges) (right=False): the number of edges
 * strictly below v (a value on an edge takes the lower level); NaN (0 / 0: an all-zero group's
 * last pick) after every edge, as torch places it. */
static inline uint8_t bucket(float v, const float *edges, int n_edges) {
    if (isnan(v)) return (uint8_t)n_edges;
    int q = 0;
    for (int i = 0; i < n_edges; i++) q += edges[i] < v;
    return (uint8_t)q;
}


/* Codes of xg[gs] for scale s into qg; returns sum((level * s - x)^2) in torch's order. levels:
 * padded to 16 entries. 16 (AVX-512) or 8 (AVX2) elements per step where the group allows (the
 * same fp32 operations, so the same codes and sum). */
__attribute__((optimize("fp-contract=off"))) static float codebook_try(
    const float *xg, int64_t gs, float s, const float *levels, const float *edges, int n_edges,
    uint8_t *qg, float *tmp) {
    int64_t d = 0;
#if defined(__AVX512F__)
    const __m512 vs = _mm512_set1_ps(s), lut = _mm512_loadu_ps(levels);
    for (; d + 16 <= gs; d += 16) {
        const __m512 x = _mm512_loadu_ps(xg + d), y = _mm512_div_ps(x, vs);
        __m512i q = _mm512_setzero_si512();
        for (int i = 0; i < n_edges; i++) /* edges strictly below y */
            q = _mm512_mask_add_epi32(q, _mm512_cmp_ps_mask(_mm512_set1_ps(edges[i]), y, _CMP_LT_OQ), q,
                                      _mm512_set1_epi32(1));
        q = _mm512_mask_mov_epi32(q, _mm512_cmp_ps_mask(y, y, _CMP_UNORD_Q), _mm512_set1_epi32(n_edges));
        _mm_storeu_si128((__m128i *)(qg + d), _mm512_cvtepi32_epi8(q));
        const __m512 e = _mm512_sub_ps(_mm512_mul_ps(_mm512_permutexvar_ps(q, lut), vs), x);
        _mm512_storeu_ps(tmp + d, _mm512_mul_ps(e, e));
    }
#elif defined(__AVX2__)
    const __m256 vs = _mm256_set1_ps(s);
    const __m256 lut_lo = _mm256_loadu_ps(levels), lut_hi = _mm256_loadu_ps(levels + 8);
    for (; d + 8 <= gs; d += 8) {
        const __m256 x = _mm256_loadu_ps(xg + d), y = _mm256_div_ps(x, vs);
        __m256i q = _mm256_setzero_si256();
        for (int i = 0; i < n_edges; i++) /* edges strictly below y: each true compare is -1 */
            q = _mm256_sub_epi32(q, _mm256_castps_si256(_mm256_cmp_ps(_mm256_set1_ps(edges[i]), y, _CMP_LT_OQ)));
        q = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(q), _mm256_castsi256_ps(_mm256_set1_epi32(n_edges)),
                                                 _mm256_cmp_ps(y, y, _CMP_UNORD_Q)));
        int32_t qi[8];
        _mm256_storeu_si256((__m256i *)qi, q);
        for (int i = 0; i < 8; i++) qg[d + i] = (uint8_t)qi[i];
        /* the level of code q: entry q & 7 of the half that bit 3 picks */
        const __m256 lv = _mm256_blendv_ps(_mm256_permutevar8x32_ps(lut_lo, q), _mm256_permutevar8x32_ps(lut_hi, q),
                                           _mm256_castsi256_ps(_mm256_slli_epi32(q, 28)));
        const __m256 e = _mm256_sub_ps(_mm256_mul_ps(lv, vs), x);
        _mm256_storeu_ps(tmp + d, _mm256_mul_ps(e, e));
    }
#endif
    for (; d < gs; d++) {
        qg[d] = bucket(xg[d] / s, edges, n_edges);
        const float e = levels[qg[d]] * s - xg[d];
        tmp[d] = e * e;
    }
    return torch_sum(tmp, gs);
}

/* x [B, H, n, D] -> codes / scale of a codebook format (levels [16]: the 2^bits ascending fp32
 * levels, padded), token axis.
 * grid [n_grid]: the multiples of the group's RMS to try (CODEBOOK_SCALE_GRID as fp32); qmax: the
 * top level as the spec holds it. Returns 0, 1 when an input or a stored scale is not finite (the
 * caller re-runs the torch path, which raises), -1 when out of memory. */
__attribute__((optimize("fp-contract=off"))) int kvq_quantize_codebook(
    const float *x, int64_t B, int64_t H, int64_t n, int64_t D, int64_t xsb, int64_t xsh, int64_t xst,
    uint8_t *codes, int64_t csb, int64_t csh, int64_t cst, void *scale, int64_t ssb, int64_t ssh,
    int64_t sst, int scale_dtype, int bits, int n_groups, const float *levels, const float *grid,
    int n_grid, float qmax, int n_threads) {
    const int64_t gs = D / n_groups;
    const int n_edges = (1 << bits) - 1;
    float edges[15];
    for (int i = 0; i < n_edges; i++) edges[i] = (levels[i + 1] + levels[i]) / 2.0f;
    int bad = 0, failed = 0;
#pragma omp parallel num_threads(n_threads < 1 ? 1 : n_threads) reduction(| : bad, failed)
    {
        uint8_t *q = malloc((size_t)D), *cand = malloc((size_t)gs);
        float *tmp = malloc(sizeof(float) * (size_t)gs);
        failed = !q || !cand || !tmp;
#pragma omp for schedule(static)
        for (int64_t r = 0; r < B * H * n; r++) { /* one head vector (row) per step, rows split among threads */
            const int64_t b = r / (H * n), h = r / n % H, t = r % n;
            if (failed || bad) continue;
            const float *row = x + b * xsb + h * xsh + t * xst;
            const int64_t si = b * ssb + h * ssh + t * sst;
            for (int64_t g = 0; g < n_groups; g++) {
                const float *xg = row + g * gs;
                uint8_t *qg = q + g * gs;
                float amax;
                bad |= group_squares(xg, gs, tmp, &amax);
                const float sumsq = torch_sum(tmp, gs);
                float rms = sqrtf(sumsq / (float)gs);
                if (rms == 0.0f) rms = 1.0f;
                const float fit_max = amax == 0.0f ? 1.0f : amax / qmax;
                float best_s = 0.0f, best_err = 0.0f;
                for (int c = 0; c <= n_grid; c++) { /* the RMS multiples, then fit_max */
                    const float raw = c < n_grid ? rms * grid[c] : fit_max;
                    const float s = store_scalar(scale, si + g, scale_dtype, raw, +1);
                    const float err = codebook_try(xg, gs, s, levels, edges, n_edges, cand, tmp);
                    if (c == 0 || err < best_err) {
                        best_s = s;
                        memcpy(qg, cand, (size_t)gs);
                    }
                    /* torch.minimum: NaN propagates */
                    best_err = c == 0 ? err : (isnan(err) || isnan(best_err) ? NAN : (err < best_err ? err : best_err));
                }
                /* stretch to the input's norm, round up again, re-pick the levels */
                for (int64_t d = 0; d < gs; d++) {
                    const float v = levels[qg[d]] * best_s;
                    tmp[d] = v * v;
                }
                const float norm_q = sqrtf(torch_sum(tmp, gs));
                const float norm_x = sqrtf(sumsq);
                const float raw = norm_q > 0.0f ? best_s * norm_x / norm_q : rms;
                const float s = store_scalar(scale, si + g, scale_dtype, raw, +1);
                codebook_try(xg, gs, s, levels, edges, n_edges, qg, tmp);
                if (amax == 0.0f) store_scalar(scale, si + g, scale_dtype, 0.0f, +1); /* exact zeros */
                else if (!isfinite(s)) bad = 1;
            }
            pack_row(q, bits, D, codes + b * csb + h * csh + t * cst);
        }
        free(q), free(cand), free(tmp);
    }
    return failed ? -1 : bad;
}

/* fp32 (finite, |v| within the format's range) -> float8 byte, round to nearest even like torch's
 * cast: m mantissa bits, exponent bias `bias` (e4m3fn: 3, 7; e5m2: 2, 15); min_normal = 2^(1 - bias),
 * sub_mul = 2^(bias - 1 + m). Branch-free (the loop over a group vectorizes). */
static inline uint8_t f32_to_fp8(float v, int m, int bias, float min_normal, float sub_mul) {
    uint32_t u;
    memcpy(&u, &v, sizeof(u));
    const uint32_t sign = (u >> 24) & 0x80, ua = u & 0x7FFFFFFFu;
    /* normal: the mantissa rounded to m bits (ties to even) with its carry into the exponent, rebiased */
    const uint32_t r = (ua + (1u << (22 - m)) - 1 + ((ua >> (23 - m)) & 1)) >> (23 - m);
    const uint32_t normal = r - ((uint32_t)(127 - bias) << m);
    /* subnormal: a multiple of 2^(1 - bias - m), nearest even (the top one is the smallest normal) */
    const uint32_t sub = (uint32_t)nearbyintf(fabsf(v) * sub_mul);
    return (uint8_t)(sign | (fabsf(v) < min_normal ? sub : normal));
}

/* x [B, H, n, D] -> fp8 codes / scale (token axis): s = max|x| / qmax (1 for an all-zero group)
 * rounded up to the scale dtype, code = fp8(clamp(x / s, -qmax, qmax)). Returns as above. */
int kvq_quantize_fp8(const float *x, int64_t B, int64_t H, int64_t n, int64_t D, int64_t xsb, int64_t xsh,
                     int64_t xst, uint8_t *codes, int64_t csb, int64_t csh, int64_t cst, void *scale,
                     int64_t ssb, int64_t ssh, int64_t sst, int scale_dtype, int n_groups, int mant,
                     int bias, float qmax) {
    const int64_t gs = D / n_groups;
    const float min_normal = ldexpf(1.0f, 1 - bias), sub_mul = ldexpf(1.0f, bias - 1 + mant);
    int bad = 0;
    for (int64_t b = 0; b < B && !bad; b++)
        for (int64_t h = 0; h < H && !bad; h++)
            for (int64_t t = 0; t < n && !bad; t++) {
                const float *row = x + b * xsb + h * xsh + t * xst;
                uint8_t *c = codes + b * csb + h * csh + t * cst;
                const int64_t si = b * ssb + h * ssh + t * sst;
                for (int64_t g = 0; g < n_groups && !bad; g++) {
                    const float *xg = row + g * gs;
                    float amax = 0.0f;
                    for (int64_t d = 0; d < gs; d++) {
                        if (!isfinite(xg[d])) bad = 1;
                        const float a = fabsf(xg[d]);
                        amax = a > amax ? a : amax;
                    }
                    float raw = amax / qmax;
                    if (raw == 0.0f) raw = 1.0f;
                    const float s = store_scalar(scale, si + g, scale_dtype, raw, +1);
                    if (!isfinite(s) || bad) {
                        bad = 1;
                        break;
                    }
                    for (int64_t d = 0; d < gs; d++) {
                        float y = xg[d] / s;
                        y = y < -qmax ? -qmax : (y > qmax ? qmax : y);
                        c[g * gs + d] = f32_to_fp8(y, mant, bias, min_normal, sub_mul);
                    }
                }
            }
    return bad;
}

/* ---------------------------------------------------------------------------------------------
 * Trellis encoder: the native twin of kvquant.trellis.trellis_encode (same codes). The squared
 * errors are formed and summed in the twin's order (difference, square, add; fp32, nothing fused)
 * and ties go to the first index, as torch's min does.
 */


#if defined(__AVX2__)
#include <immintrin.h>

/* One step of trellis_pass below for K = 2, 4 or 8 codes per state and P % 8 == 0 predecessor groups,
 * 8 groups at a time, the same IEEE operations in the same order (so the same costs, the same
 * choices): the least of each group's K predecessors (strict <, in j order: ties to the first),
 * then next[p K + b] = best[p] + (y_t - table[p K + b])^2, the square rounded before the sum. K is a
 * constant in each instance (trellis_step_2 / _4 / _8): the j loop unrolls and the groups' compare chains
 * overlap. */
__attribute__((optimize("fp-contract=off"), always_inline)) static inline void trellis_step_k(
    const float *restrict cost, float *restrict next, uint8_t *restrict back, const float *restrict table,
    float yt, const int K, int P) {
    const __m256 y = _mm256_set1_ps(yt);
    for (int p = 0; p < P; p += 8) {
        __m256 bv = _mm256_loadu_ps(cost + p);
        __m256i fv = _mm256_setzero_si256();
        for (int j = 1; j < K; j++) {
            const __m256 c = _mm256_loadu_ps(cost + j * P + p);
            const __m256 lt = _mm256_cmp_ps(c, bv, _CMP_LT_OQ); /* NaN: not less, as in C */
            bv = _mm256_blendv_ps(bv, c, lt);
            fv = _mm256_blendv_epi8(fv, _mm256_set1_epi32(j), _mm256_castps_si256(lt));
        }
        const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(fv), _mm256_extracti128_si256(fv, 1));
        _mm_storel_epi64((__m128i *)(back + p), _mm_packus_epi16(w, w)); /* the 8 choices as bytes */
        for (int i = 0; i < K; i++) { /* the K * 8 states of these 8 groups, 8 at a time */
            const int g = 8 / K * i; /* lane l: state s0 + l of group p + g + l / K */
            const __m256i pick = K == 8 ? _mm256_set1_epi32(i)
                               : K == 4 ? _mm256_setr_epi32(g, g, g, g, g + 1, g + 1, g + 1, g + 1)
                                        : _mm256_setr_epi32(g, g, g + 1, g + 1, g + 2, g + 2, g + 3, g + 3);
            const __m256 bb = _mm256_permutevar8x32_ps(bv, pick);
            const int s0 = (p + g) * K;
            const __m256 e = _mm256_sub_ps(y, _mm256_loadu_ps(table + s0));
            _mm256_storeu_ps(next + s0, _mm256_add_ps(bb, _mm256_mul_ps(e, e)));
        }
    }
}

__attribute__((optimize("fp-contract=off"))) static void trellis_step_2(const float *restrict cost, float *restrict next,
                                                                       uint8_t *restrict back, const float *restrict table,
                                                                       float yt, int P) {
    trellis_step_k(cost, next, back, table, yt, 2, P);
}

__attribute__((optimize("fp-contract=off"))) static void trellis_step_4(const float *restrict cost, float *restrict next,
                                                                       uint8_t *restrict back, const float *restrict table,
                                                                       float yt, int P) {
    trellis_step_k(cost, next, back, table, yt, 4, P);
}

__attribute__((optimize("fp-contract=off"))) static void trellis_step_8(const float *restrict cost, float *restrict next,
                                                                       uint8_t *restrict back, const float *restrict table,
                                                                       float yt, int P) {
    trellis_step_k(cost, next, back, table, yt, 8, P);
}
#endif

#if defined(__AVX512F__)
/* trellis_step_k 16 groups at a time (P % 16 == 0): the same IEEE operations in the same order, so the
 * same costs and choices as the 8-wide step and the scalar loop. */
__attribute__((optimize("fp-contract=off"), always_inline)) static inline void trellis_step16_k(
    const float *restrict cost, float *restrict next, uint8_t *restrict back, const float *restrict table,
    float yt, const int K, const int log2k, int P) {
    const __m512 y = _mm512_set1_ps(yt);
    const __m512i lane_group = _mm512_srli_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), (unsigned)log2k); /* l / K */
    for (int p = 0; p < P; p += 16) {
        __m512 bv = _mm512_loadu_ps(cost + p);
        __m512i fv = _mm512_setzero_si512();
        for (int j = 1; j < K; j++) {
            const __m512 c = _mm512_loadu_ps(cost + j * P + p);
            const __mmask16 lt = _mm512_cmp_ps_mask(c, bv, _CMP_LT_OQ); /* NaN: not less, as in C */
            bv = _mm512_mask_blend_ps(lt, bv, c);
            fv = _mm512_mask_blend_epi32(lt, fv, _mm512_set1_epi32(j));
        }
        _mm_storeu_si128((__m128i *)(back + p), _mm512_cvtepi32_epi8(fv)); /* the 16 choices as bytes */
        for (int i = 0; i < K; i++) { /* the K * 16 states of these 16 groups, 16 at a time */
            const int g = 16 / K * i; /* lane l: state s0 + l of group p + g + l / K */
            const __m512 bb = _mm512_permutexvar_ps(_mm512_add_epi32(lane_group, _mm512_set1_epi32(g)), bv);
            const int s0 = (p + g) * K;
            const __m512 e = _mm512_sub_ps(y, _mm512_loadu_ps(table + s0));
            _mm512_storeu_ps(next + s0, _mm512_add_ps(bb, _mm512_mul_ps(e, e)));
        }
    }
}
#endif

/* One Viterbi pass over y[0..d) (kvquant.trellis._viterbi). history < 0: free start and end.
 * cost / next: [S] floats, back: [d * P] bytes; writes states[0..d) and returns the least error. */
__attribute__((optimize("fp-contract=off"))) static float trellis_pass(
    const float *restrict y, int64_t d, const float *restrict table, int k, int L, int64_t history,
    float *restrict cost, float *restrict next, uint8_t *restrict back, int64_t *restrict states) {
    const int S = 1 << L, K = 1 << k, P = S >> k, shift = L - k;
    for (int s = 0; s < S; s++) {
        const float e = y[0] - table[s];
        const float sq = e * e;
        cost[s] = (history >= 0 && (s >> k) != history) ? INFINITY : sq;
    }
#if defined(__AVX2__)
    const int wide = (K == 2 || K == 4 || K == 8) && P % 8 == 0 && P <= 1024;
#endif
#if defined(__AVX512F__)
    const int wide16 = wide && P % 16 == 0;
#endif
    for (int64_t t = 1; t < d; t++) {
#if defined(__AVX512F__)
        if (wide16) {
            /* K a constant in each call: the j loop unrolls */
            if (K == 8) trellis_step16_k(cost, next, back + t * P, table, y[t], 8, 3, P);
            else if (K == 4) trellis_step16_k(cost, next, back + t * P, table, y[t], 4, 2, P);
            else trellis_step16_k(cost, next, back + t * P, table, y[t], 2, 1, P);
            float *tmp = cost;
            cost = next;
            next = tmp;
            continue;
        }
#endif
#if defined(__AVX2__)
        if (wide) {
            if (K == 8) trellis_step_8(cost, next, back + t * P, table, y[t], P);
            else if (K == 4) trellis_step_4(cost, next, back + t * P, table, y[t], P);
            else trellis_step_2(cost, next, back + t * P, table, y[t], P);
            float *tmp = cost;
            cost = next;
            next = tmp;
            continue;
        }
#endif
        for (int p = 0; p < P; p++) { /* predecessors of the states p*K + b: p | j << shift */
            float best = cost[p];
            int bj = 0;
            for (int j = 1; j < K; j++)
                if (cost[j * P + p] < best) best = cost[j * P + p], bj = j;
            back[t * P + p] = (uint8_t)bj;
            for (int b = 0; b < K; b++) {
                const float e = y[t] - table[p * K + b];
                const float sq = e * e;
                next[p * K + b] = best + sq;
            }
        }
        float *tmp = cost;
        cost = next;
        next = tmp;
    }
    int64_t s = -1;
    float least = INFINITY;
    for (int i = 0; i < S; i++) {
        if (history >= 0 && (i & (P - 1)) != history) continue;
        if (s < 0 || cost[i] < least) least = cost[i], s = i;
    }
    states[d - 1] = s;
    for (int64_t t = d - 1; t > 0; t--) {
        const int64_t p = s >> k;
        s = p | ((int64_t)back[t * P + p] << shift);
        states[t - 1] = s;
    }
    return least;
}

/* Per-thread work space of the search of one head vector of d channels (S = 2**L states, P = S >> k
 * predecessor groups). */
typedef struct {
    float *cost;     /* [2 S]: the costs of one step and of the next */
    uint8_t *back;   /* [d P]: best predecessor of each group at each channel */
    int64_t *states; /* [d]: the path of one pass */
    int64_t *best;   /* [d]: the path kept */
    float *rolled;   /* [d]: the head rotated by d / 2 (first of two passes) */
} trellis_work;

/* Allocate w for heads of d channels; 0, or -1 when out of memory (w freed). */
static int trellis_work_alloc(trellis_work *w, int64_t d, int S, int P) {
    w->cost = malloc(sizeof(float) * 2 * (size_t)S);
    w->back = malloc((size_t)(d * P));
    w->states = malloc(sizeof(int64_t) * 2 * (size_t)d);
    w->best = w->states ? w->states + d : NULL;
    w->rolled = malloc(sizeof(float) * (size_t)d);
    if (w->cost && w->back && w->states && w->rolled) return 0;
    free(w->cost), free(w->back), free(w->states), free(w->rolled);
    memset(w, 0, sizeof(*w));
    return -1;
}

static void trellis_work_free(trellis_work *w) {
    free(w->cost), free(w->back), free(w->states), free(w->rolled);
}

/* The k-bit codes q[0..d) of one head vector y[0..d) (kvquant.trellis.trellis_encode_torch): below
 * two_pass_from channels every history is tried, else two passes (see trellis.py). */
static void trellis_search_row(const float *y, int64_t d, const float *table, int k, int L,
                               int64_t two_pass_from, trellis_work *w, uint8_t *q) {
    const int S = 1 << L, P = S >> k;
    if (d < two_pass_from) {
        float least = INFINITY;
        for (int64_t h = 0; h < P; h++) {
            const float e = trellis_pass(y, d, table, k, L, h, w->cost, w->cost + S, w->back, w->states);
            if (h == 0 || e < least) {
                least = e;
                memcpy(w->best, w->states, sizeof(int64_t) * (size_t)d);
            }
        }
    } else {
        const int64_t r = d / 2; /* rolled[t] = y[(t - r) mod d]: channel d-1 at r-1 */
        for (int64_t t = 0; t < d; t++) w->rolled[t] = y[(t - r + d) % d];
        trellis_pass(w->rolled, d, table, k, L, -1, w->cost, w->cost + S, w->back, w->states);
        const int64_t seam = w->states[r - 1] & (P - 1);
        trellis_pass(y, d, table, k, L, seam, w->cost, w->cost + S, w->back, w->best);
    }
    for (int64_t t = 0; t < d; t++) q[t] = (uint8_t)(w->best[t] & ((1 << k) - 1));
}

/* Codes [n, d] (uint8, k bits each) for y [n, d] (contiguous fp32) with the 2**L-entry table,
 * rows split among threads. Returns 0, or -1 when out of memory. */
int kvq_trellis_encode(const float *y, int64_t n, int64_t d, const float *table, int k, int L,
                       int64_t two_pass_from, uint8_t *codes, int n_threads) {
    int failed = 0;
#pragma omp parallel num_threads(n_threads < 1 ? 1 : n_threads) reduction(| : failed)
    {
        trellis_work w;
        failed = trellis_work_alloc(&w, d, 1 << L, (1 << L) >> k) != 0;
#pragma omp for schedule(static)
        for (int64_t i = 0; i < n; i++)
            if (!failed) trellis_search_row(y + i * d, d, table, k, L, two_pass_from, &w, codes + i * d);
        trellis_work_free(&w);
    }
    return failed ? -1 : 0;
}

/* ---------------------------------------------------------------------------------------------
 * Trellis codes (tcq*) along the token axis: Trellis.encode_groups of kvquant/formats/families.py
 * and the packing, step for step in fp32, nothing fused. Each group's RMS (its sum of squares in
 * torch's order, see torch_sum) rounded up to the scale dtype is the search scale; the whole head
 * vector, in units of its groups' search scales, goes through the Viterbi search above; each group's
 * scale is then stretched so that the dequantized group keeps the input's norm and rounded to the
 * nearest positive value of the dtype (formats.round_nearest_positive); an all-zero group stores 0.
 * As for the codebooks, the square roots here are correctly rounded and torch's are not always:
 * a scale can then differ by an ulp (fp32 scales; a step of a narrower dtype, rarely), with the
 * codes its own search scale gives; the tests hold those groups to equal squared error.
 */

/* Round v > 0 to the nearer of its two neighbours in the scale dtype, never down to 0 (overflow:
 * the dtype's inf / NaN when only that is above, as formats.round_nearest_positive); store it at
 * element i of p and return it as fp32. */
__attribute__((optimize("fp-contract=off"))) static float store_nearest_positive(void *p, int64_t i,
                                                                                  int dtype, float v) {
    const float down = store_scalar(p, i, dtype, v, -1);
    const float up = store_scalar(p, i, dtype, v, +1);
    if (down > 0.0f && v - down < up - v) return store_scalar(p, i, dtype, v, -1);
    return up;
}

/* The table value of each channel of a head vector from its codes q[0..d) (kvquant.trellis
 * trellis_decode): the state of channel t is its code and the m - 1 codes before it, circularly,
 * the newest in the low bits. */
static void trellis_levels(const uint8_t *q, int64_t d, const float *table, int k, int L, float *out) {
    const int m = L / k;
    for (int64_t t = 0; t < d; t++) {
        int64_t s = 0;
        for (int j = m - 1; j >= 0; j--) s = (s << k) | q[(t - j + d) % d];
        out[t] = table[s];
    }
}

/* x [B, H, n, D] -> trellis codes (k bits, packed) / scale at the store's position (strides as
 * kvq_quantize), n_groups scales per head vector; table [2**L] fp32, two_pass_from as
 * kvq_trellis_encode. Returns 0, 1 when an input or a stored scale is not finite (the caller
 * re-runs the torch path, which raises), -1 when out of memory. */
__attribute__((optimize("fp-contract=off"))) int kvq_quantize_trellis(
    const float *x, int64_t B, int64_t H, int64_t n, int64_t D, int64_t xsb, int64_t xsh, int64_t xst,
    uint8_t *codes, int64_t csb, int64_t csh, int64_t cst, void *scale, int64_t ssb, int64_t ssh,
    int64_t sst, int scale_dtype, int k, int L, int n_groups, const float *table, int64_t two_pass_from,
    int n_threads) {
    const int64_t gs = D / n_groups;
    int bad = 0, failed = 0;
#pragma omp parallel num_threads(n_threads < 1 ? 1 : n_threads) reduction(| : bad, failed)
    {
        trellis_work w;
        uint8_t *q = malloc((size_t)D);
        float *y = malloc(sizeof(float) * (size_t)D), *tmp = malloc(sizeof(float) * (size_t)D);
        float *stats = malloc(sizeof(float) * 3 * (size_t)n_groups); /* sum of squares, max|x|, search */
        failed = trellis_work_alloc(&w, D, 1 << L, (1 << L) >> k) != 0 || !q || !y || !tmp || !stats;
#pragma omp for schedule(static)
        for (int64_t r = 0; r < B * H * n; r++) { /* one head vector (row) per step */
            const int64_t b = r / (H * n), h = r / n % H, t = r % n;
            if (failed || bad) continue;
            const float *row = x + b * xsb + h * xsh + t * xst;
            const int64_t si = b * ssb + h * ssh + t * sst;
            float *sumsq = stats, *amax = stats + n_groups, *search = stats + 2 * n_groups;
            for (int64_t g = 0; g < n_groups; g++) { /* the search scales: RMS rounded up */
                bad |= group_squares(row + g * gs, gs, tmp, &amax[g]);
                sumsq[g] = torch_sum(tmp, gs);
                float rms = sqrtf(sumsq[g] / (float)gs);
                if (rms == 0.0f) rms = 1.0f;
                search[g] = store_scalar(scale, si + g, scale_dtype, rms, +1);
                bad |= !isfinite(search[g]);
                for (int64_t d = 0; d < gs; d++) y[g * gs + d] = row[g * gs + d] / search[g];
            }
            if (bad) continue;
            trellis_search_row(y, D, table, k, L, two_pass_from, &w, q);
            trellis_levels(q, D, table, k, L, y);
            for (int64_t g = 0; g < n_groups; g++) { /* stretch to the input's norm */
                for (int64_t d = 0; d < gs; d++) tmp[d] = y[g * gs + d] * y[g * gs + d];
                const float norm_l = sqrtf(torch_sum(tmp, gs)), norm_x = sqrtf(sumsq[g]);
                const float raw = norm_l > 0.0f ? norm_x / norm_l : search[g];
                const float s = store_nearest_positive(scale, si + g, scale_dtype, raw);
                if (amax[g] == 0.0f) store_scalar(scale, si + g, scale_dtype, 0.0f, +1); /* exact zeros */
                else bad |= !isfinite(s);
            }
            pack_row(q, k, D, codes + b * csb + h * csh + t * cst);
        }
        trellis_work_free(&w);
        free(q), free(y), free(tmp), free(stats);
    }
    return failed ? -1 : bad;
}

/* ---------------------------------------------------------------------------------------------
 * A store's write described once (mirrored by Writer in build.py): its buffers at token 0 and
 * how its format quantizes, so a decode step's write is one call with the rows and an index.
 */
typedef struct {
    uint8_t *codes;                   /* [B, H, cap, W] at token 0 */
    int64_t csb, csh, cst;            /* element (= byte) strides */
    void *scale, *zero;               /* [B, H, cap, ng] at token 0; zero NULL where none */
    int64_t ssb, ssh, sst;            /* element strides of scale (zero: the same layout) */
    int32_t kind;                     /* 0 integer, 1 codebook, 2 fp8, 3 trellis */
    int32_t scale_dtype, bits, is_signed, n_groups;
    int32_t mant, bias;               /* fp8 */
    int32_t state_bits, n_grid;       /* trellis L; codebook search grid size */
    float qmax;                       /* codebook, fp8 */
    const float *levels, *grid;       /* codebook levels [16], search grid [n_grid] */
    const float *table;               /* trellis state table [2**L] */
    int64_t two_pass_from;            /* trellis */
    int64_t block;                    /* integer: tokens per scale row (channel axis), else 1 */
} kvq_writer;

static int64_t scale_bytes(int dtype) { return dtype == 0 ? 4 : (dtype == 3 ? 1 : 2); }

/* x [B, H, n, D] (element strides, D contiguous) into w's buffers at token `index`: the entry point
 * of w's kind, with the same results and return codes. */
int kvq_write(const kvq_writer *w, const float *x, int64_t B, int64_t H, int64_t n, int64_t D, int64_t xsb,
              int64_t xsh, int64_t xst, int64_t index, int n_threads) {
    uint8_t *codes = w->codes + index * w->cst;
    const int64_t off = index / (w->block > 1 ? w->block : 1) * w->sst * scale_bytes(w->scale_dtype);
    void *scale = (char *)w->scale + off, *zero = w->zero ? (char *)w->zero + off : scale;
    switch (w->kind) {
    case 0:
        return kvq_quantize(x, B, H, n, D, xsb, xsh, xst, codes, w->csb, w->csh, w->cst, scale, zero, w->ssb,
                            w->ssh, w->sst, w->scale_dtype, w->bits, w->is_signed, w->n_groups, w->block);
    case 1:
        return kvq_quantize_codebook(x, B, H, n, D, xsb, xsh, xst, codes, w->csb, w->csh, w->cst, scale, w->ssb,
                                     w->ssh, w->sst, w->scale_dtype, w->bits, w->n_groups, w->levels, w->grid,
                                     w->n_grid, w->qmax, n_threads);
    case 2:
        return kvq_quantize_fp8(x, B, H, n, D, xsb, xsh, xst, codes, w->csb, w->csh, w->cst, scale, w->ssb,
                                w->ssh, w->sst, w->scale_dtype, w->n_groups, w->mant, w->bias, w->qmax);
    default:
        return kvq_quantize_trellis(x, B, H, n, D, xsb, xsh, xst, codes, w->csb, w->csh, w->cst, scale, w->ssb,
                                    w->ssh, w->sst, w->scale_dtype, w->bits, w->state_bits, w->n_groups,
                                    w->table, w->two_pass_from, n_threads);
    }
}

/* fp32 -> fp16 (dtype 1) / bf16 (2) -> fp32, round to nearest even: what torch's .to() does. */
static float through_half(float x, int dtype) {
    if (dtype == 1) return (float)(_Float16)x;
    uint32_t u;
    memcpy(&u, &x, sizeof(u));
    u = ((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16) << 16;
    float y;
    memcpy(&y, &u, sizeof(y));
    return y;
}

/* Tokens [i0, i0 + n) of src dequantized (kvq_dequantize), rounded through `via` (0 fp32: as they
 * are; 1 fp16, 2 bf16: the dtype a layer holds them in), then written into dst at token `index`
 * (kvq_write): what a tier's oldest tokens cost moving to the next tier, in one call. Returns
 * kvq_write's code, -1 when out of memory. */
int kvq_transcode(const kvq_operand *src, int64_t B, int64_t H, int64_t i0, int64_t n, int64_t D,
                  const kvq_writer *dst, int64_t index, int via, int n_threads) {
    float *rows = malloc(sizeof(float) * (size_t)(B * H * n * D));
    if (!rows) return -1;
    kvq_dequantize(src, B, H, i0, n, D, rows);
    if (via)
        for (int64_t i = 0; i < B * H * n * D; i++) rows[i] = through_half(rows[i], via);
    const int rc = kvq_write(dst, rows, B, H, n, D, H * n * D, n * D, D, index, n_threads);
    free(rows);
    return rc;
}

/* One decode step's append of a cache layer (one token per row), in one call:
 *   1. tail_row >= 0: the new token k / v [B, H, 1, D] (element strides ksb / ksh, vsb / vsh; D
 *      contiguous) is copied into the full-precision tail at row `tail_row` of tail_k / tail_v;
 *   2. leave_row >= 0: the tail's row `leave_row` (the token leaving it), or with leave_row
 *      KVQ_STEP_NEW_TOKEN (-2) the new token itself (a layer with no tail), is put into the stored
 *      space as kvq_rotate_pair does (keys minus mean, divided by std, each where given; then, with
 *      rot_scale > 0, both rotated by fwht_row) and written into the first tier at `first_index`
 *      (first_k / first_v, kvq_write);
 *   3. move_from >= 0: token `move_from` of the first tier (move_src_k / _v) is transcoded into the
 *      main store at `move_to` (move_dst_k / _v, kvq_transcode through fp32).
 * The same operations, in the same order, as the cache's Python path makes them one op at a time,
 * so the same bits. Returns 0; -1 out of memory; 5 when k or v holds a NaN or an Inf (checked
 * first: nothing written); else the stage whose write refused its values (1 first_k, 2 first_v, 3
 * the move's keys, 4 its values), the stages before it done. */
#define KVQ_STEP_NEW_TOKEN (-2)

typedef struct {
    float *tail_k, *tail_v;           /* [B, H, cap, D] fp32 */
    int64_t tsb, tsh, tst;            /* element strides of both tails */
    int64_t B, H, D;
    const float *mean, *std;          /* [B, H, 1, D] contiguous, or NULL */
    float rot_scale;                  /* > 0: the stored space is rotated */
    int32_t first_threads, move_threads;
    float *scratch;                   /* [2, B, H, D] */
    const kvq_writer *first_k, *first_v;
    const kvq_operand *move_src_k, *move_src_v; /* NULL: no move (no recent window) */
    const kvq_writer *move_dst_k, *move_dst_v;
} kvq_step;

int kvq_append_step(const kvq_step *s, const float *k, int64_t ksb, int64_t ksh, const float *v, int64_t vsb,
                    int64_t vsh, int64_t tail_row, int64_t leave_row, int64_t first_index, int64_t move_from,
                    int64_t move_to) {
    const int64_t B = s->B, H = s->H, D = s->D;
    int bad = 0; /* the states' finiteness, before anything is written */
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < H; h++) {
            const float *xk = k + b * ksb + h * ksh, *xv = v + b * vsb + h * vsh;
            for (int64_t j = 0; j < D; j++) bad |= !isfinite(xk[j]) | !isfinite(xv[j]);
        }
    if (bad) return 5;
    if (tail_row >= 0)
        for (int64_t b = 0; b < B; b++)
            for (int64_t h = 0; h < H; h++) {
                const int64_t t = b * s->tsb + h * s->tsh + tail_row * s->tst;
                memcpy(s->tail_k + t, k + b * ksb + h * ksh, sizeof(float) * (size_t)D);
                memcpy(s->tail_v + t, v + b * vsb + h * vsh, sizeof(float) * (size_t)D);
            }
    if (leave_row >= 0 || leave_row == KVQ_STEP_NEW_TOKEN) {
        float *rk = s->scratch, *rv = s->scratch + B * H * D;
        const int direct = leave_row == KVQ_STEP_NEW_TOKEN;
        for (int64_t b = 0; b < B; b++)
            for (int64_t h = 0; h < H; h++) {
                const int64_t t = b * s->tsb + h * s->tsh + leave_row * s->tst, r = (b * H + h) * D;
                const float *xk = direct ? k + b * ksb + h * ksh : s->tail_k + t;
                const float *xv = direct ? v + b * vsb + h * vsh : s->tail_v + t;
                const float *m = s->mean ? s->mean + r : NULL, *sd = s->std ? s->std + r : NULL;
                for (int64_t j = 0; j < D; j++) rk[r + j] = m ? xk[j] - m[j] : xk[j];
                if (sd)
                    for (int64_t j = 0; j < D; j++) rk[r + j] = rk[r + j] / sd[j];
                memcpy(rv + r, xv, sizeof(float) * (size_t)D);
                if (s->rot_scale > 0.0f) {
                    fwht_row(rk + r, D, s->rot_scale);
                    fwht_row(rv + r, D, s->rot_scale);
                }
            }
        int rc = kvq_write(s->first_k, rk, B, H, 1, D, H * D, D, D, first_index, s->first_threads);
        if (rc) return rc < 0 ? -1 : 1;
        rc = kvq_write(s->first_v, rv, B, H, 1, D, H * D, D, D, first_index, s->first_threads);
        if (rc) return rc < 0 ? -1 : 2;
    }
    if (move_from >= 0 && s->move_src_k) {
        int rc = kvq_transcode(s->move_src_k, B, H, move_from, 1, D, s->move_dst_k, move_to, 0, s->move_threads);
        if (rc) return rc < 0 ? -1 : 3;
        rc = kvq_transcode(s->move_src_v, B, H, move_from, 1, D, s->move_dst_v, move_to, 0, s->move_threads);
        if (rc) return rc < 0 ? -1 : 4;
    }
    return 0;
}
