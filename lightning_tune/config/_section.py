"""Reading one mapping of a configuration file, with every message naming the key by its full dotted path."""

from __future__ import annotations

import difflib
import re
from collections.abc import Collection, Mapping
from typing import Any

from lightning_tune._validation import check_bool, check_choice, check_float, check_int

# PyYAML follows YAML 1.1, where `3e-4` (no dot) is a string, not a float; accept such strings for number keys.
_FLOAT_TEXT = re.compile(r"[-+]?(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+)?")


def reject(path: str, reason: str) -> ValueError:
    """The error for a key the pack cannot honour.

    Args:
        path: Dotted path of the key.
        reason: Why, and what to do instead.

    Returns:
        The error to raise.
    """
    return ValueError(f"`{path}` cannot be honoured: {reason}")


class Section:
    """One mapping of the configuration: refuses unknown keys, and reads values checked under their dotted path.

    Args:
        data: The mapping.
        path: Its dotted path (``"training.learning_rate"``).
        allowed: Keys it may hold.
        refused: Keys that exist in common configurations but cannot be honoured -> why.

    Raises:
        TypeError: If ``data`` is not a mapping or a key is not a string.
        ValueError: If a key is refused or unknown; the message lists the allowed keys.
    """

    def __init__(
        self, data: Any, path: str, allowed: Collection[str], refused: Mapping[str, str] | None = None
    ) -> None:
        if not isinstance(data, Mapping):
            raise TypeError(f"`{path}` must be a mapping of keys to values, got {data!r} ({type(data).__name__})")
        refused = refused or {}
        for key in data:
            if not isinstance(key, str):
                raise TypeError(f"keys of `{path}` must be strings, got {key!r} ({type(key).__name__})")
            if key in refused:
                raise reject(self._join(path, key), refused[key])
            if key not in allowed:
                raise ValueError(unknown_key_message(self._join(path, key), allowed))
        self.data = data
        self.path = path

    @staticmethod
    def _join(path: str, key: str) -> str:
        return f"{path}.{key}" if path else key

    def name(self, key: str) -> str:
        """Dotted path of ``key``."""
        return self._join(self.path, key)

    def __contains__(self, key: str) -> bool:
        return key in self.data

    def raw(self, key: str, default: Any = None) -> Any:
        """The value as written, or ``default``."""
        return self.data.get(key, default)

    def integer(self, key: str, default: int | None = None, *, minimum: int | None = None) -> int | None:
        """An integer value (``None`` when absent and no default)."""
        if key not in self.data:
            return default
        value = self.data[key]
        check_int(self.name(key), value, minimum=minimum)
        return int(value)

    def number(
        self,
        key: str,
        default: float | None = None,
        *,
        low: float | None = None,
        high: float | None = None,
        low_inclusive: bool = True,
        high_inclusive: bool = True,
    ) -> float | None:
        """A real value; strings such as ``"3e-4"`` (YAML 1.1 reads those as text) count as numbers."""
        if key not in self.data:
            return default
        value = self.data[key]
        if isinstance(value, str) and _FLOAT_TEXT.fullmatch(value.strip()):
            value = float(value)
        check_float(
            self.name(key), value, low=low, high=high, low_inclusive=low_inclusive, high_inclusive=high_inclusive
        )
        return float(value)

    def boolean(self, key: str, default: bool | None = None) -> bool | None:
        """A ``true``/``false`` value."""
        if key not in self.data:
            return default
        value = self.data[key]
        check_bool(self.name(key), value)
        return bool(value)

    def choice(self, key: str, choices: Collection[str], default: str | None = None) -> str | None:
        """One of ``choices``."""
        if key not in self.data:
            return default
        value = self.data[key]
        check_choice(self.name(key), value, choices)
        return str(value)

    def text(self, key: str, default: str | None = None) -> str | None:
        """A non-empty string."""
        if key not in self.data:
            return default
        value = self.data[key]
        if not isinstance(value, str) or not value:
            raise TypeError(f"`{self.name(key)}` must be a non-empty string, got {value!r} ({type(value).__name__})")
        return value

    def section(self, key: str, allowed: Collection[str], refused: Mapping[str, str] | None = None) -> Section:
        """The nested mapping under ``key`` (empty when absent)."""
        return Section(self.data.get(key, {}), self.name(key), allowed, refused)


def unknown_key_message(path: str, allowed: Collection[str]) -> str:
    """Message for an unknown key: the allowed keys, and the closest one when it looks like a typo.

    Args:
        path: Dotted path of the unknown key.
        allowed: The keys allowed where it was found.

    Returns:
        The message.
    """
    key = path.rsplit(".", 1)[-1]
    listed = ", ".join(f"`{k}`" for k in sorted(allowed)) or "none"
    close = difflib.get_close_matches(key, list(allowed), n=1)
    hint = f" (did you mean `{close[0]}`?)" if close else ""
    return f"unknown key `{path}`{hint}; allowed keys here: {listed}"
