"""Lightning-side helpers of :class:`~lightning_tune.DynamicBatchSize`: its DataLoaders made resizable, its loops told.

The private Lightning and torch attributes DynamicBatchSize needs are all here, each in one small function saying
why and on which versions it was checked; ``tests/batch/test_dynamic_batch.py`` and ``test_resume_exact.py`` fail if
one of them stops working.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from typing import TYPE_CHECKING, Any

from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.overrides.distributed import _IndexBatchSamplerWrapper
from torch import Tensor
from torch.utils.data import BatchSampler, DataLoader, IterableDataset

from lightning_tune.batch.sampler import ResizableBatchSampler
from lightning_tune.callbacks.lr_schedule import schedule_lrs

if TYPE_CHECKING:
    import lightning.pytorch as pl


def loader_parts(trainer: pl.Trainer) -> tuple[DataLoader, Any, int, bool, BatchSampler | None]:
    """The train DataLoader, its per-sample sampler, batch size, ``drop_last`` and original batch sampler.

    Raises:
        MisconfigurationException: If the loader cannot be resized (several loaders, an iterable dataset, a custom
            batch sampler, no batch size).
    """
    loader = train_loader(trainer)
    original = loader.batch_sampler
    if isinstance(original, ResizableBatchSampler):  # left by a run that could not put the original back
        return loader, original.sampler, original.granule, original.drop_last, None
    if isinstance(loader.dataset, IterableDataset):
        raise MisconfigurationException(
            "DynamicBatchSize needs a map-style dataset (with __getitem__ and __len__) in the train "
            f"DataLoader, got the iterable dataset {type(loader.dataset).__name__}; batch an iterable "
            "dataset yourself or wrap it in a map-style one"
        )
    if original is not None and type(original) is not BatchSampler:
        raise MisconfigurationException(
            f"DynamicBatchSize replaces the train DataLoader's BatchSampler, but it has a custom "
            f"{type(original).__name__}; give the DataLoader a `sampler` and a `batch_size` instead of a "
            "`batch_sampler` (a custom sampler is kept)"
        )
    if original is None or original.batch_size is None:
        raise MisconfigurationException(
            "DynamicBatchSize needs a train DataLoader built with a `batch_size`; this one has batch_size=None "
            "(the dataset returns whole batches), so there is no batch size to control"
        )
    return loader, loader.sampler, int(original.batch_size), bool(original.drop_last), original


def start_epoch_from_its_first_batch(trainer: pl.Trainer) -> None:
    """Make the training loop run the whole epoch a run resumed from a checkpoint at an epoch's last batch starts.

    From such a checkpoint Lightning (2.4 to 2.6, ``_TrainingEpochLoop.reset``) counts the next epoch as far done as
    the saved one unless that count reaches the next epoch's length, which a batch changed in the saved epoch can
    raise: the count is raised to that length.
    """
    progress = trainer.fit_loop.epoch_loop.batch_progress.current
    batches = int(trainer.num_training_batches)
    if progress.completed + 1 < batches:  # Lightning adds the saved batch, then compares and counts from zero
        progress.ready, progress.completed = batches, batches - 1
    # Lightning 2.6.6 (FitLoop.reset and on_advance_start) counts the saved epoch processed but never counts the next
    # one ready and started: the checkpoints this run writes would be one epoch behind (docs/dynamic_batch.md)
    epochs: Any = trainer.fit_loop.epoch_progress  # its trackers are typed as their base, which has no `started`
    if epochs.current.ready == epochs.current.processed:
        for counts in (epochs.current, epochs.total):
            counts.ready, counts.started = counts.ready + 1, counts.started + 1


def repair_epoch_counter(checkpoint: dict[str, Any], state: dict[str, Any] | None, path: Any) -> None:
    """Count the running epoch of a checkpoint that Lightning 2.6.6 wrote one epoch behind, or warn that it is.

    See "Resuming twice through an epoch's last batch" in the docs: ``state`` (``DynamicBatchSize``'s, in the same
    checkpoint) knows the epoch its position counts in. Checked on Lightning 2.6.6 (the ``loops`` keys of its
    checkpoints).
    """
    if state is not None and state.get("epoch_counted"):
        return  # written by a run that counts the running epoch itself (`start_epoch_from_its_first_batch`)
    loop = checkpoint.get("loops", {}).get("fit_loop", {})
    epochs, batches = loop.get("epoch_progress"), loop.get("epoch_loop.batch_progress")
    if not epochs or not batches or batches.get("is_last_batch") or not batches["current"]["ready"]:
        return
    current, batch = epochs["current"], batches["current"]
    if not current["ready"] == current["processed"] == current["completed"]:
        return  # a mid-epoch checkpoint counted right, or one saved as an epoch ended
    if batch["completed"] != batch["ready"] - 1:
        return  # not saved inside a training batch's hooks (as a step checkpoint is): e.g. after a `max_steps` stop
    if state is not None and state.get("epoch") == current["completed"] and state.get("consumed"):
        for counts in (epochs["current"], epochs["total"]):
            counts["ready"], counts["started"] = counts["ready"] + 1, counts["started"] + 1
        return
    warnings.warn(
        f"the checkpoint {path or ''} was saved after {batches['current']['ready']} batches of epoch "
        f"{current['completed']}, but Lightning's epoch counter in it says that epoch is done (written by a run "
        "resumed from a checkpoint at an epoch's last batch: Lightning 2.6's defect), so Lightning repeats or skips "
        "that epoch's batches. Add 1 to checkpoint['loops']['fit_loop']['epoch_progress'][k]['ready'] and ['started'] "
        "for k in 'current' and 'total', or resume from a checkpoint written with DynamicBatchSize",
        stacklevel=2,
    )


def set_epoch_length(trainer: pl.Trainer, batches: int, val_every: int | None) -> None:
    """Tell the training loop how many batches the running epoch has, and when to validate.

    The data fetcher (private, Lightning 2.4 to 2.6) ends the epoch by the length it cached with its iterator.
    """
    trainer.fit_loop.max_batches = batches
    combined = trainer.fit_loop._combined_loader
    if combined is not None:
        combined.limits = [batches]
    fetcher = trainer.fit_loop._data_fetcher
    if fetcher is not None and fetcher.length is not None:
        fetcher.length = batches
    interval = trainer.val_check_interval
    if getattr(trainer, "_val_check_time_interval", None) is not None:
        return
    if isinstance(interval, int) and val_every is not None:  # counted in the DataLoader's own batches
        trainer.val_check_batch = max(1, val_every)
    elif isinstance(interval, float):
        trainer.val_check_batch = max(1, int(batches * interval))


def train_loader(trainer: pl.Trainer) -> DataLoader:
    """The fit's single train DataLoader."""
    combined = trainer.train_dataloader
    loaders = getattr(combined, "flattened", [combined])
    if len(loaders) != 1 or not isinstance(loaders[0], DataLoader):
        raise MisconfigurationException(
            "DynamicBatchSize controls a single train DataLoader; this run has "
            f"{len(loaders)} train loaders ({', '.join(type(x).__name__ for x in loaders)})"
        )
    return loaders[0]


