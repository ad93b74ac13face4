"""The names a user types for a precision, an optimizer, an attention backend or an accelerator, defined once.

Each kind has one canonical spelling (Lightning's for precisions); the spellings of tuning guides and Hugging Face are
aliases, converted here and nowhere else, so every command, configuration key, swap and the planner accept one set.

Example:
    >>> canonical_precision("bf16"), canonical_optimizer("adamw_8bit"), canonical_attention("flash_attention_2")
    ('bf16-mixed', 'adamw8bit', 'flash')
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING, Final, Literal, cast, get_args

if TYPE_CHECKING:  # torch is imported where a dtype or a device is needed: the command line starts without it
    import torch

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
#: What a memory plan is made for: a training step, an evaluation step with labels
#: (``validation_step``, ``test_step``: no gradients, no optimizer state, the loss computed) or a ``predict_step``.
PlanMode = Literal["train", "eval", "predict"]
PLAN_MODES: Final[tuple[str, ...]] = get_args(PlanMode)
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
#: Loss swap backends: ``"chunked"`` (PyTorch, any device), ``"liger"`` (Liger-Kernel, CUDA), ``"auto"`` (liger on CUDA
#: when installed, else chunked).
LossBackend = Literal["auto", "chunked", "liger"]
LOSS_BACKENDS: Final[tuple[str, ...]] = get_args(LossBackend)
#: Lightning accelerator names.
Accelerator = Literal["auto", "cpu", "gpu", "cuda", "mps"]
ACCELERATORS: Final[tuple[str, ...]] = get_args(Accelerator)

# Lightning's own short forms, the tuning guides' and Hugging Face's spellings.
_PRECISION_ALIASES: Final[Mapping[str, str]] = {
    **dict.fromkeys(("32", "fp32", "float32"), "32-true"),
    **dict.fromkeys(("16", "fp16", "float16"), "16-mixed"),
    **dict.fromkeys(("bf16", "bfloat16"), "bf16-mixed"),
    **dict.fromkeys(("64", "fp64"), "64-true"),
}
_OPTIMIZER_ALIASES: Final[Mapping[str, str]] = {
    "adamw_torch": "adamw",
    "adamw_torch_fused": "adamw_fused",
    "adamw_bnb_8bit": "adamw8bit",
    **{name.replace("8bit", "_8bit"): name for name in OPTIMIZERS if name.endswith("8bit")},  # adamw_8bit, ...
}
_ATTENTION_ALIASES: Final[Mapping[str, str]] = {
    **dict.fromkeys(("flash_attention_2", "flash_attention_3", "flash-attn"), "flash"),
    "scaled_dot_product_attention": "sdpa",
}
_DTYPES: Final[Mapping[str, tuple[str, int]]] = {  # the torch dtype's name and its bytes per element
    "32-true": ("float32", 4),
    **dict.fromkeys(("16-mixed", "16-true"), ("float16", 2)),
    **dict.fromkeys(("bf16-mixed", "bf16-true"), ("bfloat16", 2)),
    "64-true": ("float64", 8),
    **dict.fromkeys(("transformer-engine", "transformer-engine-float16"), ("float8_e4m3fn", 1)),
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
    """The canonical (Lightning) name of a precision in ``allowed``, or a TypeError/ValueError naming ``arg``.

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


def canonical_loss(value: object, *, arg: str = "loss", allowed: Collection[str] = LOSS_BACKENDS) -> LossBackend:
    """The canonical name of a loss swap backend (no aliases); see :func:`canonical_precision`.

    Example:
        >>> canonical_loss("Chunked")
        'chunked'
    """
    return cast(LossBackend, _canonical("a loss backend", value, LOSS_BACKENDS, {}, arg, allowed))


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
    import torch

    return getattr(torch, _DTYPES[canonical_precision(precision, allowed=_DTYPES)][0])


def precision_bytes(precision: str) -> int:
    """The bytes per element of :func:`precision_dtype`, known without importing torch.

    Example:
        >>> precision_bytes("bf16-mixed"), precision_bytes("32-true"), precision_bytes("transformer-engine")
        (2, 4, 1)
    """
    return _DTYPES[canonical_precision(precision, allowed=_DTYPES)][1]


def check_precision_device(precision: str, device: str) -> None:
    """Refuse (ValueError) a precision that cannot train on a device type: ``16-mixed`` (fp16 with a scaler) on a CPU.

    Example:
        >>> check_precision_device("bf16", "cpu"), check_precision_device("16-mixed", "cuda")
        (None, None)
    """
    if canonical_precision(precision) == "16-mixed" and device == "cpu":
        raise ValueError(
            "`precision` '16-mixed' needs a CUDA GPU (fp16 autocast with a gradient scaler); on CPU use 'bf16-mixed'"
        )


def auto_precision(device: torch.device | str) -> str:
    """What ``"auto"`` precision means on ``device``.

    bf16-mixed on a CUDA GPU with bf16, 16-mixed on other CUDA GPUs, 32-true elsewhere. Call it only once the
    training device is known, in the training process: on a CUDA device it asks the GPU, which initialises CUDA,
    and a process that has done so can no longer fork workers that use CUDA.

    Example:
        >>> auto_precision("cpu")
        '32-true'
    """
    import torch

    if torch.device(device).type == "cuda":
        return "bf16-mixed" if torch.cuda.is_bf16_supported() else "16-mixed"
    return "32-true"
