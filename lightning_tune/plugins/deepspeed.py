"""A DeepSpeed ZeRO strategy from a memory plan or from explicit stage and offload choices (docs/presets.md).

:class:`DeepSpeedSettings` is the checked choice and the arguments it gives Lightning's ``DeepSpeedStrategy``, which
turns them into DeepSpeed's config itself, so the pack does not restate DeepSpeed's defaults.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Mapping
from dataclasses import KW_ONLY, dataclass, field, fields
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Final

from lightning_tune import _imports
from lightning_tune._validation import check_bool, check_instance, check_int

if TYPE_CHECKING:
    from lightning.pytorch.strategies import DeepSpeedStrategy

    from lightning_tune.plan.zero import ZeroPlan

#: ZeRO stages: 0 none, 1 optimizer state sharded, 2 and gradients, 3 and parameters.
ZERO_STAGES: Final[tuple[int, ...]] = (0, 1, 2, 3)
#: ``DeepSpeedStrategy`` arguments the settings decide themselves, or that would bypass them.
_OWNED: Final[frozenset[str]] = frozenset(
    {"self", "stage", "offload_optimizer", "offload_parameters", "pin_memory", "zero_optimization", "config"}
)


@dataclass(frozen=True)
class DeepSpeedSettings:
    """A checked DeepSpeed ZeRO configuration, as Lightning ``DeepSpeedStrategy`` arguments.

    Args:
        stage: ZeRO stage, one of :data:`ZERO_STAGES`.
        offload_optimizer: Keep optimizer state (and fp32 master weights) in CPU memory and step it there; stage >= 1.
        offload_parameters: Keep the parameters in CPU memory too; stage 3 only.
        pin_memory: Pin the offloaded CPU memory (faster transfers, more locked host memory).
        extra: Further ``DeepSpeedStrategy`` keyword arguments (``loss_scale``, ``hysteresis``, ...).

    Raises:
        TypeError: If a field has the wrong type or ``extra`` names an unknown argument.
        ValueError: If the stage is unknown or an offload needs a higher stage.

    Example:
        >>> settings = DeepSpeedSettings(stage=2, offload_optimizer=True)
        >>> settings.strategy_kwargs()
        {'stage': 2, 'offload_optimizer': True, 'offload_parameters': False, 'pin_memory': False}
        >>> settings.describe()
        'DeepSpeed ZeRO stage 2, optimizer state offloaded to CPU'
    """

    stage: int = 2
    _: KW_ONLY
    offload_optimizer: bool = False
    offload_parameters: bool = False
    pin_memory: bool = False
    extra: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_int("stage", self.stage)
        if self.stage not in ZERO_STAGES:
            raise ValueError(f"`stage` must be one of {', '.join(map(str, ZERO_STAGES))}, got {self.stage!r}")
        for name in ("offload_optimizer", "offload_parameters", "pin_memory"):
            check_bool(name, getattr(self, name))
        if self.offload_optimizer and self.stage < 1:
            raise ValueError(
                "`offload_optimizer` needs ZeRO stage 1, 2 or 3 (DeepSpeed offloads sharded state), got stage 0"
            )
        if self.offload_parameters and self.stage != 3:
            raise ValueError(
                f"`offload_parameters` needs ZeRO stage 3 (only stage 3 shards parameters), got stage {self.stage}"
            )
        check_instance("extra", self.extra, Mapping, "a mapping of DeepSpeedStrategy arguments")
        if self.extra:
            from lightning.pytorch.strategies import DeepSpeedStrategy

            allowed = [n for n in inspect.signature(DeepSpeedStrategy.__init__).parameters if n not in _OWNED]
            for name in self.extra:
                if not isinstance(name, str):
                    raise TypeError(f"`extra` must have argument names (strings) as keys, got {name!r}")
                if name in _OWNED:
                    raise TypeError(
                        f"`{name}` is decided by DeepSpeedSettings' own fields (stage, offload_optimizer, "
                        "offload_parameters, pin_memory); a DeepSpeed `config` dict goes to DeepSpeedStrategy directly"
                    )
                if name not in allowed:
                    raise TypeError(
                        f"`{name}` is not an argument of Lightning's DeepSpeedStrategy; allowed: {', '.join(allowed)} "
                        "(an `extra` key, or a keyword argument of deepspeed_settings)"
                    )
        object.__setattr__(self, "extra", MappingProxyType(dict(self.extra)))

    def strategy_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``lightning.pytorch.strategies.DeepSpeedStrategy``: the fields and the extra ones."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "extra"} | dict(self.extra)

    def describe(self) -> str:
        """One line saying what the configuration shards and offloads."""
        parts = (("optimizer state", self.offload_optimizer), ("parameters", self.offload_parameters))
        offloaded = [what for what, on in parts if on]
        tail = f", {' and '.join(offloaded)} offloaded to CPU" if offloaded else ""
        return f"DeepSpeed ZeRO stage {self.stage}{tail}"


def deepspeed_settings(
    plan: ZeroPlan | None = None,
    *,
    stage: int | None = None,
    offload_optimizer: bool | None = None,
    offload_parameters: bool | None = None,
    pin_memory: bool = False,
    **strategy_kwargs: Any,
) -> DeepSpeedSettings:
    """Settings from a plan, or from explicit stage and offload choices.

    Args:
        plan: A ``ZeroPlan`` (or an object with its ``stage``, ``offload_optimizer`` and ``offload_parameters``), or
            ``None`` to use the explicit arguments.
        stage: ZeRO stage (default 2) when no plan is given.
        offload_optimizer: Offload optimizer state (default ``False``) when no plan is given.
        offload_parameters: Offload parameters (default ``False``) when no plan is given.
        pin_memory: Pin offloaded CPU memory.
        **strategy_kwargs: Further ``DeepSpeedStrategy`` arguments.

    Raises:
        TypeError: If the plan lacks a field or has one of the wrong type, an argument has the wrong type, or a
            ``strategy_kwargs`` name is not a ``DeepSpeedStrategy`` argument.
        ValueError: If both a plan and explicit stage/offload arguments are given, or the combination is invalid.

    Example:
        >>> from lightning_tune.plan.zero import ZeroPlan
        >>> plan = ZeroPlan(stage=3, offload_optimizer=True, offload_parameters=True, per_gpu_bytes=1, reason="tight")
        >>> deepspeed_settings(plan).describe()
        'DeepSpeed ZeRO stage 3, optimizer state and parameters offloaded to CPU'
    """
    explicit = {"stage": stage, "offload_optimizer": offload_optimizer, "offload_parameters": offload_parameters}
    for name in ("offload_optimizer", "offload_parameters"):
        if explicit[name] is not None:
            check_bool(name, explicit[name])
    if plan is None:
        return DeepSpeedSettings(
            stage=2 if stage is None else stage,
            offload_optimizer=False if offload_optimizer is None else offload_optimizer,
            offload_parameters=False if offload_parameters is None else offload_parameters,
            pin_memory=pin_memory,
            extra=strategy_kwargs,
        )
    given = [name for name, value in explicit.items() if value is not None]
    if given:
        raise ValueError(
            f"give a plan or explicit {', '.join(f'`{n}`' for n in given)}, not both: the plan decides stage and "
            f"offloading (got plan={plan!r})"
        )
    values: dict[str, Any] = {}
    for name in explicit:
        if not hasattr(plan, name):
            raise TypeError(
                f"`plan` must have the fields stage, offload_optimizer and offload_parameters (like ZeroPlan); "
                f"{type(plan).__name__} has no `{name}`"
            )
        values[name] = getattr(plan, name)
        (check_int if name == "stage" else check_bool)(f"plan.{name}", values[name])
    if getattr(plan, "fits", True) is False:
        warnings.warn(
            f"the plan does not fit the GPU memory it was made for; using its most memory-saving configuration "
            f"(stage {values['stage']}) anyway. Plan reason: {getattr(plan, 'reason', 'not given')}",
            UserWarning,
            stacklevel=2,
        )
    return DeepSpeedSettings(**values, pin_memory=pin_memory, extra=strategy_kwargs)


def deepspeed_strategy(
    plan: ZeroPlan | None = None,
    *,
    stage: int | None = None,
    offload_optimizer: bool | None = None,
    offload_parameters: bool | None = None,
    pin_memory: bool = False,
    **strategy_kwargs: Any,
) -> DeepSpeedStrategy:
    """Lightning's ``DeepSpeedStrategy`` for a plan or explicit choices: ``build_strategy(deepspeed_settings(...))``.

    The arguments are :func:`deepspeed_settings`'s.

    Returns:
        The strategy, for ``Trainer(strategy=...)`` (CUDA only).

    Raises:
        TypeError: As :func:`deepspeed_settings`.
        ValueError: As :func:`deepspeed_settings`.
        ModuleNotFoundError: If deepspeed is not installed; the message names the extra.
    """
    offload = {"offload_optimizer": offload_optimizer, "offload_parameters": offload_parameters}
    return build_strategy(deepspeed_settings(plan, stage=stage, **offload, pin_memory=pin_memory, **strategy_kwargs))


def build_strategy(settings: DeepSpeedSettings) -> DeepSpeedStrategy:
    """Build Lightning's ``DeepSpeedStrategy`` from checked ``settings``.

    Raises:
        TypeError: If ``settings`` is not a :class:`DeepSpeedSettings`.
        ModuleNotFoundError: If deepspeed is not installed; the message names the extra.
    """
    if not isinstance(settings, DeepSpeedSettings):
        raise TypeError(f"`settings` must be a DeepSpeedSettings, got {type(settings).__name__}")
    _imports.require("deepspeed", feature="deepspeed_strategy")
    from lightning.pytorch.strategies import DeepSpeedStrategy

    return DeepSpeedStrategy(**settings.strategy_kwargs())
