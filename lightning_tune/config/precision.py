"""Precision names of training configuration files, mapped to Lightning's precision strings."""

from __future__ import annotations

from typing import Final

from lightning_tune._validation import check_str
from lightning_tune.plugins.tune import PRECISIONS

__all__ = ["PRECISION_NAMES", "lightning_precision"]

#: Names of configuration files -> (Lightning precision with mixed precision on, with it off).
_NAMED: Final[dict[str, tuple[str, str | None]]] = {
    "auto": ("auto", None),
    "bf16": ("bf16-mixed", "bf16-true"),
    "fp16": ("16-mixed", "16-true"),
    "fp32": ("32-true", "32-true"),
}
#: Names that exist in tuning guides but are not training precisions Lightning can run -> why.
_REFUSED: Final[dict[str, str]] = {
    "tf32": "TF32 is a matmul mode of fp32 on Ampere+ GPUs, not a Lightning precision; use 'fp32' and call "
    "torch.set_float32_matmul_precision('high') in your script",
    "int8": "int8 is an inference quantisation, not a training precision",
}
#: Every precision name a configuration file may use.
PRECISION_NAMES: Final[tuple[str, ...]] = (*_NAMED, *(p for p in PRECISIONS if p != "auto"))


def lightning_precision(
    name: str | None,
    mixed: bool | None,
    *,
    key: str = "training.precision",
    mixed_key: str = "training.mixed_precision.enabled",
) -> str | None:
    """The Lightning precision string for a configuration's ``precision`` and ``mixed_precision.enabled``.

    ``fp16``/``bf16`` are mixed precision unless ``mixed`` is ``False`` (then ``16-true``/``bf16-true``); ``auto``
    is :class:`~lightning_tune.TunePlugin`'s ``"auto"`` (bf16-mixed or 16-mixed on a GPU, 32-true on CPU), also what
    ``mixed=True`` alone means; Lightning's own strings are taken as they are.

    Args:
        name: The ``precision`` value, or ``None`` when absent.
        mixed: The ``mixed_precision.enabled`` value, or ``None`` when absent.
        key: Dotted path of ``precision``, for messages.
        mixed_key: Dotted path of ``mixed_precision.enabled``, for messages.

    Returns:
        A Lightning precision string, or ``None`` when neither is given.

    Raises:
        TypeError: If ``name`` is not a string, ``mixed`` not a bool or None, or a key name not a string.
        ValueError: If ``name`` is unknown or contradicts ``mixed``, or a key name is empty.

    Example:
        >>> lightning_precision("fp16", None), lightning_precision("bf16", False), lightning_precision(None, True)
        ('16-mixed', 'bf16-true', 'auto')
    """
    check_str("key", key)
    check_str("mixed_key", mixed_key)
    if mixed is not None and not isinstance(mixed, bool):
        raise TypeError(f"`{mixed_key}` must be true, false or absent, got {mixed!r} ({type(mixed).__name__})")
    if name is None:
        return "auto" if mixed else None
    if not isinstance(name, str):
        raise TypeError(f"`{key}` must be a string, got {name!r} ({type(name).__name__})")
    if name in _REFUSED:
        raise ValueError(f"`{key}` cannot be {name!r}: {_REFUSED[name]}")
    if name not in PRECISION_NAMES:
        allowed = ", ".join(repr(n) for n in PRECISION_NAMES)
        raise ValueError(f"`{key}` must be one of {allowed}, got {name!r}")
    if name in _NAMED:
        with_mixed, without = _NAMED[name]
        if name == "fp32" and mixed:
            raise ValueError(f"`{mixed_key}` is true but `{key}` is 'fp32'; mixed precision needs 'fp16' or 'bf16'")
        if mixed is False and without is None:
            raise ValueError(
                f"`{key}` 'auto' chooses a mixed precision, but `{mixed_key}` is false; name the precision "
                "('fp16', 'bf16' or 'fp32')"
            )
        return with_mixed if mixed is not False else without
    is_mixed = name.endswith("-mixed")
    if mixed is not None and mixed != is_mixed:
        raise ValueError(f"`{key}` {name!r} contradicts `{mixed_key}`: {str(mixed).lower()}")
    return name
