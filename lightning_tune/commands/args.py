"""What every ``lightning-tune`` command shares: the parser whose usage errors are one line, and the argument types.

A ``type=`` function here turns bad text into one line naming the flag and what it accepts (exit status 2, no
traceback). The precision, optimizer and attention types accept every name and alias of
:mod:`lightning_tune.vocab` and give the command the canonical name.

Example:
    >>> precision("bf16"), optimizer("adamw_8bit"), attention("flash_attention_2"), int_at_least(1)("3")
    ('bf16-mixed', 'adamw8bit', 'flash', 3)
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Collection
from typing import NoReturn

from lightning_tune import vocab

__all__ = [
    "PROG",
    "ArgumentParser",
    "attention",
    "devices",
    "int_at_least",
    "name_in",
    "optimizer",
    "path",
    "precision",
    "text",
    "usage_error",
]

#: Program name shown in help and messages.
PROG = "lightning-tune"


class ArgumentParser(argparse.ArgumentParser):
    """ArgumentParser whose usage errors are a single line on stderr (exit status 2)."""

    def error(self, message: str) -> NoReturn:
        """Print ``message`` on one line and exit with status 2."""
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def usage_error(command: str, err: BaseException) -> int:
    """Print the first line of ``err`` as ``lightning-tune COMMAND: error: ...`` on stderr; returns exit status 2."""
    lines = str(err).strip().splitlines() or [type(err).__name__]
    print(f"{PROG} {command}: error: {lines[0]}", file=sys.stderr)
    return 2


def int_at_least(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    """A ``type=`` for an integer in ``[minimum, maximum]`` (no upper bound when ``maximum`` is ``None``)."""
    rule = f"an integer >= {minimum}" if maximum is None else f"an integer from {minimum} to {maximum}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = minimum - 1
        if value < minimum or (maximum is not None and value > maximum):
            raise argparse.ArgumentTypeError(f"must be {rule}, got {text!r}")
        return value

    return parse


def name_in(canonical: Callable[..., str], allowed: Collection[str]) -> Callable[[str], str]:
    """A ``type=`` for a name in ``allowed`` or an alias of one (``canonical``: a ``canonical_*`` of the vocabulary)."""

    def parse(value: str) -> str:
        try:
            return canonical(value, arg="", allowed=allowed)
        except ValueError as err:  # argparse puts "argument --flag: " in front
            raise argparse.ArgumentTypeError(str(err).removeprefix("`` ")) from None

    return parse


precision = name_in(vocab.canonical_precision, vocab.PRECISIONS)
optimizer = name_in(vocab.canonical_optimizer, vocab.OPTIMIZERS)
attention = name_in(vocab.canonical_attention, vocab.ATTENTIONS)


def text(value: str) -> str:
    """A ``type=`` for a text that an empty value would silently replace by its default."""
    if not value.strip():
        raise argparse.ArgumentTypeError(f"must be a non-empty text, got {value!r}")
    return value


def path(value: str) -> str:
    """A ``type=`` for a path: an empty one would silently mean the current directory."""
    if not value.strip():
        raise argparse.ArgumentTypeError("must be a non-empty path (use '.' for the current directory), got ''")
    return value


def devices(value: str) -> int | str:
    """A ``type=`` for ``--devices``: a count >= 1, ``-1`` (all), ``auto``, or comma-separated device indices."""
    parts = value.split(",")
    if value == "auto" or (len(parts) > 1 and all(p.strip().isdigit() for p in parts if p.strip())):
        return value
    try:
        count = int(value)
    except ValueError:
        count = 0
    if count == 0 or count < -1:
        raise argparse.ArgumentTypeError(
            f"must be a device count >= 1, -1 (all), 'auto' or device indices such as '0,1', got {value!r}"
        )
    return count