def set_batch_sampler(loader: DataLoader, batch_sampler: Any) -> None:
    """Give an existing DataLoader a new batch sampler (checked on torch 2.3 to 2.13).

    ``DataLoader.__setattr__`` refuses ``batch_sampler``, and a new DataLoader would lose a subclass's behaviour and
    what Lightning did to the instance; workers get indices from the main process, and a persistent worker iterator,
    which would keep drawing from the old sampler, is shut down as Lightning does when it resets a loader.
    """
    from lightning.pytorch.utilities.combined_loader import _shutdown_workers_and_reset_iterator

    object.__setattr__(loader, "batch_sampler", batch_sampler)
    _shutdown_workers_and_reset_iterator(loader)


def restart_train_iterator(trainer: pl.Trainer) -> None:
    """Make the training loop draw its batches from the new batch sampler.

    Lightning (2.4 to 2.6) makes the first epoch's iterator in ``FitLoop.setup_data``, before any hook, and keeps it in
    the loop's private data fetcher; ``iter`` on that fetcher, as Lightning does at each epoch start, makes it anew.
    """
    fetcher = trainer.fit_loop._data_fetcher
    if fetcher is not None:
        iter(fetcher)


def scale_learning_rates(trainer: pl.Trainer, ratio: float) -> None:
    """Multiply every group's learning rate, and the schedulers' base LRs, by ``ratio``."""
    for optimizer in trainer.optimizers:
        for group in optimizer.param_groups:
            for key in ("lr", "initial_lr", "max_lr", "min_lr"):
                value = group.get(key)
                if isinstance(value, Tensor):
                    value.mul_(ratio)
                elif isinstance(value, (int, float)) and not isinstance(value, bool):
                    group[key] = value * ratio
    for config in trainer.lr_scheduler_configs:
        base = getattr(config.scheduler, "base_lrs", None)
        if isinstance(base, list):
            config.scheduler.base_lrs = [b * ratio for b in base]
    for scheduler in schedule_lrs(trainer):  # they keep per-group scales
        for i in range(len(scheduler.optimizer.param_groups)):
            scheduler.scale_group(i, ratio)


def retarget_schedules(trainer: pl.Trainer, epoch_samples: int, window: int, batches_done: int) -> None:
    """Tell the schedules that follow the run's length how many optimizer steps it has (``keep="lr"``/``"none"``)."""
    per_epoch = math.ceil(epoch_samples / window)
    remaining = max(0, int(trainer.fit_loop.max_batches) - batches_done)
    max_epochs = trainer.max_epochs
    if max_epochs is not None and max_epochs >= 0:
        remaining += max(0, max_epochs - trainer.current_epoch - 1) * per_epoch
    elif trainer.max_steps < 0:
        return  # an unbounded run: nothing to aim at
    if trainer.max_steps >= 0:
        remaining = min(remaining, trainer.max_steps - trainer.global_step)
    for scheduler in schedule_lrs(trainer):
        if scheduler.follows_run:
            scheduler.retarget(trainer.global_step + remaining)


