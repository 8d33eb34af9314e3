"""python -m kvquant.tools.kernel_resources: the decode kernel's offline sm_90 build, per format."""

import json

import pytest

pytest.importorskip("triton")

from kvquant.tools import kernel_resources  # noqa: E402


def test_table_formats_build_without_spills(tmp_path, capsys):
    # The codebook and trellis reads once spilled registers at head_dim 128 (nuq4: 15 spill stores,
    # tcq3: 16) and issued a byte load per channel and neighbour (tcq3: 259 global loads); a change that
    # brings either back fails here
    out = tmp_path / "rows.json"
    try:
        kernel_resources._tool("cuobjdump")
    except FileNotFoundError:
        pytest.skip("this triton build ships no cuobjdump")
    assert kernel_resources.main(["--formats", "nuq4", "tcq3", "int3", "--json", str(out)]) == 0
    rows = {r["format"]: r for r in json.loads(out.read_text())}
    assert sorted(rows) == ["int3", "nuq4", "tcq3"]
    for r in rows.values():
        assert r["head_dim"] == 128 and 0 < r["registers"] <= 255
        assert r["spill_stores"] == 0 and r["stack_bytes"] == 0, r
    assert rows["tcq3"]["global_loads"] < 150 and rows["int3"]["global_loads"] < 80
    assert rows["nuq4"]["block_t"] == 32 and rows["int3"]["block_t"] == 64  # the launcher's tiles


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
