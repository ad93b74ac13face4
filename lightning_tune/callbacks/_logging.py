"""How the callbacks log: straight to the Trainer's loggers, at ``global_step``.

Not through ``self.log``, which would copy each value to the device (a host-device synchronisation per key and step on
a GPU). The keys are those of :mod:`lightning_tune.keys`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from lightning_tune import keys

if TYPE_CHECKING:
    import lightning.pytorch as pl


def log(trainer: pl.Trainer, metrics: Mapping[str, float]) -> None:
    """Write ``metrics`` (as floats) to every logger of the Trainer, at ``global_step``."""
    for logger in trainer.loggers:
        logger.log_metrics({key: float(value) for key, value in metrics.items()}, step=trainer.global_step)


def log_every_n_steps(trainer: pl.Trainer, metrics: Callable[[], Mapping[str, float]]) -> None:
    """Write ``metrics()`` to the Trainer's loggers every ``log_every_n_steps`` optimizer steps (only then built)."""
    every = trainer.log_every_n_steps  # type: ignore[attr-defined]  # set at runtime by the logger connector
    if trainer.loggers and every and not trainer.global_step % every:
        log(trainer, metrics())


def learning_rates(trainer: pl.Trainer) -> dict[str, float]:
    """Every parameter group's LR, keyed by :func:`lightning_tune.keys.lr` (before a step: the LR the step uses)."""
    return {
        keys.lr(j, i): float(group["lr"])
        for j, optimizer in enumerate(trainer.optimizers)
        for i, group in enumerate(optimizer.param_groups)
    }
