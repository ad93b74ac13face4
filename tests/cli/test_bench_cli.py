"""``lightning-tune bench``: one table, the same figures in bench.json and bench.csv, a plot, one-line errors."""

from __future__ import annotations

import csv
import importlib
import importlib.util
import json
import shlex
from datetime import datetime
from pathlib import Path
from typing import Any

import lightning
import pytest
import torch

from lightning_tune import _imports, cli
from lightning_tune.commands import bench
from lightning_tune.commands.args import PROG, ArgumentParser
from lightning_tune.commands.bench import add_parser
from tests.cli.test_bench_modules import CLOCK

MODULES = "tests.cli.test_bench_modules"
TINY_GPT = json.dumps({"d_model": 16, "n_layers": 1, "n_heads": 2})
# table column -> (result field, decimals shown, scale)
SHOWN = {
    "samples/s": ("samples_per_sec", 1, 1.0),
    "tokens/s": ("tokens_per_sec", 0, 1.0),
    "p50 ms": ("p50_ms", 2, 1.0),
    "p95 ms": ("p95_ms", 2, 1.0),
    "p99 ms": ("p99_ms", 2, 1.0),
}


def parser() -> ArgumentParser:
    """The ``lightning-tune`` parser with the bench command registered as ``cli.build_parser`` registers it."""
    root = ArgumentParser(prog=PROG)
    add_parser(root.add_subparsers(title="commands", dest="command", metavar="<command>"))
    return root


def run_bench(argv: list[str]) -> int:
    """``lightning-tune bench ARGV``, handled as ``cli.main`` handles it."""
    try:
        args = parser().parse_args(["bench", *argv])
    except SystemExit as exit_:
        return int(exit_.code or 0)
    return int(args.handler(args))


def table_rows(out: str) -> tuple[list[str], list[list[str]]]:
    """Header cells and rows of the printed table (columns are separated by two or more spaces)."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("batch  "))
    header = [cell for cell in lines[start].split("  ") if cell.strip()]
    rows = []
    for line in lines[start + 1 :]:
        if line.startswith("wrote"):
            break
        rows.append(line.split())
    return [cell.strip() for cell in header], rows


@pytest.fixture(autouse=True)
def _in_tmp_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every sweep runs in a scratch working directory: whatever a default writes lands there."""
    monkeypatch.chdir(tmp_path)


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setattr("lightning_tune.perf.timing.perf_counter", CLOCK)
    return CLOCK


