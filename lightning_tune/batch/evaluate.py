"""The evaluation batch of :class:`~lightning_tune.DynamicBatchSize`, without a Trainer: :class:`EvalSizer`.

A batch that runs out of memory runs in pieces, each sample once, their outputs joined (:func:`join_outputs`). The
ranks agree (``agree``: the element-wise maximum over ranks) equally often on every rank. See "Evaluation" in the docs.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_tune.batch.control import BatchSizeController
from lightning_tune.batch.probes import MemoryProbe
from lightning_tune.batch.runner import MicroBatch, count_step, cut_step, is_allocation_failure
from lightning_tune.perf.batch import BatchLayout, sequence_length

_NONE = 1e18  # "no failure" in an agreement of maxima of negated sizes
Agree = Callable[[Sequence[float]], Sequence[float]]


class EvalSizer:
    """The evaluation batch size: one per kind of evaluation loop (validation in a fit, validate, test, predict).

    ``controller`` is training's control law with its own memory model (``max_batch_size=None``: bounded by memory and
    the loop's samples); ``budget() -> (capacity, peak allowed)`` in bytes; ``split``: a user's ``split_batch``.

    Example:
        >>> from lightning_tune.batch import SimulatedMemory
        >>> sim = SimulatedMemory(total_bytes=1000, fixed_bytes=400, bytes_per_sample=20, eval_bytes_per_sample=6)
        >>> ctl = BatchSizeController(target=0.9, min_batch_size=1, max_batch_size=None, multiple_of=8)
        >>> sizer = EvalSizer(ctl, sim, lambda: (1000, 900.0))
        >>> sizer.begin(loader_batch=16, samples=1000, start=None, agree=list)
        >>> with torch.no_grad():
        ...     _ = sizer.run(torch.zeros(16), lambda batch: batch.sum())
        >>> sizer.batch_end(list), sizer.size  # (900 - 400) / 6 per sample: 83, on the grid of 8
        (True, 80)
    """

    def __init__(
        self,
        controller: BatchSizeController,
        probe: MemoryProbe,
        budget: Callable[[], tuple[int, float]],
        *,
        layout: BatchLayout | None = None,
        split: Callable[[Any, list[int]], Sequence[Any]] | None = None,
        warn: Callable[[str], Any] = warnings.warn,
    ) -> None:
        self.controller, self.probe, self.budget, self.warn = controller, probe, budget, warn
        self.layout, self.split = layout if layout is not None else BatchLayout(), split
        #: The evaluation batch in samples (``None`` before the first loop).
        self.size: int | None = None
        self.piece = 0  # the largest piece a batch runs in now: the size, or less after an out-of-memory error
        self.decisions = self.oom_recoveries = 0
        self.deciding = False  # whether the running batch ends in a decision
        self.failed: int | None = None  # the smallest piece that failed since the last agreement
        self.largest = 0  # the largest piece run in the interval
        self.base = 0.0  # what live tensors held at the interval's start
        self.samples = self.handed = 0  # the fewest samples a rank holds in the loop; samples in its batches so far

    def begin(
        self, *, loader_batch: int, agree: Agree, samples: int = 0, start: int | None = None, fixed: bool = False
    ) -> None:
        """An evaluation loop of ``samples`` samples on this rank starts; ``start`` is the first size (training's).

        ``loader_batch``: the first size without ``start`` or an earlier loop, and a ``fixed`` loop's (nothing decided).
        """
        self.handed, self.failed, self.deciding = 0, None, not fixed
        if fixed:
            self.size = self.piece = self.samples = loader_batch
        else:
            self.samples = int(-agree([-float(samples)])[0])
            first = self.controller.round_down(start) if start else loader_batch
            self.size = self.piece = max(self.controller.min_batch_size, min(self.size or first, max(self.samples, 1)))
        self._new_interval()

    def _new_interval(self) -> None:
        self.probe.empty_cache()
        self.probe.reset_peak()
        self.base, self.largest = live_bytes(self.probe), 0

    def run(self, batch: Any, step: Callable[[Any], Any]) -> Any:
        """``step(batch)``, or ``step`` on each of its pieces when it runs out of memory; the pieces' outputs joined.

        Raises:
            torch.OutOfMemoryError: If a piece of ``min_batch_size`` samples runs out of memory.
            TypeError: If the pieces' outputs cannot be joined.
        """
        assert self.size is not None
        n = count_step(batch, self.layout, self.split)
        self.handed += self.size
        queue = self._cut(MicroBatch(batch, n, 1.0, sequence_length(batch)), self.piece)
        outputs: list[Any] = []
        sizes: list[int] = []
        while queue:
            piece = queue.pop(0)
            try:
                self.largest = max(self.largest, piece.samples)
                self.probe.before_micro_batch(piece.samples, piece.seq_len)
                outputs.append(step(piece.batch))
                sizes.append(piece.samples)
                continue
            except (torch.OutOfMemoryError, RuntimeError) as err:
                if not is_allocation_failure(err):
                    raise
                message = str(err).splitlines()[0] if str(err) else type(err).__name__
            # out of the except block, nothing of the failed piece is alive (no gradients: no autograd graph): its
            # memory is back in the cache, emptied without a garbage collection, which can take a large fraction of a
            # second in a big process
            self.probe.empty_cache()
            queue[:0] = self._cut(piece, self._shrink(piece.samples, message))
        return outputs[0] if len(outputs) == 1 and sizes[0] == n else join_outputs(outputs, sizes)

    def _cut(self, piece: MicroBatch, size: int) -> list[MicroBatch]:
        if piece.samples <= size:
            return [piece]
        return cut_step(piece.batch, size, sample_weight=1.0, layout=self.layout, split=self.split)

    def _shrink(self, failed: int, message: str) -> int:
        smallest = self.controller.min_batch_size
        if failed <= smallest:
            raise torch.OutOfMemoryError(
                f"DynamicBatchSize: out of memory evaluating a piece of {failed} samples, the smallest allowed "
                f"(min_batch_size={smallest}): {message}; lower `min_batch_size` or `target_vram`, or free memory"
            )
        self.piece = min(self.controller.round_down(failed / 2), failed - 1)
        self.failed = failed if self.failed is None else min(self.failed, failed)
        self.oom_recoveries += 1
        self.warn(
            f"DynamicBatchSize: out of memory evaluating {failed} samples ({message}); recovered: the rest of the "
            f"batch runs in pieces of {self.piece}, each sample once"
        )
        return self.piece

    def batch_end(self, agree: Agree) -> bool:
        """A batch ended: while deciding, and every rank ran it, decide. Whether the evaluation batch changed."""
        if not self.deciding or self.handed - (self.size or 0) >= self.samples:
            return False  # (a rank with fewer samples ran no such batch: the decision waits for the loop's end)
        capacity, budget = self.budget()
        figures = [-(self.failed or _NONE), self.probe.peak_bytes(), float(self.probe.pressure()), -budget, -self.base]
        failed, peak, pressure, budget, base, largest = agree([*figures, float(self.largest)])
        before = self.size
        if -failed < _NONE:
            self._failed_at(int(-failed), capacity, -budget)
        elif largest:
            decision = self.controller.decide(
                self.size or 1,
                peak_bytes=peak,
                total_bytes=capacity,
                pressure=pressure > 0,
                cap=max(self.samples, 1),
                observed_size=int(largest),
                budget_bytes=-budget,
                base_bytes=-base,
            )
            self.decisions += 1
            self.size = self.piece = decision.batch_size
            self.deciding = decision.reason in ("grow", "probe")
        self._new_interval()
        return self.size != before

    def _failed_at(self, failed: int, capacity: int, budget: float) -> None:
        """Every rank takes the smallest piece that failed on any rank as its ceiling, and a size below it."""
        self.size = self.piece = self.controller.on_oom(failed, total_bytes=capacity, budget_bytes=budget)
        self.failed, self.deciding = None, False
        self.decisions += 1

    def end(self, agree: Agree) -> None:
        """The loop ended: the ranks agree on the smallest piece that failed, the next loop's size below it."""
        failed = -agree([-(self.failed or _NONE)])[0]
        if failed < _NONE:
            capacity, budget = self.budget()
            self._failed_at(int(failed), capacity, budget)

    def state_dict(self) -> dict[str, Any]:
        """The size, counters and controller, for a checkpoint."""
        counts = {"decisions": self.decisions, "oom_recoveries": self.oom_recoveries}
        return {"size": self.size, **counts, "controller": self.controller.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s keys."""
        self.size, self.decisions, self.oom_recoveries = state["size"], state["decisions"], state["oom_recoveries"]
        self.controller.load_state_dict(state["controller"])


def live_bytes(probe: MemoryProbe) -> float:
    """What live tensors hold now (allocated, not reserved, where the probe tells them apart).

    A reserved base would count the free room of live segments, which the next activations fill first: it would
    under-state the slope and over-state the size that fits.
    """
    allocated = getattr(probe, "allocated_bytes", None)
    return float(allocated() if callable(allocated) else probe.peak_bytes())


def join_outputs(outputs: Sequence[Any], sizes: Sequence[int], where: str = "output") -> Any:
    """The outputs of a batch's pieces (of ``sizes`` samples each, in order) as one output of the whole batch.

    Joined as "Evaluation" in the docs says; a list or tuple of one object per sample (strings, say) is concatenated.

    Raises:
        TypeError: Naming the place in the output, if it holds anything else or the pieces' outputs differ in shape.

    Example:
        >>> join_outputs([{"p": torch.ones(2), "loss": torch.tensor(1.0)}, {"p": torch.zeros(1),
        ...     "loss": torch.tensor(4.0)}], [2, 1])
        {'p': tensor([1., 1., 0.]), 'loss': tensor(2.)}
    """
    first = outputs[0]
    if all(o is None for o in outputs):
        return None
    if all(isinstance(o, Tensor) for o in outputs):
        if first.dim() == 0:
            weights = torch.tensor(sizes, dtype=torch.float64, device=first.device)
            return (torch.stack(list(outputs)).double() * weights).sum().div(weights.sum()).to(first.dtype)
        return torch.cat(list(outputs))
    if isinstance(first, Mapping) and all(isinstance(o, Mapping) and o.keys() == first.keys() for o in outputs):
        return {key: join_outputs([o[key] for o in outputs], sizes, f"{where}[{key!r}]") for key in first}
    if isinstance(first, (list, tuple)) and all(type(o) is type(first) for o in outputs):
        if [len(o) for o in outputs] == list(sizes) and not any(
            isinstance(x, (Tensor, Mapping, list, tuple)) for o in outputs for x in o
        ):
            return type(first)(x for o in outputs for x in o)  # one object per sample
        if all(len(o) == len(first) for o in outputs):
            items = [join_outputs([o[i] for o in outputs], sizes, f"{where}[{i}]") for i in range(len(first))]
            return type(first)(*items) if hasattr(first, "_fields") else type(first)(items)
    raise TypeError(
        f"DynamicBatchSize cut an evaluation batch in pieces after an out-of-memory error, and cannot join the "
        f"pieces' {where} ({type(first).__name__}): return tensors with the samples on the first dimension, or "
        "mappings, lists and tuples of them, or pass `size_eval=False`"
    )
