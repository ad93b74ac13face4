"""Argument checks shared by every constructor, so that messages read the same across the package.

Each check names the argument, repeats the value it got and says what is allowed. Every check takes ``name``, the
argument's name for the message, and ``value``, the value given; ``allow_none=True`` accepts ``None`` as well.
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
    """Check that ``value`` is an integer (not a bool), optionally at least ``minimum`` and at most ``maximum``.

    Raises:
        TypeError: If ``value`` is not an integer.
        ValueError: If ``value`` is below ``minimum`` or above ``maximum``.
    """
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
    """Check that ``value`` is a non-empty string.

    Raises:
        TypeError: If ``value`` is not a string.
        ValueError: If it is empty.
    """
    check_instance(name, value, str, "a string", allow_none=allow_none)
    if value is not None and not value.strip():
        raise ValueError(f"`{name}` must be a non-empty string, got {value!r}")


def check_strings(
    name: str, value: Any, *, what: str = "strings", allow_none: bool = False, allow_empty: bool = True
) -> None:
    """Check that ``value`` is a sequence (not a single string) of strings.

    ``what`` says what the strings are, for the message (``"submodule names"``).

    Raises:
        TypeError: If ``value`` is not such a sequence.
        ValueError: If it is empty and ``allow_empty`` is False.
    """
    if value is None and allow_none:
        return
    if isinstance(value, str) or not isinstance(value, Sequence) or not all(isinstance(v, str) for v in value):
        kind = f"a sequence of {what}" + (" or None" if allow_none else "")
        raise TypeError(f"`{name}` must be {kind}, got {value!r} ({type(value).__name__})")
    if not value and not allow_empty:
        raise ValueError(f"`{name}` must not be empty (a sequence of {what}), got {value!r}")


def check_mapping(name: str, value: Any, *, allow_none: bool = False) -> None:
    """Check that ``value`` is a mapping with string keys.

    Raises:
        TypeError: If ``value`` is not a mapping, or a key is not a string.
    """
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
    """Check that ``value`` is a finite real number from ``low`` to ``high`` (``None``: no bound on that side).

    A bound is allowed itself unless ``low_inclusive`` (``high_inclusive``) is False.

    Raises:
        TypeError: If ``value`` is not a real number.
        ValueError: If ``value`` is not finite or lies outside the interval.
    """
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"`{name}` must be a number, got {value!r} ({type(value).__name__})")
    if not math.isfinite(value):
        raise ValueError(f"`{name}` must be a finite number, got {value!r}")
    if _outside(value, low, high, low_inclusive, high_inclusive):
        raise ValueError(f"`{name}` must be in {_interval(low, high, low_inclusive, high_inclusive)}, got {value!r}")


def _outside(x: float, low: float | None, high: float | None, low_inclusive: bool, high_inclusive: bool) -> bool:
    """Whether ``x`` lies outside the interval from ``low`` to ``high`` (``None``: unbounded on that side)."""
    below = low is not None and (x < low if low_inclusive else x <= low)
    return below or (high is not None and (x > high if high_inclusive else x >= high))


def check_choice(name: str, value: Any, choices: Collection[str]) -> None:
    """Check that ``value`` is one of ``choices``.

    Raises:
        ValueError: If ``value`` is not one of ``choices``.
    """
    if value not in choices:
        allowed = ", ".join(repr(c) for c in choices)
        raise ValueError(f"`{name}` must be one of {allowed}, got {value!r}")


def check_bool(name: str, value: Any) -> None:
    """Check that ``value`` is a bool.

    Raises:
        TypeError: If ``value`` is not a bool.
    """
    if not isinstance(value, bool):
        raise TypeError(f"`{name}` must be True or False, got {value!r} ({type(value).__name__})")


def check_numbers(name: str, value: Any, *, low: float | None = None, allow_empty: bool = False) -> None:
    """Check that ``value`` is a sequence (not a string) of finite real numbers, none below ``low``.

    Raises:
        TypeError: If ``value`` is not a sequence of real numbers.
        ValueError: If it is empty (unless ``allow_empty``), or an item is not finite or lies below ``low``.
    """
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise TypeError(f"`{name}` must be a sequence of numbers, got {value!r} ({type(value).__name__})")
    if not value and not allow_empty:
        raise ValueError(f"`{name}` must not be empty, got {value!r}")
    for item in value:
        if isinstance(item, bool) or not isinstance(item, (int, float)):
            raise TypeError(f"`{name}` must be a sequence of numbers, got {value!r} (an item is {item!r})")
        if not math.isfinite(item) or _outside(item, low, None, True, True):
            raise ValueError(f"`{name}` must hold finite numbers in {_interval(low, None, True, True)}, got {value!r}")


def check_instance(
    name: str, value: Any, kind: type | tuple[type, ...], what: str, *, allow_none: bool = False
) -> None:
    """Check that ``value`` is an instance of ``kind`` (type or tuple), called ``what`` in the message.

    Raises:
        TypeError: If ``value`` is not an instance of ``kind``.
    """
    if value is None and allow_none:
        return
    if not isinstance(value, kind):
        kind_text = what + (" or None" if allow_none else "")
        raise TypeError(f"`{name}` must be {kind_text}, got {value!r} ({type(value).__name__})")


def check_callable(name: str, value: Any, *, allow_none: bool = False) -> None:
    """Check that ``value`` is callable.

    Raises:
        TypeError: If ``value`` is not callable.
    """
    if value is None and allow_none:
        return
    if not callable(value):
        kind = "a callable or None" if allow_none else "a callable"
        raise TypeError(f"`{name}` must be {kind}, got {value!r} ({type(value).__name__})")


def check_keys(name: str, value: Mapping[str, Any], allowed: Collection[str]) -> None:
    """Check that every key of the mapping ``value`` is one of ``allowed``.

    Raises:
        ValueError: If a key is not allowed.
    """
    unknown = [key for key in value if key not in allowed]
    if unknown:
        if len(allowed) <= 30:
            hint = "allowed: " + ", ".join(sorted(allowed))
        else:
            close = difflib.get_close_matches(str(unknown[0]), list(allowed), n=3)
            hint = f"did you mean {', '.join(map(repr, close))}?" if close else f"{len(allowed)} keys are allowed"
        raise ValueError(f"`{name}` has unknown key(s) {', '.join(map(repr, unknown))}; {hint}")


def check_finite_result(name: str, value: float, inputs: str) -> float:
    """Return ``value`` if it is finite; otherwise say which inputs overflowed it.

    Args:
        name: What ``value`` is, for the message.
        value: The computed value.
        inputs: The inputs it was computed from, for the message.

    Raises:
        ValueError: If ``value`` is not finite.
    """
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


def _interval(low: float | None, high: float | None, low_inclusive: bool, high_inclusive: bool) -> str:
    left = ("[" if low_inclusive else "(") + ("-inf" if low is None else f"{low:g}")
    right = ("inf" if high is None else f"{high:g}") + ("]" if high_inclusive else ")")
    return f"{left}, {right}"
