"""The CLI's error attribution: a library error reported under the flag its value came from."""

import pytest

from kvquant.tools.arguments import flagged, flagged_fields


def _fail(msg: str):
    raise ValueError(msg)


def test_flagged_fields_names_the_flag_of_the_field():
    flags = {"base": "--base", "pinned": "--pin"}
    with pytest.raises(ValueError, match=r"^--pin: invalid key layer 99; allowed: 0\.\.29$"):
        flagged_fields(flags, _fail, "pinned: invalid key layer 99;\n allowed: 0..29")
    with pytest.raises(ValueError, match=r"^--base: key_axis 'channel'$"):
        flagged_fields(flags, _fail, "base: key_axis 'channel'")
    with pytest.raises(ValueError, match=r"^bits_tokens: expected an integer >= 1, got 0$"):  # no flag: as is
        flagged_fields(flags, _fail, "bits_tokens: expected an integer >= 1, got 0")
    assert flagged_fields(flags, lambda x: x + 1, 1) == 2


def test_flagged_prefixes_once():
    with pytest.raises(ValueError, match=r"^--corpus: no such corpus 'x'$"):
        flagged("--corpus", _fail, "corpus: no such corpus 'x'")
    with pytest.raises(ValueError, match=r"^--out: is a folder$"):
        flagged("--out", _fail, "is a folder")
