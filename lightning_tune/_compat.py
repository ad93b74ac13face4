"""The Lightning versions the private internals lightning_tune relies on were checked with, and a warn-once check.

Rather than pin the whole package, a feature that needs a private attribute (``DynamicBatchSize`` resizing the running
epoch) calls :func:`check_lightning_version` at fit start: one warning per feature and process outside the range.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import Final

from lightning.fabric.utilities.rank_zero import rank_zero_warn
from packaging.version import InvalidVersion, Version

#: Lightning versions the private internals were checked on: from the first (included) to the second (excluded).
LIGHTNING_TESTED: Final[tuple[str, str]] = ("2.6.6", "2.7")

_warned: set[str] = set()


def check_lightning_version(
    feature: str, *, installed: str | None = None, tested: tuple[str, str] = LIGHTNING_TESTED
) -> bool:
    """Warn once per ``feature`` when Lightning (``installed``, else the installed one) is outside ``tested``.

    ``tested`` is ``(first, end)``, ``end`` excluded. Returns whether the version is inside (``False`` if unreadable).

    Example:
        >>> check_lightning_version("DynamicBatchSize", installed="2.6.6")
        True
    """
    if not isinstance(feature, str) or not feature:
        raise TypeError(f"`feature` must be a non-empty string, got {feature!r} ({type(feature).__name__})")
    try:
        first, end = tested
        if not Version(first) < Version(end):
            raise ValueError
    except (TypeError, ValueError, InvalidVersion):
        raise ValueError(f"`tested` must be two increasing version strings (first, end), got {tested!r}") from None
    if installed is not None and not isinstance(installed, str):
        raise TypeError(f"`installed` must be a version string or None, got {installed!r} ({type(installed).__name__})")
    if installed is None:
        try:
            installed = version("lightning")
        except PackageNotFoundError:
            installed = "unknown"
    try:
        inside = Version(first) <= Version(installed) < Version(end)
    except InvalidVersion:
        inside = False
    if not inside and feature not in _warned:
        _warned.add(feature)
        rank_zero_warn(
            f"{feature} relies on private Lightning internals that were checked on lightning>={first},<{end}, but "
            f"lightning {installed} is installed; it may misbehave. Install 'lightning>={first},<{end}' to use "
            f"{feature} as tested.",
            category=UserWarning,
        )
    return inside
