"""Every flag of every command, given bad values: one line on stderr, exit status 2, no traceback and no hang.

The flags are read from the argparse parser, so a new flag or command is fuzzed without editing this file; a flag
whose kind of value has no table of bad values here fails the test until one is added. Each command line runs in
this process through ``cli.main`` under a timer (a Python start costs seconds); a few run end to end in a fresh
interpreter, as a user types them.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lightning_tune import cli
from lightning_tune.commands import args as cli_args

BIG = "1" + "0" * 30  # 10**30
#: Seconds a bad command line may take before it counts as a hang.
LIMIT_S = 10.0

#: The smallest valid command line of each command: a bad value that slips through runs briefly, and is caught.
BASE: dict[tuple[str, ...], dict[str, str | None]] = {
    ("demo",): {
        "--max-steps": "1",
        "--batch-size": "2",
        "--accelerator": "cpu",
        "--no-progress-bar": None,
        "--root-dir": "{tmp}/demo",
    },
    ("calc", "batch-size"): {"--model": "gpt2", "--gpu-memory": "24GB", "--sequence-length": "8"},
    ("bench",): {
        "--batch-size": "1",
        "--sequence-length": "8",
        "--steps": "2",
        "--warmup": "0",
        "--no-progress-bar": None,
        "--output-dir": "{tmp}/bench",
    },
    ("report",): {"logdir": "{tmp}/logs", "--output": "{tmp}/report.png"},
}

_WORDS = ["", " ", "x", "nan", "inf", "\0"]
_INTEGERS = ["1.5", "nan", "inf", "", "x", "0x10", "-" + BIG]


def bad_values(action: argparse.Action) -> list[str]:
    """The bad values of a flag, from the kind of value it takes; an unknown kind is an error to fix here."""
    kind = action.type
    if action.nargs == 0:  # store_true
        return []
    if action.choices is not None:
        return ["", "x", "CPU", "nan"]
    if isinstance(kind, cli_args.IntRange):
        high = BIG if kind.maximum is None else str(kind.maximum + 1)
        return [str(kind.minimum - 1), high, *_INTEGERS]
    if kind is cli_args.devices:
        return ["0", "-2", BIG, "1025", "x", "nan", "1.5", ",", "0,x"]
    if kind is cli_args.memory:
        return ["24", "0", "-1GB", "nan", "inf", BIG, f"{BIG}GB", "1.5.5GB", "24XB", "", "512MiB"]
    if kind in (cli_args.path, None):  # paths and names: the command must say why it cannot use them
        return ["", " ", "\0", "/proc/forbidden/x"]
    if kind is cli_args.text:
        return ["", " "]
    qualname = getattr(kind, "__qualname__", "")
    if qualname.startswith(("name_in.", "_swap_optimizer")) or kind in (
        cli_args.precision,
        cli_args.optimizer,
        cli_args.attention,
    ):
        return ["", "x", "nan", "adamw" if qualname == "_swap_optimizer" else "none"]
    if qualname == "_milliseconds":
        return ["", "x", "nan", "inf", "-1", "0", "1e400"]
    if qualname == "_batch_sizes":
        return ["", "x", "0", "-1", "1,1", "1.5", "nan", BIG, f"1,{BIG}", ","]
    if qualname == "_json_object":
        return ["", "x", "[]", "1", "null", "NaN", '{"no_such_field": 1}', "{1: 2}"]
    raise AssertionError(f"no bad values for {action.option_strings or action.dest} ({kind!r}): add them here")


def commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    """Every command (``("calc", "batch-size")`` ...) and its parser."""
    subparsers = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subparsers and path:
        yield path, parser
    for action in subparsers:
        for name, sub in action.choices.items():
            yield from commands(sub, (*path, name))


def flags(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if not isinstance(a, (argparse._HelpAction, argparse._VersionAction))]


def command_line(path: tuple[str, ...], action: argparse.Action, value: str, tmp: Path) -> list[str]:
    names = set(action.option_strings) | {action.dest}
    base = {flag: v for flag, v in BASE[path].items() if flag not in names and flag.lstrip("-") != action.dest}
    argv = list(path)
    if not action.option_strings:  # the positional
        argv.append(value)
    for flag, v in base.items():
        argv += [v.format(tmp=tmp)] if not flag.startswith("-") else [flag] if v is None else [flag, v.format(tmp=tmp)]
    if action.option_strings:
        argv += [f"{action.option_strings[0]}=x"] if action.nargs == 0 else [action.option_strings[0], value]
    return argv


def cases() -> list[tuple[tuple[str, ...], argparse.Action, str]]:
    found = []
    for path, parser in commands(cli.build_parser()):
        for action in flags(parser):
            values = ["=x"] if action.nargs == 0 else bad_values(action)
            found += [(path, action, value) for value in values]
    return found


@pytest.fixture(scope="module", autouse=True)
def _lightning_imported() -> None:
    """Import what the commands import on their first run before any timer starts."""
    import lightning_tune.bench.runner
    import lightning_tune.demos.run  # noqa: F401


class Hang(Exception):
    pass


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    def alarm(signum: int, frame: Any) -> None:
        raise Hang

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def run(argv: list[str], capsys: pytest.CaptureFixture[str], limit: float = LIMIT_S) -> str | None:
    """Run one command line; ``None`` when it was refused well, else what went wrong."""
    capsys.readouterr()
    try:
        with time_limit(limit):
            status = cli.main(argv)
    except Hang:
        return f"no answer within {limit:.0f} s"
    except BaseException as err:  # noqa: BLE001 - whatever escapes main is a traceback for the user
        return f"traceback: {type(err).__name__}: {str(err)[:120]}"
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    if status != 2:
        return f"exit status {status}, not 2" + (f" ({lines[-1][:120]})" if lines else " (accepted)")
    if len(lines) != 1 or "Traceback" in out or not lines[0].startswith(cli_args.PROG):
        return f"{len(lines)} lines on stderr, not one: {err[:200]!r}"
    return None


def test_every_command_has_a_base_command_line() -> None:
    assert {path for path, _ in commands(cli.build_parser())} == set(BASE)


@pytest.mark.parametrize(
    "argv",
    [
        pytest.param(["demo", "--devices", BIG], id="demo-devices-overflow"),
        pytest.param(["demo", "--root-dir", "/proc/forbidden/x"], id="demo-root-dir-cannot-be-made"),
        pytest.param(["demo", "--precision", "16-mixed", "--accelerator", "cpu"], id="demo-16-mixed-on-cpu"),
        pytest.param(["demo", "--max-steps", BIG], id="demo-max-steps-forever"),
        pytest.param(["bench", "--batch-size", BIG, "--seq-len", "16", "--steps", "2"], id="bench-huge-batch"),
        pytest.param(["bench", "--warmup", BIG], id="bench-warmup-forever"),
        pytest.param(["bench", "--steps", BIG], id="bench-steps-after-the-sweep-starts"),
        pytest.param(["bench", "--seed", "4294967296"], id="bench-seed-after-the-sweep-starts"),
        pytest.param([], id="no-command"),
        pytest.param(["calc"], id="calc-alone"),
        pytest.param(["calc", "--model", "llama-2-7b"], id="calc-flag-without-calculation"),
        pytest.param(["calc", "batch-size", "--model", "gpt2", "--gpu-memory", "24", "--seq-len", "8"], id="24-mib"),
    ],
)
def test_reported_command_lines_get_one_line_and_status_2(
    argv: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    assert run(argv, capsys) is None


def test_every_flag_refuses_bad_values_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "logs").mkdir()
    tried, failures = 0, []
    for path, action, value in cases():
        argv = command_line(path, action, value, tmp_path)
        problem = run(argv, capsys)
        tried += 1
        if problem is not None:
            failures.append(f"lightning-tune {' '.join(map(repr, argv))}: {problem}")
    with capsys.disabled():
        print(f"\nCLI fuzz: {tried} command lines tried, {len(failures)} not refused in one line with status 2")
    assert tried > 200
    assert failures == []


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        pytest.param([], "lightning-tune: error: the following arguments are required: <command>", id="no-command"),
        pytest.param(
            ["demo", "--devices", BIG], "lightning-tune demo: error: argument --devices: must be", id="devices"
        ),
        pytest.param(
            ["calc", "--model", "llama-2-7b"],
            "lightning-tune calc: error: --model is an option of 'lightning-tune calc batch-size'",
            id="calc-hint",
        ),
    ],
)
def test_end_to_end_one_line(argv: list[str], expected: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "lightning_tune", *argv], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and result.stderr.startswith(expected), result.stderr[-2000:]
