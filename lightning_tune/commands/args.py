"""What every ``lightning-tune`` command shares: the parser whose usage errors are one line, and the argument types.

A ``type=`` here turns bad text into one line naming the flag and what it accepts (exit status 2, no traceback); the
name types take every alias of :mod:`lightning_tune.vocab` and give the command the canonical name.

Example:
    >>> precision("bf16"), optimizer("adamw_8bit"), attention("flash_attention_2"), IntRange(1)("3")
    ('bf16-mixed', 'adamw8bit', 'flash', 3)
    >>> memory("24GB") == memory("24GiB") == memory("24576") == 24 * 2**30
    True
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from lightning_tune import vocab

PROG = "lightning-tune"


class ArgumentParser(argparse.ArgumentParser):
    """ArgumentParser whose usage errors are a single line on stderr (exit status 2).

    ``hints`` maps a flag to the command that takes it: an error on a command line holding the flag names that command.
    """

    hints: Mapping[str, str] = {}
    _given: Sequence[str] = ()

    def parse_known_args(  # type: ignore[override]  # argparse's overloads, collapsed
        self, args: Sequence[str] | None = None, namespace: Any = None
    ) -> tuple[Any, list[str]]:
        """As argparse's; the arguments are kept for the hints of :meth:`error`."""
        self._given = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def error(self, message: str) -> NoReturn:
        """Print ``message`` on one line and exit with status 2."""
        given = {arg.split("=", 1)[0] for arg in self._given}
        for flag, command in self.hints.items():
            if flag in given:
                self.exit(2, f"{self.prog}: error: {flag} is an option of '{command}': run '{command} {flag} ...'\n")
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def usage_error(command: str, err: BaseException) -> int:
    """Print the first line of ``err`` as ``lightning-tune COMMAND: error: ...`` on stderr; returns exit status 2."""
    lines = str(err).strip().splitlines() or [type(err).__name__]
    print(f"{PROG} {command}: error: {lines[0]}", file=sys.stderr)
    return 2


@dataclass(frozen=True)
class IntRange:
    """A ``type=`` for an integer in ``[minimum, maximum]`` (no upper bound when ``maximum`` is ``None``)."""

    minimum: int
    maximum: int | None = None

    def __call__(self, text: str) -> int:
        """The integer ``text`` spells, or an ArgumentTypeError saying what is allowed."""
        try:
            value = int(text)
        except ValueError:
            value = self.minimum - 1
        if value < self.minimum or (self.maximum is not None and value > self.maximum):
            rule = f">= {self.minimum}" if self.maximum is None else f"from {self.minimum} to {self.maximum}"
            raise argparse.ArgumentTypeError(f"must be an integer {rule}, got {text!r}")
        return value


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
    if not value.strip() or "\0" in value:
        raise argparse.ArgumentTypeError(
            f"must be a non-empty path without NUL characters (use '.' for the current directory), got {value!r}"
        )
    return value


#: The most devices ``--devices`` names: more than any one machine holds (Lightning's count is per machine).
MAX_DEVICES = 1024


def devices(value: str) -> int | str:
    """A ``type=`` for ``--devices``: a count from 1 to 1024, ``-1`` (all), ``auto``, or device indices (``0,1``)."""
    parts = [p.strip() for p in value.split(",")]
    if value == "auto" or (
        len(parts) > 1 and all(p.isdigit() and int(p) < MAX_DEVICES for p in parts if p) and any(parts)
    ):
        return value
    try:
        count = int(value)
    except ValueError:
        count = 0
    if count == 0 or count < -1 or count > MAX_DEVICES:
        raise argparse.ArgumentTypeError(
            f"must be a device count from 1 to {MAX_DEVICES}, -1 (all), 'auto' or device indices such as '0,1', "
            f"got {value!r}"
        )
    return count


_MEMORY = re.compile(r"(\d+(?:\.\d+)?)\s*(?:([kmgt])(?:i?b)?|(b))?", re.IGNORECASE)
_MEMORY_UNITS = {"k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40, "b": 1}
#: The range ``--gpu-memory`` accepts, in bytes: 1 GiB to 64 TiB.
MEMORY_RANGE = (2**30, 2**46)


def memory(text: str) -> int:
    """A ``type=`` for device memory in bytes: ``24GB``, ``24GiB``, ``80G``, ``24000MiB`` or a bare number of MiB.

    ``G``, ``GB`` and ``GiB`` all mean 2**30 bytes, as GPU makers count (an "80GB" GPU holds 80 GiB), and likewise
    ``K``, ``M``, ``T``; a bare number below 1024 is refused with a hint (24 MiB is no GPU's memory, 24 GiB is).
    """
    match = _MEMORY.fullmatch(text.strip())
    low, high = MEMORY_RANGE
    allowed = "an amount such as '24GB', '24GiB', '80G' or '24576' (MiB)"
    if match is None:
        raise argparse.ArgumentTypeError(f"must be {allowed}, got {text!r}")
    amount, unit, plain_bytes = match.groups()
    if unit is None and plain_bytes is None and float(amount) < low // 2**20:
        raise argparse.ArgumentTypeError(
            f"a bare number is MiB, so {text!r} is {amount} MiB, less than any GPU; give a unit, such as "
            f"'{amount}GB' for {amount} GiB"
        )
    value = round(float(amount) * _MEMORY_UNITS[(unit or plain_bytes or "m").lower()])
    if not low <= value <= high:
        raise argparse.ArgumentTypeError(f"must be from 1 GiB to 64 TiB, such as '24GB', got {text!r}")
    return value
