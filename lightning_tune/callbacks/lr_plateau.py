"""``AdaptiveLROnPlateau``: reduce the learning rate when a monitored metric stops improving, on top of any schedule."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import Tensor
from typing_extensions import override

from lightning_tune import keys
from lightning_tune._validation import changed_arguments, check_bool, check_float
from lightning_tune.callbacks._logging import LRLogger, log
from lightning_tune.callbacks.lr_schedule import base_lrs, number_or_numbers, per_group, schedule_lrs
from lightning_tune.lr.plateau import PlateauDetector, PlateauMode, ThresholdMode
from lightning_tune.lr.scheduler import set_lr

if TYPE_CHECKING:
    import lightning.pytorch as pl


class AdaptiveLROnPlateau(LRLogger):
    """Multiply the learning rate by ``factor`` when ``monitor`` has not improved for ``patience`` evaluations.

    A run resumed with other arguments than its checkpoint's uses them from the restored counters on, with one
    warning naming each change (``docs/lr_plateau.md``).

    Args:
        monitor: Name of the logged metric to watch.
        mode: ``"min"`` if lower is better, ``"max"`` if higher is better.
        factor: Reduction factor, in (0, 1).
        patience: Evaluations without improvement before reducing, >= 0.
        threshold: Smallest change that counts as an improvement, >= 0.
        threshold_mode: ``"rel"`` or ``"abs"``.
        cooldown: Evaluations to wait after a reduction before counting again, >= 0.
        min_lr: Floor for the reduced LR: one number, or one per parameter group of the first optimizer.
        eps: Smallest LR change that is applied, >= 0.
        check_on_train_epoch_end: Read the metric at epoch ends, not after validation (``None``: as ``EarlyStopping``).

    Raises:
        TypeError: If an argument has the wrong type.
        ValueError: If an argument is out of range or a mode is unknown.

    Example:
        >>> from lightning.pytorch import Trainer
        >>> trainer = Trainer(callbacks=[AdaptiveLROnPlateau(monitor="val_loss", patience=3)], logger=False)
    """

    def __init__(
        self,
        monitor: str = "val_loss",
        mode: PlateauMode = "min",
        *,
        factor: float = 0.5,
        patience: int = 5,
        threshold: float = 1e-4,
        threshold_mode: ThresholdMode = "rel",
        cooldown: int = 0,
        min_lr: float | Sequence[float] = 1e-6,
        eps: float = 1e-8,
        check_on_train_epoch_end: bool | None = None,
    ) -> None:
        if not isinstance(monitor, str) or not monitor:
            raise TypeError(f"`monitor` must be a non-empty metric name, got {monitor!r}")
        check_float("factor", factor, low=0.0, high=1.0, low_inclusive=False, high_inclusive=False)
        self.min_lr = number_or_numbers("min_lr", min_lr, positive=False)
        check_float("eps", eps, low=0.0)
        if check_on_train_epoch_end is not None:
            check_bool("check_on_train_epoch_end", check_on_train_epoch_end)
        self.detector = PlateauDetector(
            mode=mode, patience=patience, threshold=threshold, threshold_mode=threshold_mode, cooldown=cooldown
        )
        self.monitor, self.factor, self.eps, self.reductions = monitor, factor, eps, 0
        self.check_on_train_epoch_end, self._warned_missing = check_on_train_epoch_end, False

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(monitor=self.monitor, mode=self.detector.mode)

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.check_on_train_epoch_end is None:
            self.check_on_train_epoch_end = trainer.val_check_interval == 1.0 and trainer.check_val_every_n_epoch == 1

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for optimizer in trainer.optimizers:
            floors = per_group("AdaptiveLROnPlateau", "min_lr", self.min_lr, optimizer)
            for index, (floor, lr) in enumerate(zip(floors, base_lrs(optimizer), strict=True)):
                if floor > lr:
                    raise MisconfigurationException(
                        f"`min_lr` of AdaptiveLROnPlateau ({floor!r}) is above the learning rate of parameter group "
                        f"{index} ({lr:g}), so it could never reduce it; lower `min_lr`"
                    )

    @override
    def logs_lr(self, trainer: pl.Trainer) -> bool:
        return not any(scheduler.log_lr for scheduler in schedule_lrs(trainer))  # a schedule callback logs them

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.check_on_train_epoch_end:
            self._evaluate(trainer)

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.check_on_train_epoch_end and not trainer.sanity_checking:
            self._evaluate(trainer)

    def _evaluate(self, trainer: pl.Trainer) -> None:
        value = trainer.callback_metrics.get(self.monitor)
        current = None if value is None else float(value.item() if isinstance(value, Tensor) else value)
        current = trainer.strategy.broadcast(current, src=0)  # every rank decides on rank 0's value
        if current is None:
            if not self._warned_missing:
                self._warned_missing = True
                available = ", ".join(sorted(trainer.callback_metrics)) or "none yet"
                rank_zero_warn(
                    f"AdaptiveLROnPlateau is monitoring {self.monitor!r}, but no metric of that name was logged; the "
                    f"learning rate is not adapted until it appears. Metrics logged so far: {available}. "
                    "Log it with `self.log(...)` or change `monitor`.",
                    category=RuntimeWarning,
                )
            return
        if self.detector.update(current):
            self._reduce(trainer)
        log(trainer, {keys.PLATEAU_REDUCTIONS: self.reductions, keys.PLATEAU_BAD_EVALS: self.detector.num_bad_evals})

    def _reduce(self, trainer: pl.Trainer) -> None:
        schedulers = {id(scheduler.optimizer): scheduler for scheduler in schedule_lrs(trainer)}
        reduced = False
        for optimizer in trainer.optimizers:
            scheduler = schedulers.get(id(optimizer))
            floors = per_group("AdaptiveLROnPlateau", "min_lr", self.min_lr, optimizer)
            for index, (group, floor) in enumerate(zip(optimizer.param_groups, floors, strict=True)):
                old_lr = float(group["lr"])
                new_lr = max(old_lr * self.factor, floor)
                if old_lr - new_lr <= self.eps:
                    continue
                reduced = True
                if scheduler is not None:
                    scheduler.scale_group(index, new_lr / old_lr)
                else:
                    set_lr(group, new_lr)
        if reduced:
            self.reductions += 1

    def arguments(self) -> dict[str, Any]:
        """The arguments a checkpoint records, so that a run resumed with other values can say which it uses."""
        given = {name: getattr(self.detector, name) for name in ("patience", "threshold", "threshold_mode", "cooldown")}
        return {"factor": self.factor, **given, "min_lr": self.min_lr, "eps": self.eps}

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"detector": self.detector.state_dict(), "reductions": self.reductions, "arguments": self.arguments()}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.detector.load_state_dict(state_dict["detector"])
        self.reductions = int(state_dict["reductions"])
        if changed := changed_arguments(state_dict.get("arguments", {}), self.arguments()):
            bad = self.detector.num_bad_evals
            rank_zero_warn(
                "AdaptiveLROnPlateau: resumed with other arguments than the checkpoint's, which are used from here on: "
                f"{', '.join(changed)} ({bad} evaluation{'s' if bad != 1 else ''} without improvement so far)",
                category=UserWarning,
            )
