"""The Lightning versions whose private internals lightning_tune relies on were checked with, and a warn-once check.

Most of the package uses Lightning's public API and follows ``lightning>=2.4`` from ``pyproject.toml``. Where a
private attribute is the only way (:class:`~lightning_tune.DynamicBatchSize` resizing the running epoch), the code
was checked on the versions in :data:`LIGHTNING_TESTED` only. Pinning the whole package to them would stop users of
every other feature from installing it on another Lightning, so such a feature calls :func:`check_lightning_version`
at fit start instead: one warning per feature and process outside the range, naming both versions.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import Final

from lightning.fabric.utilities.rank_zero import rank_zero_warn
from packaging.version import InvalidVersion, Version

__all__ = ["LIGHTNING_TESTED", "check_lightning_version"]

#: Lightning versions the private internals were checked on: from the first (included) to the second (excluded).
LIGHTNING_TESTED: Final[tuple[str, str]] = ("2.6.6", "2.7")

_warned: set[str] = set()


def check_lightning_version(
    feature: str, *, installed: str | None = None, tested: tuple[str, str] = LIGHTNING_TESTED
) -> bool:
    """Warn once per ``feature`` when the installed Lightning is outside the range its internals were checked on.

    Args:
        feature: What relies on the internals, for the message (``"DynamicBatchSize"``).
        installed: The Lightning version to judge; ``None`` reads the installed ``lightning`` package.
        tested: ``(first, end)``: versions from ``first`` up to, not including, ``end`` were checked.

    Returns:
        Whether the version is inside the tested range (``False`` also when it cannot be read).

    Raises:
        TypeError: If ``feature`` is not a non-empty string or ``installed`` not a string.
        ValueError: If ``tested`` is not two increasing version strings.

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
