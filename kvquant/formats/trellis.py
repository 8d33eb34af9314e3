"""Tail-biting bit-shift trellis codes (``tcq1`` / ``tcq2`` / ``tcq3``): vector quantization of a head vector.

A scalar codebook (``nuq2``) picks each channel's level on its own. A trellis code spends the same
``k`` bits per channel but lets each channel's level depend on the ``m - 1`` previous channels'
codes too (QTIP-style bit-shift trellis): the *state* of channel ``t`` is the ``L = m * k``-bit word

    ``s_t = b_t | b_(t-1) << k | ... | b_(t-m+1) << (m-1)k``   (``b_t``: the ``k``-bit code of channel t)

and channel ``t`` is rebuilt as ``table[s_t] * scale``. The codes of a head vector are read as a
circle (``b_(-1) = b_(D-1)``; *tail-biting*), so no extra bits are stored: ``k`` bits per channel,
exactly like ``nuq{k}``. The table has ``2**L`` entries, trained by Lloyd's iteration on standard
normal vectors (what the Hadamard rotation makes head vectors look like), so the encoder picks, by
the Viterbi algorithm, the sequence of codes with the least squared error over the whole vector.

On standard normal vectors of 64 channels the mean squared error per channel is about 0.078 for
``tcq2`` (L = 8; the 2-bit Lloyd-Max scalar codebook: 0.1175; the rate-distortion bound: 0.0625),
0.020 for ``tcq3`` (L = 9; Lloyd-Max 3-bit: 0.0345; bound 0.0156) and 0.29 for ``tcq1`` (L = 8:
a state spans 8 channels; 1-bit Lloyd-Max, the sign: 0.363; bound 0.25), the format that takes a
cache below 2 bits. Reading costs one table lookup per channel.

From 64 channels on, the encoder runs two Viterbi passes: one over the vector rotated by ``D / 2``
channels (so the seam lies inside the path), which fixes the ``m - 1`` codes that wrap around, and
one with those codes as the history before channel 0 and the required end (exactly optimal under
that constraint); on 64 channels its total error is within ~0.3% (tcq3), ~0.7% (tcq2) and ~1.6%
(tcq1: the closed pass is held to 7 codes) of the exact circular optimum. Shorter
heads try every history (``2**(L - k)`` constrained passes) and get the exact optimum. This module
is the spec, in torch; the C twin (``kvq_trellis_encode`` in ``kernels/cpu/decode_cpu.c``, the same
codes) is a backend of ``kvquant.kernels.ops.encode``, which the cache's write path uses on CPU.

Example:
    >>> y = torch.randn(5, 64)
    >>> codes = trellis_encode(y, 2)             # [5, 64] uint8, 2-bit codes
    >>> yhat = trellis_decode(codes, 2)           # [5, 64] fp32 table values
    >>> float((yhat - y).pow(2).mean()) < 0.1
    True
"""

from __future__ import annotations

import functools

import torch

from kvquant.formats.trellis_tables import TABLES

# bits per channel -> state bits L (a multiple of the bits)
TRELLIS_STATE_BITS = {1: 8, 2: 8, 3: 9}
_CHUNK = 2048  # vectors per Viterbi batch (back pointers: 8 * D * chunk * 2**(L-k) bytes)
TWO_PASS_FROM = 64  # head sizes from which the two-pass search replaces trying every history


