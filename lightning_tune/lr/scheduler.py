"""``ScheduleLR``: torch's ``LambdaLR`` with one factor function for every parameter group, and per-group scales.

A group's LR at step ``last_epoch`` is its peak (its configured LR times its ``lr_scale``) times its scale times the
factor of the step: recomputed, never accumulated (``docs/lr_schedules.md``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from functools import partial
from typing import Any, Final

from torch import Tensor
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler
from typing_extensions import override

from lightning_tune._validation import check_bool, check_callable, check_float, check_instance, check_int
from lightning_tune.lr.schedules import FACTORS, floor_ratio

#: A function of the optimizer step: the multiple of the base LR that step uses (or, as ``momentum``, the momentum).
Factor = Callable[[int], float]
#: What a scheduler follows, as plain data (:attr:`ScheduleLR.schedule`).
Schedule = dict[str, Any]
#: The entries of a :data:`Schedule` that are factors.
FACTOR_KEYS: Final = ("factor", "momentum")


def configured_lr(group: Mapping[str, Any]) -> Any:
    """The learning rate a parameter group was configured with, whatever a scheduler has set it to since.

    Example:
        >>> import torch
        >>> opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
        >>> _ = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: step / 10)
        >>> opt.param_groups[0]["lr"], configured_lr(opt.param_groups[0])
        (0.0, 0.1)
    """
    return group.get("initial_lr", group["lr"])


def set_lr(group: dict[str, Any], value: float | Tensor) -> None:
    """Set a parameter group's learning rate, in place where the group holds it as a tensor."""
    if isinstance(group["lr"], Tensor):
        group["lr"].fill_(value)
    else:
        group["lr"] = value


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
        keywords["min_ratio"] = floor_ratio(saved["min_lrs"][top], peaks[top])
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
        factor: The multiple of each group's peak LR a step uses; only a factor function's ``partial`` is saved.
        last_epoch: As in torch's schedulers; ``-1`` starts at step 0.
        momentum: The momentum (Adam's ``beta1``) of every group as a function of the step, or ``None`` to leave it.
        on_restore: ``on_restore(saved, configured, step)`` returns the :attr:`schedule` a restored state follows
            from its step on (``None``: the saved one, as torch's schedulers do).
        follows_run: The schedule's length is the run's: whoever changes the run's length calls :meth:`retarget`.
        log_lr: A callback logs this scheduler's learning rates, so no other one logs them again.

    Raises:
        TypeError: If an argument, or a group's ``lr_scale``, has the wrong type.
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

    @override
    def get_lr(self) -> list[float | Tensor]:
        if self.momentum is not None:  # set on the groups, for the step `last_epoch` too
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
        """What it follows as plain data: ``{"factor": to_data(...), "momentum": to_data(...), "peaks": [...]}``."""
        return {key: to_data(getattr(self, key)) for key in FACTOR_KEYS} | {"peaks": list(self.peaks)}

    def scale_group(self, group: int, factor: float) -> None:
        """Multiply parameter group ``group``'s learning rate by ``factor`` now and at every later step."""
        self.scales[group] *= factor
        self._set_lrs([group])

    def retarget(self, total_steps: int) -> None:
        """Make the schedule end at ``total_steps`` (optimizer steps, >= 0) from the next step on, as if built for it.

        The warm-up (and a decay of fixed length) keep their lengths (``docs/lr_schedules.md``); the schedule never ends
        before they fit or before the next step. A factor without a length stays as it is.
        """
        check_int("total_steps", total_steps, minimum=0)
        for name in FACTOR_KEYS:
            function = getattr(self, name)
            if isinstance(function, partial) and function.keywords.get("total_steps", total_steps) != total_steps:
                keywords = stretched(function.keywords, total_steps, self.last_epoch)
                setattr(self, name, partial(function.func, **keywords))

    def _set_lrs(self, indices: Iterable[int]) -> None:
        """Set these groups' learning rates to the schedule's for :attr:`last_epoch`, and the ones torch reports."""
        groups, lrs = self.optimizer.param_groups, self.get_lr()
        for index in indices:
            set_lr(groups[index], lrs[index])
        self._last_lr = [g["lr"].clone() if isinstance(g["lr"], Tensor) else g["lr"] for g in groups]

    @override
    def state_dict(self) -> dict[str, Any]:
        # plain data (the factors by name and keywords), so that checkpoints load with `weights_only`
        state = {key: value for key, value in super().state_dict().items() if key not in _CONFIGURATION}
        return state | self.schedule

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a state saved by :meth:`state_dict` (or by the per-group schedules of earlier releases)."""
        state = dict(state_dict)
        if "schedule" in state:
            state |= _from_schedule(state.pop("schedule"))
        saved = {key: state.pop(key) for key in (*FACTOR_KEYS, "peaks")}
        configured = self.schedule
        super().load_state_dict(state)
        chosen = saved if self.on_restore is None else self.on_restore(saved, configured, self.last_epoch)
        for key in FACTOR_KEYS:
            if chosen[key] is not None:
                setattr(self, key, from_data(chosen[key]))
        self.peaks = [float(peak) for peak in chosen["peaks"]]
        if chosen is not saved:  # the optimizer's restored LRs are the saved schedule's: set this one's
            self._set_lrs(range(len(self.peaks)))
