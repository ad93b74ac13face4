"""The names a user types for a precision, an optimizer, an attention backend or an accelerator, defined once.

Each kind has one canonical spelling: Lightning's for precisions (``"bf16-mixed"``), the pack's for optimizers
(``"adamw8bit"``) and attention (``"flash"``). The spellings of tuning guides and Hugging Face (``"bf16"``,
``"fp16"``, ``"adamw_8bit"``, ``"adamw_torch_fused"``, ``"flash_attention_2"``) are aliases, converted here and
nowhere else. Commands, configuration keys, the plugin, the swaps and the planner all accept the same set, and their
messages show the canonical name.

Example:
    >>> canonical_precision("bf16"), canonical_optimizer("adamw_8bit"), canonical_attention("flash_attention_2")
    ('bf16-mixed', 'adamw8bit', 'flash')
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Final, Literal, cast, get_args

import torch

__all__ = [
    "ACCELERATORS",
    "ATTENTIONS",
    "OPTIMIZERS",
    "PRECISIONS",
    "Accelerator",
    "Attention",
    "OptimizerName",
    "Precision",
    "auto_precision",
    "canonical_attention",
    "canonical_optimizer",
    "canonical_precision",
    "precision_dtype",
]

#: Lightning's precision strings, and ``"auto"``: bf16-mixed or 16-mixed on a CUDA GPU, 32-true elsewhere.
Precision = Literal[
    "auto",
    "32-true",
    "16-mixed",
    "bf16-mixed",
    "16-true",
    "bf16-true",
    "64-true",
    "transformer-engine",
    "transformer-engine-float16",
]
PRECISIONS: Final[tuple[str, ...]] = get_args(Precision)
#: Optimizers: the module's own AdamW or SGD (what a plan assumes when nothing is swapped), and those a swap builds.
OptimizerName = Literal[
    "adamw",
    "sgd",
    "adamw_fused",
    "adam8bit",
    "adamw8bit",
    "lion8bit",
    "sgd8bit",
    "paged_adam8bit",
    "paged_adamw8bit",
    "paged_lion8bit",
]
OPTIMIZERS: Final[tuple[str, ...]] = get_args(OptimizerName)
#: Attention backends; ``"flash"`` picks the flash-attn generation that fits the GPU.
Attention = Literal["auto", "flash", "sdpa", "eager"]
ATTENTIONS: Final[tuple[str, ...]] = get_args(Attention)
#: Lightning accelerator names.
Accelerator = Literal["auto", "cpu", "gpu", "cuda", "mps"]
ACCELERATORS: Final[tuple[str, ...]] = get_args(Accelerator)

# Lightning's own short forms, then the tuning guides' and Hugging Face's spellings.
_PRECISION_ALIASES: Final[Mapping[str, str]] = {
    "32": "32-true",
    "16": "16-mixed",
    "bf16": "bf16-mixed",
    "64": "64-true",
    "fp32": "32-true",
    "fp16": "16-mixed",
    "fp64": "64-true",
    "float32": "32-true",
    "float16": "16-mixed",
    "bfloat16": "bf16-mixed",
}
_OPTIMIZER_ALIASES: Final[Mapping[str, str]] = {
    "adamw_torch": "adamw",
    "adamw_torch_fused": "adamw_fused",
    "adam_8bit": "adam8bit",
    "adamw_8bit": "adamw8bit",
    "adamw_bnb_8bit": "adamw8bit",
    "lion_8bit": "lion8bit",
    "sgd_8bit": "sgd8bit",
    "paged_adam_8bit": "paged_adam8bit",
    "paged_adamw_8bit": "paged_adamw8bit",
    "paged_lion_8bit": "paged_lion8bit",
}
_ATTENTION_ALIASES: Final[Mapping[str, str]] = {
    "flash_attention_2": "flash",
    "flash_attention_3": "flash",
    "flash-attn": "flash",
    "scaled_dot_product_attention": "sdpa",
}
_DTYPES: Final[Mapping[str, torch.dtype]] = {
    "32-true": torch.float32,
    "16-mixed": torch.float16,
    "16-true": torch.float16,
    "bf16-mixed": torch.bfloat16,
    "bf16-true": torch.bfloat16,
    "64-true": torch.float64,
    "transformer-engine": torch.float8_e4m3fn,
    "transformer-engine-float16": torch.float8_e4m3fn,
}


def _canonical(
    kind: str, value: object, names: tuple[str, ...], aliases: Mapping[str, str], arg: str, allowed: Collection[str]
) -> str:
    if not isinstance(value, str):
        raise TypeError(f"`{arg}` must be a string naming {kind}, got {value!r} ({type(value).__name__})")
    name = aliases.get(value.strip().lower(), value.strip().lower())
    if name in allowed and name in names:
        return name
    shown = ", ".join(repr(n) for n in names if n in allowed)
    spelled = sorted(alias for alias, target in aliases.items() if target in allowed)
    also = f" (or an alias: {', '.join(repr(a) for a in spelled)})" if spelled else ""
    why = f"; {name!r} is {kind} but not one this accepts" if name in names else ""
    raise ValueError(f"`{arg}` must be one of {shown}{also}, got {value!r}{why}")


def canonical_precision(value: object, *, arg: str = "precision", allowed: Collection[str] = PRECISIONS) -> Precision:
    """The canonical (Lightning) name of a precision, or a clear error.

    Args:
        value: A precision name or alias, e.g. ``"bf16"``, ``"fp16"`` or ``"bf16-mixed"``.
        arg: The argument, flag or key named in messages.
        allowed: The canonical names the caller accepts (a subset of :data:`PRECISIONS`).

    Raises:
        TypeError: If ``value`` is not a string.
        ValueError: If it names no precision in ``allowed``.

    Example:
        >>> canonical_precision("fp16"), canonical_precision("32")
        ('16-mixed', '32-true')
    """
    return cast(Precision, _canonical("a precision", value, PRECISIONS, _PRECISION_ALIASES, arg, allowed))


def canonical_optimizer(
    value: object, *, arg: str = "optimizer", allowed: Collection[str] = OPTIMIZERS
) -> OptimizerName:
    """The canonical name of an optimizer (Hugging Face's ``optim`` names are aliases); see :func:`canonical_precision`.

    Example:
        >>> canonical_optimizer("paged_adamw_8bit"), canonical_optimizer("adamw_torch_fused")
        ('paged_adamw8bit', 'adamw_fused')
    """
    return cast(OptimizerName, _canonical("an optimizer", value, OPTIMIZERS, _OPTIMIZER_ALIASES, arg, allowed))


def canonical_attention(value: object, *, arg: str = "attention", allowed: Collection[str] = ATTENTIONS) -> Attention:
    """The canonical name of an attention backend (``attn_implementation`` names are aliases).

    Example:
        >>> canonical_attention("flash_attention_2"), canonical_attention("sdpa")
        ('flash', 'sdpa')
    """
    return cast(Attention, _canonical("an attention backend", value, ATTENTIONS, _ATTENTION_ALIASES, arg, allowed))


def precision_dtype(precision: str) -> torch.dtype:
    """The dtype a Lightning precision computes matmuls and attention in (autocast's dtype under mixed precision).

    Args:
        precision: A precision name or alias other than ``"auto"`` (resolve that with :func:`auto_precision`).

    Raises:
        ValueError: If ``precision`` is ``"auto"`` or names no precision.

    Example:
        >>> precision_dtype("bf16-mixed"), precision_dtype("16-true"), precision_dtype("transformer-engine")
        (torch.bfloat16, torch.float16, torch.float8_e4m3fn)
    """
    return _DTYPES[canonical_precision(precision, allowed=_DTYPES)]


def auto_precision(device: torch.device | str) -> str:
    """What ``"auto"`` precision means on ``device``.

    bf16-mixed on a CUDA GPU with bf16, 16-mixed on other CUDA GPUs, 32-true elsewhere. Call it only once the
    training device is known, in the training process: on a CUDA device it asks the GPU, which initialises CUDA,
    and a process that has done so can no longer fork workers that use CUDA.

    Example:
        >>> auto_precision("cpu")
        '32-true'
    """
    if torch.device(device).type == "cuda":
        return "bf16-mixed" if torch.cuda.is_bf16_supported() else "16-mixed"
    return "32-true"
