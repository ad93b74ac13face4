"""DynamicBatchSize's plumbing: refusals, memory probe, agreement, backward passes, typed view of its engine."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Generic, TypeVar, cast, overload

import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_tune.batch.probes import CudaMemory, MemoryProbe
from lightning_tune.batch.runner import all_reduce_max, is_allocation_failure

if TYPE_CHECKING:
    import lightning.pytorch as pl


def choose_probe(probe: MemoryProbe | None, trainer: pl.Trainer) -> MemoryProbe | None:
    """The probe given, else :class:`CudaMemory` on a CUDA device; elsewhere none, with a warning."""
    device = None if probe is not None else trainer.strategy.root_device
    if device is not None and device.type == "cuda":
        probe = CudaMemory(device)
    elif device is not None:
        warnings.warn(
            f"DynamicBatchSize: training runs on {device.type!r}, which has no device memory to target, so nothing "
            "is resized: a micro-batch holds the DataLoader's batch size in samples or, for padded batches (an "
            "`attention_mask`) with keep='effective', as many padded tokens as that batch at the first step's padded "
            "length; padding is still trimmed (each step's samples grouped by length, each micro-batch cut to its "
            "longest). To try the size control without a GPU, give it probe=SimulatedMemory(...).",
            stacklevel=3,
        )
        return None
    expandable = getattr(probe, "expandable_segments", None)
    rank_zero_info(
        f"DynamicBatchSize: reading memory from {probe!r}"
        + ("" if expandable is None else f", expandable_segments {'on' if expandable else 'off'}")
    )
    return probe


def check_strategy(trainer: pl.Trainer, pl_module: pl.LightningModule, sync_oom: bool) -> tuple[bool, bool]:
    """Refuse a run DynamicBatchSize cannot drive; whether its ranks can agree on OOMs (DDP, FSDP2) and FSDP2.

    Raises:
        MisconfigurationException: Under manual optimization, a strategy that accumulates gradients itself, with
            ``GradientAccumulationScheduler``, under ``FSDPStrategy`` or tensor parallelism (collectives inside every
            forward), or FSDP2 without ``sync_oom``.
    """
    from lightning.pytorch.callbacks import GradientAccumulationScheduler
    from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy

    from lightning_tune._compat import check_lightning_version

    check_lightning_version("DynamicBatchSize")  # its private Lightning internals were checked on these versions
    if not pl_module.automatic_optimization:
        raise MisconfigurationException(
            "DynamicBatchSize needs automatic optimization: with manual optimization the module runs its own "
            "backward and steps, so micro-batches cannot be split or retried for it"
        )
    if getattr(trainer.strategy, "handles_gradient_accumulation", False):
        raise MisconfigurationException(
            f"DynamicBatchSize cannot drive {type(trainer.strategy).__name__}, which accumulates gradients "
            "itself (DeepSpeed); use DDP or FSDP"
        )
    if any(isinstance(cb, GradientAccumulationScheduler) for cb in trainer.callbacks):  # type: ignore[attr-defined]
        raise MisconfigurationException(
            "DynamicBatchSize sets gradient accumulation itself: remove GradientAccumulationScheduler and give "
            "the effective batch through the DataLoader's batch size and Trainer(accumulate_grad_batches=...)"
        )
    strategy = trainer.strategy
    distributed = trainer.world_size > 1
    if distributed and isinstance(strategy, FSDPStrategy):
        raise MisconfigurationException(
            "DynamicBatchSize cannot drive FSDPStrategy: its forward all-gathers each wrapped module's parameters, so "
            "an out-of-memory error on one rank would leave the others waiting in the next all-gather. Use "
            "ModelParallelStrategy with a `configure_model` that calls `fully_shard` (FSDP2), where DynamicBatchSize "
            "gathers the parameters once per step and the ranks agree before any collective, or DDP"
        )
    ddp = isinstance(strategy, DDPStrategy)
    fsdp2 = distributed and isinstance(strategy, ModelParallelStrategy)  # data-parallel only, as checked next
    tensor_parallel = getattr(strategy, "_tensor_parallel_size", 1)
    if fsdp2 and tensor_parallel not in (1, "auto"):
        raise MisconfigurationException(
            f"DynamicBatchSize cannot drive ModelParallelStrategy with tensor_parallel_size={tensor_parallel}: tensor "
            "parallelism runs collectives inside every forward, so an out-of-memory error on one rank would leave the "
            "others waiting in one. Use tensor_parallel_size=1 (FSDP2 only) or DDP"
        )
    if distributed and not (ddp or fsdp2):
        warnings.warn(
            f"DynamicBatchSize: under {type(strategy).__name__} every rank takes the same batch-size "
            "decisions, but an out-of-memory error can only be recovered when every rank hits it: the agreement "
            "that lets one rank's OOM make all of them retry (`sync_oom`) is made for DDP and FSDP2",
            stacklevel=3,
        )
    if fsdp2 and not sync_oom:
        raise MisconfigurationException(
            "DynamicBatchSize needs `sync_oom=True` under FSDP2: the step's gradients are reduced only once the "
            "ranks agreed that every micro-batch ran, and without the agreement a rank that ran out of memory "
            "would leave the others waiting in that reduction"
        )
    return distributed and (ddp or fsdp2), fsdp2


def max_over_ranks(trainer: pl.Trainer, values: Sequence[float], *, timeout: float) -> list[float]:
    """The element-wise maximum of ``values`` over the ranks (of one rank: ``values``)."""
    if trainer.world_size == 1:
        return list(values)
    return all_reduce_max(values, device=trainer.strategy.root_device, timeout=timeout)


def micro_batch_backward(trainer: pl.Trainer, loss: torch.Tensor) -> None:
    """A micro-batch's backward through the strategy, outside autocast as Lightning's (it runs inside the step)."""
    strategy, optimizers = trainer.strategy, trainer.optimizers
    device = strategy.root_device.type
    with torch.autocast(device, enabled=False) if torch.is_autocast_enabled(device) else contextlib.nullcontext():
        strategy.backward(loss, optimizers[0] if optimizers else None)


def last_backward_failure(
    trainer: pl.Trainer | None, err: BaseException, sharded: bool
) -> torch.OutOfMemoryError | None:
    """The error for an allocation failure in DDP's last backward, which reduces the gradients (else ``None``).

    The runner's own backward passes run without sync and recover; this one cannot be agreed with the other ranks.
    """
    model = None if trainer is None or trainer.world_size == 1 or sharded else trainer.strategy.model
    if not (getattr(model, "require_backward_grad_sync", False) and is_allocation_failure(err)):
        return None
    return torch.OutOfMemoryError(
        f"DynamicBatchSize: out of memory in the last micro-batch's backward, where the gradients are reduced "
        f"across ranks ({str(err).splitlines()[0]}); it cannot be agreed with the other ranks, so training stops. "
        "Lower `target_vram` or `max_batch_size`, or keep memory free with `reserve_gib`"
    )


_T = TypeVar("_T")


class Engine(Generic[_T]):
    """A typed attribute of the callback: its engine's attribute of the same name, or its settings' (``setting``)."""

    def __init__(self, *, setting: bool = False) -> None:
        self.setting = setting

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def _source(self, obj: Any) -> Any:
        return obj.step.settings if self.setting else obj.step

    @overload
    def __get__(self, obj: None, owner: type) -> Engine[_T]: ...
    @overload
    def __get__(self, obj: object, owner: type) -> _T: ...
    def __get__(self, obj: object, owner: type) -> Engine[_T] | _T:
        return self if obj is None else cast(_T, getattr(self._source(obj), self.name))

    def __set__(self, obj: Any, value: _T) -> None:
        setattr(self._source(obj), self.name, value)  # a setting is frozen: FrozenInstanceError
