"""A configuration's ``precision`` and ``mixed_precision.enabled``, as one Lightning precision string."""

from __future__ import annotations

from typing import Final

from lightning_tune.vocab import canonical_precision

#: Names of tuning guides that are not training precisions Lightning can run -> why.
_REFUSED: Final[dict[str, str]] = {
    "tf32": "TF32 is a matmul mode of fp32 on Ampere+ GPUs, not a Lightning precision; use 'fp32' and call "
    "torch.set_float32_matmul_precision('high') in your script",
    "int8": "int8 is an inference quantisation, not a training precision",
}


def lightning_precision(
    name: str | None,
    mixed: bool | None,
    *,
    key: str = "training.precision",
    mixed_key: str = "training.mixed_precision.enabled",
) -> str | None:
    """The Lightning precision for a configuration's ``precision`` and ``mixed_precision.enabled`` (``None``: absent).

    The rules are those of ``docs/config.md``; messages name ``key`` and ``mixed_key``.

    Example:
        >>> lightning_precision("fp16", None), lightning_precision("bf16", False), lightning_precision(None, True)
        ('16-mixed', 'bf16-true', 'auto')
    """
    if mixed is not None and not isinstance(mixed, bool):
        raise TypeError(f"`{mixed_key}` must be true, false or absent, got {mixed!r} ({type(mixed).__name__})")
    if name is None:
        return "auto" if mixed else None
    if isinstance(name, str) and name.strip().lower() in _REFUSED:
        raise ValueError(f"`{key}` cannot be {name!r}: {_REFUSED[name.strip().lower()]}")
    precision = canonical_precision(name, arg=key)
    if mixed is False and precision.endswith("-mixed") and not name.strip().lower().endswith("-mixed"):
        return precision.replace("-mixed", "-true")  # `fp16`/`bf16` with mixed precision off
    if mixed is None or mixed == (precision == "auto" or precision.endswith("-mixed")):
        return precision
    kind = "a mixed precision" if mixed is False else "not a mixed precision"
    raise ValueError(f"`{key}` {name!r} is {kind}, but `{mixed_key}` is {str(mixed).lower()}")
