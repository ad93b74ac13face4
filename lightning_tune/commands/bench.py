"""``lightning-tune bench``: sweep batch sizes, print throughput and latency percentiles, write JSON/CSV and a plot."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import sys
from pathlib import Path
from typing import Any

from lightning_tune import bench
from lightning_tune._validation import MAX_SEED, check_writable_dir
from lightning_tune.bench.budget import Recommendation, format_recommendation
from lightning_tune.bench.files import new_version_dir, sweep_record, write_results
from lightning_tune.bench.plot import check_png_path, plot_tradeoff
from lightning_tune.bench.settings import DEMO_MAX_SEQ_LEN, MAX_STEPS, MODES, parse_batch_sizes
from lightning_tune.commands.args import PROG, IntRange, attention, name_in, path, precision, usage_error
from lightning_tune.vocab import ACCELERATORS, canonical_optimizer

_DEFAULT_BATCH_SIZES = "1,4,8,16,32"
#: Where sweeps go without --output-dir: a new version_N per sweep beside Lightning's own runs, so no sweep
#: overwrites another and the lightning_logs/ a Lightning project already keeps out of version control holds them.
_DEFAULT_OUTPUT_ROOT = os.path.join("lightning_logs", "bench")


def _batch_sizes(text: str) -> tuple[int, ...]:
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


def _swap_optimizer(text: str) -> str:
    from lightning_tune.swaps.optimizer import TARGETS  # imports torch: only when the flag is given

    return name_in(canonical_optimizer, TARGETS)(text)


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
    """Register the ``bench`` sub-command on ``commands``, the ``lightning-tune`` parser's sub-parsers action."""
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
    parser.add_argument("--mode", choices=MODES, default="train", help="time optimizer steps or predict_step calls")
    parser.add_argument(
        "--model",
        default="demo",
        help="'demo' (the demo GPT on synthetic tokens) or package.module:ClassName of a LightningModule whose "
        "dataloader reads self.batch_size (default: demo)",
    )
    parser.add_argument(
        "--model-args",
        type=_json_object,
        metavar="JSON",
        help="keyword arguments of the module as a JSON object; for the demo, GPTConfig fields such as "
        '\'{"d_model": 256, "n_layers": 4}\'',
    )
    parser.add_argument("--datamodule", help="package.module:ClassName of a LightningDataModule that provides the data")
    parser.add_argument("--datamodule-args", type=_json_object, metavar="JSON", help="its keyword arguments as JSON")
    parser.add_argument(
        "--batch-size",
        type=_batch_sizes,
        default=_DEFAULT_BATCH_SIZES,
        metavar="LIST",
        help=f"comma-separated batch sizes (default: {_DEFAULT_BATCH_SIZES})",
    )
    parser.add_argument(
        "--sequence-length",
        "--seq-len",
        type=IntRange(1, DEMO_MAX_SEQ_LEN),
        metavar="N",
        help="tokens per sequence, demo only (default: 512)",
    )
    parser.add_argument(
        "--steps",
        type=IntRange(2, MAX_STEPS),
        default=100,
        help="measured steps (train) or predict batches per batch size (default: 100)",
    )
    parser.add_argument(
        "--warmup", type=IntRange(0, MAX_STEPS), default=10, help="steps run first and left out (default: 10)"
    )
    parser.add_argument(
        "--precision", type=precision, default="auto", help="e.g. bf16-mixed or bf16 (default: auto, for the device)"
    )
    parser.add_argument(
        "--optimizer",
        type=_swap_optimizer,
        help="swap the module's optimizer through TunePlugin, e.g. adamw8bit (needs bitsandbytes) or adamw_fused",
    )
    parser.add_argument(
        "--attention",
        type=attention,
        help="route attention through TunePlugin: auto, flash, sdpa or eager",
    )
    parser.add_argument("--accelerator", choices=ACCELERATORS, default="auto", help="where to run (default: auto)")
    parser.add_argument(
        "--seed", type=IntRange(0, MAX_SEED), default=0, help="seed set before each batch size, below 2**32"
    )
    for q in (95, 99):
        parser.add_argument(
            f"--p{q}-budget-ms",
            type=_milliseconds,
            metavar="MS",
            help=f"p{q} latency budget: recommend the largest batch size whose p{q} step (train) or request "
            "(predict) latency is within it",
        )
    parser.add_argument(
        "--output-dir",
        type=path,
        metavar="DIR",
        help="directory that receives bench.json and bench.csv (default: a new "
        f"{os.path.join(_DEFAULT_OUTPUT_ROOT, 'version_N')} per sweep)",
    )
    parser.add_argument(
        "--plot",
        type=path,
        metavar="PNG",
        help="draw samples/s against p95 latency (and the budget) into PNG",
    )
    parser.add_argument("--no-progress-bar", action="store_true", help="hide the per-batch-size progress bars")
    parser.set_defaults(handler=_run_bench_command)


