"""``ScheduleLR``: torch's ``LambdaLR`` with one factor function for every parameter group, and per-group scales.

Lightning steps it once per optimizer step (``interval="step"``), saves it in checkpoints and shows it in
``LearningRateMonitor``, like any scheduler a module returns. Its ``last_epoch`` is the index of the optimizer step the
current learning rate is for. A group's LR is its peak (its configured LR times its ``lr_scale``, timm's per-group
multiplier, read when the scheduler is built) times its entry of :attr:`ScheduleLR.scales` (1.0 until a plateau
reduction or a batch-size change multiplies it) times the factor of the step: recomputed, never accumulated.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

from torch import Tensor
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from lightning_tune._validation import check_bool, check_callable, check_float, check_instance, check_int
from lightning_tune.lr.schedules import FACTORS

#: A function of the optimizer step: the multiple of the base LR that step uses (or, as ``momentum``, the momentum).
Factor = Callable[[int], float]
#: What a scheduler follows, as plain data (:attr:`ScheduleLR.schedule`).
Schedule = dict[str, Any]


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


def stretched(keywords: Mapping[str, Any], total_steps: int, step: int) -> dict[str, Any]:
    """A factor's keywords ending at ``total_steps``, but never before its warm-up (and decay) fit or ``step + 1``."""
    floor = max(keywords.get("warmup_steps", 0) + max(keywords.get("decay_steps", 0), 1), step + 1)
    return {**keywords, "total_steps": max(total_steps, floor)}


def to_data(function: Factor | None) -> dict[str, Any] | None:
    """A factor as plain data (its function's name, its defaults, its keywords), or ``None`` if it has no such form."""
    if not isinstance(function, partial) or function.args:
        return None
    name = getattr(function.func, "__name__", "")
    if FACTORS.get(name) is not function.func:
        return None
    defaults = {k: v for k, v in (function.func.__kwdefaults__ or {}).items() if k not in function.keywords}
    return {"name": name, **function.keywords, **defaults}


def from_data(data: Mapping[str, Any]) -> Factor:
    """The factor saved as :func:`to_data`."""
    if data.get("name") not in FACTORS:
        raise ValueError(f"unknown factor {data.get('name')!r} in saved state; known factors are {sorted(FACTORS)}")
    return partial(FACTORS[data["name"]], **{key: value for key, value in data.items() if key != "name"})


#: The fields of the per-group schedules of earlier releases that are keywords of the factor functions.
_FIELDS = (
    *("warmup_steps", "decay_steps", "total_steps", "power", "num_cycles", "hard_restarts"),
    *("warmup_shape", "decay_shape", "pct_start", "anneal_strategy", "three_phase"),
)


def _from_schedule(saved: Mapping[str, Any]) -> Schedule:
    """The schedule of a state saved before schedules were factor functions: one value per group (5d2ad38, 56799b8)."""
    kind, peaks = saved["kind"], list(saved.get("base_lrs", saved.get("max_lrs", [])))
    if kind not in FACTORS:
        raise ValueError(f"unknown schedule kind {kind!r} in saved state; known kinds are {sorted(FACTORS)}")
    keywords = {key: saved[key] for key in _FIELDS if key in saved}
    top = peaks.index(max(peaks))  # the floors were the largest group's ratio, spread over the others
    if "min_lrs" in saved:
        keywords["min_ratio"] = saved["min_lrs"][top] / peaks[top] if peaks[top] > 0 else 0.0
    momentum = None
    if kind == "one_cycle":
        start = 1.0 / saved.get("div_factor", 25.0)
        keywords |= {"start": start, "end": start / saved.get("final_div_factor", 1e4)}
        if saved.get("max_momentums"):
            high, low = saved["max_momentums"][0], saved["base_momentums"][0]
            momentum = to_data(partial(FACTORS[kind], **keywords | {"start": high, "peak": low, "end": high}))
    return {"factor": to_data(partial(FACTORS[kind], **keywords)), "momentum": momentum, "peaks": peaks}


_CONFIGURATION = ("on_restore", "follows_run", "log_lr")  # attributes that are configuration, not state


