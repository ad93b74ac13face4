"""What one benchmark sweep measures: :class:`BenchSettings`, and the parser of a batch-size list."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Final, Literal, get_args

from lightning_tune._validation import MAX_SEED, check_choice, check_instance, check_int
from lightning_tune.vocab import (
    ACCELERATORS,
    Accelerator,
    Attention,
    OptimizerName,
    Precision,
    canonical_attention,
    canonical_optimizer,
    canonical_precision,
)

#: What a sweep times: optimizer steps of ``Trainer.fit`` or ``predict_step`` calls of ``Trainer.predict``.
Mode = Literal["train", "predict"]
MODES: Final[tuple[str, ...]] = get_args(Mode)

#: The model name that selects the demo GPT and its synthetic data.
DEMO: Final = "demo"
#: Tokens per sequence of the demo when none is given.
DEFAULT_SEQ_LEN: Final = 512
#: The longest demo sequence: its position table and its token generation grow with the length.
DEMO_MAX_SEQ_LEN: Final = 2**16
#: The most tokens (batch size x sequence length) one demo batch may hold: its data is generated in memory, at
#: least one batch of it, and 2**24 tokens already need 4 GiB of logits.
DEMO_MAX_BATCH_TOKENS: Final = 2**24
#: The most measured (or warm-up) steps per batch size: as many step times as the monitor's window keeps
#: (``lightning_tune.perf.window.MAX_WINDOW``).
MAX_STEPS: Final = 1_000_000

# "package.module:Class", the class possibly nested ("module:Outer.Inner")
_SPEC = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")
_SPEC_ALLOWED = "'package.module:ClassName'"


def parse_batch_sizes(text: str) -> tuple[int, ...]:
    """The batch sizes of ``--batch-size``, distinct integers >= 1 separated by commas, in the order given.

    Raises:
        ValueError: If an entry is not an integer >= 1, the list is empty or repeats a size.

    Example:
        >>> parse_batch_sizes("1, 4,8")
        (1, 4, 8)
    """
    allowed = "distinct integers >= 1 separated by commas, such as '1,4,8'"
    parts = [part.strip() for part in text.split(",")]
    if not all(part.isdigit() and int(part) >= 1 for part in parts):
        raise ValueError(f"`batch_sizes` must be {allowed}, got {text!r}")
    sizes = tuple(int(part) for part in parts)
    if len(set(sizes)) != len(sizes):
        raise ValueError(f"`batch_sizes` must be {allowed}, got {text!r} (a size is repeated)")
    return sizes


def _check_spec(name: str, value: Any) -> None:
    check_instance(name, value, str, f"a string such as {_SPEC_ALLOWED}")
    if not _SPEC.match(value):
        raise ValueError(f"`{name}` must be {_SPEC_ALLOWED}, got {value!r}")


def _check_kwargs(name: str, value: Any) -> dict[str, Any]:
    if not isinstance(value, Mapping) or not all(isinstance(key, str) for key in value):
        raise TypeError(f"`{name}` must be a mapping of keyword arguments (str keys), got {value!r}")
    return dict(value)


@dataclass(frozen=True, kw_only=True)
class BenchSettings:
    """One sweep: the model, the batch sizes to try, and how each setting is run.

    Args:
        batch_sizes: Batch sizes to try, in order; distinct integers >= 1.
        mode: ``"train"`` times optimizer steps; ``"predict"`` times ``predict_step`` calls (request latency).
        model: ``"demo"`` (the demo GPT) or ``"package.module:ClassName"`` naming a LightningModule subclass.
        model_args: Keyword arguments of the module, or for the demo :class:`~lightning_tune.demos.GPTConfig` fields.
        datamodule: ``"package.module:ClassName"`` of a LightningDataModule, ``None`` for the module's own data.
            Not with the demo.
        datamodule_args: Keyword arguments of the datamodule's constructor.
        sequence_length: Tokens per sequence, demo only (``None``: 512), at most :data:`DEMO_MAX_SEQ_LEN`, and
            at most :data:`DEMO_MAX_BATCH_TOKENS` per batch (batch size x sequence length).
        steps: Measured steps (or predict batches) per batch size, from 2 to :data:`MAX_STEPS`.
        warmup: Steps (or predict batches) run first and left out of the figures, from 0 to :data:`MAX_STEPS`.
        precision: Precision of :class:`~lightning_tune.TunePlugin` (``"auto"``: decided for the device). This,
            ``optimizer`` and ``attention`` take the aliases of :mod:`lightning_tune.vocab`, stored canonical.
        optimizer: Optimizer swap of :class:`~lightning_tune.TunePlugin` (e.g. ``"adamw8bit"``), or ``None``.
        attention: Attention backend of :class:`~lightning_tune.TunePlugin`, or ``None`` to leave attention alone.
        accelerator: Lightning accelerator (``"auto"``, ``"cpu"``, ``"gpu"``, ``"cuda"`` or ``"mps"``), one device.
        seed: Seed set before each setting, from 0 to 2**32 - 1, so every batch size starts from the same weights.

    Raises:
        TypeError: If an argument has the wrong type.
        ValueError: If an argument is not allowed.

    Example:
        >>> BenchSettings(batch_sizes=(1, 4), steps=20).demo_sequence_length
        512
    """

    mode: Mode = "train"
    model: str = DEMO
    model_args: Mapping[str, Any] = field(default_factory=dict)
    datamodule: str | None = None
    datamodule_args: Mapping[str, Any] = field(default_factory=dict)
    batch_sizes: tuple[int, ...]  # after the fields above in as_dict() and bench.json
    sequence_length: int | None = None
    steps: int = 100
    warmup: int = 10
    precision: Precision = "auto"
    optimizer: OptimizerName | None = None
    attention: Attention | None = None
    accelerator: Accelerator = "auto"
    seed: int = 0

    def __post_init__(self) -> None:
        from lightning_tune.swaps.optimizer import TARGETS

        sizes = self.batch_sizes
        if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Sequence):
            raise TypeError(f"`batch_sizes` must be a sequence of integers such as (1, 4, 8), got {sizes!r}")
        if not sizes:
            raise ValueError("`batch_sizes` must hold at least one batch size, got ()")
        for index, size in enumerate(sizes):
            check_int(f"batch_sizes[{index}]", size, minimum=1)
        if len(set(sizes)) != len(sizes):
            raise ValueError(f"`batch_sizes` must not repeat a batch size, got {tuple(sizes)!r}")
        object.__setattr__(self, "batch_sizes", tuple(sizes))
        check_choice("mode", self.mode, MODES)
        if self.model != DEMO:
            _check_spec("model", self.model)
        object.__setattr__(self, "model_args", _check_kwargs("model_args", self.model_args))
        if self.datamodule is not None:
            _check_spec("datamodule", self.datamodule)
            if self.model == DEMO:
                raise ValueError(
                    f"`datamodule` must be None with model='demo' (the demo brings its own data), got "
                    f"{self.datamodule!r}"
                )
        datamodule_args = _check_kwargs("datamodule_args", self.datamodule_args)
        if datamodule_args and self.datamodule is None:
            raise ValueError(f"`datamodule_args` needs a `datamodule`, got {datamodule_args!r} without one")
        object.__setattr__(self, "datamodule_args", datamodule_args)
        check_int("sequence_length", self.sequence_length, minimum=1, maximum=DEMO_MAX_SEQ_LEN, allow_none=True)
        if self.sequence_length is not None and self.model != DEMO:
            raise ValueError(
                "`sequence_length` applies only to model='demo' (a module's own data fixes its sequence length), got "
                f"sequence_length={self.sequence_length!r} with model={self.model!r}"
            )
        if self.model == DEMO and "seq_len" in self.model_args:
            raise ValueError("`model_args` must not hold 'seq_len' for the demo; give `sequence_length` instead")
        seq_len = self.demo_sequence_length
        if seq_len is not None and max(sizes) * seq_len > DEMO_MAX_BATCH_TOKENS:
            raise ValueError(
                f"`batch_sizes` of the demo must hold at most {DEMO_MAX_BATCH_TOKENS:,} tokens per batch (batch size x "
                f"sequence length {seq_len}), so at most {DEMO_MAX_BATCH_TOKENS // seq_len:,} sequences, got "
                f"{max(sizes)!r}"
            )
        check_int("steps", self.steps, minimum=2, maximum=MAX_STEPS)
        check_int("warmup", self.warmup, minimum=0, maximum=MAX_STEPS)
        object.__setattr__(self, "precision", canonical_precision(self.precision))
        if self.optimizer is not None:
            object.__setattr__(self, "optimizer", canonical_optimizer(self.optimizer, allowed=TARGETS))
        if self.attention is not None:
            object.__setattr__(self, "attention", canonical_attention(self.attention))
        check_choice("accelerator", self.accelerator, ACCELERATORS)
        check_int("seed", self.seed, minimum=0, maximum=MAX_SEED)

    @property
    def demo_sequence_length(self) -> int | None:
        """The demo's sequence length (``sequence_length``, else 512); ``None`` for a user module."""
        return (self.sequence_length or DEFAULT_SEQ_LEN) if self.model == DEMO else None

    def as_dict(self) -> dict[str, Any]:
        """The settings as JSON-ready builtins (``bench.json``'s ``settings``), ``sequence_length`` resolved."""
        return {**asdict(self), "batch_sizes": list(self.batch_sizes), "sequence_length": self.demo_sequence_length}
