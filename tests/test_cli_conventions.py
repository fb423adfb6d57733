"""The command line behaves like the tools users know: --version, a light --help, completion, the same logging
flags everywhere, choices and ranges shown and enforced, and third-party chatter kept off the terminal.

Whole commands run in fresh processes (``python -m edgeline.cli``) where what is measured is the process: what
it imports, what reaches its file descriptors.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from importlib.metadata import version as distribution_version
from pathlib import Path

import numpy as np
import pytest

from edgeline.backends import RUNTIME_BACKENDS
from edgeline.cli import build_parser, main
from edgeline.device_profiles import Precision, profile_ids
from edgeline.export.backends import EXPORT_BACKENDS
from edgeline.export.reference import CATALOGUE
from edgeline.sim.data import SENSORS

from .conftest import CLASSES
from .package_tree import package_tree

EDGELINE = [sys.executable, "-m", "edgeline.cli"]
HEAVY = ("numpy", "pydantic", "torch")


def _edgeline(*args: str | Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*EDGELINE, *map(str, args)], capture_output=True, text=True, timeout=timeout, check=False)


def _command_paths(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every command and action of the parser: (), ("infer",), ("profiles", "list"), ..."""
    paths = [path]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                paths += _command_paths(child, (*path, name))
    return paths


def _parsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    found = [parser]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                found += _parsers(child)
    return found


def _one_error_line(capsys: pytest.CaptureFixture[str], argv: list[str | Path], command: str) -> str:
    code = main([str(arg) for arg in argv])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"edgeline {command}: error: "), err
    return lines[0].removeprefix(f"edgeline {command}: error: ")


# ---------------------------------------------------------------------------------------------------------------------
# --version and a light --help


@pytest.mark.integration
def test_version_is_the_installed_distributions() -> None:
    done = _edgeline("--version")
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"edgeline {distribution_version('edgeline')}\n"