def _command_line(args: argparse.Namespace) -> str:
    """The command that reproduces the sweep: every option given or defaulted, in the order of ``--help``."""
    words = [PROG, "bench"]
    for dest, value in vars(args).items():  # without --output-dir, the default makes a new directory per sweep
        if dest in ("command", "handler") or value is None or value is False or value == {}:
            continue
        flag = "--" + dest.replace("_", "-")
        if value is True:
            words.append(flag)
        elif isinstance(value, dict):
            words += [flag, json.dumps(value)]
        else:
            words += [flag, ",".join(map(str, value)) if isinstance(value, tuple) else str(value)]
    return shlex.join(words)


def _headline(runner: bench.BenchRunner, settings: bench.BenchSettings) -> str:
    run = runner.describe()
    what = "optimizer steps" if settings.mode == "train" else "predict requests"
    swaps = "".join(f", {key} {run[key]}" for key in ("optimizer", "attention") if run[key])
    return (
        f"{PROG} bench ({settings.mode}): {run['model']} on {run['device']}, {run['precision']}{swaps}; "
        f"{settings.steps} {what} per batch size after {settings.warmup} warm-up"
    )


def _run_bench_command(args: argparse.Namespace) -> int:
    if args.model != "demo" and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # `package.module` is found from the current directory, as with python -m
    output_dir = args.output_dir
    try:
        names = {field.name for field in dataclasses.fields(bench.BenchSettings)}
        given = {name: value for name, value in vars(args).items() if name in names and value is not None}
        settings = bench.BenchSettings(batch_sizes=args.batch_size, **given)
        budget = None
        if args.p95_budget_ms is not None or args.p99_budget_ms is not None:
            budget = bench.LatencyBudget(p95_budget_ms=args.p95_budget_ms, p99_budget_ms=args.p99_budget_ms)
        plot = check_png_path(args.plot) if args.plot is not None else None
        if output_dir is not None and os.path.exists(output_dir) and not os.path.isdir(output_dir):
            raise ValueError(f"`output_dir` must be a directory, got the file {output_dir!r}")
        runner = bench.BenchRunner(settings, progress=not args.no_progress_bar)
        # where the files go is checked before any batch size runs, and created only once nothing else is wrong
        if output_dir is None:
            check_writable_dir(
                _DEFAULT_OUTPUT_ROOT,
                f"the default output directory {_DEFAULT_OUTPUT_ROOT!r} cannot be created here (give --output-dir)",
            )
            output_dir = str(new_version_dir(_DEFAULT_OUTPUT_ROOT))
        else:
            check_writable_dir(output_dir, f"`output_dir` {output_dir!r} cannot hold the results")
        if plot is not None:
            check_writable_dir(plot.parent, f"`plot` {args.plot!r} cannot be written")
    except (ValueError, TypeError, ModuleNotFoundError) as err:
        return usage_error("bench", err)
    for note in runner.notes:
        print(f"{PROG} bench: {note}", file=sys.stderr)
    command = _command_line(args)
    done: list[bench.BenchResult] = []

    def save(
        results: list[bench.BenchResult], complete: bool = False, recommendation: Recommendation | None = None
    ) -> tuple[Path, Path]:
        done[:] = results
        decision = recommendation.as_dict() if recommendation is not None else None
        record = sweep_record(
            settings, results, run=runner.describe(), command=command, complete=complete, recommendation=decision
        )
        return write_results(output_dir, record, results)

    try:
        results = runner.sweep(after_each=save)
    except OSError as err:  # the results could not be written after a batch size
        print(f"{PROG} bench: error: cannot write the results to {output_dir}: {err}", file=sys.stderr)
        return 1
    except bench.SettingFailed as err:
        if done:
            print(_headline(runner, settings))
            print(bench.format_table(done, mode=settings.mode))
        print(f"{PROG} bench: error: {err} (the batch sizes before it are in {output_dir})", file=sys.stderr)
        return 1
    recommendation = budget.recommend(results) if budget is not None else None
    json_path, csv_path = save(results, complete=True, recommendation=recommendation)
    print(_headline(runner, settings))
    print(bench.format_table(results, mode=settings.mode))
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