def test_demo_sweep_prints_one_table_and_writes_the_same_figures(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_dir, png = tmp_path / "results", tmp_path / "plots" / "tradeoff.png"
    argv = ["--sequence-length", "16", "--batch-size", "1,2", "--steps", "3", "--warmup", "1", "--model-args", TINY_GPT]
    argv += ["--accelerator", "cpu", "--output-dir", str(out_dir), "--plot", str(png), "--no-progress-bar"]
    assert run_bench(argv) == 0
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    assert captured.out.startswith("lightning-tune bench (train): demo GPT (seq_len 16, d_model 16, n_layers 1")
    header, rows = table_rows(captured.out)
    assert header == [
        "batch",
        "samples/s",
        "tokens/s",
        "step p50 ms",
        "step p95 ms",
        "step p99 ms",
        "peak VRAM GiB",
        "MFU %",
    ]
    assert [row[0] for row in rows] == ["1", "2"]
    assert f"wrote {out_dir / 'bench.json'} and {out_dir / 'bench.csv'}" in captured.out
    assert f"wrote {png}" in captured.out

    record = json.loads((out_dir / "bench.json").read_text())
    results = record["results"]
    assert [r["batch_size"] for r in results] == [1, 2]
    for row, result in zip(rows, results, strict=True):
        assert result["status"] == "ok" and result["samples_per_sec"] > 0
        assert result["tokens_per_sec"] == pytest.approx(result["samples_per_sec"] * 16)
        assert result["p50_ms"] <= result["p95_ms"] <= result["p99_ms"]
        for cell, name in zip(row[1:], header[1:], strict=True):
            key = name.removeprefix("step ")
            if key not in SHOWN:
                assert cell == "-"  # no VRAM, no MFU on a CPU
                continue
            field, decimals, _ = SHOWN[key]
            assert float(cell.replace(",", "")) == pytest.approx(result[field], abs=0.51 * 10**-decimals), name
    # the CSV holds the JSON's figures, unrounded
    with open(out_dir / "bench.csv", newline="") as handle:
        csv_rows = list(csv.DictReader(handle))
    assert [row["batch_size"] for row in csv_rows] == ["1", "2"]
    for row, result in zip(csv_rows, results, strict=True):
        for key, value in result.items():
            assert row[key] == ("" if value is None else str(value)), key

    assert record["complete"] is True
    assert record["versions"]["torch"] == torch.__version__
    assert record["versions"]["lightning"] == lightning.__version__
    assert record["run"]["device"].startswith("cpu (") and record["run"]["precision"] == "32-true"
    assert datetime.fromisoformat(record["date"]).tzinfo is not None
    assert record["settings"]["batch_sizes"] == [1, 2] and record["settings"]["sequence_length"] == 16
    # the recorded command spells out every option and parses back to the same sweep
    words = shlex.split(record["command"])
    assert words[:2] == ["lightning-tune", "bench"] and "--sequence-length" in words and "--precision" in words
    again = vars(parser().parse_args(words[1:]))
    first = vars(parser().parse_args(["bench", *argv]))
    assert {k: v for k, v in again.items() if k != "handler"} == {k: v for k, v in first.items() if k != "handler"}
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_predict_mode_reports_request_latency_and_oom_rows(
    clock: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--mode", "predict", "--model", f"{MODULES}:ClockedModule", "--model-args", '{"oom_above": 2}']
    argv += ["--batch-size", "1,4,2", "--steps", "3", "--warmup", "1", "--output-dir", str(tmp_path)]
    assert run_bench([*argv, "--accelerator", "cpu", "--no-progress-bar"]) == 0
    header, rows = table_rows(capsys.readouterr().out)
    assert header[3:6] == ["request p50 ms", "request p95 ms", "request p99 ms"]
    # every predict_step takes 10 ms on the fake clock; 8 tokens per sample
    assert rows == [
        ["1", "100.0", "800", "10.00", "10.00", "10.00", "-", "-"],
        ["4", "OOM", "-", "-", "-", "-", "-", "-"],
        ["2", "200.0", "1,600", "10.00", "10.00", "10.00", "-", "-"],
    ]
    record = json.loads((tmp_path / "bench.json").read_text())
    assert record["results"][1]["message"] == "CUDA out of memory. Tried to allocate 2.00 GiB"


def test_a_failing_setting_keeps_the_results_before_it(
    clock: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--model", f"{MODULES}:ClockedModule", "--model-args", '{"fail_above": 1}', "--batch-size", "1,2,4"]
    argv += ["--steps", "2", "--warmup", "1", "--output-dir", str(tmp_path), "--accelerator", "cpu"]
    assert run_bench([*argv, "--no-progress-bar"]) == 1
    captured = capsys.readouterr()
    assert captured.err.strip().splitlines() == [
        "lightning-tune bench: error: batch size 2 failed: ValueError: this module cannot take 2 samples "
        f"(the batch sizes before it are in {tmp_path})"
    ]
    assert [row[0] for row in table_rows(captured.out)[1]] == ["1"]
    record = json.loads((tmp_path / "bench.json").read_text())
    assert record["complete"] is False
    assert [r["batch_size"] for r in record["results"]] == [1]
    assert (tmp_path / "bench.csv").read_text().splitlines()[1].startswith("1,ok,2,")


def _flash_message() -> str:
    installed = _imports.is_available("flash_attn") or _imports.is_available("flash_attn.cute")
    return "needs a CUDA device" if installed else "pip install 'lightning-tune[flash4]'"


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        pytest.param(["--batch-size", "4,x"], "--batch-size: must be distinct integers >= 1", id="batch-not-int"),
        pytest.param(["--batch-size", "0"], "argument --batch-size: must be distinct integers >= 1", id="batch-0"),
        pytest.param(["--steps", "1"], "--steps: must be an integer from 2 to 1000000, got '1'", id="steps"),
        pytest.param(["--warmup", "-1"], "--warmup: must be an integer from 0 to 1000000", id="warmup"),
        pytest.param(["--mode", "eval"], "invalid choice: 'eval'", id="mode"),
        pytest.param(["--model", "mymodel"], "`model` must be 'package.module:ClassName', got 'mymodel'", id="spec"),
        pytest.param(["--model", "no_such_package.models:Net"], "cannot import module", id="import-fails"),
        pytest.param(["--model", "collections:OrderedDict"], "must name a LightningModule subclass", id="not-module"),
        pytest.param(["--model", f"{MODULES}:NoBatchSize"], "cannot set the batch size", id="no-batch-size"),
        pytest.param(["--model-args", "[1]"], "--model-args: must be a JSON object", id="model-args-list"),
        pytest.param(["--model-args", "{d_model: 8}"], "--model-args: must be a JSON object", id="model-args-json"),
        pytest.param(["--model-args", '{"depth": 2}'], "must be fields of GPTConfig", id="demo-unknown-arg"),
        pytest.param(
            ["--model", f"{MODULES}:ClockedModule", "--seq-len", "64"],
            "`sequence_length` applies only",
            id="seq-len-user",
        ),
        pytest.param(["--plot", "out.jpg"], "`plot` must be a path ending in .png, got 'out.jpg'", id="plot"),
        pytest.param(["--optimizer", "sgd9"], "--optimizer: must be one of 'adamw_fused', 'adam8bit'", id="optimizer"),
        pytest.param(  # the module's own optimizer: nothing to swap, refused by the flag itself
            ["--optimizer", "sgd"], "--optimizer: must be one of 'adamw_fused', 'adam8bit'", id="optimizer-own"
        ),
        pytest.param(["--attention", "fast"], "--attention: must be one of 'auto', 'flash'", id="attention"),
        pytest.param(["--precision", "fp8"], "--precision: must be one of 'auto', '32-true'", id="precision"),
        pytest.param(["--attention", "flash", "--accelerator", "cpu"], _flash_message(), id="flash-on-cpu"),
        pytest.param(["--precision", "16-mixed", "--accelerator", "cpu"], "needs a CUDA GPU", id="fp16-on-cpu"),
        pytest.param(["--no-such-flag"], "unrecognized arguments: --no-such-flag", id="unknown-flag"),
        pytest.param(
            ["--output-dir", "/proc/no-such-dir"], "`output_dir` '/proc/no-such-dir' cannot hold the results", id="out"
        ),
        pytest.param(["--p95-budget-ms", "0"], "`p95_budget_ms` must be in (0, inf], got 0.0", id="p95-zero"),
        pytest.param(["--p99-budget-ms", "-5"], "`p99_budget_ms` must be in (0, inf], got -5.0", id="p99-negative"),
        pytest.param(["--p95-budget-ms", "nan"], "`p95_budget_ms` must be a finite number, got nan", id="p95-nan"),
        pytest.param(["--p99-budget-ms", "inf"], "`p99_budget_ms` must be a finite number, got inf", id="p99-inf"),
        pytest.param(
            ["--p95-budget-ms", "50ms"], "--p95-budget-ms: must be a number of milliseconds > 0, got '50ms'", id="unit"
        ),
    ],
)
def test_bad_arguments_exit_2_with_one_line(argv: list[str], expected: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_bench(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("lightning-tune") and "error: " in lines[0] and expected in lines[0]
    assert "Traceback" not in captured.err


def test_missing_bitsandbytes_is_a_usage_error_naming_the_extra(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real_import = importlib.import_module

    def fake_import(name: str, *args: Any) -> Any:
        if name == "bitsandbytes":
            raise ModuleNotFoundError("No module named 'bitsandbytes'", name=name)
        return real_import(name, *args)

    monkeypatch.setattr(_imports.importlib, "import_module", fake_import)
    assert run_bench(["--optimizer", "adamw8bit"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install 'lightning-tune[bnb]'" in err


def test_flags_take_the_vocabularys_aliases_and_give_the_canonical_names() -> None:
    argv = ["--precision", "fp32", "--optimizer", "adamw_torch_fused", "--attention", "scaled_dot_product_attention"]
    args = parser().parse_args(["bench", *argv, "--seq-len", "8"])
    assert (args.precision, args.optimizer, args.attention) == ("32-true", "adamw_fused", "sdpa")
    assert args.sequence_length == 8  # --seq-len is the short form of --sequence-length
    assert parser().parse_args(["bench"]).precision == "auto"


def test_output_dir_must_not_be_a_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    taken = tmp_path / "results"
    taken.write_text("")
    assert run_bench(["--output-dir", str(taken)]) == 2
    assert "`output_dir` must be a directory" in capsys.readouterr().err


def test_bench_is_a_command_of_lightning_tune(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench in cli.COMMANDS
    assert run_bench(["--help"]) == 0
    out = capsys.readouterr().out
    assert "--batch-size LIST" in out and "--plot PNG" in out
    if importlib.util.find_spec("lightning_tune.commands.calc") is None:
        pytest.skip("the calc command is not in this checkout, so cli.main cannot build its parser")
    assert cli.main(["bench", "--help"]) == 0


# ---------------------------------------------------------------------------------------------- latency budgets

CLOCKED = ["--model", f"{MODULES}:ClockedModule", "--accelerator", "cpu", "--no-progress-bar", "--warmup", "0"]


@pytest.mark.slow
def test_huge_budget_recommends_the_largest_batch_size_of_the_demo(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--mode", "predict", "--batch-size", "1,2,4,8", "--p95-budget-ms", "1e9", "--steps", "20"]
    argv += ["--seq-len", "16", "--model-args", TINY_GPT, "--accelerator", "cpu", "--no-progress-bar"]
    assert run_bench([*argv, "--warmup", "1", "--output-dir", "out"]) == 0
    out = capsys.readouterr().out
    assert "latency budget: request p95 <= 1e+09 ms; each percentile from 20 timed requests per batch size" in out
    assert "  recommended  batch size 8: " in out and "uncertain" not in out
    record = json.loads(Path("out/bench.json").read_text())
    assert record["recommendation"]["batch_size"] == 8 and record["recommendation"]["firm"] is True
    assert record["recommendation"]["budgets_ms"] == {"p95": 1e9}
    assert "--p95-budget-ms 1000000000.0" in record["command"]


def test_impossible_budget_exits_1_naming_the_smallest_batch_size_latency(
    clock: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [*CLOCKED, "--mode", "predict", "--model-args", '{"durations_ms": [3.0], "ms_per_sample": 1.0}']
    argv += ["--batch-size", "2,1", "--steps", "20", "--p95-budget-ms", "0.001", "--output-dir", "out"]
    assert run_bench([*argv, "--plot", "plot.png"]) == 1
    captured = capsys.readouterr()
    assert captured.err.strip().splitlines() == [
        "lightning-tune bench: error: no batch size meets the latency budget (request p95 <= 0.001 ms): the "
        "smallest, batch size 1, has request p95 4.00 ms"
    ]
    assert "wrote plot.png" in captured.out and "\n\n" not in captured.out  # table, files and plot, no gap
    assert json.loads(Path("out/bench.json").read_text())["recommendation"]["batch_size"] is None


@pytest.mark.slow
def test_train_mode_budget_on_a_fake_clock_goes_into_the_json_and_the_plot(
    clock: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [*CLOCKED, "--model-args", '{"durations_ms": [0.5], "ms_per_sample": 1.0}', "--batch-size", "1,2,4,8"]
    argv += ["--steps", "5", "--p95-budget-ms", "5", "--output-dir", "out", "--plot", "plot.png"]
    assert run_bench(argv) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    start = lines.index(next(line for line in lines if line.startswith("latency budget:")))
    assert lines[start : start + 5] == [
        "latency budget: step p95 <= 5 ms; each percentile from 5 timed steps per batch size",
        "  recommended  batch size 4 (uncertain): 888.9 samples/s, step p95 4.50 ms",
        "  knee         batch size 4: 888.9 samples/s, 94 % of the best (941.2 at batch size 8); knee = smallest "
        "batch size reaching 90 % of the best",
        "  binds        both: batch size 4 is the knee, and the budget stops there (batch size 8 has step p95 8.50 ms)",
        "  uncertain    the percentiles rest on 5 timed steps per batch size; a p95 needs 20 for one step beyond it. "
        "Run with --steps 20 or more to make the choice firm",
    ]
    recommendation = json.loads(Path("out/bench.json").read_text())["recommendation"]
    assert recommendation["batch_size"] == 4 and recommendation["binds"] == "both"
    assert recommendation["latency_ms"]["p95"] == pytest.approx(4.5)
    assert recommendation["firm"] is False and recommendation["steps_for_firm"] == 20
    assert Path("plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------------------------------------- where files go


def test_an_unwritable_plot_path_fails_before_any_batch_size_runs(
    clock: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [*CLOCKED, "--batch-size", "1", "--steps", "2", "--output-dir", "out", "--plot", "/proc/no-such/p.png"]
    assert run_bench(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lightning-tune bench: error: `plot` '/proc/no-such/p.png' cannot")
    assert captured.out == "" and not Path("out/bench.json").exists()  # nothing ran


def test_default_output_is_a_new_version_under_lightning_logs(clock: Any, tmp_path: Path) -> None:
    argv = [*CLOCKED, "--batch-size", "1", "--steps", "2"]
    assert run_bench(argv) == 0
    assert run_bench(argv) == 0
    bench = tmp_path / "lightning_logs" / "bench"
    assert sorted(p.name for p in bench.iterdir()) == ["version_0", "version_1"]  # the second kept the first
    assert all((bench / v / "bench.json").is_file() for v in ("version_0", "version_1"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lightning_logs"]
    record = json.loads((bench / "version_1" / "bench.json").read_text())
    assert "--output-dir" not in record["command"]  # run again, it makes a new version rather than overwrite


def test_a_usage_error_leaves_nothing_behind(tmp_path: Path) -> None:
    assert run_bench(["--model", f"{MODULES}:NoBatchSize"]) == 2
    assert list(tmp_path.iterdir()) == []


def test_generated_output_is_kept_out_of_version_control() -> None:
    import shutil
    import subprocess

    root = Path(__file__).resolve().parents[2]
    if shutil.which("git") is None or not (root / ".git").exists():
        pytest.skip("not a git checkout")
    paths = ["lightning_logs/bench/version_0/bench.json", "bench_results/bench.json", "tradeoff.png"]
    ignored = subprocess.run(
        ["git", "check-ignore", "--no-index", *paths], cwd=root, capture_output=True, text=True, check=False
    )
    assert ignored.stdout.split() == paths
