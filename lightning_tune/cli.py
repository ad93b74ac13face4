"""Command-line interface ``lightning-tune <command>`` (also ``python -m lightning_tune``) over :data:`COMMANDS`."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

import lightning_tune
from lightning_tune.commands import bench, calc, demo, report
from lightning_tune.commands.args import PROG, ArgumentParser

#: The command modules, in the order ``--help`` lists them.
COMMANDS = (demo, calc, bench, report)


def build_parser() -> argparse.ArgumentParser:
    """The ``lightning-tune`` parser; a parsed namespace carries the chosen command's ``handler``."""
    parser = ArgumentParser(
        prog=PROG,
        description="PyTorch Lightning callbacks that make an existing LightningModule train faster and fit larger.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {lightning_tune.__version__}")
    commands = parser.add_subparsers(title="commands", dest="command", metavar="<command>", required=True)
    for command in COMMANDS:
        command.add_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line on ``argv`` (``None``: ``sys.argv[1:]``) and return the exit status.

    0 on success, 2 on a usage error (message on stderr), 130 when interrupted, 141 (128 + SIGPIPE, as a shell
    reports a Unix tool) when the reader of the output closed it early (``lightning-tune calc ... | head -2``).
    """
    parser = build_parser()
    try:
        args = parser.parse_args(None if argv is None else list(argv))
    except SystemExit as exit_:  # --help / --version (status 0) or a usage error already reported (status 2)
        return exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 2)
    try:
        status = int(args.handler(args))
        sys.stdout.flush()  # a reader gone shows here, not in the interpreter's own flush at exit
        return status
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # stop quietly, as a Unix tool stops on SIGPIPE; what is still buffered goes nowhere
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
