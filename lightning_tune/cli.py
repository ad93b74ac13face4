"""Command-line interface: ``lightning-tune <command> [options]`` (also ``python -m lightning_tune``).

Each command is registered by its own ``_add_<command>_parser`` function, which builds the sub-parser and sets its
handler; adding a command means adding one such function to :data:`_COMMANDS`. Usage errors exit with status 2 and a
one-line message on stderr. Each handler imports what its command needs (the demo's model and data) only when
that command runs.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

if TYPE_CHECKING:
    from lightning_tune.demos.run import DemoSummary

__all__ = ["ACCELERATORS", "PRECISIONS", "PROG", "build_parser", "main"]

#: Program name shown in help and messages.
PROG = "lightning-tune"

#: Accelerator names accepted by ``demo --accelerator``.
ACCELERATORS: tuple[str, ...] = ("auto", "cpu", "gpu", "cuda", "mps")
#: Lightning precision names accepted by ``demo --precision``.
PRECISIONS: tuple[str, ...] = ("32-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true", "64-true")

_Handler = Callable[[argparse.Namespace], int]


class _ArgumentParser(argparse.ArgumentParser):
    """ArgumentParser whose usage errors are a single line on stderr (exit status 2)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("lightning-tune")
    except PackageNotFoundError:
        import lightning_tune

        return str(getattr(lightning_tune, "__version__", "unknown"))


def _int_at_least(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    rule = f"an integer >= {minimum}" if maximum is None else f"an integer from {minimum} to {maximum}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {rule}, got {text!r}") from None
        if value < minimum or (maximum is not None and value > maximum):
            raise argparse.ArgumentTypeError(f"must be {rule}, got {text!r}")
        return value

    return parse


