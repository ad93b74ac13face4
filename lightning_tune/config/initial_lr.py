"""``InitialLR``: set the peak learning rate of the optimizer a LightningModule configured (``docs/config.md``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from typing_extensions import override

from lightning_tune._validation import check_float
from lightning_tune.callbacks.lr_schedule import ScheduleCallback, base_lrs
from lightning_tune.lr.scheduler import set_lr

if TYPE_CHECKING:
    import lightning.pytorch as pl


class InitialLR(Callback):
    """Set the configured learning rate of every optimizer at fit start, keeping the ratios between groups.

    The group with the largest configured LR gets ``lr``. Put it before a schedule callback in ``callbacks=[...]``.

    Args:
        lr: The peak learning rate, > 0.

    Raises:
        TypeError: If ``lr`` is not a number.
        ValueError: If ``lr`` is not positive and finite.

    Example:
        >>> import lightning_tune as lt
        >>> from lightning.pytorch import Trainer
        >>> trainer = Trainer(callbacks=[InitialLR(3e-4), lt.WarmupCosine(warmup_steps=100)], logger=False)
    """

    def __init__(self, lr: float) -> None:
        check_float("lr", lr, low=0.0, low_inclusive=False)
        self.lr = float(lr)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for callback in trainer.callbacks:  # type: ignore[attr-defined]
            if isinstance(callback, ScheduleCallback) and callback.schedulers:
                raise MisconfigurationException(
                    f"InitialLR must come before {type(callback).__name__} in `callbacks=[...]`: the schedule has "
                    "already read the optimizer's learning rate"
                )
        for optimizer in trainer.optimizers:
            lrs = base_lrs(optimizer)
            peak = max(lrs)
            if peak <= 0:
                raise MisconfigurationException(
                    f"InitialLR cannot scale {type(optimizer).__name__}'s learning rates {lrs}: the largest is not > 0"
                )
            for group, configured in zip(optimizer.param_groups, lrs, strict=True):
                value = self.lr * configured / peak
                set_lr(group, value)
                if "initial_lr" in group:
                    group["initial_lr"] = value
