"""The trellis search on the GPU: a Triton Viterbi kernel, the twin of ``trellis_encode_torch``.

``viterbi_kernel``, grid ``(cdiv(rows, BN),)``: program ``i`` runs the Viterbi algorithm for ``BN``
rows at once (a row is one head vector, or one head vector under one fixed history). It keeps the
path costs of all ``S = 2**L`` states in registers ``[BN, S]``; per channel ``t`` it takes, for each
group of states sharing their ``m - 1`` older codes (``P = S >> K`` groups), the least cost over the
``2**K`` predecessors (``tl.min`` with indices, ties to the first like torch), stores that choice
as a back pointer (one byte per row, channel and group, in a global scratch ``[rows, D - 1, P]``),
and adds ``(y_t - table[s])**2``. A closed circle (``HIST``) fixes the start's history and requires
the end's. The back trace reads the scratch (after a barrier) and writes the codes
``[rows, D]`` and the path's squared error ``[rows]``.

:func:`trellis_encode_triton` is the search of :func:`kvquant.formats.trellis.trellis_encode` with
this kernel: heads under ``TWO_PASS_FROM`` channels run every history (``P`` rows per vector) and
keep the least error; longer ones run the two passes (the rotated vector free, then the vector
closed on the seam's codes). Everything between the passes is device torch: no per-channel Python
loop, no host sync. The sums are the same fp32 operations in the same order as the torch search
(built without FMA contraction), so the codes are the same; where two paths tie to the last bit on
the GPU's arithmetic they may differ with equal squared error.

Example:
    >>> y = torch.randn(4, 64, device="cuda")                       # doctest: +SKIP
    >>> trellis_encode_triton(y, 2).shape                           # doctest: +SKIP
    torch.Size([4, 64])
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kvquant.formats.trellis import TRELLIS_STATE_BITS, TWO_PASS_FROM, check_channels, trellis_table

SCRATCH_BYTES = 64 << 20  # back pointers per launch; vectors are searched in chunks that fit


@triton.jit
def viterbi_kernel(p_y, p_table, p_hist, p_codes, p_err, p_back, N, D, stride_yn, stride_yd,
                   stride_cn, stride_cd, BN: tl.constexpr, K: tl.constexpr, L: tl.constexpr,
                   HIST: tl.constexpr, PER_VECTOR: tl.constexpr):  # fmt: skip
    """Rows ``o_n``; with ``PER_VECTOR > 1`` row ``r`` is vector ``r // PER_VECTOR`` under history
    ``r % PER_VECTOR`` (every history of a short head), else history ``p_hist[r]`` (``HIST``) or none."""
    S: tl.constexpr = 1 << L
    NB: tl.constexpr = 1 << K
    P: tl.constexpr = S >> K
    i_p = tl.program_id(0)
    o_n = (i_p * BN + tl.arange(0, BN)).to(tl.int64)  # [BN] rows
    m_n = o_n < N
    o_s = tl.arange(0, S)
    o_p = tl.arange(0, P)
    b_tab = tl.load(p_table + o_s)  # [S]
    if PER_VECTOR > 1:
        o_v = o_n // PER_VECTOR
        b_h = (o_n % PER_VECTOR).to(tl.int32)
    else:
        o_v = o_n
        if HIST:
            b_h = tl.load(p_hist + o_n, mask=m_n, other=0).to(tl.int32)  # [BN]
    p_y = p_y + o_v * stride_yn
    b_y = tl.load(p_y, mask=m_n, other=0.0)  # [BN] channel 0
    b_d = b_y[:, None] - b_tab[None, :]
    b_cost = b_d * b_d  # [BN, S]
    if HIST:
        b_cost = tl.where((o_s >> K)[None, :] == b_h[:, None], b_cost, float("inf"))
    p_b = p_back + o_n[:, None] * ((D - 1) * P) + o_p[None, :]  # [BN, P]
    for t in range(1, D):
        b_best, b_j = tl.min(tl.reshape(b_cost, (BN, NB, P)), axis=1, return_indices=True)  # [BN, P]
        tl.store(p_b + (t - 1) * P, b_j.to(tl.uint8), mask=m_n[:, None])
        b_y = tl.load(p_y + t * stride_yd, mask=m_n, other=0.0)
        b_d = b_y[:, None] - b_tab[None, :]
        b_sq = tl.reshape(b_d * b_d, (BN, P, NB))  # state p << K | b
        b_cost = tl.reshape(tl.reshape(b_best, (BN, P, 1)) + b_sq, (BN, S))
    if HIST:
        b_cost = tl.where((o_s & (P - 1))[None, :] == b_h[:, None], b_cost, float("inf"))
    b_least, b_s = tl.min(b_cost, axis=1, return_indices=True)  # [BN]
    tl.store(p_err + o_n, b_least, mask=m_n)
    tl.debug_barrier()  # the back pointers of every thread are written
    p_c = p_codes + o_n * stride_cn
    tl.store(p_c + (D - 1) * stride_cd, (b_s & (NB - 1)).to(tl.uint8), mask=m_n)
    p_b = p_back + o_n * ((D - 1) * P)
    for i in range(1, D):
        t = D - i  # channel t -> t - 1
        b_pp = b_s >> K
        b_j = tl.load(p_b + (t - 1) * P + b_pp, mask=m_n, other=0).to(tl.int32)
        b_s = b_pp | (b_j << (L - K))
        tl.store(p_c + (t - 1) * stride_cd, (b_s & (NB - 1)).to(tl.uint8), mask=m_n)


def _viterbi(y: torch.Tensor, table: torch.Tensor, bits: int, hist: torch.Tensor | None, per_vector: int):
    """Codes ``[rows, D]`` (uint8) and squared errors ``[rows]`` of the rows of ``y[N, D]`` (fp32)."""
    n, d = y.shape
    state_bits = TRELLIS_STATE_BITS[bits]
    rows = n * per_vector
    p = 1 << (state_bits - bits)
    codes = torch.empty(rows, d, dtype=torch.uint8, device=y.device)
    err = torch.empty(rows, dtype=torch.float32, device=y.device)
    back = torch.empty(rows, max(d - 1, 1), p, dtype=torch.uint8, device=y.device)  # [rows, D - 1, P]
    bn = max(1, 4096 >> state_bits)
    viterbi_kernel[(triton.cdiv(rows, bn),)](
        y, table, hist if hist is not None else err, codes, err, back, rows, d, *y.stride(), *codes.stride(),
        BN=bn, K=bits, L=state_bits, HIST=hist is not None or per_vector > 1, PER_VECTOR=per_vector,
        enable_fp_fusion=False,
    )  # fmt: skip
    return codes, err


@functools.cache
def _history_shifts(m: int, bits: int, device: torch.device) -> torch.Tensor:
    """``[m - 1]`` int32: the bit offset in the history word of the codes of channels ``r - m + 1 .. r - 1``."""
    return torch.tensor([(m - 2 - i) * bits for i in range(m - 1)], dtype=torch.int32, device=device)


def trellis_encode_triton(y: torch.Tensor, bits: int) -> torch.Tensor:
    """``bits``-bit trellis codes ``[N, D]`` (uint8) of ``y[N, D]`` (units of the scale) with the Triton
    Viterbi kernel: the codes of :func:`kvquant.formats.trellis.trellis_encode` (an ``Encoder``)."""
    n, d = y.shape
    check_channels(d, bits)
    table = trellis_table(bits, y.device)
    m = TRELLIS_STATE_BITS[bits] // bits
    n_hist = table.numel() >> bits
    y = y.float().contiguous()
    out = torch.empty(n, d, dtype=torch.uint8, device=y.device)
    exact = d < TWO_PASS_FROM
    per_row = n_hist * n_hist * max(d - 1, 1) if exact else 2 * n_hist * max(d - 1, 1)
    chunk = max(1, SCRATCH_BYTES // per_row)
    for i in range(0, n, chunk):
        yc = y[i : i + chunk]
        c = yc.shape[0]
        if exact:  # every history: the best closed circle
            codes, err = _viterbi(yc, table, bits, None, n_hist)  # [c * H, D]
            pick = err.view(c, n_hist).argmin(1) + torch.arange(c, device=y.device) * n_hist
            out[i : i + c] = codes[pick]
        else:  # the seam's m - 1 codes from a pass over the rotated circle, then the closed pass
            r = d // 2
            first, _ = _viterbi(torch.roll(yc, r, dims=1), table, bits, None, 1)
            # the codes of channels D-1, D-2, ... (rotated: r-1, r-2, ...) at bits 0, bits, ...: one word
            hist = (first[:, r - m + 1 : r].to(torch.int32) << _history_shifts(m, bits, y.device)).sum(
                1, dtype=torch.int32
            )
            out[i : i + c] = _viterbi(yc, table, bits, hist, 1)[0]
    return out
