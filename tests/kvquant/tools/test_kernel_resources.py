"""python -m kvquant.tools.kernel_resources: the decode kernel's offline sm_90 build, per format."""

import json

import pytest

pytest.importorskip("triton")

from kvquant.tools import kernel_resources  # noqa: E402


def _rows(tmp_path, *args: str) -> dict[str, dict]:
    """``kernel_resources.main(args)``'s rows by format (skips where Triton ships no cuobjdump)."""
    try:
        kernel_resources._tool("cuobjdump")
    except FileNotFoundError:
        pytest.skip("this triton build ships no cuobjdump")
    out = tmp_path / "rows.json"
    assert kernel_resources.main([*args, "--json", str(out)]) == 0
    return {r["format"]: r for r in json.loads(out.read_text())}


def test_the_build_specializes_like_the_jit():
    # strides of 1 become constants and the rest are marked multiples of 16, as at launch; without
    # this the offline build loaded int4 codes a byte at a time where the launched kernel loads 16
    from kvquant.kernels.triton.decode_kernels import decode_attention_split_kernel as fn

    sig, constexprs, attrs = kernel_resources._specialize(
        fn, {"stride_qd": 1, "stride_qh": 128, "stride_kct": 7, "end": 1000, "scaling": 0.125}
    )
    at = {name: (fn.arg_names.index(name),) for name in ("stride_qd", "stride_qh", "stride_kct")}
    assert sig["stride_qd"] == "constexpr" and constexprs[at["stride_qd"]] == 1
    assert sig["stride_qh"] == "i32" and attrs[at["stride_qh"]] == [["tt.divisibility", 16]]
    assert sig["stride_kct"] == "i32" and at["stride_kct"] not in attrs
    assert sig["scaling"] == "fp32"


def test_table_formats_build_without_spills(tmp_path):
    # The codebook and trellis reads once spilled registers at head_dim 128 (nuq4: 13 spill stores,
    # tcq3: 14) and issued a byte load per channel and neighbour (tcq3: 259 global-load instructions
    # for a 32-token tile, int3: 139 for 64); a change that brings either back fails here
    rows = _rows(tmp_path, "--formats", "nuq4,tcq3", "int3")
    assert sorted(rows) == ["int3", "nuq4", "tcq3"]
    for r in rows.values():
        assert r["head_dim"] == 128 and 0 < r["registers"] <= 255
        assert r["spill_stores"] == 0 and r["stack_bytes"] == 0, r
    per_token = {f: r["global_loads"] / r["block_t"] for f, r in rows.items()}  # SASS loads per tile token
    assert per_token["tcq3"] < 4 and per_token["int3"] < 0.5, per_token
    # integer codes become fp16 by bit pattern, not by I2F (a quarter-rate conversion per element: 64
    # per thread and tile before); one I2F stays, the prologue's integer division
    assert rows["int3"]["int_to_float"] <= 1, rows["int3"]
    # table formats with one scale per token fold it out of fp16 dots: the integer formats' 64-token tile
    assert rows["nuq4"]["block_t"] == 64 and rows["tcq3"]["block_t"] == 64


def test_channel_groups_build_lean(tmp_path):
    # the presets' scales per 32 / 64 channels once dequantized each tile to fp32 for tf32x3 dots
    # (int4, 64 channels at head_dim 128: 255 registers, 8 spill stores, 85 instructions per token);
    # one dot per group with the scales folded out (mode 3) takes about what one scale per head does
    for r in _rows(tmp_path, "--formats", "int4,tcq3", "--group", "64").values():
        assert r["mode"] == 3 and r["block_t"] == 64 and r["registers"] < 255, r
        assert r["instructions"] / r["block_t"] < 50 and r["spill_stores"] <= 1, r


def test_wide_heads_take_64_token_tiles_without_tables(tmp_path):
    # head_dim 256 (Gemma): codes read without a table take 64-token tiles without spilling (fewer
    # instructions per token than 32: int4 28 against 45); codebooks and trellis codes keep 32
    rows = _rows(tmp_path, "--formats", "int4,nuq2", "--head-dim", "256")
    assert rows["int4"]["block_t"] == 64 and rows["int4"]["spill_stores"] == 0, rows["int4"]
    assert rows["nuq2"]["block_t"] == 32, rows["nuq2"]


SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   ISETP.GE.AND P0, PT, R0, R2, PT ;
        /*0020*/               @P0 BRA 0x0080 ;
        /*0030*/                   LDG.E R4, desc[UR4][R2.64] ;
        /*0040*/                   HADD2 R4, R4, -1024, -1024 ;
        /*0050*/                   HMMA.16816.F32 R8, R4, R6, R8 ;
        /*0060*/                   IADD3 R0, R0, 0x1, RZ ;
        /*0070*/              @!P0 BRA 0x0030 ;
        /*0080*/                   EXIT ;
        /*0090*/                   BRA 0x0090;
"""


def test_the_main_loop_is_the_longest_backward_branch():
    # 0x30..0x70 is the loop (5 instructions); the forward branch and the closing self-branch are not
    assert kernel_resources.main_loop(SASS) == 5
    assert kernel_resources.main_loop(SASS.replace("0x0030 ;", "0x0080 ;")) == 0  # no backward branch


def test_what_the_sms_issue_per_token(tmp_path):
    # the token loop once per tile in every warp: int4 at head_dim 128 with 8 warps and 64-token tiles
    # issued 89.5 warp-instructions per token when this was written (716 per pass)
    r = _rows(tmp_path, "--formats", "int4")["int4"]
    assert 0 < r["loop_instructions"] < r["instructions"], r
    expected = round(r["loop_instructions"] * r["num_warps"] / r["block_t"], 1)
    assert r["num_warps"] == 8 and r["warp_instructions_per_token"] == expected, r
    assert r["warp_instructions_per_token"] < 100, r


def test_formats_the_kernel_does_not_read_are_refused(capsys):
    with pytest.raises(SystemExit) as exc:
        kernel_resources.main(["--formats", "int4", "none"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--formats" in err and "none" in err and "allowed: " in err and "nuq4" in err


def test_head_dim_must_suit_the_kernel(capsys):
    with pytest.raises(SystemExit) as exc:
        kernel_resources.main(["--head-dim", "80"])
    assert exc.value.code == 2
    assert "--head-dim" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        kernel_resources.main(["--group", "48"])
    assert exc.value.code == 2
    assert "--group" in capsys.readouterr().err
