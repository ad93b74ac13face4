"""Argument checks shared by every constructor, so that messages read the same across the package.

Each check names the argument (``name``), repeats the value it got and says what is allowed: ``TypeError`` for a wrong
type, ``ValueError`` for a wrong value; ``allow_none=True`` accepts ``None`` as well.
"""

from __future__ import annotations

import difflib
import math
import os
import tempfile
from collections.abc import Collection, Mapping, Sequence
from typing import Any

#: The largest seed Lightning's ``seed_everything`` (and numpy's generator) accepts.
MAX_SEED = 2**32 - 1


def check_int(
    name: str, value: Any, *, minimum: int | None = None, maximum: int | None = None, allow_none: bool = False
) -> None:
    """Check that ``value`` is an integer (not a bool), optionally at least ``minimum`` and at most ``maximum``."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        kind = "an integer or None" if allow_none else "an integer"
        raise TypeError(f"`{name}` must be {kind}, got {value!r} ({type(value).__name__})")
    if maximum is not None and (value > maximum or (minimum is not None and value < minimum)):
        rule = f"from {minimum} to {maximum}" if minimum is not None else f"<= {maximum}"
        raise ValueError(f"`{name}` must be an integer {rule}, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"`{name}` must be an integer >= {minimum}, got {value!r}")


def check_str(name: str, value: Any, *, allow_none: bool = False) -> None:
    """Check that ``value`` is a non-empty string."""
    check_instance(name, value, str, "a string", allow_none=allow_none)
    if value is not None and not value.strip():
        raise ValueError(f"`{name}` must be a non-empty string, got {value!r}")


def check_strings(
    name: str, value: Any, *, what: str = "strings", allow_none: bool = False, allow_empty: bool = True
) -> None:
    """Check that ``value`` is a sequence (not a single string) of strings, called ``what`` in the message."""
    if value is None and allow_none:
        return
    if isinstance(value, str) or not isinstance(value, Sequence) or not all(isinstance(v, str) for v in value):
        kind = f"a sequence of {what}" + (" or None" if allow_none else "")
        raise TypeError(f"`{name}` must be {kind}, got {value!r} ({type(value).__name__})")
    if not value and not allow_empty:
        raise ValueError(f"`{name}` must not be empty (a sequence of {what}), got {value!r}")


def check_mapping(name: str, value: Any, *, allow_none: bool = False) -> None:
    """Check that ``value`` is a mapping with string keys."""
    if value is None and allow_none:
        return
    if not isinstance(value, Mapping) or not all(isinstance(key, str) for key in value):
        kind = "a mapping of argument names to values" + (" or None" if allow_none else "")
        raise TypeError(f"`{name}` must be {kind}, got {value!r} ({type(value).__name__})")


def check_float(
    name: str,
    value: Any,
    *,
    low: float | None = None,
    high: float | None = None,
    low_inclusive: bool = True,
    high_inclusive: bool = True,
    allow_none: bool = False,
) -> None:
    """Check that ``value`` is a finite number in [``low``, ``high``] (``None``: unbounded; ``*_inclusive``: closed)."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"`{name}` must be a number, got {value!r} ({type(value).__name__})")
    if not math.isfinite(value):
        raise ValueError(f"`{name}` must be a finite number, got {value!r}")
    below = low is not None and (value < low if low_inclusive else value <= low)
    if below or (high is not None and (value > high if high_inclusive else value >= high)):
        left = ("[" if low_inclusive else "(") + ("-inf" if low is None else f"{low:g}")
        right = ("inf" if high is None else f"{high:g}") + ("]" if high_inclusive else ")")
        raise ValueError(f"`{name}` must be in {left}, {right}, got {value!r}")


def check_choice(name: str, value: Any, choices: Collection[str]) -> None:
    """Check that ``value`` is one of ``choices`` (a ``ValueError`` otherwise, whatever its type)."""
    if value not in choices:
        allowed = ", ".join(repr(c) for c in choices)
        raise ValueError(f"`{name}` must be one of {allowed}, got {value!r}")


def check_bool(name: str, value: Any) -> None:
    """Check that ``value`` is a bool."""
    if not isinstance(value, bool):
        raise TypeError(f"`{name}` must be True or False, got {value!r} ({type(value).__name__})")


def check_instance(
    name: str, value: Any, kind: type | tuple[type, ...], what: str, *, allow_none: bool = False
) -> None:
    """Check that ``value`` is an instance of ``kind`` (type or tuple), called ``what`` in the message."""
    if value is None and allow_none:
        return
    if not isinstance(value, kind):
        kind_text = what + (" or None" if allow_none else "")
        raise TypeError(f"`{name}` must be {kind_text}, got {value!r} ({type(value).__name__})")


def check_callable(name: str, value: Any, *, allow_none: bool = False) -> None:
    """Check that ``value`` is callable."""
    if value is None and allow_none:
        return
    if not callable(value):
        kind = "a callable or None" if allow_none else "a callable"
        raise TypeError(f"`{name}` must be {kind}, got {value!r} ({type(value).__name__})")


def check_keys(name: str, value: Mapping[str, Any], allowed: Collection[str]) -> None:
    """Check that every key of the mapping ``value`` is one of ``allowed`` (a ``ValueError`` naming the others)."""
    unknown = [key for key in value if key not in allowed]
    if unknown:
        if len(allowed) <= 30:
            hint = "allowed: " + ", ".join(sorted(allowed))
        else:
            close = difflib.get_close_matches(str(unknown[0]), list(allowed), n=3)
            hint = f"did you mean {', '.join(map(repr, close))}?" if close else f"{len(allowed)} keys are allowed"
        raise ValueError(f"`{name}` has unknown key(s) {', '.join(map(repr, unknown))}; {hint}")


def check_finite_result(name: str, value: float, inputs: str) -> float:
    """Return ``value`` if it is finite, else a ``ValueError`` saying that ``name`` overflowed for ``inputs``."""
    if not math.isfinite(value):
        raise ValueError(f"{name} is not finite ({value!r}) for {inputs}")
    return value


def changed_arguments(saved: Mapping[str, Any], now: Mapping[str, Any], *, ignore: Collection[str] = ()) -> list[str]:
    """``["patience 5 -> 2", ...]``: the arguments a checkpoint recorded that this run gives other values.

    A callback that records its arguments in its checkpoint warns with these on resume, in one wording: ``"<Name>:
    resumed with other arguments than the checkpoint's, which are used from here on: " + ", ".join(changed)``.
    Arguments the checkpoint does not record (it predates them), and those in ``ignore``, are left out.
    """
    return [f"{k} {saved[k]!r} -> {v!r}" for k, v in now.items() if k in saved and saved[k] != v and k not in ignore]


def check_writable_dir(directory: str | os.PathLike[str], problem: str) -> None:
    """Create ``directory`` if needed and make sure a file can be written in it, else a ValueError: ``problem``, why."""
    try:
        os.makedirs(directory, exist_ok=True)
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as err:
        raise ValueError(f"{problem}: {err.strerror or err}") from None
