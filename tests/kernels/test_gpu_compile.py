"""The kernels compile for sm_90 (Hopper) even on a machine without a GPU.

The interpreter runs the kernels' Python, not Triton's compiler: layouts, ``tl.dot`` shape rules,
``join`` / ``permute`` / ``reshape`` lowering or register allocation can still break a GPU build.
Triton ships ``ptxas``, so the whole pipeline (TTIR -> TTGIR -> LLVM -> PTX -> cubin) runs on CPU.
It runs in a subprocess because this session's kernels were decorated for the interpreter.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

SCRIPT = textwrap.dedent(
    r"""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kvquant.kernels.triton import decode_kernels as da, dequantize as dq, quantize as qz, trellis as tk
    from kvquant.kernels.triton import trellis_write as tw

    def build(fn, ptrs, floats, consts, num_warps):
        sig = {}
        for name in fn.arg_names:
            if name in consts:
                sig[name] = "constexpr"
            elif name in ptrs:
                sig[name] = ptrs[name]
            elif name in floats:
                sig[name] = "fp32"
            else:
                sig[name] = "i64" if name.startswith("stride") else "i32"
        constexprs = {(fn.arg_names.index(k),): v for k, v in consts.items()}
        src = ASTSource(fn=fn, signature=sig, constexprs=constexprs)
        return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})

    def decode(q, kc, vc, **c):
        scales = "*u8" if c.get("K_SFP8") else "*fp16"
        ptrs = dict(p_q=q, p_kc=kc, p_vc=vc, p_ks=scales, p_kz=scales, p_vs=scales, p_vz=scales,
                    p_klut="*fp32", p_vlut="*fp32", p_start="*i64", p_valid="*u8", p_o="*fp32", p_lse="*fp32")
        base = dict(GQ=4, GQP=16, D=128, BT=64, K_BITS=8, V_BITS=8, K_FP8=0, V_FP8=0, K_LUT=0, V_LUT=0, K_M=1,
                    V_M=1, K_SFP8=False, V_SFP8=False, K_MODE=0, V_MODE=0, K_CHANNEL=False, K_G=128, V_G=128,
                    K_SCALE=True, K_ZERO=False, V_SCALE=True, V_ZERO=False, Q_SPLIT=False, SOFTCAP=False,
                    F32_DOT="tf32x3", VALID=False)
        base.update(c)
        return build(da.decode_attention_split_kernel, ptrs, ("scaling", "softcap"), base, 8)

    def quant(x, codes, scale, **c):
        ptrs = dict(p_x=x, p_codes=codes, p_scale=scale, p_zero=scale, p_levels="*fp32", p_edges="*fp32",
                    p_grid="*fp32", p_flag="*i32")
        base = dict(D=128, G=128, BT=16, CHANNEL=False, KIND=1, BITS=8, QMAX=127.0, MANT=0, BIAS=0,
                    SCALE_KIND=1, STATIC=False, NL=1, NGRID=1, FLAG=True)
        base.update(c)
        return build(qz.quantize_append_kernel, ptrs, (), base, 4)

    def dequant(codes, scale, **c):
        ptrs = dict(p_c=codes, p_lut="*fp32", p_s=scale, p_z=scale, p_out="*fp32")
        base = dict(D=128, BT=32, BITS=4, FP8=0, LUT=0, M=1, G=128, CHANNEL=False, SCALE=True, ZERO=False,
                    SFP8=False)
        base.update(c)
        return build(dq.dequantize_kernel, ptrs, (), base, 4)

    def viterbi(**c):
        ptrs = dict(p_y="*fp32", p_table="*fp32", p_hist="*i32", p_codes="*u8", p_err="*fp32", p_back="*u8")
        return build(tk.viterbi_kernel, ptrs, (), c, 4)

    built = [
        viterbi(BN=16, K=2, L=8, HIST=True, PER_VECTOR=1),  # tcq2, closed on the seam's codes
        viterbi(BN=8, K=3, L=9, HIST=True, PER_VECTOR=64),  # tcq3, every history of a short head
        decode("*fp16", "*u8", "*u8", K_BITS=4, V_BITS=4, K_ZERO=True, V_ZERO=True),  # int4, folded scales
        decode("*bf16", "*u8", "*u8", K_BITS=2, V_BITS=2, K_ZERO=True, V_ZERO=True, K_MODE=1, K_CHANNEL=True,
               K_G=32, BT=32, Q_SPLIT=True, SOFTCAP=True),  # int2 KIVI keys
        decode("*fp32", "*u8", "*i8", K_FP8=1, K_MODE=2, V_MODE=2, K_G=32, V_G=16, BT=32, Q_SPLIT=True),  # grouped
        decode("*fp16", "*fp16", "*fp16", K_BITS=16, V_BITS=16, K_SCALE=False, V_SCALE=False, D=256, BT=32),
        # full-precision tokens (sinks, tail, the new token) under a mask with holes, in the same launch set
        decode("*bf16", "*bf16", "*bf16", K_BITS=16, V_BITS=16, K_SCALE=False, V_SCALE=False, K_MODE=2, V_MODE=2,
               BT=32, Q_SPLIT=True, VALID=True),
        # issue 13: tcq2 keys (trellis states from 4 codes) + nuq4 values (table), 8-bit scales, grouped keys
        decode("*bf16", "*u8", "*u8", K_BITS=2, V_BITS=4, K_LUT=2, K_M=4, V_LUT=1, K_SFP8=True, V_SFP8=True,
               K_MODE=2, V_MODE=2, K_G=32, BT=32, Q_SPLIT=True),
        decode("*fp16", "*u8", "*u8", K_BITS=3, V_BITS=3, K_ZERO=True, V_ZERO=True),  # int3, folded scales
        decode("*fp16", "*u8", "*u8", K_BITS=3, V_BITS=3, K_LUT=2, K_M=3, V_LUT=1, K_MODE=2, V_MODE=2, BT=32,
               D=64),  # tcq3 / nuq3
        build(da.merge_splits_kernel, dict(p_op="*fp32", p_lp="*fp32", p_o="*fp32", p_lse="*fp32"), (),
              dict(D=128, BS=8), 4),
        quant("*bf16", "*u8", "*fp16", KIND=2, BITS=4, QMAX=15.0, G=32),
        quant("*fp16", "*u8", "*bf16", KIND=3, QMAX=448.0, MANT=3, BIAS=7, CHANNEL=True, G=16, SCALE_KIND=2),
        quant("*fp32", "*i8", "*fp32", STATIC=True, SCALE_KIND=0, BT=1, FLAG=False),
        # issue 13: int3 planes with 8-bit scales, the nuq4 / nuq2 scale search
        quant("*bf16", "*u8", "*u8", KIND=2, BITS=3, QMAX=7.0, G=32, SCALE_KIND=3),
        quant("*bf16", "*u8", "*u8", KIND=4, BITS=4, QMAX=2.73259, G=32, SCALE_KIND=3, NL=16, NGRID=8),
        quant("*fp16", "*u8", "*fp16", KIND=4, BITS=2, QMAX=1.510418, NL=4, NGRID=8),
        # the transcode's read: int4 with zero points, channel-axis int2; nuq4 with fp8 scales; tcq3 states
        dequant("*u8", "*fp16", ZERO=True, G=32),
        dequant("*u8", "*bf16", BITS=2, ZERO=True, CHANNEL=True, G=32),
        dequant("*u8", "*u8", LUT=1, SFP8=True, G=32, BT=1),
        dequant("*u8", "*fp16", BITS=3, LUT=2, M=3, D=64),
        # the fused trellis write around the Viterbi kernel: units (bf16 keys, fp8 scales), store tcq2 / tcq3
        build(tw.trellis_search_units_kernel, dict(p_x="*bf16", p_y="*fp32", p_flag="*i32"), (),
              dict(D=128, G=32, SCALE_KIND=3), 4),
        build(tw.trellis_store_kernel, dict(p_x="*bf16", p_q="*u8", p_tab="*fp32", p_codes="*u8", p_scale="*u8",
              p_flag="*i32"), (), dict(D=128, G=32, BITS=2, M=4, SCALE_KIND=3), 4),
        build(tw.trellis_store_kernel, dict(p_x="*fp16", p_q="*u8", p_tab="*fp32", p_codes="*u8",
              p_scale="*fp16", p_flag="*i32"), (), dict(D=64, G=64, BITS=3, M=3, SCALE_KIND=1), 4),
    ]
    assert all("cubin" in k.asm for k in built)
    print("compiled", len(built))
    """
)


def test_kernels_compile_for_sm90(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path
    )
    if proc.returncode and "ptxas" in proc.stderr and "No such file" in proc.stderr:
        pytest.skip("this triton build ships no ptxas")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "compiled 24" in proc.stdout