def _text(text: str) -> str:
    """A text argument that an empty value would silently replace by its default."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"must be a non-empty text, got {text!r}")
    return text


def _path(text: str) -> str:
    """A path argument: an empty one would silently mean the current directory."""
    if not text.strip():
        raise argparse.ArgumentTypeError("must be a non-empty path (use '.' for the current directory), got ''")
    return text


_DEVICES_ALLOWED = "must be a device count >= 1, -1 (all), 'auto' or device indices such as '0,1'"


def _devices(text: str) -> int | str:
    """Parse ``--devices``: a count >= 1, ``-1`` (all), ``auto``, or a comma-separated list of device indices."""
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        parts = text.split(",")
        if len(parts) > 1 and all(p.strip().isdigit() for p in parts if p.strip()):
            return text
        raise argparse.ArgumentTypeError(_DEVICES_ALLOWED + f", got {text!r}") from None
    if value == 0 or value < -1:
        raise argparse.ArgumentTypeError(_DEVICES_ALLOWED + f", got {text!r}")
    return value


def _add_demo_parser(commands: Any) -> None:
    parser = commands.add_parser(
        "demo",
        help="train a small GPT on synthetic tokens with the pack's callbacks and print a summary",
        description=(
            "Train a small GPT on a synthetic token corpus (generated locally, nothing is downloaded) with "
            "WarmupCosine and AdaptiveLROnPlateau, then print how far the loss fell and where the TensorBoard "
            "logs are. The defaults took 20 s on two otherwise idle CPU cores (14 s of it training), and several "
            "minutes when other work shared them."
        ),
    )
    parser.add_argument("--max-steps", type=_int_at_least(1), default=300, help="optimizer steps (default: 300)")
    parser.add_argument(
        "--batch-size",
        type=_int_at_least(1),
        default=32,
        help="sequences per batch, at most the 4096 of the training split (default: 32)",
    )
    parser.add_argument("--accelerator", choices=ACCELERATORS, default="auto", help="where to train (default: auto)")
    parser.add_argument(
        "--devices", type=_devices, default=1, help="device count, 'auto' or indices such as '0,1' (default: 1)"
    )
    parser.add_argument(
        "--precision",
        choices=PRECISIONS,
        default=None,
        help="Lightning precision (default: bf16-mixed or 16-mixed on a CUDA GPU, 32-true otherwise)",
    )
    parser.add_argument("--seed", type=_int_at_least(0), default=0, help="random seed, below 2**32 (default: 0)")
    parser.add_argument(
        "--root-dir",
        type=_path,
        default=".",
        help="directory that receives lightning_logs/ (default: current directory)",
    )
    parser.add_argument("--no-progress-bar", action="store_true", help="hide the progress bar and model summary")
    parser.set_defaults(handler=_run_demo_command)


def _run_demo_command(args: argparse.Namespace) -> int:
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    from lightning_tune.demos.run import _fit_demo, _prepare_demo

    try:
        # Combinations only Lightning can judge (e.g. --accelerator gpu on a machine without one) fail here.
        run = _prepare_demo(
            max_steps=args.max_steps,
            batch_size=args.batch_size,
            accelerator=args.accelerator,
            devices=args.devices,
            precision=args.precision,
            seed=args.seed,
            default_root_dir=args.root_dir,
            enable_progress_bar=not args.no_progress_bar,
            extra_callbacks=(),
        )
    except (MisconfigurationException, ValueError, TypeError) as err:
        return _usage_error("demo", err)
    try:
        summary = _fit_demo(run)
    except MisconfigurationException as err:
        return _usage_error("demo", err)
    if run.trainer.global_rank != 0:  # multi-device runs: print the summary once
        return 0
    print(_format_demo_summary(summary))
    return 0


def _rate(summary: DemoSummary) -> str:
    """Training throughput as the monitor measured it (validation excluded), else over the whole fit."""
    if "samples_per_sec" in summary.perf:
        tokens = f", {summary.perf['tokens_per_sec']:,.0f} tokens/s" if "tokens_per_sec" in summary.perf else ""
        return f"training {summary.perf['samples_per_sec']:,.0f} samples/s{tokens}"
    return f"{summary.samples_per_sec:,.0f} samples/s over the whole fit"


def _batch_line(summary: DemoSummary) -> list[str]:
    batch = summary.batch
    if not batch:
        return []
    device = (
        f"a simulated {batch['device_gib']:.1f} GiB device (no GPU here)"
        if batch["simulated"]
        else f"{batch['device_gib']:.1f} GiB of device memory"
    )
    ooms = batch["oom_recoveries"]
    recovered = f", {ooms} out-of-memory error{'s' if ooms != 1 else ''} recovered" if ooms else ""
    return [
        f"  micro-batch    {batch['start']} -> {batch['final']} by DynamicBatchSize, 90 % target of {device}"
        f"{recovered}; every step still trained on {batch['start']} sequences"
    ]


def _format_demo_summary(summary: DemoSummary) -> str:
    drop = summary.loss_drop
    gap = summary.final_loss - summary.entropy_floor
    return "\n".join(
        [
            f"\n{PROG} demo finished on {summary.device}",
            f"  steps          {summary.steps} in {summary.seconds:.1f} s ({_rate(summary)})",
            f"  train loss     {summary.start_loss:.3f} -> {summary.final_loss:.3f} "
            f"({100 * abs(drop):.1f} % {'lower' if drop >= 0 else 'higher'})",
            f"  entropy floor  {summary.entropy_floor:.3f} nats/token (the best achievable in expectation; "
            + (
                f"final loss is {gap:.3f} above it)"
                if gap >= 0
                else f"the last batches' mean is {-gap:.3f} below it, within sampling noise)"
            ),
            *_batch_line(summary),
            f"  logs           {summary.log_dir}",
            f"  view them with {summary.tensorboard_command}",
        ]
    )


def _add_report_parser(commands: Any) -> None:
    from lightning_tune.report import MAX_DPI, MIN_DPI

    parser = commands.add_parser(
        "report",
        help="draw throughput, step-time percentiles, memory, LR and batch size from TensorBoard logs into one PNG",
        description=(
            "Read the TensorBoard runs under LOGDIR, draw their perf/ and tune/ scalars over training steps into one "
            "PNG (only the panels that have data) and print a summary table."
        ),
    )
    parser.add_argument(
        "logdir",
        metavar="LOGDIR",
        nargs="?",
        type=_path,
        default="lightning_logs",
        help="TensorBoard logs (default: lightning_logs)",
    )
    parser.add_argument("-o", "--output", type=_path, default="report.png", help="PNG to write (default: report.png)")
    parser.add_argument(
        "--title", type=_text, default=None, help="figure title (default: 'lightning_tune report: <LOGDIR name>')"
    )
    parser.add_argument(
        "--dpi",
        type=_int_at_least(MIN_DPI, MAX_DPI),
        default=100,
        help=f"resolution, {MIN_DPI} to {MAX_DPI} (default: 100, 1600 px wide)",
    )
    parser.set_defaults(handler=_run_report_command)


def _run_report_command(args: argparse.Namespace) -> int:
    from lightning_tune.report import ReportError, _check_output, _default_title, read_scalars, render_report, summarise

    try:
        output = _check_output(args.output)  # refuse a bad output before reading any log
        runs = read_scalars(args.logdir)
        panels = render_report(runs, output, title=args.title or _default_title(args.logdir), dpi=args.dpi)
    except ReportError as err:
        return _usage_error("report", err)
    print(summarise(runs))
    print(f"wrote {output} ({len(panels)} panels: {', '.join(panels)})")
    return 0


def _add_calc_parser(commands: Any) -> None:
    from lightning_tune.commands.calc import add_parser

    add_parser(commands)


def _add_bench_parser(commands: Any) -> None:
    from lightning_tune.commands.bench import add_parser

    add_parser(commands)


#: Sub-command registrars, in the order ``--help`` lists them.
_COMMANDS: tuple[Callable[[Any], None], ...] = (
    _add_demo_parser,
    _add_calc_parser,
    _add_bench_parser,
    _add_report_parser,
)


def _usage_error(command: str, err: BaseException) -> int:
    lines = str(err).strip().splitlines() or [type(err).__name__]
    print(f"{PROG} {command}: error: {lines[0]}", file=sys.stderr)
    return 2


def build_parser() -> argparse.ArgumentParser:
    """Build the ``lightning-tune`` argument parser with every sub-command.

    Returns:
        The parser; parsed namespaces carry the chosen command's ``handler``.
    """
    parser = _ArgumentParser(
        prog=PROG,
        description="PyTorch Lightning callbacks that make an existing LightningModule train faster and fit larger.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    commands = parser.add_subparsers(title="commands", dest="command", metavar="<command>")
    for register in _COMMANDS:
        register(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``lightning-tune`` command line.

    Args:
        argv: Arguments without the program name; ``None`` reads ``sys.argv[1:]``.

    Returns:
        The exit status: 0 on success, 2 on a usage error (message on stderr), 130 when interrupted.
    """
    parser = build_parser()
    try:
        args = parser.parse_args(None if argv is None else list(argv))
    except SystemExit as exit_:  # --help / --version (status 0) or a usage error already reported (status 2)
        return exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 2)
    handler: _Handler | None = getattr(args, "handler", None)
    if handler is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return handler(args)
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
