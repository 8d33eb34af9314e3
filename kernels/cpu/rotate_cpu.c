/* The Hadamard rotation of head vectors: the cpu backend of kvquant.kernels.ops.rotate.
 *
 * kvq_rotate: y [n, d] = x [n, d] @ H (H the normalized Walsh-Hadamard matrix, block-diagonal in
 * blocks of the largest power of two dividing d), as fwht_row in kvq_common.h, pass for pass with
 * kvquant.kernels.reference.rotate_ref; `scale` is 1 / sqrt(block) rounded to fp32. Each step is one IEEE addition, subtraction or product in the same order as the twin's, so the
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
