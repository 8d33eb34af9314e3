/* The Hadamard rotation of head vectors: the cpu backend of kvquant.kernels.ops.rotate.
 *
 * kvq_rotate: y [n, d] = x [n, d] @ H (H the normalized Walsh-Hadamard matrix, block-diagonal in
 * blocks of the largest power of two dividing d), as fwht_row in kvq_common.h, pass for pass with
 * kvquant.kernels.reference.rotate_ref; `scale` is 1 / sqrt(block) rounded to fp32. Each step is one IEEE addition, subtraction or product in the same order as the twin's, so the
 * result equals it bit for bit, whatever the vector width the compiler picks. Rows are independent:
 * they are split among threads.
 *
 * kvq_rotate_pair: the key transform of a decode step's keys and values in one call (the cpu backend
 * of ops.rotate_pair): out[0] = ((k - mean) / std) @ H, out[1] = v @ H, k / v [B, H, n, d] at element
 * strides (sb, sh, st; unit along d), mean / std [B, H, d] or NULL, out [2, B, H, n, d] contiguous.
 * The subtraction and division are the twin's IEEE operations, then fwht_row: bit for bit the same.
 */

#include <stdint.h>
#include <string.h>

#include "kvq_common.h"

void kvq_rotate(const float *x, int64_t xs, float *y, int64_t n, int64_t d, float scale, int n_threads) {
#pragma omp parallel for num_threads(n_threads < 1 ? 1 : n_threads) schedule(static) if (n_threads > 1)
    for (int64_t i = 0; i < n; i++) {
        float *r = y + i * d;
        memcpy(r, x + i * xs, sizeof(float) * (size_t)d);
        fwht_row(r, d, scale);
    }
}

void kvq_rotate_pair(const float *k, int64_t ksb, int64_t ksh, int64_t kst, const float *v, int64_t vsb,
                     int64_t vsh, int64_t vst, int64_t B, int64_t H, int64_t n, int64_t d, const float *mean,
                     const float *std, float scale, float *out) {
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < H; h++) {
            const float *m = mean ? mean + (b * H + h) * d : NULL, *s = std ? std + (b * H + h) * d : NULL;
            for (int64_t t = 0; t < n; t++) {
                float *rk = out + ((b * H + h) * n + t) * d, *rv = rk + B * H * n * d;
                const float *xk = k + b * ksb + h * ksh + t * kst, *xv = v + b * vsb + h * vsh + t * vst;
                for (int64_t j = 0; j < d; j++) rk[j] = m ? xk[j] - m[j] : xk[j];
                if (s)
                    for (int64_t j = 0; j < d; j++) rk[j] = rk[j] / s[j];
                memcpy(rv, xv, sizeof(float) * (size_t)d);
                fwht_row(rk, d, scale);
                fwht_row(rv, d, scale);
            }
        }
}
