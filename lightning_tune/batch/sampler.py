"""A batch sampler whose batch size can change while an epoch runs, and that can resume mid-epoch.

The epoch's order is drawn from the user's sampler once, when the epoch starts; batches are cut from it at whatever
size :attr:`batch_size` has when each is handed out (with workers, a few batches later): nothing skipped or repeated.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Mapping, Sized
from typing import Any

import torch
from torch.utils.data import Sampler

from lightning_tune._validation import check_int


class ResizableBatchSampler(Sampler[list[int]]):
    """Yield lists of indices from ``sampler`` in batches of a size that may change at any time.

    ``drop_last`` leaves out the samples that would not fill a last batch of ``granule`` (the DataLoader's own batch
    size); ``limit`` caps an epoch's samples. With a ``seed``, a sampler that draws from a ``generator`` draws each
    epoch's order with one seeded ``seed + epoch``, as ``DistributedSampler`` does, so a resumed run draws the same.

    Example:
        >>> from torch.utils.data import SequentialSampler
        >>> batches = ResizableBatchSampler(SequentialSampler(range(10)), batch_size=4)
        >>> it = iter(batches)
        >>> next(it)
        [0, 1, 2, 3]
        >>> batches.batch_size = 2
        >>> list(it)
        [[4, 5], [6, 7], [8, 9]]
    """

    def __init__(
        self,
        sampler: Sampler[int],
        batch_size: int,
        *,
        drop_last: bool = False,
        granule: int = 1,
        limit: int | None = None,
        seed: int | None = None,
    ) -> None:
        if isinstance(sampler, (str, bytes)) or not isinstance(sampler, Sized):
            raise TypeError(f"`sampler` must be a sampler of indices with a length, got {type(sampler).__name__}")
        # the sizes come from the DataLoader's BatchSampler and Lightning's limit; a seed may come from a checkpoint
        check_int("seed", seed, minimum=0, maximum=2**63 - 1, allow_none=True)
        self.sampler = sampler  # the name DataLoader and Lightning look for (set_epoch, DistributedSampler)
        self.drop_last, self.granule, self.limit, self.seed, self.epoch = drop_last, granule, limit, seed, 0
        #: Size of the batches handed out from now on.
        self.batch_size = batch_size
        self._order: list[int] | None = None  # the running epoch's order
        self._handed_out = 0  # samples of the running epoch already handed out
        self._batches_out = 0  # batches of the running epoch already handed out
        # a resumed epoch's order (None: drawn again, the same from a sampler that reproduces it), samples, batches
        self._resume: tuple[list[int] | None, int, int] | None = None
        self._drawn: deque[int] = deque()  # sizes of the batches handed out and not trained yet, in order

    def _epoch_samples(self) -> int:
        n = len(self.sampler)
        n = (n // self.granule) * self.granule if self.drop_last else n
        return n if self.limit is None else min(n, self.limit)

    def epoch_samples(self) -> int:
        """Samples the running (or next) epoch hands out in all."""
        return len(self._order) if self._order is not None else self._epoch_samples()

    def set_epoch(self, epoch: int) -> None:
        """The epoch whose order the next iteration draws (passed on to the sampler's own ``set_epoch``)."""
        self.epoch = epoch
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)

    def _draw(self) -> list[int]:
        """The epoch's order from the sampler; with a :attr:`seed`, its generator seeded by the epoch."""
        if self.seed is None or not hasattr(self.sampler, "generator"):
            return [int(i) for i in self.sampler]
        own = self.sampler.generator
        self.sampler.generator = torch.Generator().manual_seed(self.seed + self.epoch)
        try:
            return [int(i) for i in self.sampler]
        finally:
            self.sampler.generator = own

    def new_epoch(self) -> None:
        """Forget the finished epoch, so that :func:`len` counts the next one (called at each epoch start)."""
        self._order = None

    def __len__(self) -> int:
        """Batches of this epoch: those handed out plus the rest at the current size (the full epoch when idle)."""
        if self._order is None:
            if self._resume is None:
                return self._count(self._epoch_samples())
            order, consumed, batches_done = self._resume
            return batches_done + self._count((self._epoch_samples() if order is None else len(order)) - consumed)
        return self._batches_out + self._count(len(self._order) - self._handed_out)

    def _count(self, samples: int) -> int:
        return -(-max(samples, 0) // self.batch_size)

    def restore(self, state: Mapping[str, Any], epoch: int, mid_epoch: bool) -> tuple[bool, bool]:
        """Take a checkpoint's ``seed`` and position (``order``, ``consumed``, ``batches_done``, the ``epoch`` of them).

        Returns whether the epoch resumes after its ``consumed`` samples, and whether the run goes on with the epoch
        after the checkpoint's (saved at its last batch).
        """
        if state.get("seed") is not None:
            self.seed = state["seed"]
        if state.get("epoch") is None:  # saved before the epoch was: an epoch whose samples were all trained has ended
            same = state["consumed"] < (self.epoch_samples() if state["order"] is None else len(state["order"]))
        else:
            same = state["epoch"] == epoch
        if mid_epoch and same and state["consumed"]:  # skip what was trained
            order = None if state["order"] is None else [int(i) for i in state["order"].tolist()]
            self._resume = (order, state["consumed"], state["batches_done"])
        return mid_epoch and same and bool(state["consumed"]), mid_epoch and not same

    def __iter__(self) -> Iterator[list[int]]:
        if self._resume is not None:
            saved, consumed, batches_done = self._resume
            self._resume = None
            order = list(saved) if saved is not None else self._draw()
        else:
            consumed = batches_done = 0
            order = self._draw()
        order = order[: self._epoch_samples()]
        self._order, self._handed_out, self._batches_out = order, consumed, batches_done
        self._drawn.clear()  # a new iterator: what the last one drew and nobody trained is gone
        # The order and counters stay after the last batch is handed out: a DataLoader with workers draws the
        # whole epoch's indices long before training reaches its end, and a checkpoint then still needs them.
        while self._handed_out < len(order):
            batch = order[self._handed_out : self._handed_out + self.batch_size]
            self._handed_out += len(batch)
            self._batches_out += 1
            self._drawn.append(len(batch))
            yield batch

    def next_drawn(self) -> int | None:
        """The samples drawn for the oldest batch handed out that training has not finished (``None``: unknown).

        A collate may drop or add samples: the step and the epoch's position count drawn ones, in the order drawn.
        """
        return self._drawn[0] if self._drawn else None

    def pop_drawn(self) -> int | None:
        """:meth:`next_drawn`, and that batch is done (trained, or skipped as Lightning skips a ``None`` batch)."""
        return self._drawn.popleft() if self._drawn else None

    def saved_order(self) -> torch.Tensor | None:
        """The running epoch's order as a tensor, for a checkpoint (``None`` before the first epoch starts)."""
        return None if self._order is None else torch.tensor(self._order, dtype=torch.int64)
