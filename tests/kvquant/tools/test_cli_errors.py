"""Every ``kvquant`` command turns bad input into one line on stderr and exit status 2.

The cases are those of the robustness probe (numeric flags, unknown names, models, cache YAML files,
eval / sweep config files, data files, devices, output folders, results files), run in-process through
``kvquant.tools.cli.main``; each asserts exit status 2, exactly one stderr line of the form
``kvquant <command>: error: ...``, the flag or field named in it, and no traceback. A few end-to-end
checks run the installed ``kvquant`` script (Ctrl-C, ``--debug``, a bad file).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import kvquant.tools.commands.plan as plan_command
from kvquant.tools.arguments import describe
from kvquant.tools.cli import main

UNWRITABLE = "/sys/kvquant-test"  # mkdir fails there even as root


@pytest.fixture(scope="module")
def tiny_dir(tiny_model_dir) -> Path:
    return tiny_model_dir


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    """Bad input files, by name."""
    d = tmp_path_factory.mktemp("bad-files")
    texts: dict[str, str | bytes] = {
        "malformed.yaml": "key_format: [int4\n  : :\n",
        "empty.yaml": "",
        "comment.yaml": "# nothing but a comment\n",
        "list.yaml": "- int4\n- int8\n",
        "scalar.yaml": "int4\n",
        "binary.yaml": bytes(range(256)) * 4,
        "unknownkey.yaml": "key_format: int4\nfoo: 1\n",
        "badvalue.yaml": "key_format: int9\n",
        "garbage.pt": "not a torch file\n",
        "empty.txt": "",
        "binary.txt": bytes(range(256)) * 40,
        "bad.jsonl": '{"text": "a"}\n{not json\n',
        "nofield.jsonl": '{"body": "a"}\n',
        "badconfig.json": "{not json",
        "afile": "x",
        "eval_badkey.yaml": "quality:\n  foo: 1\n",
        "eval_badtype.yaml": "quality: 5\n",
    }
    out = {}
    for name, data in texts.items():
        path = d / name
        path.write_bytes(data if isinstance(data, bytes) else data.encode())
        out[name] = str(path)
    torch.save([1, 2, 3], d / "wrong.pt")
    (d / "adir").mkdir()
    out |= {"wrong.pt": str(d / "wrong.pt"), "adir": str(d / "adir"), "dir": str(d)}
    for name, target in (
        ("missing", d / "nope.pt"),
        ("garbage", d / "garbage.pt"),
        ("wrong", d / "wrong.pt"),
    ):
        path = d / f"static_{name}.yaml"
        path.write_text(f"key_format: int8\nvalue_format: int8\nstatic_scales: {target}\n")
        out[f"static_{name}.yaml"] = str(path)
        path = d / f"keymap_{name}.yaml"
        path.write_text(f"key_format: nuq4\nvalue_format: nuq4\nkey_map: {target}\n")
        out[f"keymap_{name}.yaml"] = str(path)
    return out


def _argv(kind: str, tiny: Path, d: str) -> list[str]:
    """The valid base command of each kind: fast settings on the tiny model; a case adds one bad flag."""
    t = str(tiny)
    return {
        "demo": ["demo", "--model", t, "--prompt", "Hi", "-n", "2"],
        "eval": ["eval", "--model", t, "--no-progress", "--prefix-len", "48", "--score-len", "12",
                 "--windows", "2", "--speed-contexts", "32", "--decode-tokens", "2", "--warmup", "0",
                 "--repeats", "1", "--retrieval-lengths", "360", "--retrieval-trials", "1",
                 "--output-dir", f"{d}/runs", "--cache", "int8"],
        "sweep": ["sweep", "default", "--set", f"models=[{t}]", "--set", "grid.contexts=[32]",
                  "--set", "caches=[dynamic, int8]", "--corpus", "embedded", "--no-progress", "--out", f"{d}/sweep"],
        "bench": ["bench", "cpu", "--model", t, "--contexts", "32", "--steps", "2", "--repeats", "1",
                  "--warmup", "0", "--prefill", "0", "--presets", "int4", "--no-dequant"],
        "calibrate": ["calibrate", "--model", t, "--tokens", "64", "--out", f"{d}/s.pt"],
        "tune": ["tune", "--model", t, "--windows", "1", "--prefix-len", "24", "--score-len", "8", "--out", f"{d}/t.yaml",
                 "--no-progress", "--budget-bits", "4"],
        "plan": ["plan", "--memory", "80GiB", "--context", "1024"],
        "none": [],
    }[kind]  # fmt: skip


# (base command, extra args, text the one error line must hold); "{name}" is a file of `files`,
# "{dir}" the folder holding them. Later flags win over the base command's.
CASES: dict[str, tuple[str, list[str], str]] = {
    # ---------------------------------------------------------------- numeric flags
    "demo -n 0": ("demo", ["-n", "0"], "-n/--max-new-tokens: expected an integer >= 1"),
    "demo -n -5": ("demo", ["-n", "-5"], "--max-new-tokens"),
    "demo -n abc": ("demo", ["-n", "abc"], "--max-new-tokens"),
    "bench --steps -1": ("bench", ["--steps", "-1"], "--steps: expected an integer >= 1"),
    "bench --steps 0": ("bench", ["--steps", "0"], "--steps"),
    "bench --contexts 0": (
        "bench",
        ["--contexts", "0"],
        "--contexts: expected comma-separated integers >= 1",
    ),
    "bench --contexts abc": ("bench", ["--contexts", "abc"], "--contexts"),
    "bench --contexts ,": ("bench", ["--contexts", ","], "--contexts"),
    "bench --repeats 0": ("bench", ["--repeats", "0"], "--repeats"),
    "bench --warmup -1": ("bench", ["--warmup", "-1"], "--warmup: expected an integer >= 0"),
    "bench --prefill -1": ("bench", ["--prefill", "-1"], "--prefill"),
    "tune --budget-bits -1": ("tune", ["--budget-bits", "-1"], "--budget-bits: expected a finite number > 0"),
    "tune --budget-bits nan": ("tune", ["--budget-bits", "nan"], "--budget-bits"),
    "tune --windows 0": ("tune", ["--windows", "0"], "--windows: expected an integer >= 1"),
    "tune --score-len 1": ("tune", ["--score-len", "1"], "--score-len: expected an integer >= 2"),
    "tune --prefix-len 0": ("tune", ["--prefix-len", "0"], "--prefix-len: expected an integer >= 1"),
    "tune --formats int9": ("tune", ["--formats", "tcq2,int9"], "--formats: invalid value 'int9'; allowed:"),
    "calibrate --tokens 0": ("calibrate", ["--tokens", "0"], "--tokens: expected an integer >= 1"),
    "calibrate --tokens -3": ("calibrate", ["--tokens", "-3"], "--tokens"),
    "calibrate --margin 0": ("calibrate", ["--margin", "0"], "--margin: expected a finite number > 0"),
    "calibrate --margin inf": ("calibrate", ["--margin", "inf"], "--margin"),
    "calibrate --exponent 2": (
        "calibrate",
        ["--key-map", "--exponent", "2"],
        "--exponent: expected a number from 0 to 1",
    ),
    "calibrate --key-map --cache nosuch": (
        "calibrate",
        ["--key-map", "--cache", "nosuch"],
        "--cache: config: no such preset or YAML file 'nosuch'",
    ),
    "plan --context 0": ("plan", ["--context", "0"], "--context: expected an integer >= 1"),
    "plan --batch 0": ("plan", ["--batch", "0"], "--batch"),
    "plan --memory abc": ("plan", ["--memory", "abc"], "--memory: cannot parse size 'abc'"),
    "plan --reserve 150%": ("plan", ["--reserve", "150%"], "--reserve"),
    "eval --prefix-len 0": ("eval", ["--prefix-len", "0"], "quality.prefix_len: invalid value 0"),
    "eval --repeats 0": ("eval", ["--repeats", "0"], "speed.repeats"),
    "eval --speed-contexts 0": ("eval", ["--speed-contexts", "0"], "speed.context_lengths"),
    "eval --decode-tokens x": ("eval", ["--decode-tokens", "x"], "--decode-tokens"),
    "sweep grid.contexts=[0]": ("sweep", ["--set", "grid.contexts=[0]"], "grid.contexts"),
    # ---------------------------------------------------------------- unknown names
    "demo unknown preset": (
        "demo",
        ["--cache", "int9"],
        "--cache: config: no such preset or YAML file 'int9'",
    ),
    "bench --presets nosuch": ("bench", ["--presets", "nosuch"], "--presets: unknown preset 'nosuch'"),
    "bench target nosuch": ("none", ["bench", "nosuch"], "invalid choice: 'nosuch'"),
    "eval --cache nosuch": ("eval", ["--cache", "nosuch"], "unknown cache or preset 'nosuch'"),
    "eval --dtype float64": ("eval", ["--dtype", "float64"], "--dtype"),
    "eval --attn nosuch": ("eval", ["--attn", "nosuch"], "model.attn_implementation: invalid value 'nosuch'"),
    "eval --tasks foo": ("eval", ["--tasks", "foo"], "--tasks: unknown task 'foo'"),
    "plan --weights-dtype foo": ("plan", ["--weights-dtype", "foo"], "--weights-dtype"),
    "tune --base nosuch": ("tune", ["--base", "nosuch"], "--base: config: no such preset"),
    "tune --pin nosuch": ("tune", ["--pin", "nosuch"], "--pin: config: no such preset or YAML file 'nosuch'"),
    "tune --base kivi4": ("tune", ["--base", "kivi4"], "--base: key_axis 'channel'; the tuner needs 'token'"),
    "calibrate --format int4": ("calibrate", ["--format", "int4"], "--format"),
    "calibrate --retrieval --protect-format int5": (
        "calibrate",
        ["--retrieval", "--protect-format", "int5"],
        "--protect-format: invalid value 'int5'; allowed:",
    ),
    "calibrate --retrieval --length 100": ("calibrate", ["--retrieval", "--length", "100"], "--length"),
    "calibrate --retrieval --tolerance 0": ("calibrate", ["--retrieval", "--tolerance", "0"], "--tolerance"),
    "calibrate --retrieval --cache nosuch": (
        "calibrate",
        ["--retrieval", "--cache", "nosuch"],
        "--cache: config: no such preset or YAML file 'nosuch'",
    ),
    "calibrate --retrieval --retrieval-count": (
        "calibrate",
        ["--retrieval", "--retrieval-count"],
        "--retrieval-count: give either --retrieval or --retrieval-count, not both",
    ),
    "calibrate --retrieval-count --cache nosuch": (
        "calibrate",
        ["--retrieval-count", "--cache", "nosuch"],
        "--cache: config: no such preset or YAML file 'nosuch'",
    ),
    "no command": ("none", [], "COMMAND"),
    "unknown command": ("none", ["nosuch"], "invalid choice: 'nosuch'"),
    # ---------------------------------------------------------------- models
    "demo --model missing": ("demo", ["--model", "/no/such/model"], "--model: "),
    "demo --model empty folder": ("demo", ["--model", "{adir}"], "--model: "),
    "bench --model missing": ("bench", ["--model", "/no/such/model"], "--model: "),
    "tune --model missing": ("tune", ["--model", "/no/such/model"], "--model: "),
    "plan --model bad json": ("plan", ["--model", "{badconfig.json}"], "--model: "),
    # ---------------------------------------------------------------- cache config files
    **{
        f"{cmd} {flag} {name}": (cmd, [flag, f"{{{name}}}"], text)
        for cmd, flag in (
            ("demo", "--cache"),
            ("eval", "--cache"),
            ("bench", "--presets"),
            ("tune", "--base"),
        )
        for name, text in (
            ("malformed.yaml", "not valid YAML"),
            ("empty.yaml", "empty; expected a mapping of fields"),
            ("comment.yaml", "empty; expected a mapping of fields"),
            ("list.yaml", "expected a mapping of fields (e.g. 'key_format: int4'), got a list"),
            ("binary.yaml", "not a UTF-8 text file"),
            ("unknownkey.yaml", "unknown key 'foo'"),
            ("badvalue.yaml", "key_format: invalid value 'int9'"),
        )
    },
    "demo --cache folder": ("demo", ["--cache", "{adir}"], "is a folder, not a YAML file"),
    "demo --cache scalar": ("demo", ["--cache", "{scalar.yaml}"], "got a str"),
    # ---------------------------------------------------------------- eval / sweep config files
    **{
        f"{cmd} config {name}": (cmd, ["--config", f"{{{name}}}"] if cmd == "eval" else [], text)
        for cmd in ("eval", "sweep")
        for name, text in (
            ("malformed.yaml", "not valid YAML"),
            ("empty.yaml", "empty; expected a mapping of settings"),
            ("list.yaml", "expected a mapping at the top level, got a list"),
            ("binary.yaml", "not a UTF-8 text file"),
            ("adir", "config: no such file"),
        )
    },
    "eval config missing": ("eval", ["--config", "/no/such.yaml"], "config: no such file '/no/such.yaml'"),
    "eval config bad key": ("eval", ["--config", "{eval_badkey.yaml}"], "unknown key 'quality.foo'"),
    "eval config bad type": ("eval", ["--config", "{eval_badtype.yaml}"], "quality: expected a mapping"),
    # ---------------------------------------------------------------- data files
    **{
        f"{cmd} --cache {name}": (cmd, ["--cache", f"{{{name}}}"], text)
        for cmd in ("demo", "eval")
        for name, text in (
            ("static_missing.yaml", "static_scales: no such calibration file"),
            ("static_garbage.yaml", "static_scales: cannot read"),
            ("static_wrong.yaml", "is not a kvquant calibration file"),
            ("keymap_missing.yaml", "key_map: no such key map file"),
            ("keymap_garbage.yaml", "is not a kvquant key map file"),
            ("keymap_wrong.yaml", "is not a kvquant key map file"),
        )
    },
    **{
        f"{cmd} --corpus {name}": (cmd, ["--corpus", f"{{{name}}}"], text)
        for cmd in ("eval", "calibrate", "tune")
        for name, text in (
            ("empty.txt", "empty.txt' is empty"),
            ("binary.txt", "binary.txt' is not UTF-8 text"),
            ("bad.jsonl", "bad.jsonl' line 2: not JSON"),
            ("nofield.jsonl", "has no column 'text'"),
            ("adir", "no such file"),
        )
    },
    "calibrate --corpus missing": ("calibrate", ["--corpus", "/no/such.txt"], "--corpus: no such file"),
    # ---------------------------------------------------------------- output folders / files
    **{
        f"{cmd} {flag} {what}": (cmd, [flag, path], text)
        for cmd, flag, name in (
            ("eval", "--output-dir", "output.dir"),
            ("sweep", "--out", "out"),
            ("bench", "--out", "--out"),
        )
        for what, path, text in (
            ("unwritable", UNWRITABLE, f"{name}: cannot write to the folder"),
            ("under a file", "{afile}/sub", f"{name}: '"),
            ("is a file", "{afile}", f"{name}: '"),
        )
    },
    **{
        f"{cmd} --out {what}": (cmd, ["--out", path], text)
        for cmd, file in (("calibrate", "s.pt"), ("tune", "t.yaml"))
        for what, path, text in (
            ("unwritable", f"{UNWRITABLE}/{file}", "--out: cannot write to the folder"),
            ("under a file", f"{{afile}}/{file}", "afile' is a file, not a folder"),
            ("is a folder", "{adir}", "--out: '"),
        )
    },
}
if not torch.cuda.is_available():
    CASES |= {
        "eval --device cuda": ("eval", ["--device", "cuda"], "model.device: 'cuda', but torch sees 0 CUDA"),
        "eval --device cuda:7": ("eval", ["--device", "cuda:7"], "model.device"),
        "sweep --device cuda": ("sweep", ["--set", "model.device=cuda"], "model.device"),
        "bench kernels": ("none", ["bench", "kernels", "--out", "{dir}/bk"], "needs a CUDA GPU"),
    }
CASES["eval --device gpu"] = ("eval", ["--device", "gpu"], "model.device: invalid value 'gpu'")


def _fill(text: str, fill: dict[str, str]) -> str:
    for name, value in fill.items():
        text = text.replace("{" + name + "}", value)
    return text


def _run(argv: list[str], capsys) -> tuple[int, list[str]]:
    try:
        rc = main(argv)
    except SystemExit as exc:  # argparse errors
        rc = exc.code
    return rc, capsys.readouterr().err.splitlines()


def _assert_one_line(rc: int, err: list[str], command: str, text: str) -> None:
    assert rc == 2, err
    assert len(err) == 1, err  # one line: no usage block, no log lines, no traceback
    assert err[0].startswith(f"{command}: error: "), err
    assert text in err[0], err
    assert "Traceback" not in err[0]


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_one_line_and_exit_2(case, tiny_dir, files, tmp_path, capsys, caplog):
    kind, extra, text = CASES[case]
    fill = {**files, "dir": str(tmp_path)}
    extra = [_fill(a, fill) for a in extra]
    argv = _argv(kind, tiny_dir, str(tmp_path))
    if kind == "sweep" and case.startswith("sweep config"):
        argv = ["sweep", files[case.rsplit(" ", 1)[1]], *argv[2:]]
    rc, err = _run(argv + extra, capsys)
    command = "kvquant" + (f" {argv[0]}" if argv else f" {extra[0]}" if extra[:1] == ["bench"] else "")
    _assert_one_line(rc, err, command, _fill(text, fill))


def _results_dir(tmp_path: Path, content: bytes, stamp: bytes | None = None) -> Path:
    run = tmp_path / "runs" / "r"
    run.mkdir(parents=True)
    (run / "results.jsonl").write_bytes(content)
    if stamp is not None:
        (run / "run.json").write_bytes(stamp)
    return run


@pytest.mark.parametrize(
    "content, stamp, text",
    [
        (b'\n{"key": "y", "to\n\n', None, "results.jsonl: line 2 is not a JSON record"),
        (b"\xff\xfe\n", None, "results.jsonl: line 1 is not a JSON record"),
        (b"[1]\n", None, "results.jsonl: line 1 is not a JSON record"),
        (b"", b"\xff\x00", "run.json: unreadable"),
        (b"", b"[1, 2]", "run.json: unreadable"),
    ],
    ids=["torn line in the middle", "binary line", "not an object", "binary stamp", "list stamp"],
)
def test_a_damaged_results_folder_is_one_line(content, stamp, text, tiny_dir, tmp_path, capsys):
    _results_dir(tmp_path, content, stamp)
    argv = _argv("eval", tiny_dir, str(tmp_path)) + ["--run-name", "r", "--tasks", "memory"]
    rc, err = _run(argv, capsys)
    _assert_one_line(rc, err, "kvquant eval", text)


def test_a_torn_last_record_is_redone_and_cut_off(tiny_dir, tmp_path, capsys):
    run = _results_dir(tmp_path, b'{"key": "int8@0000", "cache": "int8", "to')
    argv = _argv("eval", tiny_dir, str(tmp_path)) + ["--run-name", "r", "--tasks", "memory"]
    assert main(argv) == 0
    assert "cutting off the torn last line" in capsys.readouterr().err
    lines = (run / "results.jsonl").read_text().splitlines()
    assert len(lines) == 2 and all(line.startswith('{"cache": ') for line in lines)


# ------------------------------------------------------------------------------------------ policy


def test_debug_shows_the_traceback_of_a_user_error(capsys):
    with pytest.raises(ValueError, match="--cache"):
        main(["--debug", "demo", "--cache", "int9"])


def test_an_internal_bug_is_not_reported_as_bad_input(monkeypatch, capsys):
    def buggy(args):
        raise KeyError("a bug")

    monkeypatch.setattr(plan_command, "_cmd_plan", buggy)
    with pytest.raises(KeyError):
        main(["plan", "--memory", "1GiB", "--context", "8"])
    assert capsys.readouterr().err == ""


def test_a_keyboard_interrupt_in_process_is_one_line_and_130(monkeypatch, capsys):
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(plan_command, "_cmd_plan", interrupted)
    assert main(["plan", "--memory", "1GiB", "--context", "8"]) == 130
    assert capsys.readouterr().err == "kvquant plan: interrupted\n"


@pytest.mark.parametrize(
    "flag", [["--reserve", "150%"], ["--weights-dtype", "foo"], ["--kv-dtype", "foo"], ["--memory", "abc"]]
)
def test_plan_checks_its_flags_before_it_reads_the_model(flag, monkeypatch, capsys):
    # the default model's first read converts the embedded GGUF, whose progress output would come
    # before the one-line error: a bad flag must fail first
    import kvquant.tools.plan as plan_tool

    def unread(model):
        raise AssertionError("the model config was read before the flags were checked")

    monkeypatch.setattr(plan_tool, "load_config", unread)
    assert main(["plan", "--memory", "80GiB", "--context", "8", *flag]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"kvquant plan: error: {flag[0]}"), err


def test_os_errors_name_the_path():
    exc = PermissionError(13, "Permission denied", "/x/y")
    assert describe(exc) == "'/x/y': permission denied"


# ------------------------------------------------------------------------------------------ end to end

KVQUANT = Path(sys.executable).parent / "kvquant"
SLOW_COMMAND = """
import sys, time
import kvquant.tools.cli as cli
import kvquant.tools.commands.plan as plan_command
def slow(args):
    print("ready", flush=True)
    time.sleep(60)
    return 0