class ScheduleLR(LRScheduler):
    """Drive an optimizer's learning rates (and optionally momentum) from a factor function of the step.

    Args:
        optimizer: The optimizer to drive.
        factor: The multiple of each group's peak LR that a step uses, as a function of the step: a
            ``functools.partial`` of a factor function of :mod:`lightning_tune.lr.schedules` (saved in checkpoints
            by name and keywords) or any callable (not saved, as ``LambdaLR`` saves no function).
        last_epoch: As in torch's schedulers; ``-1`` starts at step 0.
        momentum: The momentum (Adam's ``beta1``) of every group as a function of the step, or ``None`` to leave it.
        on_restore: Decides which schedule a resumed run follows: called as ``on_restore(saved, configured, step)``
            when :meth:`load_state_dict` loads a saved state (``saved`` is the checkpoint's :attr:`schedule`,
            ``configured`` this scheduler's, ``step`` the restored :attr:`last_epoch`) and returns the one to follow.
            ``None`` follows the saved one, as torch's schedulers restore their own arguments. The schedule callbacks
            use it to honour the arguments a run is resumed with.
        follows_run: The schedule's length is the run's: whoever changes the run's length calls :meth:`retarget`
            (``DynamicBatchSize`` does, under ``keep="lr"`` and ``"none"``). The schedule callbacks set it when
            ``total_steps`` is left to the Trainer.
        log_lr: A callback logs this scheduler's learning rates (``tune/lr...``), so no other one logs them again; the
            scheduler itself logs nothing.

    Raises:
        TypeError: If ``optimizer`` is not an optimizer, ``factor`` or ``momentum`` not callable, ``last_epoch`` not
            an integer, ``on_restore`` not callable, a flag not a bool or a group's ``lr_scale`` not a number.
        ValueError: If ``last_epoch < -1``, a group's ``lr_scale`` is negative, or ``momentum`` is given and the
            optimizer has neither ``momentum`` nor ``betas``.

    Example:
        >>> import torch
        >>> from functools import partial
        >>> from lightning_tune.lr.schedules import linear_warmup
        >>> opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
        >>> sched = ScheduleLR(opt, partial(linear_warmup, warmup_steps=4))
        >>> [opt.param_groups[0]["lr"] for _ in range(3) if opt.step() or sched.step() or True]
        [0.25, 0.5, 0.75]
    """

    def __init__(
        self,
        optimizer: Optimizer,
        factor: Factor,
        last_epoch: int = -1,
        *,
        momentum: Factor | None = None,
        on_restore: Callable[[Schedule, Schedule, int], Schedule] | None = None,
        follows_run: bool = False,
        log_lr: bool = False,
    ) -> None:
        check_instance("optimizer", optimizer, Optimizer, "a torch.optim.Optimizer")
        check_callable("factor", factor)
        check_callable("momentum", momentum, allow_none=True)
        if momentum is not None and not all("momentum" in g or "betas" in g for g in optimizer.param_groups):
            raise ValueError(
                f"`momentum` is scheduled but {type(optimizer).__name__} has neither `momentum` nor `betas`; "
                "pass `momentum=None` (the callbacks: `cycle_momentum=False`)"
            )
        check_int("last_epoch", last_epoch, minimum=-1)
        check_callable("on_restore", on_restore, allow_none=True)
        check_bool("follows_run", follows_run)
        check_bool("log_lr", log_lr)
        for index, group in enumerate(optimizer.param_groups):
            check_float(f"param_groups[{index}]['lr_scale']", group.get("lr_scale", 1.0), low=0.0)
            # torch resumes from `initial_lr`; the peaks are read from it once, here
            group.setdefault("initial_lr", group["lr"].clone() if isinstance(group["lr"], Tensor) else group["lr"])
        self.factor, self.momentum = factor, momentum
        self.peaks = [float(configured_lr(group)) * group.get("lr_scale", 1.0) for group in optimizer.param_groups]
        self.scales = [1.0] * len(self.peaks)
        self.on_restore, self.follows_run, self.log_lr = on_restore, follows_run, log_lr
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[float | Tensor]:
        """Learning rates for the step :attr:`last_epoch` (and the momentum, set on the groups).

        Returns:
            One learning rate per parameter group: its peak times its scale times the factor.
        """
        if self.momentum is not None:
            momentum = self.momentum(self.last_epoch)
            for group in self.optimizer.param_groups:
                if "betas" in group:
                    group["betas"] = (momentum, *group["betas"][1:])
                else:
                    group["momentum"] = momentum
        factor = self.factor(self.last_epoch)
        return [peak * scale * factor for peak, scale in zip(self.peaks, self.scales, strict=True)]

    @property
    def schedule(self) -> Schedule:
        """What the scheduler follows, as plain data: ``{"factor": ..., "momentum": ..., "peaks": [...]}``.

        A factor is ``{"name": <factor function>, **its keywords}``, or ``None`` for a callable of no such form.
        """
        return {"factor": to_data(self.factor), "momentum": to_data(self.momentum), "peaks": list(self.peaks)}

    def scale_group(self, group: int, factor: float) -> None:
        """Multiply a group's learning rate by ``factor`` now and at every later step.

        Args:
            group: Parameter group index.
            factor: Multiplier (e.g. a plateau reduction).
        """
        self.scales[group] *= factor
        self._set_lr(group, self.peaks[group] * self.scales[group] * self.factor(self.last_epoch))

    def retarget(self, total_steps: int) -> None:
        """Make the schedule end at ``total_steps`` from the next step on, as if built for that length.

        The warm-up (and a decay of fixed length) keep their lengths; the schedule never ends before they fit or before
        the next step. A factor without a length (:func:`~lightning_tune.lr.schedules.linear_warmup`) stays as it is.

        Args:
            total_steps: The run's new length in optimizer steps, >= 0.
        """
        check_int("total_steps", total_steps, minimum=0)
        for name in ("factor", "momentum"):
            function = getattr(self, name)
            if isinstance(function, partial) and function.keywords.get("total_steps", total_steps) != total_steps:
                keywords = stretched(function.keywords, total_steps, self.last_epoch)
                setattr(self, name, partial(function.func, **keywords))

    def _set_lr(self, group: int, value: float | Tensor) -> None:
        """Set a group's learning rate (in place where it is a tensor) and the last learning rates torch reports."""
        groups = self.optimizer.param_groups
        if isinstance(groups[group]["lr"], Tensor):
            groups[group]["lr"].fill_(value)
        else:
            groups[group]["lr"] = value
        self._last_lr = [g["lr"].clone() if isinstance(g["lr"], Tensor) else g["lr"] for g in groups]

    def state_dict(self) -> dict[str, Any]:
        """State as plain data (the factors by name and keywords, so checkpoints load with ``weights_only``).

        Returns:
            The scheduler's state.
        """
        state = {key: value for key, value in super().state_dict().items() if key not in _CONFIGURATION}
        return state | self.schedule

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a state saved by :meth:`state_dict` (or by the per-group schedules of earlier releases).

        With ``on_restore`` set, the schedule it returns is followed from the restored step on, and the optimizer's
        learning rates are set to that schedule's values for that step.

        Args:
            state_dict: The saved state.
        """
        state = dict(state_dict)
        if "schedule" in state:
            state |= _from_schedule(state.pop("schedule"))
        saved = {key: state.pop(key) for key in ("factor", "momentum", "peaks")}
        configured = self.schedule
        super().load_state_dict(state)
        chosen = saved if self.on_restore is None else self.on_restore(saved, configured, self.last_epoch)
        self.factor = from_data(chosen["factor"]) if chosen["factor"] is not None else self.factor
        self.momentum = from_data(chosen["momentum"]) if chosen["momentum"] is not None else self.momentum
        self.peaks = [float(peak) for peak in chosen["peaks"]]
        if chosen is not saved:  # the optimizer's restored LRs are the saved schedule's: set this one's
            for group, value in enumerate(self.get_lr()):
                self._set_lr(group, value)


def same(saved: Any, configured: Any) -> bool:
    """Whether two schedules (or parts of them) agree, numbers to a relative 1e-12 (a ratio computed two ways)."""
    if isinstance(saved, Mapping) and isinstance(configured, Mapping):
        return saved.keys() == configured.keys() and all(same(saved[key], configured[key]) for key in saved)
    if isinstance(saved, list) and isinstance(configured, list):
        return len(saved) == len(configured) and all(map(same, saved, configured))
    if isinstance(saved, float) or isinstance(configured, float):
        numbers = all(isinstance(v, int | float) and not isinstance(v, bool) for v in (saved, configured))
        return numbers and math.isclose(saved, configured, rel_tol=1e-12)
    return bool(saved == configured)
