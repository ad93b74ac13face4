"""How the callbacks log: straight to the Trainer's loggers, at the steps Lightning logs ``self.log`` values on.

Not through ``self.log``, which would copy each value to the device (a host-device synchronisation per key and step on
a GPU); on Lightning's step numbering, so that the curves overlay ``self.log``'s and ``LearningRateMonitor``'s.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from lightning.pytorch.callbacks import Callback
from torch.optim import Optimizer
from typing_extensions import override

from lightning_tune import keys

if TYPE_CHECKING:
    import lightning.pytorch as pl


def lightning_step(trainer: pl.Trainer) -> int:
    """The step Lightning logs at: the optimizer steps taken before the current batch's (after fit: all of them).

    Lightning writes ``self.log`` values and ``LearningRateMonitor`` its LRs at ``fit_loop.epoch_loop.
    _batches_that_stepped``, which is one less than ``global_step`` in ``on_train_batch_end`` and which no public
    attribute gives. Private; checked on Lightning 2.6.6 (a test fails if it moves) and read only here.
    """
    step = getattr(getattr(trainer.fit_loop, "epoch_loop", None), "_batches_that_stepped", None)
    return step if isinstance(step, int) else trainer.global_step


def should_log(trainer: pl.Trainer, every: int | None = None) -> bool:
    """Whether this optimizer step is one Lightning logs on (``every=None``), or would with ``every`` as interval."""
    if every is not None:
        return (lightning_step(trainer) + 1) % every == 0
    # private, as lightning_step, and read only here: Lightning's own rule (the step after lightning_step is a
    # multiple of the Trainer's `log_every_n_steps`, or the run is stopping)
    connector = getattr(trainer, "_logger_connector", None)
    return bool(getattr(connector, "should_update_logs", False))


def log(trainer: pl.Trainer, metrics: Mapping[str, float]) -> None:
    """Write ``metrics`` (as floats) to every logger of the Trainer, at :func:`lightning_step`."""
    step = lightning_step(trainer)
    for logger in trainer.loggers:
        logger.log_metrics({key: float(value) for key, value in metrics.items()}, step=step)


def log_every_n_steps(trainer: pl.Trainer, metrics: Callable[[], Mapping[str, float]]) -> None:
    """Write ``metrics()`` to the Trainer's loggers on the steps Lightning logs on (only then built)."""
    if trainer.loggers and should_log(trainer):
        log(trainer, metrics())


def learning_rates(trainer: pl.Trainer) -> dict[str, float]:
    """Every parameter group's LR, keyed by :func:`lightning_tune.keys.lr` (before a step: the LR the step uses)."""
    return {
        keys.lr(j, i): float(group["lr"])
        for j, optimizer in enumerate(trainer.optimizers)
        for i, group in enumerate(optimizer.param_groups)
    }


class LRLogger(Callback):
    """Base of the callbacks that log every group's LR (on Lightning's logging steps, then where the run ended)."""

    def logs_lr(self, trainer: pl.Trainer) -> bool:
        """Whether this callback logs the learning rates of ``trainer`` (no other callback logs them already)."""
        return True

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        # the cheap checks first: whether another callback logs the LRs is asked on logging steps only
        if optimizer is trainer.optimizers[0] and trainer.loggers and should_log(trainer) and self.logs_lr(trainer):
            log(trainer, learning_rates(trainer))

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.logs_lr(trainer):
            log(trainer, learning_rates(trainer))  # where the run ended: its last step is rarely a logging step
