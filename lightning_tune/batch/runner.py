"""Run one optimizer step as micro-batches, through allocation failures, agreed across ranks.

:class:`MicroBatchRunner` knows no Trainer. It is given callables (forward, backward, zero-grad, free, and for a
multi-process run agree) and a batch; it cuts the batch into micro-batches with their exact weights
(:func:`cut_step`), runs them, and after an allocation failure (:func:`is_allocation_failure`) drops the step's
gradients, frees memory, shrinks the micro-batch and runs the same step again. Recovery always happens after the
``except`` block has exited: nothing of the failed micro-batch (the exception, its traceback and frames, its outputs)
is alive while memory is freed.

The ``agree`` contract (DDP today; FSDP/FSDP2 builds on it):

- ``agree(values)`` takes this rank's list of floats and returns the element-wise maximum over all ranks. The first
  value is the rank's status for the attempt: ``0`` every micro-batch ran, ``1`` an allocation failure that a smaller
  micro-batch can retry, ``2`` a failure that cannot be recovered (the micro-batch is already at its minimum). The
  others are a payload the caller adds (the interval's memory figures), so that a step costs one collective at most.
- It is called exactly once per attempt at a step, by every rank, after the rank ran every micro-batch it could (a
  rank whose micro-batch failed stops there and goes straight to ``agree``) and before anything that enters a
  collective of the step's gradient reduction. Micro-batches therefore must run without collectives of their own:
  under DDP inside ``no_sync`` (all but the last, whose backward carries the gradient all-reduce overlapped with
  it, after the agreement); under FSDP2 every micro-batch, the last's backward included, with the parameters
  gathered once before the first and gradient sync off, the gradients reduce-scattered after the agreement
  (:class:`~lightning_tune.batch.sharded.GatheredStep`).
- It must be one small all-reduce, with no barrier, read back once, and bounded in time: a rank that waits longer
  than its timeout raises a clear error instead of waiting forever (:func:`all_reduce_max`). When the agreed status
  is ``2``, every rank raises the same error at once.
- Under DDP, an allocation failure inside the last micro-batch's backward, where the gradient reduction runs, cannot
  be agreed: that rank raises, and the others end with their collective's error (at once under gloo, at the process
  group's timeout under NCCL). Under FSDP2 there is no such case: the reduction runs after the agreement.
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

from lightning_tune._validation import check_callable, check_float, check_instance, check_int, check_numbers
from lightning_tune.batch.split import split_sizes
from lightning_tune.perf.batch import BatchLayout, sequence_length

__all__ = [
    "ALLOCATION_FAILURE_MESSAGES",
    "MicroBatch",
    "MicroBatchRunner",
    "StepOutcome",
    "all_reduce_max",
    "cut_step",
    "is_allocation_failure",
    "retry_steps",
    "step_with_retry",
    "undo_retry_steps",
]

#: Allocation-failure messages of the devices Lightning trains on, for errors that are not ``torch.OutOfMemoryError``:
#: CUDA and its libraries (a cuBLAS handle or workspace, a cuDNN workspace, a raw ``cudaMalloc`` in an extension),
#: ROCm's HIP, Intel's XPU (builds that raise it as a plain ``RuntimeError``), Apple's MPS allocator, torch's CPU
#: allocator (``[enforce fail at alloc_cpu.cpp:...] DefaultCPUAllocator: can't allocate memory: ...``) and Habana's
#: HPU device-memory module; then what Lightning's ``is_oom_error`` and accelerate's ``should_reduce_batch_size`` also
#: shrink on: any device's ``"<DEVICE> out of memory."`` (NPU, MLU, MUSA, ...) and cuDNN's
#: ``CUDNN_STATUS_NOT_SUPPORTED``, which cuDNN returns when a convolution or RNN's batch is too large for its kernels
#: and workspace (PyTorch issue 4107; torch adds "This error may appear if you passed in a non-contiguous input": a
#: smaller batch cannot help there, and at the smallest micro-batch the runner stops with an error quoting cuDNN's).
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

#: The types an allocation failure that is not ``torch.OutOfMemoryError`` comes as: torch's C++ checks raise
#: ``RuntimeError``, and torch versions that have ``torch.AcceleratorError`` raise that subclass for a failed CUDA
#: runtime call (``torch.AcceleratorError: CUDA error: out of memory``). Other subclasses (``NotImplementedError``, ...)
#: are other errors.
_FAILURE_TYPES = frozenset({RuntimeError, getattr(torch, "AcceleratorError", RuntimeError)})

OK, RETRY, FATAL = 0, 1, 2


def is_allocation_failure(err: BaseException) -> bool:
    """Whether ``err`` is a failure a smaller micro-batch can cure: by type first, then by the devices' messages.

    ``torch.OutOfMemoryError`` always is. A ``RuntimeError`` or ``torch.AcceleratorError`` (not another subclass, such
    as ``NotImplementedError``) is when its message holds one of :data:`ALLOCATION_FAILURE_MESSAGES` or names CUDA and
    "out of memory" together: each message on which Lightning's ``is_oom_error`` (its ``BatchSizeFinder``) or
    accelerate's ``should_reduce_batch_size`` (its ``find_executable_batch_size``) shrinks the batch, and the CUDA
    libraries' allocation statuses besides. cuDNN's
    ``CUDNN_STATUS_NOT_SUPPORTED`` counts, as upstream: cuDNN returns it when a batch is too large for its kernels
    and workspace. Where a smaller batch does not cure it (a non-contiguous input), the runner shrinks to its
    smallest micro-batch and then stops with an error that quotes cuDNN's message.

    Example:
        >>> is_allocation_failure(RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate`"))
        True
        >>> is_allocation_failure(RuntimeError("cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if "
        ...                                    "you passed in a non-contiguous input."))
        True
        >>> is_allocation_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
        False
    """
    check_instance("err", err, BaseException, "an exception")
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
    """Cut one optimizer step's batch into micro-batches with their exact loss weights.

    The step's last ``tail`` samples (a DataLoader's short last batch, which Lightning averages on its own) form
    micro-batches of their own; each of their samples weighs ``tail_weight``, every other sample ``sample_weight``.
    With ``tokens`` (each sample's count of label tokens) a micro-batch weighs its share of the step's tokens
    instead. A micro-batch's weight is its sample count times its samples' weight: its mean loss times the weight is
    its share of the step's loss. This is the one place a step is cut in consecutive pieces.

    Args:
        batch: The step's collated batch.
        micro_batch_size: Largest micro-batch.
        sample_weight: Weight of one sample outside the tail.
        tail: Samples at the end forming their own micro-batches (0 for none).
        tail_weight: Weight of one tail sample.
        tokens: Each sample's label tokens, to weigh micro-batches by (``None``: by samples).
        layout: The run's :class:`~lightning_tune.perf.batch.BatchLayout` (a fresh one by default).
        split: ``split(batch, sizes) -> pieces`` cuts the batch instead of the layout's rule (:func:`count_step`).

    Returns:
        The micro-batches, in order.

    Raises:
        TypeError: If the batch holds nothing per-sample to count, or ``split`` returns another number of pieces.
        ValueError: If the layout's rule cannot cut the batch (see ``BatchLayout``).

    Example:
        >>> import torch
        >>> pieces = cut_step(torch.arange(10), 4, sample_weight=1 / 8, tail=2, tail_weight=1 / 4)
        >>> [(p.samples, p.weight) for p in pieces]
        [(4, 0.5), (4, 0.5), (2, 0.5)]
    """
    check_int("micro_batch_size", micro_batch_size, minimum=1)
    check_float("sample_weight", sample_weight, low=0.0, low_inclusive=False)
    check_float("tail_weight", tail_weight, low=0.0)
    check_callable("split", split, allow_none=True)
    check_instance("layout", layout, BatchLayout, "a BatchLayout", allow_none=True)
    if tokens is not None:
        check_numbers("tokens", tokens, low=0, allow_empty=True)
    layout = layout if layout is not None else BatchLayout()
    n = count_step(batch, layout, split)
    check_int("tail", tail, minimum=0, maximum=n)
    if tokens is not None and len(tokens) != n:
        raise ValueError(f"`tokens` must hold one count per sample of the batch's {n}, got {len(tokens)}")
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
    if isinstance(output, Tensor):
        return output
    if isinstance(output, Mapping):
        loss = output.get("loss")
        return loss if isinstance(loss, Tensor) else None
    return None


def _with_loss(output: Any, change: Callable[[Tensor], Tensor]) -> Any:
    """``output`` with its loss (a tensor, or a mapping's ``"loss"``) replaced by ``change(loss)``."""
    if isinstance(output, Tensor):
        return change(output)
    if isinstance(output, Mapping) and isinstance(output.get("loss"), Tensor):
        return {**output, "loss": change(output["loss"])}
    return output


def _scaled(output: Any, weight: float) -> Any:
    return output if weight == 1.0 else _with_loss(output, lambda loss: loss * weight)


@dataclass
class StepOutcome:
    """What :meth:`MicroBatchRunner.run` leaves: the output to return and the agreed payload.

    Attributes:
        output: The last micro-batch's output, its loss weighted, valued at the step's mean loss. Its loss still
            needs a backward when the runner was told to leave the last backward to the caller; otherwise it is
            detached.
        payload: The element-wise maximum over ranks of the payload given to :meth:`MicroBatchRunner.run` (the
            payload itself without ``agree``).
        failures: Allocation failures recovered from during the step.
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
        agree: For a multi-process run, the agreement (see the module's docstring); ``None`` for one process.
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
        for name, hook in (("forward", forward), ("backward", backward), ("zero_grad", zero_grad), ("free", free)):
            check_callable(name, hook)
        check_callable("shrink", shrink)
        check_callable("no_sync", no_sync)
        check_callable("agree", agree, allow_none=True)
        check_callable("on_failure", on_failure, allow_none=True)
        check_int("min_size", min_size, minimum=1)
        check_int("min_samples", min_samples, minimum=1, allow_none=True)
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

        Args:
            batch: The step's batch.
            payload: Floats to agree on with the other ranks (their element-wise maximum comes back).
            cut: ``cut(batch, size) -> micro-batches`` (:func:`cut_step` with the step's weights).
            size: Micro-batch size to start with.
            leave_last_backward: Leave the last micro-batch's backward to the caller (under DDP, so that its gradient
                all-reduce overlaps the backward, after the agreement); otherwise every backward runs here.
            payload_fn: Computes the payload just before the agreement instead (the interval's figures so far).

        Returns:
            StepOutcome: The output for the caller, the agreed payload and the failures recovered.

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
    """Element-wise maximum of ``values`` over the ranks: one small all-reduce, no barrier, one host read.

    Args:
        values: This rank's floats.
        device: Where the collective runs (the rank's device).
        timeout: Seconds to wait for the other ranks before raising.
        group: The process group (``None``: the default one).

    Returns:
        The maximum of each value over the ranks.

    Raises:
        RuntimeError: If the other ranks did not join within ``timeout`` (one of them failed or hangs).
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

    The closure (the step's micro-batches and their backward) runs once, before the update. A failure while the
    optimizer created state for parameters that had none (its first step) is retried once, when no parameter was
    updated yet (their version counters say so: an optimizer steps its groups one after the other, so a failure in
    the second group's state comes after the first group's update): the state it had started is dropped and memory
    freed. Otherwise, or when the retry fails too, it raises a clear error: the fixed memory does not fit, whatever
    the batch size.

    Raises:
        torch.OutOfMemoryError: If the step does not fit.
    """
    if not (hasattr(optimizer, "state") and hasattr(optimizer, "param_groups")):  # wrappers of other packages too
        raise TypeError(f"`optimizer` must be an optimizer, got {optimizer!r} ({type(optimizer).__name__})")
    for name, hook in (("step", step), ("free", free), ("warn", warn)):
        check_callable(name, hook)
    check_callable("closure", closure, allow_none=True)
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