plan_command._cmd_plan = slow
sys.exit(cli.main(sys.argv[1:] + ["plan", "--memory", "1GiB", "--context", "8"]))
"""


@pytest.mark.parametrize("debug", [False, True], ids=["plain", "debug"])
def test_ctrl_c_exits_130_with_one_line(debug, tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    argv = [sys.executable, "-c", SLOW_COMMAND] + (["--debug"] if debug else [])
    # SIGINT back to its default in the child: a shell's background job (`make test &`) starts with it
    # ignored, and Python then installs no KeyboardInterrupt handler
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=tmp_path,
        env=env,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        assert proc.stdout.readline() == b"ready\n"  # inside the command
        time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    if debug:
        assert b"Traceback" in err and b"KeyboardInterrupt" in err
    else:
        assert (proc.returncode, err) == (130, b"kvquant plan: interrupted\n")


def test_the_installed_command_reports_a_bad_file_in_one_line(files, tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    run = subprocess.run(
        [str(KVQUANT), "demo", "--cache", files["empty.yaml"]], capture_output=True, cwd=tmp_path, env=env
    )
    err = run.stderr.decode().splitlines()
    assert run.returncode == 2 and len(err) == 1, err
    assert err[0].startswith("kvquant demo: error: --cache: config: ") and "empty" in err[0]