@pytest.mark.integration
def test_version_of_a_source_tree_that_is_not_installed(tmp_path: Path) -> None:
    """-S: no site-packages, so no distribution metadata; the package comes from a tree of links to the folders.
    Run outside the work tree: an editable install leaves edgeline.egg-info there, metadata a -m run would find."""
    tree = package_tree(tmp_path / "tree")
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run(
        [sys.executable, "-S", "-m", "edgeline.cli", "--version"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "edgeline unknown (not installed)\n"


HELP_SCRIPT = """
import json, runpy, sys
sys.argv = ["edgeline", *sys.argv[1:], "--help"]
try:
    runpy.run_module("edgeline.cli", run_name="__main__")  # python -m edgeline.cli ... --help
except SystemExit as exc:
    code = exc.code
print(json.dumps({"code": code, "modules": sorted(sys.modules)}), file=sys.stderr)
"""


@pytest.mark.integration
@pytest.mark.parametrize("path", _command_paths(build_parser()), ids=lambda path: " ".join(path) or "edgeline")
def test_help_imports_neither_numpy_pydantic_nor_torch(path: tuple[str, ...]) -> None:
    done = subprocess.run([sys.executable, "-c", HELP_SCRIPT, *path], capture_output=True, text=True, timeout=60)
    report = json.loads(done.stderr.splitlines()[-1])
    assert report["code"] == 0, done.stderr
    assert done.stdout.startswith(f"usage: {' '.join(('edgeline', *path))} ")
    assert "edgeline.commands" in report["modules"]  # the commands were registered in this process
    assert [name for name in report["modules"] if name.split(".")[0] in HEAVY] == []


# ---------------------------------------------------------------------------------------------------------------------
# shell completion


@pytest.fixture(scope="module")
def bash_script(tmp_path_factory: pytest.TempPathFactory) -> Path:
    done = _edgeline("completion", "bash")
    assert done.returncode == 0, done.stderr
    path = tmp_path_factory.mktemp("completion") / "edgeline.bash"
    path.write_text(done.stdout, encoding="utf-8")
    return path


def _complete_in_bash(script: Path, *words: str) -> list[str]:
    """What bash offers for `edgeline WORDS...` (the last word is the one being completed)."""
    program = f"""
source {script}
complete -p edgeline
COMP_WORDS=(edgeline {" ".join(f"'{word}'" for word in words)})
COMP_CWORD=$(( ${{#COMP_WORDS[@]}} - 1 ))
_edgeline
printf '%s\\n' "${{COMPREPLY[@]}}"
"""
    done = subprocess.run(["bash", "-c", program], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "complete -o default -F _edgeline edgeline"
    return [line for line in lines[1:] if line]


@pytest.mark.integration
def test_the_bash_script_is_valid_bash(bash_script: Path) -> None:
    done = subprocess.run(["bash", "-n", str(bash_script)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


@pytest.mark.integration
def test_bash_offers_the_commands_options_and_choices(bash_script: Path) -> None:
    commands = [path[0] for path in _command_paths(build_parser()) if len(path) == 1]
    assert _complete_in_bash(bash_script, "") == commands
    assert _complete_in_bash(bash_script, "ver") == ["verify"]
    assert _complete_in_bash(bash_script, "profiles", "") == ["list", "show", "schema"]
    assert _complete_in_bash(bash_script, "-v", "infer", "--backend", "") == sorted(RUNTIME_BACKENDS)
    assert _complete_in_bash(bash_script, "export", "--backend", "") == sorted(EXPORT_BACKENDS)
    assert _complete_in_bash(bash_script, "export", "--precision", "int8") == [
        "int8-dynamic",
        "int8-static",
        "int8-weights",
    ]
    assert _complete_in_bash(bash_script, "sim", "") == list(SENSORS)
    assert "--top-k" in _complete_in_bash(bash_script, "infer", "BUNDLE", "--")
    assert "--log-level" in _complete_in_bash(bash_script, "profiles", "show", "--")
    assert _complete_in_bash(bash_script, "infer", "") == []  # a BUNDLE: bash falls back to file names


@pytest.mark.integration
def test_the_zsh_script_runs_in_zsh() -> None:
    zsh = shutil.which("zsh")
    assert zsh is not None, "zsh is not installed (scripts/setup.sh installs it with apt-get)"
    done = _edgeline("completion", "zsh")
    assert done.returncode == 0, done.stderr
    check = subprocess.run([zsh, "-n"], input=done.stdout, capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stderr
    program = "autoload -U compinit && compinit -u\n" + done.stdout + "\n_edgeline_candidates '' profiles\n"
    run = subprocess.run([zsh, "-f", "-c", program], capture_output=True, text=True, timeout=60)
    assert run.stdout.split() == ["list", "show", "schema"], run.stderr


# ---------------------------------------------------------------------------------------------------------------------
# -v, -q and --log-level, before or after the command


@pytest.mark.quick
@pytest.mark.parametrize(
    ("argv", "level"),
    [
        (["profiles", "list"], "info"),
        (["-v", "profiles", "list"], "debug"),
        (["profiles", "-q", "list"], "warning"),
        (["profiles", "list", "--log-level", "ERROR"], "error"),
        (["-q", "profiles", "list", "-v"], "debug"),  # the flag nearest the action wins
    ],
)
def test_logging_flags_at_every_level(argv: list[str], level: str) -> None:
    assert build_parser().parse_args(argv).log_level == level


@pytest.mark.quick
def test_verbose_and_quiet_together_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    message = _one_error_line(capsys, ["profiles", "list", "-v", "-q"], "profiles list")
    assert message == "argument -q/--quiet: not allowed with argument -v/--verbose"


@pytest.mark.integration
@pytest.mark.parametrize(
    ("before", "after", "shown"),
    [
        ([], [], True),
        (["-q"], [], False),
        ([], ["--log-level", "warning"], False),
        (["-q"], ["--log-level", "info"], True),
    ],
)
def test_the_start_up_line_of_run_is_a_log_record(
    built_litert_bundle: Path, before: list[str], after: list[str], shown: bool
) -> None:
    """Flags before the command and after it both reach the daemon's logging."""
    done = _edgeline(*before, "run", built_litert_bundle, "--replay", os.devnull, *after)
    assert done.returncode == 0, done.stderr
    start_up = [line for line in done.stderr.splitlines() if " edgeline run: " in line]
    assert len(start_up) == int(shown), done.stderr
    if shown:
        assert " INFO edgeline.daemon" in start_up[0] and " edgeline run: tiny v1 (litert) " in start_up[0]


# ---------------------------------------------------------------------------------------------------------------------
# choices and help


@pytest.mark.quick
@pytest.mark.parametrize(
    ("command", "expected"),
    [
        (["infer"], ["--backend RUNTIME", "runtime backend", ", ".join(sorted(RUNTIME_BACKENDS))]),
        (["verify"], ["--backend RUNTIME", "runtime backend", ", ".join(sorted(RUNTIME_BACKENDS))]),
        (["run"], ["--backend RUNTIME", ", ".join(sorted(RUNTIME_BACKENDS)), "json, raw, cbor, msgpack", "0, 1"]),
        (
            ["export"],
            [
                "--backend EXPORTER",
                "export target",
                ", ".join(sorted(EXPORT_BACKENDS)),
                ", ".join(precision.value for precision in Precision),
                "classify, regress, anomaly, detect, raw",
                "end2end, yolov5, yolov8",
            ],
        ),
        (["sim"], [", ".join(SENSORS), "0, 1"]),
        (["completion"], ["bash, zsh"]),
        ([], ["debug, info, warning, error"]),
    ],
)
def test_help_lists_the_choices(command: list[str], expected: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*command, "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for fragment in expected:
        assert fragment in text


@pytest.mark.quick
def test_every_positional_argument_and_choice_has_help() -> None:
    for parser in _parsers(build_parser()):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                continue
            if not action.option_strings or action.choices is not None:
                assert action.help and action.help != argparse.SUPPRESS, f"{parser.prog} {action.dest}"


# ---------------------------------------------------------------------------------------------------------------------
# no silent fixes: ranges and flags of another source are refused in one line


@pytest.mark.quick
@pytest.mark.parametrize(
    ("flag", "value", "valid"),
    [("--top-k", "0", "1 or more"), ("--threads", "0", "1 or more"), ("--show", "-3", "0 or more")],
)
def test_numbers_out_of_range_are_refused_with_the_range(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, flag: str, value: str, valid: str
) -> None:
    message = _one_error_line(capsys, ["infer", tmp_path, "--input", tmp_path / "x.npz", flag, value], "infer")
    assert message == f"argument {flag}: {value} is out of range; valid: {valid}"


@pytest.mark.quick
def test_a_negative_seed_is_refused_with_the_range(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    message = _one_error_line(
        capsys, ["reference", "prepare", "digits", "--out", tmp_path, "--seed", "-1"], "reference prepare"
    )
    assert message == "argument --seed: -1 is out of range; valid: 0 or more"


@pytest.mark.quick
def test_ranges_that_depend_on_the_model_and_the_machine(
    capsys: pytest.CaptureFixture[str], built_litert_bundle: Path, sample_files: dict[str, Path]
) -> None:
    args = ["infer", built_litert_bundle, "--input", sample_files["validation"]]
    message = _one_error_line(capsys, [*args, "--top-k", str(CLASSES + 1)], "infer")
    assert message == f"--top-k {CLASSES + 1}: tiny has {CLASSES} classes; valid: 1 to {CLASSES}"
    cpus = len(os.sched_getaffinity(0))
    message = _one_error_line(capsys, [*args, "--threads", str(cpus + 1)], "infer")
    assert message == f"--threads {cpus + 1}: this process may use {cpus} CPUs here; valid: 1 to {cpus}"


@pytest.mark.quick
@pytest.mark.parametrize(
    ("source", "flag", "expected"),
    [
        (["--replay", os.devnull], ["--baudrate", "9600"], "--baudrate applies to the serial source (--serial)"),
        ([], ["--baudrate", "9600"], "--baudrate applies to the serial source (--serial); this run reads mqtt"),
        (
            ["--serial", "socket://127.0.0.1:9"],
            ["--speed", "2"],
            "--speed applies to the replay or camera source (--replay, --camera)",
        ),
    ],
)
def test_a_setting_of_another_source_is_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, source: list[str], flag: list[str], expected: str
) -> None:
    message = _one_error_line(capsys, ["run", tmp_path, *source, *flag], "run")
    assert message.startswith(expected)


@pytest.mark.quick
@pytest.mark.parametrize("path", _command_paths(build_parser()), ids=lambda path: " ".join(path) or "edgeline")
def test_an_unknown_flag_is_the_error_of_the_command_it_was_given_to(
    capsys: pytest.CaptureFixture[str], path: tuple[str, ...]
) -> None:
    """Named even when the command also misses what it requires (`edgeline export --bogus`)."""
    code = main([*path, "--bogus"])
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    prefix = f"{' '.join(('edgeline', *path))}: error: unrecognized arguments: --bogus"
    assert len(lines) == 1 and lines[0].startswith(prefix), err


@pytest.mark.quick
@pytest.mark.parametrize(
    "argv",
    [
        ["verify", "BUNDLE", "--bogus"],
        ["infer", "BUNDLE", "--input", "x.npz", "--bogus"],
        ["run", "BUNDLE", "--replay", "-", "--bogus"],
        ["bundle", "show", "BUNDLE", "--json", "--bogus"],
        ["profiles", "show", "rpi5", "--bogus"],
        ["export", "model.py:model", "--profile", "rpi5", "--calibration", "c.npz", "--bogus"],
        ["sim", "digits", "--bogus", "--count", "1"],
    ],
    ids=lambda argv: " ".join(argv[: 2 if argv[0] in ("bundle", "profiles") else 1]),
)
def test_an_unknown_flag_after_a_valid_command_line(capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    command = " ".join(argv[: 2 if argv[0] in ("bundle", "profiles") else 1])
    assert _one_error_line(capsys, list(argv), command) == "unrecognized arguments: --bogus"


# ---------------------------------------------------------------------------------------------------------------------
# --json: one document for a report


@pytest.mark.quick
def test_profiles_list_and_show_print_one_json_document(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["profiles", "list", "--json"]) == 0
    profiles = json.loads(capsys.readouterr().out)
    assert [profile["id"] for profile in profiles] == profile_ids()
    assert main(["profiles", "show", "rpi5", "--json"]) == 0
    rpi5 = json.loads(capsys.readouterr().out)
    assert rpi5 == next(profile for profile in profiles if profile["id"] == "rpi5")
    assert rpi5["cpu"]["cores"] >= 1 and rpi5["targets"][0]["threads"] >= 1


@pytest.mark.quick
def test_reference_list_prints_one_json_document(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["reference", "list", "--json"]) == 0
    entries = json.loads(capsys.readouterr().out)
    assert [entry["name"] for entry in entries] == list(CATALOGUE)
    for entry in entries:
        info = CATALOGUE[entry["name"]]
        assert entry["input_shape"] == list(info.input_shape) and entry["label_count"] == info.label_count


# ---------------------------------------------------------------------------------------------------------------------
# third-party chatter: captured at the file descriptors, shown with -v or when the command fails


@pytest.fixture(scope="module")
def runtime_chatter(built_litert_bundle: Path) -> list[str]:
    """What loading the bundle prints outside edgeline's commands (LiteRT writes from C to fd 2)."""
    done = subprocess.run(
        [sys.executable, "-c", "import sys, edgeline; edgeline.load(sys.argv[1])", str(built_litert_bundle)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert lines, "the runtime printed nothing: there is no chatter to capture"
    return lines


@pytest.mark.integration
@pytest.mark.parametrize("command", ["verify", "infer"])
def test_chatter_is_kept_off_the_terminal(
    built_litert_bundle: Path, sample_files: dict[str, Path], runtime_chatter: list[str], command: str
) -> None:
    extra = ["--input", sample_files["validation"]] if command == "infer" else []
    quiet = _edgeline(command, built_litert_bundle, *extra)
    assert quiet.returncode == 0, quiet.stderr
    for line in runtime_chatter:
        assert line not in quiet.stderr + quiet.stdout
    for verbose in (
        _edgeline("-v", command, built_litert_bundle, *extra),
        _edgeline(command, "-v", built_litert_bundle, *extra),
    ):
        assert verbose.returncode == 0, verbose.stderr
        assert " DEBUG edgeline.commands: the runtime printed:" in verbose.stderr
        for line in runtime_chatter:
            assert line in verbose.stderr
        assert quiet.stdout.splitlines()[0] == verbose.stdout.splitlines()[0]


@pytest.mark.integration
def test_chatter_is_shown_when_verify_fails(litert_bundle: Path, runtime_chatter: list[str]) -> None:
    golden = litert_bundle / "golden.npz"
    with np.load(golden, allow_pickle=False) as arrays:
        changed = {key: arrays[key] for key in arrays.files}
    changed["output_0"] = changed["output_0"] + 1.0
    np.savez(golden, **changed)
    manifest = json.loads((litert_bundle / "manifest.json").read_text(encoding="utf-8"))
    for entry in manifest["files"]:
        if entry["path"] == "golden.npz":
            entry.update(size=golden.stat().st_size, sha256=hashlib.sha256(golden.read_bytes()).hexdigest())
    (litert_bundle / "manifest.json").write_text(json.dumps(manifest), encoding="utf-8")
    done = _edgeline("verify", litert_bundle)
    assert done.returncode == 1, done.stderr
    assert " WARNING edgeline.commands: the runtime printed:" in done.stderr
    for line in runtime_chatter:
        assert line in done.stderr


LOG_RECORD = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR|CRITICAL) [\w.]+: ")
"""The start of a line the daemon logs (``edgeline.cli.LOG_FORMAT``)."""


@pytest.mark.integration
def test_run_logs_records_only_the_runtime_s_chatter_in_one_debug_record(
    built_litert_bundle: Path, runtime_chatter: list[str], tmp_path: Path
) -> None:
    messages = tmp_path / "messages.jsonl"
    messages.write_text("".join(json.dumps({"id": str(i), "data": [0.5] * 64}) + "\n" for i in range(3)))
    quiet = _edgeline("run", built_litert_bundle, "--replay", messages)
    assert quiet.returncode == 0, quiet.stderr
    assert [json.loads(line)["id"] for line in quiet.stdout.splitlines()] == ["0", "1", "2"]
    assert quiet.stderr and all(LOG_RECORD.match(line) for line in quiet.stderr.splitlines()), quiet.stderr
    for line in runtime_chatter:
        assert line not in quiet.stderr + quiet.stdout
    verbose = _edgeline("run", built_litert_bundle, "--replay", messages, "-v")
    assert verbose.returncode == 0, verbose.stderr
    assert all(LOG_RECORD.match(line) for line in verbose.stderr.splitlines()), verbose.stderr
    (record,) = [line for line in verbose.stderr.splitlines() if "the runtime printed" in line]
    assert " DEBUG edgeline.daemon.run_command: the runtime printed while the model loaded: " in record
    for line in runtime_chatter:
        assert line.strip() in record
