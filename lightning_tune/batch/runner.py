"""Run one optimizer step as micro-batches, through allocation failures, agreed across ranks.

:class:`MicroBatchRunner` knows no Trainer: it runs the step again at a smaller micro-batch once the ``except`` block
has exited, so that nothing of the failed micro-batch is alive then.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Mapping, Sequence, Sized
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
from torch import Tensor

from lightning_tune.batch.split import split_sizes
from lightning_tune.perf.batch import BatchLayout, sequence_length

#: Allocation-failure messages of the devices Lightning trains on, for errors that are not ``torch.OutOfMemoryError``:
#: CUDA and its libraries, ROCm's HIP, Intel's XPU, Apple's MPS, torch's CPU allocator and Habana's HPU; then what
#: Lightning's ``is_oom_error`` and accelerate's ``should_reduce_batch_size`` also shrink on: any device's
#: ``"<DEVICE> out of memory."`` and cuDNN's ``CUDNN_STATUS_NOT_SUPPORTED``, returned when a convolution or RNN's batch
#: is too large for its kernels and workspace (PyTorch issue 4107; where a non-contiguous input is the cause instead,
#: the runner stops at the smallest micro-batch with an error quoting cuDNN's).
ALLOCATION_FAILURE_MESSAGES: tuple[str, ...] = (
    "CUDA out of memory",
    "CUDA error: out of memory",
    "cudaErrorMemoryAllocation",
    "CUBLAS_STATUS_ALLOC_FAILED",
    "CUDNN_STATUS_ALLOC_FAILED",
    "CUSOLVER_STATUS_ALLOC_FAILED",
    "CUFFT_ALLOC_FAILED",
    "CUSPARSE_STATUS_ALLOC_FAILED",
    "HIP out of memory",
    "HIP error: out of memory",
    "XPU out of memory",
    "MPS backend out of memory",
    "CPU out of memory",
    "DefaultCPUAllocator: can't allocate memory",
    "MODULE:PT_DEVMEM Allocation failed",
    " out of memory.",
    "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED.",
)

#: The types of other allocation failures: ``RuntimeError`` (torch's C++ checks) and, where torch has it,
#: ``torch.AcceleratorError`` (a failed CUDA runtime call); their other subclasses are other errors.
_FAILURE_TYPES = frozenset({RuntimeError, getattr(torch, "AcceleratorError", RuntimeError)})

OK, RETRY, FATAL = 0, 1, 2


def is_allocation_failure(err: BaseException) -> bool:
    """Whether ``err`` is a failure a smaller micro-batch can cure: by type first, then by the devices' messages.

    Example:
        >>> is_allocation_failure(RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate`"))
        True
        >>> is_allocation_failure(RuntimeError("cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if "
        ...                                    "you passed in a non-contiguous input."))
        True
        >>> is_allocation_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
        False
    """
    if isinstance(err, torch.OutOfMemoryError):
        return True
    if type(err) not in _FAILURE_TYPES:
        return False
    text = str(err)
    lightning_cuda_rule = "CUDA" in text and "out of memory" in text  # Lightning's is_cuda_out_of_memory
    return lightning_cuda_rule or any(message in text for message in ALLOCATION_FAILURE_MESSAGES)


@dataclass(frozen=True)
class MicroBatch:
    """A micro-batch of a step: the batch itself, its sample count, its loss weight and its padded length."""

    batch: Any
    samples: int
    weight: float
    seq_len: int | None = None


def cut_step(
    batch: Any,
    micro_batch_size: int,
    *,
    sample_weight: float,
    tail: int = 0,
    tail_weight: float = 0.0,
    tokens: Sequence[int] | None = None,
    layout: BatchLayout | None = None,
    split: Callable[[Any, list[int]], Sequence[Any]] | None = None,
) -> list[MicroBatch]:
    """Cut one optimizer step's batch into consecutive micro-batches with their exact loss weights.

    The step's last ``tail`` samples (a DataLoader's short last batch, which Lightning averages on its own) form
    micro-batches of their own whose samples weigh ``tail_weight``, the others ``sample_weight``; with ``tokens`` (each
    sample's label tokens) a micro-batch weighs its share of them instead. ``split(batch, sizes) -> pieces``, the
    user's ``split_batch``, cuts instead of ``layout``'s rule.

    Raises:
        TypeError: If the batch holds nothing per-sample to count, or ``split`` returns another number of pieces.
        ValueError: If the layout's rule cannot cut the batch (see ``BatchLayout``).

    Example:
        >>> import torch
        >>> pieces = cut_step(torch.arange(10), 4, sample_weight=1 / 8, tail=2, tail_weight=1 / 4)
        >>> [(p.samples, p.weight) for p in pieces]
        [(4, 0.5), (4, 0.5), (2, 0.5)]
    """
    layout = layout if layout is not None else BatchLayout()
    n = count_step(batch, layout, split)
    tail = 0 if tokens is not None else tail  # a token mean weighs the short last batch's tokens as any others

    def chunks(total: int) -> list[int]:
        return [min(micro_batch_size, total - start) for start in range(0, total, micro_batch_size)]

    head, rest = chunks(n - tail), chunks(tail)
    sizes = head + rest
    if tokens is not None:
        total, starts = sum(tokens), [sum(sizes[:i]) for i in range(len(sizes))]
        weights = [sum(tokens[a : a + k]) / total if total else k / n for a, k in zip(starts, sizes, strict=True)]
    else:
        weights = [k * sample_weight for k in head] + [k * tail_weight for k in rest]
    if len(sizes) <= 1:  # an empty step runs whole once, as Lightning runs it
        return [MicroBatch(batch, n, weights[0] if n else 1.0, sequence_length(batch))]
    if split is not None:
        parts = list(split(batch, sizes))
        if len(parts) != len(sizes):
            raise TypeError(f"`split_batch` must return {len(sizes)} pieces of {sizes} samples, got {len(parts)}")
    else:
        parts = split_sizes(batch, sizes, layout=layout)
    return [MicroBatch(p, k, w, sequence_length(p)) for p, k, w in zip(parts, sizes, weights, strict=True)]


def count_step(batch: Any, layout: BatchLayout, split: Callable[..., Any] | None = None) -> int:
    """A step's samples by ``layout``'s rule (0 for ``None``, a collate's empty step).

    With a user's ``split``, nothing is refused, and a batch object the rule finds nothing in is counted by ``len()``.

    Raises:
        TypeError: If the batch holds nothing per-sample to count, or a value the rule cannot cut.
        ValueError: If its per-sample values disagree on the count (see ``BatchLayout``).
    """
    n = 0 if batch is None else layout.samples(batch, check=split is None)
    if n is None and split is not None and isinstance(batch, Sized):
        n = len(batch)
    if n is None:
        raise TypeError(
            f"cannot count the samples of a batch of type {type(batch).__name__}: it holds no tensor or sequence of "
            "per-sample objects; cut such batches with `split_batch=`"
        )
    return n


def loss_of(output: Any) -> Tensor | None:
    """The loss in what ``training_step`` returned (a tensor, or a dict's ``"loss"``)."""
    loss = output.get("loss") if isinstance(output, Mapping) else output
    return loss if isinstance(loss, Tensor) else None


def _with_loss(output: Any, change: Callable[[Tensor], Tensor]) -> Any:
    """``output`` with its loss (as :func:`loss_of` finds it) replaced by ``change(loss)``."""
    loss = loss_of(output)
    if loss is None:
        return output
    return change(loss) if loss is output else {**output, "loss": change(loss)}


def _scaled(output: Any, weight: float) -> Any:
    return output if weight == 1.0 else _with_loss(output, lambda loss: loss * weight)


@dataclass
class StepOutcome:
    """What :meth:`MicroBatchRunner.run` leaves: the output to return, the agreed payload, the failures recovered.

    ``output`` is the last micro-batch's, its loss weighted and valued at the step's mean loss, detached unless the
    caller was left the last backward.
    """

    output: Any
    payload: list[float]
    failures: int


class MicroBatchRunner:
    """Run an optimizer step's micro-batches; after an allocation failure, shrink and run the whole step again.

    Args:
        forward: ``forward(micro_batch) -> output`` runs ``training_step`` on a micro-batch.
        backward: ``backward(loss)`` back-propagates a (weighted) loss.
        zero_grad: ``zero_grad()`` drops the gradients.
        free: ``free()`` gives cached memory back (called after a failure, with nothing of it alive).
        shrink: ``shrink(failed_size) -> smaller_size`` after a failure at ``failed_size``.
        min_size: The smallest micro-batch: a failure there cannot be retried.
        min_samples: With sizes that are token budgets, the fewest samples a micro-batch can hold: a failure in a
            micro-batch that small cannot be helped by a smaller budget, so it is not retried either.
        agree: For a multi-process run, ``agree(values)``: the element-wise maximum over ranks of this rank's status
            (``OK``, ``RETRY``, or ``FATAL`` at the smallest micro-batch) and payload, called by every rank once per
            attempt, after its micro-batches (run without collectives) and before the step's gradient reduction
            (:func:`all_reduce_max`); ``None`` for one process.
        no_sync: A context manager factory under which backward does not reduce gradients across ranks.
        on_failure: ``on_failure(old_size, new_size, message)`` after each recovered failure (for a warning).

    Example:
        >>> import torch
        >>> w = torch.zeros(1, requires_grad=True)
        >>> runner = MicroBatchRunner(
        ...     forward=lambda mb: ((mb.batch - w) ** 2).mean(),
        ...     backward=lambda loss: loss.backward(),
        ...     zero_grad=lambda: setattr(w, "grad", None),
        ...     free=lambda: None,
        ...     shrink=lambda size: size // 2,
        ...     min_size=1,
        ... )
        >>> outcome = runner.run(torch.arange(4.0), [], lambda b, m: cut_step(b, m, sample_weight=1 / 4), 2)
        >>> w.grad  # the gradient of the mean over the 4 samples: -2 x mean(0, 1, 2, 3)
        tensor([-3.])
    """

    def __init__(
        self,
        *,
        forward: Callable[[MicroBatch], Any],
        backward: Callable[[Tensor], None],
        zero_grad: Callable[[], None],
        free: Callable[[], None],
        shrink: Callable[[int], int],
        min_size: int,
        agree: Callable[[Sequence[float]], Sequence[float]] | None = None,
        no_sync: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
        on_failure: Callable[[int, int, str], None] | None = None,
        min_samples: int | None = None,
    ) -> None:
        self.forward, self.backward, self.zero_grad, self.free = forward, backward, zero_grad, free
        self.shrink, self.min_size, self.agree, self.no_sync = shrink, min_size, agree, no_sync
        self.on_failure, self.min_samples = on_failure, min_samples
        #: Micro-batch size in use; set by the caller, lowered by :meth:`run` after a failure.
        self.size = 0
        #: Largest micro-batch run since the caller last reset it (a short last batch may be all an interval saw).
        self.largest_run = 0

    def run(
        self,
        batch: Any,
        payload: Sequence[float],
        cut: Callable[[Any, int], list[MicroBatch]],
        size: int,
        *,
        leave_last_backward: bool = False,
        payload_fn: Callable[[], Sequence[float]] | None = None,
    ) -> StepOutcome:
        """Run one step's micro-batches at ``size`` (or smaller, after failures) and return what is left to do.

        ``cut(batch, size)`` makes the micro-batches (:func:`cut_step` with the step's weights). ``payload``, or what
        ``payload_fn`` computes just before the agreement (the interval's figures so far), is agreed with the other
        ranks. With ``leave_last_backward`` the last micro-batch's backward is the caller's (under DDP, so that its
        gradient all-reduce overlaps the backward, after the agreement).

        Raises:
            torch.OutOfMemoryError: If the micro-batch failed at ``min_size`` on this or another rank.
        """
        self.size = size
        failures = 0
        while True:
            status, message, output, shown, total_weight = self._attempt(batch, cut, leave_last_backward)
            values = [float(status), *(payload_fn() if payload_fn is not None else payload)]
            agreed = list(self.agree(values)) if self.agree is not None else values
            code = int(agreed[0])
            if code == OK:
                output = _with_mean(output, shown, total_weight)
                output = output if leave_last_backward else _with_loss(output, Tensor.detach)  # every backward ran
                return StepOutcome(output, agreed[1:], failures)
            del output, shown  # nothing of the failed attempt stays alive while memory is freed
            self.largest_run = 0  # the interval starts again at the smaller size
            self.zero_grad()
            self.free()
            if code == FATAL:
                where = "on this rank" if status == FATAL else "on another rank"
                smallest = self.min_samples or self.min_size
                raise torch.OutOfMemoryError(
                    f"out of memory at the smallest allowed micro-batch (min_batch_size={smallest}) {where}"
                    f"{': ' + message if message else ''}; lower `min_batch_size`, free memory (8-bit optimizer, "
                    "activation checkpointing) or use more devices"
                )
            failed, self.size = self.size, self.shrink(self.size)
            failures += 1
            if self.on_failure is not None:
                self.on_failure(failed, self.size, message or "out of memory on another rank")

    def _attempt(
        self, batch: Any, cut: Callable[[Any, int], list[MicroBatch]], leave_last: bool
    ) -> tuple[int, str, Any, list[Tensor], float]:
        """Run the micro-batches once; an allocation failure ends the attempt with status RETRY or FATAL."""
        pieces = cut(batch, self.size)
        total_weight = sum(piece.weight for piece in pieces)
        shown: list[Tensor] = []
        output: Any = None
        samples = self.size
        self.zero_grad()
        try:
            for i, piece in enumerate(pieces):
                samples = piece.samples
                last = i == len(pieces) - 1
                self.largest_run = max(self.largest_run, piece.samples)
                # every micro-batch but the last runs without collectives (DDP's forward prepares its all-reduce)
                with contextlib.nullcontext() if last else self.no_sync():
                    output = _scaled(self.forward(piece), piece.weight)
                    loss = loss_of(output)
                    if loss is not None and not (last and leave_last):
                        self.backward(loss)
                if not last:
                    if loss is not None:
                        shown.append(loss.detach())
                    output = loss = None
        except (torch.OutOfMemoryError, RuntimeError) as err:
            if not is_allocation_failure(err):
                raise
            message = str(err).splitlines()[0] if str(err) else type(err).__name__
            # leave the except block first: `err` and its traceback (which holds the failed micro-batch's frames and
            # activations) are gone once it has exited
        else:
            return OK, "", output, shown, total_weight
        smallest = self.size <= self.min_size or (self.min_samples is not None and samples <= self.min_samples)
        return (FATAL if smallest else RETRY), message, None, [], total_weight


def _with_mean(output: Any, earlier: list[Tensor], total_weight: float) -> Any:
    """Give the last micro-batch's weighted loss the step's mean loss as value, keeping its gradient."""
    loss = loss_of(output)
    if loss is None or (not earlier and total_weight == 1.0):
        return output
    value = (torch.stack([*earlier, loss.detach()]).sum() / total_weight).to(loss.dtype)
    return _with_loss(output, lambda loss: loss + (value - loss.detach()))


def all_reduce_max(values: Sequence[float], *, device: torch.device, timeout: float, group: Any = None) -> list[float]:
    """Element-wise maximum of ``values`` over ``group``'s ranks: one small all-reduce, no barrier, one host read.

    Raises:
        RuntimeError: If the other ranks did not join within ``timeout`` seconds (one of them failed or hangs).
    """
    import torch.distributed as dist

    flags = torch.tensor(list(values), dtype=torch.float64, device=device)
    work = dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group, async_op=True)
    try:
        work.wait(timeout=timedelta(seconds=timeout))
    except RuntimeError as err:
        message = str(err).splitlines()[0]
    else:
        return [float(x) for x in flags.tolist()]
    raise RuntimeError(
        f"DynamicBatchSize: the other ranks did not join the step's out-of-memory agreement within {timeout:g} s "
        f"(another rank failed or stopped): {message}"
    )


def step_with_retry(
    optimizer: torch.optim.Optimizer,
    step: Callable[..., Any],
    closure: Callable[[], Any] | None = None,
    *,
    free: Callable[[], None],
    warn: Callable[[str], Any],
    **kwargs: Any,
) -> Any:
    """``optimizer``'s ``step``, retried once after an allocation failure while it was creating its state.

    The closure runs once, before the update. The retry (new state dropped, memory freed) happens only when no
    parameter was updated yet, as their version counters say: an optimizer steps its groups one after the other.

    Raises:
        torch.OutOfMemoryError: If the step does not fit.
    """
    if not (hasattr(optimizer, "state") and hasattr(optimizer, "param_groups")):  # wrappers of other packages too
        raise TypeError(f"`optimizer` must be an optimizer, got {optimizer!r} ({type(optimizer).__name__})")
    loss = closure() if closure is not None else None
    before = set(optimizer.state)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    versions = [p._version for p in params] if len(before) < len(params) else []  # a retry is possible only then
    message = ""
    for attempt in range(2):
        try:
            step(**kwargs)
        except (torch.OutOfMemoryError, RuntimeError) as err:
            if not is_allocation_failure(err):
                raise
            message = str(err).splitlines()[0]
        else:
            return loss
        new = [p for p in optimizer.state if p not in before]
        updated = any(p._version != v for p, v in zip(params, versions, strict=False))
        if attempt or not new or updated:  # a parameter already updated must not be updated twice
            break
        for p in new:
            del optimizer.state[p]
        free()
        warn(f"DynamicBatchSize: out of memory in the optimizer step ({message}); retrying once")
    raise torch.OutOfMemoryError(
        f"DynamicBatchSize: out of memory in the optimizer step ({message}), after emptying the cache and retrying: "
        "the fixed memory (weights, gradients, optimizer state) does not fit, whatever the batch size. "
        "`lightning-tune calc` (lightning_tune.plan.estimate_memory) shows what fits and advises an 8-bit optimizer "
        "(OptimizerSwap), sharding (FSDP) or a smaller model"
    )


def retry_steps(optimizers: Sequence[Any], *, free: Callable[[], None], warn: Callable[[str], Any]) -> None:
    """Make each optimizer's ``step`` a :func:`step_with_retry` (not LBFGS's, which runs its closure many times)."""
    for optimizer in optimizers:
        if not isinstance(optimizer, torch.optim.LBFGS):
            # update_wrapper keeps an LR scheduler's mark on the step, or torch warns it was overridden
            retry = functools.partial(step_with_retry, optimizer, optimizer.step, free=free, warn=warn)
            optimizer.step = functools.update_wrapper(retry, optimizer.step)


def undo_retry_steps(optimizers: Sequence[Any]) -> None:
    """Give each optimizer back the ``step`` :func:`retry_steps` wrapped."""
    for optimizer in optimizers:
        step = vars(optimizer).get("step")
        if isinstance(step, functools.partial) and step.func is step_with_retry:
            if inspect.ismethod(step.args[1]):  # the class's own step
                del vars(optimizer)["step"]
            else:  # an LR scheduler's wrapper
                optimizer.step = step.args[1]
