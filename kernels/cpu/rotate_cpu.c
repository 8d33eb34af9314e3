/* The Hadamard rotation of head vectors: the cpu backend of kvquant.kernels.ops.rotate.
 *
 * kvq_rotate: y [n, d] = x [n, d] @ H_d / sqrt(d) (H_d the Walsh-Hadamard matrix, d a power of two),
 * as the fast transform of kvquant.kernels.reference.rotate_ref, pass for pass: for h = 1, 2, ...,
 * d / 2, each block of 2h channels turns its pairs (j, j + h) into (a + b, a - b); then every value is
 * multiplied by `scale` (1 / sqrt(d) rounded to fp32, as torch multiplies an fp32 tensor by it).
 * Each step is one IEEE addition, subtraction or product in the same order as the twin's, so the
 * result equals it bit for bit, whatever the vector width the compiler picks. Rows are independent:
 * they are split among threads.
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
