"""``lightning-tune bench``: sweep batch sizes, print throughput and latency percentiles, write JSON/CSV and a plot.

The parser is built without importing torch or Lightning; the handler imports :mod:`lightning_tune.bench`, the
engine that does the work.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning_tune.cli import ACCELERATORS, PRECISIONS, PROG, _int_at_least, _usage_error

if TYPE_CHECKING:
    from lightning_tune.bench import BenchResult, BenchRunner, BenchSettings, LatencyBudget

__all__ = ["add_parser"]

_DEFAULT_BATCH_SIZES = "1,4,8,16,32"
#: Where sweeps go without --output-dir: a new version_N per sweep beside Lightning's own runs, so no sweep
#: overwrites another and the lightning_logs/ a Lightning project already keeps out of version control holds them.
_DEFAULT_OUTPUT_ROOT = os.path.join("lightning_logs", "bench")


def _batch_sizes(text: str) -> tuple[int, ...]:
    from lightning_tune.bench.settings import parse_batch_sizes

    try:
        return parse_batch_sizes(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be distinct integers >= 1 separated by commas, such as '1,4,8', got {text!r}"
        ) from None


def _milliseconds(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of milliseconds > 0, got {text!r}") from None


def _json_object(text: str) -> dict[str, Any]:
    allowed = "must be a JSON object such as '{\"lr\": 0.001}'"
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"{allowed}, got {text!r} ({err})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{allowed}, got {text!r}")
    return value


def add_parser(commands: Any) -> None:
    """Register the ``bench`` sub-command.

    Args:
        commands: The ``add_subparsers()`` action of the ``lightning-tune`` parser.
    """
    parser = commands.add_parser(
        "bench",
        help="sweep batch sizes and print throughput, latency percentiles, peak VRAM and MFU",
        description=(
            "Run each batch size in a fresh Trainer (warm-up steps first, left out of the figures) and print one "
            "table: samples/s, tokens/s, p50/p95/p99 step (train) or request (predict) latency, peak VRAM and MFU. "
            "The figures are also written to bench.json and bench.csv in --output-dir after every batch size; a batch "
            "size that runs out of memory is reported as OOM and the sweep goes on. With --p95-budget-ms or "
            "--p99-budget-ms it recommends the largest batch size within the budget and names the throughput knee; "
            "exit status 1 when no batch size is within it."
        ),
    )
    parser.add_argument(
        "--mode", choices=("train", "predict"), default="train", help="time optimizer steps or predict_step calls"
    )
    parser.add_argument(
        "--model",
        default="demo",
        help="'demo' (the demo GPT on synthetic tokens) or package.module:ClassName of a LightningModule whose "
        "dataloader reads self.batch_size (default: demo)",
    )
    parser.add_argument(
        "--model-args",
        type=_json_object,
        default=None,
        metavar="JSON",
        help="keyword arguments of the module as a JSON object; for the demo, GPTConfig fields such as "
        '\'{"d_model": 256, "n_layers": 4}\'',
    )
    parser.add_argument(
        "--datamodule", default=None, help="package.module:ClassName of a LightningDataModule that provides the data"
    )
    parser.add_argument(
        "--datamodule-args", type=_json_object, default=None, metavar="JSON", help="its keyword arguments as JSON"
    )
    parser.add_argument(
        "--batch-size",
        type=_batch_sizes,
        default=_DEFAULT_BATCH_SIZES,
        metavar="LIST",
        help=f"comma-separated batch sizes (default: {_DEFAULT_BATCH_SIZES})",
    )
    parser.add_argument(
        "--seq-len", type=_int_at_least(1), default=None, help="tokens per sequence, demo only (default: 512)"
    )
    parser.add_argument(
        "--steps",
        type=_int_at_least(2),
        default=100,
        help="measured steps (train) or predict batches per batch size (default: 100)",
    )
    parser.add_argument(
        "--warmup", type=_int_at_least(0), default=10, help="steps run first and left out (default: 10)"
    )
    parser.add_argument(
        "--precision",
        choices=PRECISIONS,
        default=None,
        help="precision (default: bf16-mixed or 16-mixed on a CUDA GPU, 32-true otherwise)",
    )
    parser.add_argument(
        "--optimizer",
        default=None,
        help="swap the module's optimizer through TunePlugin, e.g. adamw8bit (needs bitsandbytes) or adamw_fused",
    )
    parser.add_argument(
        "--attention", default=None, help="route attention through TunePlugin: auto, flash, sdpa or eager"
    )
    parser.add_argument("--accelerator", choices=ACCELERATORS, default="auto", help="where to run (default: auto)")
    parser.add_argument("--seed", type=_int_at_least(0), default=0, help="seed set before each batch size")
    for q in (95, 99):
        parser.add_argument(
            f"--p{q}-budget-ms",
            type=_milliseconds,
            default=None,
            metavar="MS",
            help=f"p{q} latency budget: recommend the largest batch size whose p{q} step (train) or request "
            "(predict) latency is within it",
        )
    parser.add_argument(
        "--output-dir",
        default=None,
        metavar="DIR",
        help="directory that receives bench.json and bench.csv (default: a new "
        f"{os.path.join(_DEFAULT_OUTPUT_ROOT, 'version_N')} per sweep)",
    )
    parser.add_argument(
        "--plot", default=None, metavar="PNG", help="draw samples/s against p95 latency (and the budget) into PNG"
    )
    parser.add_argument("--no-progress-bar", action="store_true", help="hide the per-batch-size progress bars")
    parser.set_defaults(handler=_run_bench_command)


def _command_line(args: argparse.Namespace) -> str:
    """The command that reproduces the sweep, every option spelled out."""
    parts = [PROG, "bench", "--mode", args.mode, "--model", args.model]
    if args.model_args:
        parts += ["--model-args", json.dumps(args.model_args)]
    if args.datamodule:
        parts += ["--datamodule", args.datamodule]
    if args.datamodule_args:
        parts += ["--datamodule-args", json.dumps(args.datamodule_args)]
    parts += ["--batch-size", ",".join(str(size) for size in args.batch_size)]
    if args.seq_len is not None:
        parts += ["--seq-len", str(args.seq_len)]
    parts += ["--steps", str(args.steps), "--warmup", str(args.warmup)]
    for flag, value in (("--precision", args.precision), ("--optimizer", args.optimizer)):
        if value is not None:
            parts += [flag, value]
    if args.attention is not None:
        parts += ["--attention", args.attention]
    parts += ["--accelerator", args.accelerator, "--seed", str(args.seed)]
    for flag, ms in (("--p95-budget-ms", args.p95_budget_ms), ("--p99-budget-ms", args.p99_budget_ms)):
        if ms is not None:
            parts += [flag, repr(ms)]
    if args.output_dir is not None:  # the default makes a new directory for every sweep
        parts += ["--output-dir", args.output_dir]
    if args.plot:
        parts += ["--plot", args.plot]
    if args.no_progress_bar:
        parts.append("--no-progress-bar")
    return shlex.join(parts)


def _settings(args: argparse.Namespace) -> BenchSettings:
    from lightning_tune.bench import BenchSettings

    return BenchSettings(
        batch_sizes=args.batch_size,
        mode=args.mode,
        model=args.model,
        model_args=args.model_args or {},
        datamodule=args.datamodule,
        datamodule_args=args.datamodule_args or {},
        seq_len=args.seq_len,
        steps=args.steps,
        warmup=args.warmup,
        precision=args.precision or "auto",
        optimizer=args.optimizer,
        attention=args.attention,
        accelerator=args.accelerator,
        seed=args.seed,
    )


def _headline(runner: BenchRunner, settings: BenchSettings) -> str:
    run = runner.describe()
    what = "optimizer steps" if settings.mode == "train" else "predict requests"
    swaps = "".join(f", {key} {run[key]}" for key in ("optimizer", "attention") if run[key])
    return (
        f"{PROG} bench ({settings.mode}): {run['model']} on {run['device']}, {run['precision']}{swaps}; "
        f"{settings.steps} {what} per batch size after {settings.warmup} warm-up"
    )


def _check_writable(directory: str | Path, problem: str) -> None:
    """Create ``directory`` if needed and make sure a file can be written in it.

    Raises:
        ValueError: ``problem`` and why.
    """
    import tempfile

    try:
        os.makedirs(directory, exist_ok=True)
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as err:
        raise ValueError(f"{problem}: {err.strerror or err}") from None


def _budget(args: argparse.Namespace) -> LatencyBudget | None:
    from lightning_tune.bench import LatencyBudget

    if args.p95_budget_ms is None and args.p99_budget_ms is None:
        return None
    return LatencyBudget(p95_budget_ms=args.p95_budget_ms, p99_budget_ms=args.p99_budget_ms)


def _run_bench_command(args: argparse.Namespace) -> int:
    from lightning_tune.bench import (
        BenchRunner,
        Recommendation,
        SettingFailed,
        check_png_path,
        format_recommendation,
        format_table,
        new_version_dir,
        plot_tradeoff,
        sweep_record,
        write_results,
    )

    if args.model != "demo" and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # `package.module` is found from the current directory, as with python -m
    output_dir = args.output_dir
    try:
        settings = _settings(args)
        budget = _budget(args)
        plot = check_png_path(args.plot) if args.plot is not None else None
        if output_dir is not None and os.path.exists(output_dir) and not os.path.isdir(output_dir):
            raise ValueError(f"`output_dir` must be a directory, got the file {output_dir!r}")
        runner = BenchRunner(settings, progress=not args.no_progress_bar)
        # where the files go is checked before any batch size runs, and created only once nothing else is wrong
        if output_dir is None:
            _check_writable(_DEFAULT_OUTPUT_ROOT, f"the default output directory {_DEFAULT_OUTPUT_ROOT!r} cannot be "
                            "created here (give --output-dir)")  # fmt: skip
            output_dir = str(new_version_dir(_DEFAULT_OUTPUT_ROOT))
        else:
            _check_writable(output_dir, f"`output_dir` {output_dir!r} cannot hold the results")
        if plot is not None:
            _check_writable(plot.parent, f"`plot` {args.plot!r} cannot be written")
    except (ValueError, TypeError, ModuleNotFoundError) as err:
        return _usage_error("bench", err)
    for note in runner.notes:
        print(f"{PROG} bench: {note}", file=sys.stderr)
    command = _command_line(args)

    def save(
        results: list[BenchResult], complete: bool = False, recommendation: Recommendation | None = None
    ) -> tuple[Path, Path]:
        decision = recommendation.as_dict() if recommendation is not None else None
        record = sweep_record(
            settings, results, run=runner.describe(), command=command, complete=complete, recommendation=decision
        )
        return write_results(output_dir, record, results)

    done: list[BenchResult] = []

    def keep(results: list[BenchResult]) -> None:
        done[:] = results
        save(results)

    try:
        results = runner.sweep(after_each=keep)
    except OSError as err:  # the results could not be written after a batch size
        print(f"{PROG} bench: error: cannot write the results to {output_dir}: {err}", file=sys.stderr)
        return 1
    except SettingFailed as err:
        if done:
            print(_headline(runner, settings))
            print(format_table(done, mode=settings.mode))
        print(f"{PROG} bench: error: {err} (the batch sizes before it are in {output_dir})", file=sys.stderr)
        return 1
    recommendation = budget.recommend(results) if budget is not None else None
    json_path, csv_path = save(results, complete=True, recommendation=recommendation)
    print(_headline(runner, settings))
    print(format_table(results, mode=settings.mode))
    failure = None
    if recommendation is not None:
        lines = format_recommendation(recommendation, mode=settings.mode)
        if recommendation.batch_size is None:  # the first line says no batch size is within the budget
            failure, lines = lines[0], lines[1:]
        for line in lines:
            print(line)
    print(f"wrote {json_path} and {csv_path}")
    if plot is not None:
        try:
            run = runner.describe()
            subtitle = f"{run['model']} on {run['device']}, {run['precision']}"
            plot_tradeoff(results, plot, mode=settings.mode, subtitle=subtitle, recommendation=recommendation)
        except (ValueError, OSError) as err:
            print(f"{PROG} bench: error: no plot: {err}", file=sys.stderr)
            return 1
        print(f"wrote {plot}")
    if failure is not None:
        print(f"{PROG} bench: error: {failure}", file=sys.stderr)
        return 1
    return 0
