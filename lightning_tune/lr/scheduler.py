"""A ``torch.optim.lr_scheduler.LRScheduler`` that follows a pure :class:`~lightning_tune.lr.schedules.Schedule`.

Lightning steps it once per optimizer step (``interval="step"``), saves it in checkpoints and shows it in
``LearningRateMonitor``, like any scheduler a module returns. Its ``last_epoch`` is the index of the optimizer step the
current learning rate is for; the learning rate itself is always recomputed from the schedule, never accumulated.

Each parameter group also carries a multiplier in :attr:`ScheduleLR.scales` (1.0 until something changes it), so that
decisions taken on top of the schedule, such as :class:`~lightning_tune.callbacks.lr_plateau.AdaptiveLROnPlateau`'s
reductions, multiply the scheduled value instead of being overwritten by it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from torch import Tensor
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from lightning_tune._validation import check_bool, check_callable, check_instance, check_int
from lightning_tune.lr.schedules import Schedule, schedule_from_dict, schedule_to_dict


def configured_lr(group: Mapping[str, Any]) -> Any:
    """The learning rate a parameter group was configured with, whatever a scheduler has set it to since.

    torch's schedulers (and :class:`ScheduleLR`) store it in the group's ``initial_lr`` when they are built, before
    they change ``lr`` (a warm-up sets it to 0 at once); without one it is the group's ``lr``. A number or a tensor, as
    the group holds it.

    Example:
        >>> import torch
        >>> opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
        >>> _ = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: step / 10)
        >>> opt.param_groups[0]["lr"], configured_lr(opt.param_groups[0])
        (0.0, 0.1)
    """
    return group.get("initial_lr", group["lr"])


class ScheduleLR(LRScheduler):
    """Drive an optimizer's learning rates (and optionally momentum) from a schedule.

    Args:
        optimizer: The optimizer to drive.
        schedule: Per-group learning rates as functions of the optimizer step.
        last_epoch: As in torch's schedulers; ``-1`` starts at step 0.
        on_restore: Decides which schedule a resumed run follows: called as ``on_restore(saved, configured, step)``
            when :meth:`load_state_dict` loads a saved state (``saved`` is the checkpoint's schedule, ``configured``
            the one this scheduler was built with, ``step`` the restored :attr:`last_epoch`) and returns the schedule
            to follow. ``None`` follows the saved one, as torch's schedulers restore their own arguments. The
            schedule callbacks use it to honour the arguments a run is resumed with.
        follows_run: The schedule's length is the run's: whoever changes the run's length calls :meth:`retarget`
            (``DynamicBatchSize`` does, under ``keep="lr"`` and ``"none"``). The schedule callbacks set it when
            ``total_steps`` is left to the Trainer.
        log_lr: A callback logs this scheduler's learning rates (``tune/lr...``), so no other one logs them again; the
            scheduler itself logs nothing.

    Raises:
        TypeError: If ``optimizer`` is not an optimizer, ``schedule`` not a schedule, ``last_epoch`` not an integer,
            ``on_restore`` not callable or a flag not a bool.
        ValueError: If ``last_epoch < -1``, the schedule was resolved for a different number of parameter groups, or
            it cycles momentum and the optimizer has neither ``momentum`` nor ``betas``.

    Example:
        >>> import torch
        >>> from lightning_tune.lr.schedules import LinearWarmupSchedule
        >>> opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
        >>> sched = ScheduleLR(opt, LinearWarmupSchedule(base_lrs=(1.0,), warmup_steps=4))
        >>> [opt.param_groups[0]["lr"] for _ in range(3) if opt.step() or sched.step() or True]
        [0.25, 0.5, 0.75]
    """

    def __init__(
        self,
        optimizer: Optimizer,
        schedule: Schedule,
        last_epoch: int = -1,
        *,
        on_restore: Callable[[Schedule, Schedule, int], Schedule] | None = None,
        follows_run: bool = False,
        log_lr: bool = False,
    ) -> None:
        check_instance("optimizer", optimizer, Optimizer, "a torch.optim.Optimizer")
        check_instance("schedule", schedule, Schedule, "a schedule (such as WarmupCosineSchedule)")
        if schedule.num_groups != len(optimizer.param_groups):
            raise ValueError(
                f"the schedule was resolved for {schedule.num_groups} parameter group(s) but the optimizer has "
                f"{len(optimizer.param_groups)}"
            )
        if schedule.momentum_at(0, 0) is not None and not all(
            "momentum" in group or "betas" in group for group in optimizer.param_groups
        ):
            raise ValueError(
                f"the schedule cycles momentum but {type(optimizer).__name__} has neither `momentum` nor `betas`; "
                "pass `cycle_momentum=False`"
            )
        check_int("last_epoch", last_epoch, minimum=-1)
        check_callable("on_restore", on_restore, allow_none=True)
        check_bool("follows_run", follows_run)
        check_bool("log_lr", log_lr)
        for group in optimizer.param_groups:  # torch resumes from `initial_lr`; the schedule recomputes it anyway
            group.setdefault("initial_lr", group["lr"].clone() if isinstance(group["lr"], Tensor) else group["lr"])
        self.schedule = schedule
        self.scales = [1.0] * len(optimizer.param_groups)
        self.on_restore, self.follows_run, self.log_lr = on_restore, follows_run, log_lr
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[float | Tensor]:
        """Learning rates for the step :attr:`last_epoch` (the scheduled value times the group's scale).

        Returns:
            One learning rate per parameter group.
        """
        step = self.last_epoch
        for index, group in enumerate(self.optimizer.param_groups):
            momentum = self.schedule.momentum_at(step, index)
            if momentum is not None:
                if "betas" in group:
                    group["betas"] = (momentum, *group["betas"][1:])
                else:
                    group["momentum"] = momentum
        return [self.schedule.lr_at(step, index) * scale for index, scale in enumerate(self.scales)]

    def scale_group(self, group: int, factor: float) -> None:
        """Multiply a group's learning rate by ``factor`` now and at every later step.

        Args:
            group: Parameter group index.
            factor: Multiplier (e.g. a plateau reduction).
        """
        self.scales[group] *= factor
        self._set_lr(group, self.schedule.lr_at(self.last_epoch, group) * self.scales[group])

    def retarget(self, total_steps: int) -> None:
        """Make the schedule end at ``total_steps`` from the next step on, as if built for that length.

        The warm-up (and a decay of fixed length) keep their lengths; the schedule never ends before they fit or before
        the next step. A schedule without a length (:class:`~lightning_tune.lr.LinearWarmupSchedule`) stays as it is.

        Args:
            total_steps: The run's new length in optimizer steps, >= 0.
        """
        check_int("total_steps", total_steps, minimum=0)
        if getattr(self.schedule, "total_steps", total_steps) != total_steps:
            self.schedule = with_length(self.schedule, total_steps, self.last_epoch)

    def _set_lr(self, group: int, value: float | Tensor) -> None:
        """Set a group's learning rate (in place where it is a tensor) and the last learning rates torch reports."""
        groups = self.optimizer.param_groups
        if isinstance(groups[group]["lr"], Tensor):
            groups[group]["lr"].fill_(value)
        else:
            groups[group]["lr"] = value
        self._last_lr = [g["lr"].clone() if isinstance(g["lr"], Tensor) else g["lr"] for g in groups]

    def state_dict(self) -> dict[str, Any]:
        """State as plain data (the schedule is saved as a dictionary, so checkpoints load with ``weights_only``).

        Returns:
            The scheduler's state.
        """
        state = super().state_dict()
        for key in ("on_restore", "follows_run", "log_lr"):  # configuration, not state
            state.pop(key, None)
        state["schedule"] = schedule_to_dict(self.schedule)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a state saved by :meth:`state_dict`.

        With ``on_restore`` set, the schedule it returns is followed from the restored step on, and the optimizer's
        learning rates are set to that schedule's values for that step.

        Args:
            state_dict: The saved state.
        """
        state = dict(state_dict)
        saved = schedule_from_dict(state.pop("schedule"))
        configured = self.schedule
        super().load_state_dict(state)
        self.schedule = saved if self.on_restore is None else self.on_restore(saved, configured, self.last_epoch)
        if self.schedule != saved:  # the optimizer's restored LRs are the saved schedule's: set this one's
            for group, value in enumerate(self.get_lr()):
                self._set_lr(group, value)


def with_length(schedule: Schedule, total_steps: int, step: int) -> Schedule:
    """``schedule`` ending at ``total_steps``, but never before its warm-up (and decay) fit or before ``step + 1``."""
    floor = max(getattr(schedule, "warmup_steps", 0) + max(getattr(schedule, "decay_steps", 0), 1), step + 1)
    return dataclasses.replace(schedule, total_steps=max(total_steps, floor))  # type: ignore[type-var]