_NOT_RESUMABLE = "You're resuming from a checkpoint that ended before the epoch ended and your dataloader is not"


def silence_not_resumable() -> Any:
    """Silence Lightning's warning that a DataLoader resumed mid-epoch is not resumable; the filter, for unsilence."""
    warnings.filterwarnings("ignore", message=_NOT_RESUMABLE)
    return warnings.filters[0]


def unsilence(quiet: Any) -> None:
    """Remove the filter :func:`silence_not_resumable` returned (``None``: nothing to remove)."""
    if quiet is not None:
        with contextlib.suppress(ValueError):
            warnings.filters.remove(quiet)  # type: ignore[attr-defined]
        warnings._filters_mutated()  # type: ignore[attr-defined]


def eval_loop(trainer: pl.Trainer) -> tuple[str, Any]:
    """The running evaluation loop's name (``"fit"``: validation inside a fit) and the loop (public attributes)."""
    if trainer.predicting:
        return "predict", trainer.predict_loop
    if trainer.testing:
        return "test", trainer.test_loop
    if trainer.state.fn == "fit":
        return "fit", trainer.fit_loop.epoch_loop.val_loop
    return "validate", trainer.validate_loop


def eval_loader(trainer: pl.Trainer, loop: Any) -> tuple[DataLoader, BatchSampler | None, Any] | None:
    """The loop's single DataLoader, the BatchSampler it was given and the one it has, when it can be resized.

    ``None`` (the batch is kept) for several loaders, limited batches, an iterable dataset, a custom batch sampler or
    no batch size. Lightning keeps the loop's processed loaders (predict's batch sampler wrapped, a distributed sampler
    injected) in the loop's private ``_combined_loader``; checked on Lightning 2.4 to 2.6.
    """
    combined = loop._combined_loader
    prefix = "predict" if trainer.predicting else "test" if trainer.testing else "val"
    overfit: Any = getattr(trainer, "overfit_batches", 0)
    overfit = prefix == "val" and overfit
    limited = getattr(trainer, f"limit_{prefix}_batches") != 1.0 or overfit
    if combined is None or limited or len(combined.flattened) != 1 or not isinstance(combined.flattened[0], DataLoader):
        return None
    loader = combined.flattened[0]
    given = loader.batch_sampler
    inner = unwrapped(given)
    if isinstance(inner, ResizableBatchSampler):  # made resizable by an earlier loop of this fit
        return loader, None, given
    if isinstance(loader.dataset, IterableDataset) or type(inner) is not BatchSampler or inner.batch_size is None:
        return None
    return loader, inner, given


def eval_batch(loop: Any) -> int:
    """The batch size of the loop's first DataLoader (1 when it has none), as :func:`eval_loader` finds the loader."""
    combined = loop._combined_loader
    given = getattr(combined.flattened[0], "batch_sampler", None) if combined is not None else None
    return int(getattr(given, "batch_size", None) or 1)


def unwrapped(batch_sampler: Any) -> Any:
    """An evaluation loader's batch sampler, out of predict's ``_IndexBatchSamplerWrapper`` (see below)."""
    return batch_sampler._batch_sampler if isinstance(batch_sampler, _IndexBatchSamplerWrapper) else batch_sampler


def set_eval_sampler(loader: DataLoader, given: Any, original: Any) -> None:
    """Give an evaluation loader a resizable batch sampler in place of ``given`` (``original`` is the one inside).

    Predict's stays inside a new ``_IndexBatchSamplerWrapper`` (private, Lightning 2.4 to 2.6): the loop reads the
    batches' indices there for a ``BasePredictionWriter``.
    """
    size = int(original.batch_size or 1)
    new = ResizableBatchSampler(original.sampler, size, drop_last=bool(original.drop_last), granule=size)
    set_batch_sampler(loader, _IndexBatchSamplerWrapper(new) if isinstance(given, _IndexBatchSamplerWrapper) else new)


def set_eval_length(loop: Any, loader: DataLoader, *, restart: bool) -> None:
    """Make the loop expect the loader's batches at its batch sampler's size; ``restart``: draw them from it anew.

    Lightning (2.4 to 2.6) counts an evaluation loop's batches once, in a list the loop, its ``CombinedLoader.limits``
    and the running iterator share; its private data fetcher ends the loop by the length it took when its iterator
    was made, before any hook.
    """
    limits = loop._combined_loader.limits
    limits[0] = len(loader)  # in place: the running iterator holds the same list
    fetcher = loop._data_fetcher
    if restart:
        iter(fetcher)
        fetcher.fetched += loop.batch_progress.current.ready
    elif fetcher.length is not None:
        fetcher.length = len(loader)
        fetcher.done = fetcher.fetched >= fetcher.length


def log_as(trainer: pl.Trainer, batch: Any) -> None:
    """Make ``self.log`` infer its batch size (an epoch mean's weight) from ``batch``, a piece of the loop's batch.

    The loop's private ``_ResultCollection`` holds the batch it infers it from (Lightning 2.4 to 2.6).
    """
    results = trainer._results
    if results is not None:
        results.batch, results.batch_size = batch, None
