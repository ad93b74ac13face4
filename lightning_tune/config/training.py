"""``TrainingConfig``: a checked training configuration and the Trainer arguments it stands for.

The dataclass holds plain values only; :meth:`TrainingConfig.trainer_kwargs` builds fresh callbacks, plugins and a
strategy from them on every call, so two Trainers never share a stateful callback.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Final, Literal, get_args

from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_tune._validation import check_bool, check_choice, check_float, check_int, check_keys, check_mapping
from lightning_tune.callbacks.dynamic_batch import DynamicBatchSize
from lightning_tune.callbacks.lr_plateau import AdaptiveLROnPlateau
from lightning_tune.callbacks.lr_schedule import LinearWarmup, OneCycle, WarmupCosine
from lightning_tune.callbacks.surgery import ActivationCheckpointing, TorchCompile
from lightning_tune.config.initial_lr import InitialLR
from lightning_tune.plugins.deepspeed import DeepSpeedSettings
from lightning_tune.swaps.checkpointing import BlockTypes
from lightning_tune.swaps.optimizer import TARGETS
from lightning_tune.vocab import canonical_attention, canonical_loss, canonical_optimizer, canonical_precision

if TYPE_CHECKING:
    from lightning.pytorch.strategies import Strategy
    from torch.utils.data import DataLoader, Dataset


#: Learning-rate schedules a configuration can name, and the callback each one is.
Schedule = Literal["cosine_with_warmup", "linear_warmup", "onecycle"]
SCHEDULES: Final[tuple[str, ...]] = get_args(Schedule)
SCHEDULE_CALLBACKS: Final[dict[str, type[Callback]]] = {
    "cosine_with_warmup": WarmupCosine,
    "linear_warmup": LinearWarmup,
    "onecycle": OneCycle,
}


#: Checks of the DataLoader settings the configuration file also knows (``dataloader.*``), the same rules.
_LOADER_CHECKS: Final[dict[str, Callable[[str, Any], None]]] = {
    "num_workers": lambda name, value: check_int(name, value, minimum=0),
    "prefetch_factor": lambda name, value: check_int(name, value, minimum=1, allow_none=True),
    **dict.fromkeys(("pin_memory", "persistent_workers", "drop_last"), check_bool),
    "timeout": lambda name, value: check_float(name, value, low=0.0),
}


def _build(name: str, kind: type[Callback], kwargs: Mapping[str, Any]) -> Callback:
    """``kind(**kwargs)``, with a key ``kind`` does not take named as a key of the field ``name``."""
    check_keys(name, kwargs, list(inspect.signature(kind).parameters))
    return kind(**kwargs)


@dataclass(frozen=True, kw_only=True)
class TrainingConfig:
    """A checked training configuration, as :func:`~lightning_tune.config.from_config` returns it (``docs/config.md``).

    Attributes:
        precision: Lightning precision string (``"bf16-mixed"``, ...), or ``None`` for Lightning's default.
        micro_batch_size: Samples per forward/backward on one device, or ``None``.
        sequence_length: Tokens per sample, for the DataModule, or ``None``.
        accumulate_grad_batches: Micro-batches per optimizer step, or ``None`` (1).
        dataloader_kwargs: ``DataLoader`` keyword arguments (``num_workers``, ``pin_memory``, ...).
        initial_lr: Peak LR set on the module's optimizer by :class:`~lightning_tune.config.InitialLR`, or ``None``.
        schedule: The LR schedule, or ``None``.
        schedule_kwargs: Arguments of the schedule callback.
        plateau_kwargs: Arguments of :class:`~lightning_tune.AdaptiveLROnPlateau`, or ``None`` when off.
        dynamic_batch_kwargs: Arguments of ``DynamicBatchSize``, or ``None`` when off.
        optimizer: :class:`~lightning_tune.OptimizerSwap` name, or ``None`` to keep the module's optimizer.
        attention: :class:`~lightning_tune.AttentionSwap` backend, or ``None`` to leave attention alone.
        loss: :class:`~lightning_tune.callbacks.LossSwap` backend, or ``None`` to leave the loss alone.
        checkpointing_blocks: ``None`` when activation checkpointing is off, ``"auto"``, or the block classes/names.
        compile_kwargs: Arguments of :class:`~lightning_tune.callbacks.surgery.TorchCompile`, or ``None`` when off.
        deepspeed: DeepSpeed settings when CPU offload is on, else ``None``.
        devices: ``Trainer(devices=...)``, or ``None``.
        data_parallel: Train with DDP.
        process_group_backend: ``"nccl"``/``"gloo"`` for DDP or DeepSpeed, or ``None`` for Lightning's choice.
        checkpoint_every_n_steps: Save a checkpoint every this many optimizer steps, or ``None``.
        async_checkpoint: Write checkpoints in a background thread (Lightning's ``AsyncCheckpointIO``).
        source: The configuration as given.
    """

    precision: str | None = None
    micro_batch_size: int | None = None
    sequence_length: int | None = None
    accumulate_grad_batches: int | None = None
    dataloader_kwargs: Mapping[str, Any] = field(default_factory=dict)
    initial_lr: float | None = None
    schedule: Schedule | None = None
    schedule_kwargs: Mapping[str, Any] = field(default_factory=dict)
    plateau_kwargs: Mapping[str, Any] | None = None
    dynamic_batch_kwargs: Mapping[str, Any] | None = None
    optimizer: str | None = None
    attention: str | None = None
    loss: str | None = None
    checkpointing_blocks: BlockTypes | Literal["auto"] | None = None
    compile_kwargs: Mapping[str, Any] | None = None
    deepspeed: DeepSpeedSettings | None = None
    devices: int | tuple[int, ...] | None = None
    data_parallel: bool = False
    process_group_backend: str | None = None
    checkpoint_every_n_steps: int | None = None
    async_checkpoint: bool = False
    source: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.precision is not None:
            object.__setattr__(self, "precision", canonical_precision(self.precision))
        if self.optimizer is not None:
            object.__setattr__(self, "optimizer", canonical_optimizer(self.optimizer, allowed=TARGETS))
        if self.attention is not None:
            object.__setattr__(self, "attention", canonical_attention(self.attention))
        if self.loss is not None:
            object.__setattr__(self, "loss", canonical_loss(self.loss))
        for name in ("micro_batch_size", "sequence_length", "accumulate_grad_batches", "checkpoint_every_n_steps"):
            check_int(name, getattr(self, name), minimum=1, allow_none=True)
        check_float("initial_lr", self.initial_lr, low=0.0, low_inclusive=False, allow_none=True)
        if self.schedule is not None:
            check_choice("schedule", self.schedule, SCHEDULES)
        if self.process_group_backend is not None:
            check_choice("process_group_backend", self.process_group_backend, ("nccl", "gloo"))
        required = ("dataloader_kwargs", "schedule_kwargs", "source")
        for name in (*required, "plateau_kwargs", "dynamic_batch_kwargs", "compile_kwargs"):
            value = getattr(self, name)
            check_mapping(name, value, allow_none=name not in required)
            object.__setattr__(self, name, None if value is None else MappingProxyType(dict(value)))
        if self.schedule is None and self.schedule_kwargs:
            raise ValueError(f"`schedule_kwargs` needs a `schedule`, got {dict(self.schedule_kwargs)!r} without one")
        if self.checkpointing_blocks is not None and self.checkpointing_blocks != "auto":
            from lightning_tune.swaps.checkpointing import type_matcher

            try:
                type_matcher(self.checkpointing_blocks)
            except (TypeError, ValueError) as err:
                raise type(err)(f"`checkpointing_blocks` must be None, 'auto' or block types: {err}") from None
        if self.deepspeed is not None and not isinstance(self.deepspeed, DeepSpeedSettings):
            raise TypeError(
                f"`deepspeed` must be a DeepSpeedSettings or None, got {self.deepspeed!r} "
                f"({type(self.deepspeed).__name__})"
            )
        if isinstance(self.devices, (tuple, list)):
            for index, device in enumerate(self.devices):
                check_int(f"devices[{index}]", device, minimum=0)
            if not self.devices or len(set(self.devices)) != len(self.devices):
                raise ValueError(f"`devices` must list distinct device indices, got {self.devices!r}")
            object.__setattr__(self, "devices", tuple(self.devices))
        else:
            check_int("devices", self.devices, minimum=1, allow_none=True)
        check_bool("data_parallel", self.data_parallel)
        check_bool("async_checkpoint", self.async_checkpoint)
        if self.process_group_backend is not None and not self.data_parallel:
            raise ValueError(
                f"`process_group_backend` ({self.process_group_backend!r}) sets the backend of data parallelism: it "
                "needs `data_parallel=True`"
            )
        from torch.utils.data import DataLoader

        allowed = set(inspect.signature(DataLoader).parameters) - {"self", "dataset", "batch_size"}
        if unknown := sorted(set(self.dataloader_kwargs) - allowed):
            raise ValueError(
                f"`dataloader_kwargs` has keys DataLoader does not take: {', '.join(unknown)} (allowed: "
                f"{', '.join(sorted(allowed))}; the batch size is `micro_batch_size`)"
            )
        for key, value in self.dataloader_kwargs.items():
            if key in _LOADER_CHECKS:
                _LOADER_CHECKS[key](f"dataloader_kwargs['{key}']", value)
        self.callbacks()  # the callbacks' own constructors check their arguments now, not when the Trainer is built

    @property
    def uses_plugin(self) -> bool:
        """Whether a :class:`~lightning_tune.TunePlugin` carries the precision and the swaps."""
        return any(value is not None for value in (self.precision, self.optimizer, self.attention, self.loss))

    def callbacks(self) -> list[Callback]:
        """Fresh callbacks, in the order they must run.

        ``InitialLR`` comes before the schedule (which reads the LR it sets), the schedule before the plateau
        callback (which multiplies the schedule), and activation checkpointing before ``torch.compile`` (which traces
        the checkpointed blocks).
        """
        out: list[Callback] = []
        if self.initial_lr is not None:
            out.append(InitialLR(self.initial_lr))
        if self.schedule is not None:
            out.append(_build("schedule_kwargs", SCHEDULE_CALLBACKS[self.schedule], self.schedule_kwargs))
        if self.plateau_kwargs is not None:
            out.append(_build("plateau_kwargs", AdaptiveLROnPlateau, self.plateau_kwargs))
        if self.dynamic_batch_kwargs is not None:
            out.append(_build("dynamic_batch_kwargs", DynamicBatchSize, self.dynamic_batch_kwargs))
        if self.checkpointing_blocks is not None:
            blocks = None if self.checkpointing_blocks == "auto" else self.checkpointing_blocks
            out.append(ActivationCheckpointing(blocks))
        if self.compile_kwargs is not None:
            out.append(_build("compile_kwargs", TorchCompile, self.compile_kwargs))
        if self.checkpoint_every_n_steps is not None:
            out.append(ModelCheckpoint(every_n_train_steps=self.checkpoint_every_n_steps))
        return out

    def plugins(self) -> list[Any]:
        """Fresh plugins: a :class:`~lightning_tune.TunePlugin` and Lightning's ``AsyncCheckpointIO`` as configured."""
        out: list[Any] = []
        if self.uses_plugin:
            from lightning_tune.plugins.tune import TunePlugin

            precision = self.precision or "32-true"
            plugin = TunePlugin(precision, optimizer=self.optimizer, attention=self.attention, loss=self.loss)  # type: ignore[arg-type]
            out.append(plugin)
        if self.async_checkpoint:
            from lightning.pytorch.plugins.io import AsyncCheckpointIO

            out.append(AsyncCheckpointIO())
        return out

    def strategy(self) -> Strategy | str | None:
        """A fresh strategy: DeepSpeed when CPU offload is on, DDP (``"ddp"``) for data parallelism, else ``None``.

        Raises:
            ModuleNotFoundError: If DeepSpeed is needed and not installed (names the extra).
        """
        if self.deepspeed is not None:
            from lightning_tune.plugins.deepspeed import build_strategy

            return build_strategy(self.deepspeed)
        if not self.data_parallel:
            return None
        if self.process_group_backend is None:
            return "ddp"
        from lightning.pytorch.strategies import DDPStrategy

        return DDPStrategy(process_group_backend=self.process_group_backend)

    def trainer_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``Trainer``: only those the configuration sets (the precision goes to the plugin).

        Raises:
            ModuleNotFoundError: If a configured feature needs an optional package that is missing.
        """
        kwargs: dict[str, Any] = {}
        if callbacks := self.callbacks():
            kwargs["callbacks"] = callbacks
        if plugins := self.plugins():
            kwargs["plugins"] = plugins
        if (strategy := self.strategy()) is not None:
            kwargs["strategy"] = strategy
        if self.devices is not None:
            kwargs["devices"] = list(self.devices) if isinstance(self.devices, tuple) else self.devices
        if self.accumulate_grad_batches is not None:
            kwargs["accumulate_grad_batches"] = self.accumulate_grad_batches
        return kwargs

    def dataloader(self, dataset: Dataset, **overrides: Any) -> DataLoader:
        """``DataLoader(dataset, ...)`` with :attr:`micro_batch_size`, :attr:`dataloader_kwargs`, then ``overrides``."""
        from torch.utils.data import DataLoader

        kwargs: dict[str, Any] = dict(self.dataloader_kwargs)
        if self.micro_batch_size is not None:
            kwargs["batch_size"] = self.micro_batch_size
        kwargs.update(overrides)
        return DataLoader(dataset, **kwargs)