def trellis_table(bits: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The ``[2**L]`` fp32 reconstruction table of the ``bits``-per-channel trellis (do not modify)."""
    if bits not in TABLES:
        raise ValueError(
            f"bits: trellis codes exist for {', '.join(map(str, sorted(TABLES)))} bits, not {bits}"
        )
    return _table(bits, str(device))


@functools.lru_cache(maxsize=16)
def _table(bits: int, device: str) -> torch.Tensor:
    return torch.tensor(TABLES[bits], dtype=torch.float32, device=device)


def trellis_states(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes ``[..., D]`` (``bits``-bit, any integer dtype) -> states ``[..., D]`` (int64, circular)."""
    m = TRELLIS_STATE_BITS[bits] // bits
    c = codes.long()
    states = c.clone()
    for j in range(1, m):
        states |= torch.roll(c, j, dims=-1) << (bits * j)
    return states


def trellis_decode(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes ``[..., D]`` -> table values ``[..., D]`` (fp32, in units of the scale)."""
    return trellis_table(bits, codes.device)[trellis_states(codes, bits)]


def _viterbi(
    y: torch.Tensor, table: torch.Tensor, bits: int, history: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Least-squared-error states ``[N, D]`` (int64) for ``y[N, D]``, and that error ``[N]`` (fp32,
    summed channel by channel).

    ``history`` (``[N]``, the ``(m-1) * bits``-bit word of the codes before channel 0) fixes the
    start and requires the path to end on the same codes (a closed circle); ``None`` leaves both
    free. States sharing ``s >> bits`` share their predecessors, so each step takes one min over
    ``2**bits`` candidates per group, not per state.
    """
    n, d = y.shape
    k = bits
    n_states = table.numel()
    n_groups = n_states >> k  # states s = p << k | b share predecessors p | j << (L - k)
    low_mask = n_groups - 1  # the last (m - 1) codes of a state
    inf = torch.tensor(float("inf"), device=y.device)
    cost = (y[:, :1] - table) ** 2  # [N, S]
    if history is not None:
        start = (torch.arange(n_states, device=y.device) >> k)[None, :] == history[:, None]
        cost = torch.where(start, cost, inf)
    tv = table.view(n_groups, 1 << k)
    back = []  # back[t - 1]: [N, P] the best predecessor (its top code) of each group at channel t
    for t in range(1, d):
        best, j = cost.view(n, 1 << k, n_groups).min(1)  # [N, P]
        back.append(j)
        cost = (best[:, :, None] + (y[:, t, None, None] - tv) ** 2).view(n, n_states)
    if history is not None:
        end = (torch.arange(n_states, device=y.device) & low_mask)[None, :] == history[:, None]
        cost = torch.where(end, cost, inf)
    least, s = cost.min(-1, keepdim=True)  # [N, 1]
    states = torch.empty(n, d, dtype=torch.long, device=y.device)
    states[:, -1:] = s
    shift = (n_states.bit_length() - 1) - k
    for t in range(d - 1, 0, -1):
        p = s >> k
        s = p | (back[t - 1].gather(1, p) << shift)
        states[:, t - 1 : t] = s
    return states, least[:, 0]


def trellis_encode(y: torch.Tensor, bits: int, table: torch.Tensor | None = None) -> torch.Tensor:
    """``bits``-bit codes ``[N, D]`` (uint8) of the tail-biting trellis for ``y[N, D]`` (fp32, units of
    the scale): the circle of states they decode to follows the least-squared-error path (exactly for
    ``D < 64``, where every history is tried; by two Viterbi passes from 64 channels on, see the
    module docstring). ``D`` must be at least the ``m`` codes of a state. ``table``: another
    ``[2**L]`` table than the shipped one (training)."""
    table = trellis_table(bits, y.device) if table is None else table
    check_channels(y.shape[-1], bits)
    return trellis_encode_torch(y, bits, table)


def check_channels(d: int, bits: int) -> None:
    """``ValueError`` unless a head of ``d`` channels holds the ``m`` codes of a state."""
    m = TRELLIS_STATE_BITS[bits] // bits
    if d < m:
        raise ValueError(f"head_dim: trellis codes of {bits} bits need at least {m} channels, got {d}")


def trellis_encode_torch(y: torch.Tensor, bits: int, table: torch.Tensor) -> torch.Tensor:
    """The torch search of :func:`trellis_encode` (the C encoder ``kvq_trellis_encode`` is its twin)."""
    n, d = y.shape
    n_hist = table.numel() >> bits  # words of the m - 1 codes before channel 0
    out = torch.empty(n, d, dtype=torch.uint8, device=y.device)
    exact = d < TWO_PASS_FROM
    chunk = max(_CHUNK // n_hist, 1) if exact else _CHUNK
    for i in range(0, n, chunk):
        yc = y[i : i + chunk].float()
        if exact:  # every history, the best closed circle
            c = yc.shape[0]
            hist = torch.arange(n_hist, device=y.device).repeat(c)  # [c * H]
            states, err = _viterbi(yc.repeat_interleave(n_hist, 0), table, bits, hist)  # [c * H, D]
            pick = err.view(c, n_hist).argmin(1) + torch.arange(c, device=y.device) * n_hist
            states = states[pick]
        else:  # the first pass reads the circle across the seam, fixing the codes that wrap around
            r = d // 2
            seam = _viterbi(torch.roll(yc, r, dims=1), table, bits, None)[0][:, r - 1]  # channel D-1
            states = _viterbi(yc, table, bits, seam & (n_hist - 1))[0]
        out[i : i + chunk] = (states & ((1 << bits) - 1)).to(torch.uint8)
    return out


def train_trellis_table(
    bits: int, *, iterations: int, vectors: int, head_dim: int = 64, seed: int = 0
) -> list[float]:
    """Lloyd's iteration for the ``bits``-per-channel table (how ``kvquant/formats/trellis_tables.py`` is made).

    Starts from the normal quantiles of ``2**L`` evenly spaced probabilities in a random order; each
    iteration encodes ``vectors`` fresh standard normal vectors of ``head_dim`` channels with the
    current table and moves every entry to the mean of the values its state coded (kept where none).
    """
    n_states = 1 << TRELLIS_STATE_BITS[bits]
    gen = torch.Generator().manual_seed(seed)
    probs = (torch.randperm(n_states, generator=gen).double() + 0.5) / n_states
    table = torch.distributions.Normal(0.0, 1.0).icdf(probs)  # [S] float64
    for _ in range(iterations):
        y = torch.randn(vectors, head_dim, generator=gen)
        states = trellis_states(trellis_encode(y, bits, table.float()), bits).flatten()
        sums = torch.zeros(n_states, dtype=torch.float64).index_add_(0, states, y.flatten().double())
        counts = torch.bincount(states, minlength=n_states).double()
        table = torch.where(counts > 0, sums / counts.clamp_min(1), table)
    return table.tolist()


def _write_tables(path: str, iterations: int, vectors: int) -> None:
    lines = [
        '"""Reconstruction tables of the trellis codes (:mod:`kvquant.formats.trellis`). Generated, do not edit:',
        f"``python -m kvquant.formats.trellis`` ({iterations} Lloyd iterations of {vectors} standard normal",
        'vectors of 64 channels each; see ``train_trellis_table``)."""',
        "",
        "# fmt: off",
        "TABLES = {",
    ]
    tables = {
        bits: train_trellis_table(bits, iterations=iterations, vectors=vectors) for bits in TRELLIS_STATE_BITS
    }
    for bits, table in tables.items():
        lines.append(f"    {bits}: [")
        lines += [
            "        " + ", ".join(f"{v:.6f}" for v in table[i : i + 8]) + ","
            for i in range(0, len(table), 8)
        ]
        lines.append("    ],")
    lines += ["}", "# fmt: on"]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":  # regenerate the tables
    from pathlib import Path

    _write_tables(str(Path(__file__).with_name("trellis_tables.py")), iterations=30, vectors=16384)
