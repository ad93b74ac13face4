"""``lightning-tune report``: draw the perf/ and tune/ scalars of TensorBoard runs into one PNG and print a summary."""

from __future__ import annotations

import argparse
import sys
import warnings
from typing import Any

from lightning_tune import report
from lightning_tune.commands.args import PROG, IntRange, path, text, usage_error


def add_parser(commands: Any) -> None:
    """Register the ``report`` sub-command on ``commands``, the ``lightning-tune`` parser's sub-parsers action."""
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
        type=path,
        default="lightning_logs",
        help="TensorBoard logs (default: %(default)s)",
    )
    parser.add_argument("-o", "--output", type=path, default="report.png", help="PNG to write (default: report.png)")
    parser.add_argument(
        "--title", type=text, default=None, help="figure title (default: 'lightning_tune report: <LOGDIR name>')"
    )
    low, high = report.MIN_DPI, report.MAX_DPI
    parser.add_argument(
        "--dpi",
        type=IntRange(low, high),
        default=report.DEFAULT_DPI,
        help=f"resolution, {low} to {high} (default: %(default)s, for a 16-inch-wide figure)",
    )
    parser.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    try:
        output = report.check_output(args.output)  # refuse a bad output before reading any log
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", report.ReportWarning)
            runs = report.read_scalars(args.logdir)
        for warning in caught:  # files left out: one line each, the report goes on
            if issubclass(warning.category, report.ReportWarning):
                print(f"{PROG} report: warning: {warning.message}", file=sys.stderr)
            else:
                warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
        title = args.title or report.default_title(args.logdir)
        panels = report.render_report(runs, output, title=title, dpi=args.dpi)
    except report.ReportError as err:
        return usage_error("report", err)
    print(report.summarise(runs))
    print(f"wrote {output} ({len(panels)} panels: {', '.join(panels)})")
    return 0
