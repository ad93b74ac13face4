from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_tune import cli
from lightning_tune.cli import main

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_demo_command_trains_and_prints_a_summary(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["demo", "--max-steps", "20", "--batch-size", "16", "--accelerator", "cpu", "--no-progress-bar"]
    assert main([*argv, "--root-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "demo finished on cpu" in out
    assert "steps          20 in " in out
    assert "samples/s" in out
    assert " -> " in out and "% lower)" in out
    assert "entropy floor" in out
    assert str(tmp_path / "lightning_logs") in out
    assert "tensorboard --logdir" in out
    assert list((tmp_path / "lightning_logs").glob("version_*/events.out.tfevents.*"))


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        pytest.param(["demo", "--max-steps", "0"], "--max-steps: must be an integer >= 1, got '0'", id="zero-steps"),
        pytest.param(["demo", "--max-steps", "ten"], "--max-steps: must be an integer >= 1", id="not-a-number"),
        pytest.param(["demo", "--batch-size", "-4"], "--batch-size: must be an integer >= 1", id="negative-batch"),
        pytest.param(["demo", "--seed", "-1"], "--seed: must be an integer from 0 to 4294967295", id="negative-seed"),
        pytest.param(["demo", "--accelerator", "tpu"], "invalid choice: 'tpu'", id="accelerator"),
        pytest.param(["demo", "--precision", "8-bit"], "--precision: must be one of 'auto', '32-true'", id="precision"),
        pytest.param(["demo", "--devices", "0"], "--devices: must be a device count from 1 to 1024", id="zero-devices"),
        pytest.param(
            ["demo", "--precision", "transformer-engine", "--accelerator", "cpu"],
            "transformer_engine",
            id="precision-without-its-package",
        ),
        pytest.param(["demo", "--no-such-flag"], "unrecognized arguments: --no-such-flag", id="unknown-flag"),
        pytest.param(["frobnicate"], "invalid choice: 'frobnicate'", id="unknown-command"),
        pytest.param(
            ["demo", "--batch-size", "100000000"],
            "`batch_size` must be at most 4096 (the sequences of the demo's training split), got 100000000",
            id="huge-batch",
        ),
        pytest.param(
            ["demo", "--root-dir", ""],
            "--root-dir: must be a non-empty path without NUL characters (use '.' for the current directory), got ''",
            id="empty-root-dir",
        ),
        pytest.param(
            ["demo", "--no-progress-bar=yes"], "--no-progress-bar: ignored explicit argument 'yes'", id="flag-value"
        ),
        pytest.param(
            ["demo", "--accelerator", "cpu", "--devices", "0,1"], "`devices` selected with", id="lightning-rejects"
        ),
    ],
)
def test_bad_arguments_exit_2_with_one_line_message(
    argv: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert "error:" in lines[0] and expected in lines[0]
    assert "Traceback" not in captured.err


def test_demo_root_dir_through_a_file_exits_2_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "a-file").write_text("")
    assert main(["demo", "--root-dir", str(tmp_path / "a-file" / "logs"), "--max-steps", "1"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [
        f"lightning-tune demo: error: `default_root_dir` '{tmp_path}/a-file/logs' cannot be a directory: "
        f"'{tmp_path}/a-file' is a file"
    ]
    assert (tmp_path / "a-file").read_text() == ""


def test_no_command_is_a_one_line_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    err = capsys.readouterr().err
    assert err == (
        "lightning-tune: error: the following arguments are required: <command> (see 'lightning-tune --help')\n"
    )


@pytest.mark.parametrize(
    "argv",
    [
        pytest.param(["--version"], id="version"),
        pytest.param(["calc", "batch-size", "--help"], id="calc-help"),
        pytest.param(
            ["calc", "batch-size", "--model", "llama-2-7b", "--gpu-memory", "80GB", "--seq-len", "2048"], id="calc"
        ),
        pytest.param(["report", "--help"], id="report-help"),
        pytest.param(["bench", "--steps", "1"], id="usage-error"),
    ],
)
def test_commands_that_do_not_train_import_neither_torch_nor_lightning(argv: list[str]) -> None:
    """Importing torch and Lightning takes seconds; ``--version``, ``calc`` and usage errors need neither."""
    code = (
        "import sys; from lightning_tune.cli import main; main(sys.argv[1:]); "
        "print(sorted(set(sys.modules) & {'torch', 'lightning', 'matplotlib'}))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.stdout.splitlines()[-1] == "[]", result.stderr[-2000:]


def test_import_lightning_tune_loads_its_names_on_first_use() -> None:
    import lightning_tune

    assert set(lightning_tune._ORIGINS) == set(lightning_tune.__all__) - {"__version__"}
    code = "import sys, lightning_tune; print(sorted(set(sys.modules) & {'torch', 'lightning'}))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert result.stdout.strip() == "[]", result.stderr[-2000:]


def test_help_returns_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--max-steps" in out and "--no-progress-bar" in out


def test_python_dash_m_prints_the_version() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "lightning_tune", "--version"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("lightning-tune ")
    assert len(result.stdout.split()) == 2


def test_a_bad_precision_is_one_line_naming_the_flag_and_the_canonical_names(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["demo", "--precision", "bf17"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("lightning-tune demo: error: argument --precision: must be one of 'auto', '32-true', ")
    assert "'bf16-mixed'" in lines[0] and "alias: " in lines[0] and "got 'bf17'" in lines[0]


@pytest.mark.parametrize("command", ["demo", "calc", "bench", "report"])
def test_cli_only_assembles_the_parser_each_command_lives_in_its_module(command: str) -> None:
    """``cli`` holds no command code: every handler and sub-parser comes from ``lightning_tune.commands.<command>``."""
    argv = {"calc": ["calc", "batch-size", "--model", "gpt2", "--gpu-memory", "1GB", "--sequence-length", "8"]}
    args = cli.build_parser().parse_args(argv.get(command, [command]))
    assert args.handler.__module__ == f"lightning_tune.commands.{command}"
    tree = ast.parse(Path(cli.__file__).read_text())
    assert [node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))] == [
        "build_parser",
        "main",
    ]


def test_demo_precision_takes_an_alias_and_gives_the_canonical_name() -> None:
    assert cli.build_parser().parse_args(["demo", "--precision", "bf16"]).precision == "bf16-mixed"
    assert cli.build_parser().parse_args(["demo"]).precision == "auto"
