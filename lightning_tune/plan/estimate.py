"""The result of a memory plan: a byte breakdown, linear in batch size, and the batch that fits a budget.

Peak training memory is modelled as ``fixed_bytes + bytes_per_sample * batch_size``: weights, gradients, optimizer
states and buffers do not grow with the batch; activations do. A budget is first cut by a margin, the share kept
back for what the model does not see (the CUDA context, the caching allocator's fragmentation, NCCL buffers, other
processes):

- ``"safe"`` keeps 20 % back: long unattended runs, variable sequence lengths, shared GPUs;
- ``"optimal"`` keeps 10 % back, the default: what a steady run under the caching allocator usually needs;
- ``"aggressive"`` keeps 5 % back: fixed shapes on a dedicated GPU, a run you watch.

Example:
    >>> estimate = MemoryEstimate(parameters=1000, weight_bytes=4000, bytes_per_sample=1000, fixed_bytes=4000)
    >>> estimate.total_bytes(3)
    7000
    >>> estimate.batch_sizes(20_000)
    {'safe': 12, 'optimal': 14, 'aggressive': 15}
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Final, Literal, get_args

from lightning_tune._validation import check_choice, check_int
from lightning_tune.vocab import PRECISIONS

__all__ = [
    "MARGINS",
    "MARGIN_RESERVE",
    "PLAN_MODES",
    "PLAN_PRECISIONS",
    "Margin",
    "MemoryEstimate",
    "PlanMode",
    "format_bytes",
]

#: The precisions a plan is made for: all but ``"auto"`` (it depends on the GPU) and transformer-engine's float8.
PLAN_PRECISIONS: Final[tuple[str, ...]] = tuple(p for p in PRECISIONS if p != "auto" and "transformer" not in p)

#: What a plan is made for: a training step, an evaluation step with labels (``validation_step``, ``test_step``: no
#: gradients, no optimizer state, nothing saved for backward, the loss computed) or a ``predict_step`` (no labels, no
#: loss: the logits are what it returns).
PlanMode = Literal["train", "eval", "predict"]
PLAN_MODES: Final[tuple[str, ...]] = get_args(PlanMode)

#: Names of the margins a budget is cut by.
Margin = Literal["safe", "optimal", "aggressive"]
MARGINS: Final[tuple[str, ...]] = get_args(Margin)

#: Share of the budget each margin keeps back.
MARGIN_RESERVE: Final[Mapping[str, float]] = MappingProxyType({"safe": 0.20, "optimal": 0.10, "aggressive": 0.05})

_GIB = 2**30


def format_bytes(n: int) -> str:
    """Render a byte count in GiB (or MiB below 1 GiB), as the planner prints it (binary units).

    Args:
        n: The number of bytes.

    Returns:
        The text, e.g. ``"12.55 GiB"``.

    Example:
        >>> format_bytes(13_476_831_232), format_bytes(3 * 2**20), format_bytes(512)
        ('12.55 GiB', '3.0 MiB', '512 B')
    """
    check_int("n", n, minimum=0)
    if abs(n) >= _GIB:
        return f"{n / _GIB:.2f} GiB"
    if abs(n) >= 2**20:
        return f"{n / 2**20:.1f} MiB"
    return f"{n / 2**10:.1f} KiB" if abs(n) >= 2**10 else f"{n} B"


@dataclass(frozen=True, kw_only=True)
class MemoryEstimate:
    """Training memory of one model setting: a breakdown in bytes and a linear model of the peak.

    ``fixed_bytes`` and ``bytes_per_sample`` are what the batch-size arithmetic uses. For an analytic estimate they
    are the sums of the breakdown; for a measured one they come from peaks measured at two batch sizes, so they
    may differ from the breakdown's sum (the peak holds temporaries, and gradients and activations are not all
    alive at once).

    Args:
        parameters: All parameters, counted once.
        weight_bytes: Bytes of the weights as the model holds them ("model size").
        bytes_per_sample: What each extra sample adds to the peak (activations, inputs).
        fixed_bytes: Everything at the peak that does not grow with the batch.
        trainable_parameters: Parameters that get gradients; ``None`` means ``parameters``.
        gradient_bytes: Bytes of the gradients.
        master_weight_bytes: Bytes of float32 master copies of 16-bit weights (0 when there are none).
        optimizer_bytes: Bytes of the optimizer's state.
        buffer_bytes: Bytes of the model's buffers.
        largest_layer_parameters: Parameters of the largest module (ZeRO stage 3 gathers one at a time); ``None``
            means ``parameters``.
        sequence_length: Sequence length the activations were sized for, if any.
        source: ``"analytic"`` (from a shape) or ``"measured"`` (from a fake-tensor training step).
        notes: One line per assumption worth printing next to the figures.
        mode: What the figures are for, one of :data:`PLAN_MODES`: ``"train"``, or ``"eval"``/``"predict"``, where
            the breakdown is what ``trainer.validate``, ``test`` or ``predict`` holds (weights and buffers).
        fit_fixed_bytes: With ``"eval"``/``"predict"``: the fixed bytes of evaluation inside ``fit``, where the
            training state (gradients, master weights, optimizer state) stays resident; ``None`` when not planned.

    Raises:
        TypeError: If a count is not an integer.
        ValueError: If a count is negative or ``bytes_per_sample`` is 0.
    """

    parameters: int
    weight_bytes: int
    bytes_per_sample: int
    fixed_bytes: int
    trainable_parameters: int | None = None
    gradient_bytes: int = 0
    master_weight_bytes: int = 0
    optimizer_bytes: int = 0
    buffer_bytes: int = 0
    largest_layer_parameters: int | None = None
    sequence_length: int | None = None
    source: Literal["analytic", "measured"] = "analytic"
    notes: tuple[str, ...] = field(default=())
    mode: PlanMode = "train"
    fit_fixed_bytes: int | None = None

    def __post_init__(self) -> None:
        for name in (
            "parameters",
            "weight_bytes",
            "fixed_bytes",
            "gradient_bytes",
            "master_weight_bytes",
            "optimizer_bytes",
            "buffer_bytes",
        ):
            check_int(name, getattr(self, name), minimum=0)
        check_int("bytes_per_sample", self.bytes_per_sample, minimum=1)
        check_int("trainable_parameters", self.trainable_parameters, minimum=0, allow_none=True)
        check_int("largest_layer_parameters", self.largest_layer_parameters, minimum=0, allow_none=True)
        check_int("sequence_length", self.sequence_length, minimum=1, allow_none=True)
        check_choice("source", self.source, ("analytic", "measured"))
        check_choice("mode", self.mode, PLAN_MODES)
        check_int("fit_fixed_bytes", self.fit_fixed_bytes, minimum=1, allow_none=True)
        if not isinstance(self.notes, tuple) or not all(isinstance(note, str) for note in self.notes):
            raise TypeError(f"`notes` must be a tuple of strings, got {self.notes!r} ({type(self.notes).__name__})")
        if self.trainable_parameters is None:
            object.__setattr__(self, "trainable_parameters", self.parameters)
        if self.largest_layer_parameters is None:
            object.__setattr__(self, "largest_layer_parameters", self.parameters)

    @property
    def state_bytes(self) -> int:
        """Weights, gradients, master weights and optimizer state: what ZeRO shards."""
        return self.weight_bytes + self.gradient_bytes + self.master_weight_bytes + self.optimizer_bytes

    def total_bytes(self, batch_size: int) -> int:
        """Predicted peak memory at ``batch_size``: ``fixed_bytes + bytes_per_sample * batch_size``.

        Args:
            batch_size: Samples per micro-batch, >= 0.

        Returns:
            The number of bytes.

        Raises:
            TypeError: If ``batch_size`` is not an integer.
            ValueError: If ``batch_size`` is negative.
        """
        check_int("batch_size", batch_size, minimum=0)
        return self.fixed_bytes + self.bytes_per_sample * batch_size

    def usable_bytes(self, budget_bytes: int, margin: Margin = "optimal") -> int:
        """The part of a budget a margin leaves to the model.

        Args:
            budget_bytes: Memory of one device, in bytes.
            margin: ``"safe"``, ``"optimal"`` or ``"aggressive"``.

        Returns:
            ``floor(budget_bytes * (1 - reserve))``.

        Raises:
            TypeError: If ``budget_bytes`` is not an integer.
            ValueError: If ``budget_bytes`` is negative or ``margin`` is unknown.
        """
        check_int("budget_bytes", budget_bytes, minimum=0)
        check_choice("margin", margin, MARGINS)
        return int(budget_bytes * (1.0 - MARGIN_RESERVE[margin]))

    def max_batch_size(self, budget_bytes: int, margin: Margin = "optimal") -> int:
        """Largest batch whose predicted peak fits the budget after the margin.

        Args:
            budget_bytes: Memory of one device, in bytes.
            margin: ``"safe"``, ``"optimal"`` or ``"aggressive"``.

        Returns:
            The batch size; 0 when not even one sample fits.

        Raises:
            TypeError: If ``budget_bytes`` is not an integer.
            ValueError: If ``budget_bytes`` is negative or ``margin`` is unknown.
        """
        usable = self.usable_bytes(budget_bytes, margin)
        return max(0, (usable - self.fixed_bytes) // self.bytes_per_sample)

    def batch_sizes(self, budget_bytes: int) -> dict[str, int]:
        """:meth:`max_batch_size` at every margin.

        Args:
            budget_bytes: Memory of one device, in bytes.

        Returns:
            ``{"safe": n, "optimal": n, "aggressive": n}``.

        Raises:
            TypeError: If ``budget_bytes`` is not an integer.
            ValueError: If ``budget_bytes`` is negative.
        """
        return {margin: self.max_batch_size(budget_bytes, margin) for margin in MARGINS}  # type: ignore[arg-type]
