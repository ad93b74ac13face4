"""Memory probes: where :class:`~lightning_tune.DynamicBatchSize` reads device memory (:class:`MemoryProbe`).

Pressure is the allocator having had to free cached blocks and retry an allocation, the step before an out-of-memory
error; a probe is told each micro-batch's size and padded length just before it runs.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import gc
import os
import random
import weakref
from collections.abc import Iterator
from typing import Any, Literal, Protocol, get_args, runtime_checkable

import torch

from lightning_tune._validation import check_bool, check_choice, check_float, check_instance, check_int

FailureKind = Literal["oom", "cublas", "cudnn"]
#: How :class:`SimulatedMemory` reports an allocation failure: ``torch.OutOfMemoryError``, or the ``RuntimeError``
#: that cuBLAS or cuDNN raise when their own allocation fails near a full device.
FAILURE_KINDS: tuple[str, ...] = get_args(FailureKind)
Activations = Literal["micro_batch", "tensors"]
_ACTIVATIONS: tuple[str, ...] = get_args(Activations)


def expandable_segments(conf: str | None = None) -> bool:
    """Whether ``conf``, or ``PYTORCH_CUDA_ALLOC_CONF`` / ``PYTORCH_ALLOC_CONF``, turns expandable segments on.

    Example:
        >>> expandable_segments("max_split_size_mb:128,expandable_segments:True")
        True
    """
    names = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
    texts = [conf] if conf is not None else [os.environ.get(name, "") for name in names]
    for text in texts:
        for item in text.split(","):
            key, _, value = item.partition(":")
            if key.strip() == "expandable_segments":
                return value.strip().lower() == "true"
    return False


@runtime_checkable
class MemoryProbe(Protocol):
    """What :class:`~lightning_tune.DynamicBatchSize` needs from a memory probe."""

    def total_bytes(self) -> int:
        """Memory the device has in all, in bytes."""

    def capacity_bytes(self) -> int:
        """Memory this process can get, in bytes: the device's free memory plus what the allocator holds already."""

    def reset_peak(self) -> None:
        """Start a new measurement interval: forget the peak and the pressure seen so far."""

    def peak_bytes(self) -> int:
        """Highest memory reserved (bytes) since the last :meth:`reset_peak`."""

    def pressure(self) -> bool:
        """Whether the allocator had to retry an allocation since the last :meth:`reset_peak`."""

    def before_micro_batch(self, batch_size: int, seq_len: int | None = None) -> None:
        """Called just before a micro-batch of ``batch_size`` samples, padded to ``seq_len``, runs forward."""

    def free(self) -> None:
        """Collect garbage and give cached memory back (after an out-of-memory error, or a validation run)."""

    def empty_cache(self) -> None:
        """Give cached memory back, without collecting garbage (after every decision, so cheap)."""


class CudaMemory:
    """Memory of a CUDA device, read from the caching allocator's statistics and the driver (``docs/dynamic_batch.md``).

    Args:
        device: The CUDA device; ``None`` is the current device at the time memory is read (after the Trainer has
            set each rank's device), not at construction.

    Raises:
        RuntimeError: If CUDA is not available.
        ValueError: If ``device`` is not a CUDA device.
    """

    def __init__(self, device: torch.device | int | str | None = None) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("CudaMemory needs a CUDA device; for a trial run without one use SimulatedMemory")
        if isinstance(device, int):
            device = torch.device("cuda", device)
        self._device = None if device is None else torch.device(device)
        if self._device is not None and self._device.type != "cuda":
            raise ValueError(f"`device` must be a CUDA device, got {str(self._device)!r}")
        #: Whether ``PYTORCH_CUDA_ALLOC_CONF`` turns expandable segments on.
        self.expandable_segments = expandable_segments()
        self._retries: int | None = None

    @property
    def device(self) -> torch.device:
        """The device read: the one given, or the current one now."""
        return self._device if self._device is not None else torch.device("cuda", torch.cuda.current_device())

    def _alloc_retries(self) -> int:
        return int(torch.cuda.memory_stats(self.device).get("num_alloc_retries", 0))

    def total_bytes(self) -> int:
        """Total memory of the device in bytes."""
        return int(torch.cuda.get_device_properties(self.device).total_memory)

    def capacity_bytes(self) -> int:
        """Free memory of the device plus the allocator's reserved bytes."""
        free, _ = torch.cuda.mem_get_info(self.device)
        return int(free) + int(torch.cuda.memory_reserved(self.device))

    def reset_peak(self) -> None:
        """Start a new interval (the run's peak stays readable through the monitor) and remember the retry count."""
        from lightning_tune.perf.devices import reset_interval_peak

        reset_interval_peak(self.device)
        self._retries = self._alloc_retries()

    def peak_bytes(self) -> int:
        """Peak reserved memory since the last reset."""
        return int(torch.cuda.max_memory_reserved(self.device))

    def allocated_bytes(self) -> int:
        """Memory live tensors hold now (``torch.cuda.memory_allocated``): DynamicBatchSize's base between steps."""
        return int(torch.cuda.memory_allocated(self.device))

    def pressure(self) -> bool:
        """Whether the allocator retried an allocation since the last reset."""
        return self._retries is not None and self._alloc_retries() > self._retries

    def before_micro_batch(self, batch_size: int, seq_len: int | None = None) -> None:
        """Nothing to do: a real device raises by itself."""

    def free(self) -> None:
        """Collect garbage and empty the allocator's cache."""
        gc.collect()
        self.empty_cache()

    def empty_cache(self) -> None:
        """Empty the allocator's cache (``torch.cuda.empty_cache``)."""
        torch.cuda.empty_cache()

    def __repr__(self) -> str:
        return f"CudaMemory(device={None if self._device is None else str(self._device)!r})"


class _CachingAllocator:
    """The caching allocator that :class:`SimulatedMemory` and :class:`TrackedMemory` model."""

    granule = 1  # every request is rounded up to a multiple of this

    def __init__(self, total_bytes: int, outside_bytes: int, fragmentation: float, expandable_segments: bool) -> None:
        check_int("total_bytes", total_bytes, minimum=1)
        check_int("outside_bytes", outside_bytes, minimum=0)
        check_float("fragmentation", fragmentation, low=0.0, high=1.0, high_inclusive=False)
        check_bool("expandable_segments", expandable_segments)
        self.total, self.outside_bytes = total_bytes, outside_bytes
        self.fragmentation, self.expandable_segments = fragmentation, expandable_segments
        self._blocks: dict[int, int] = {}  # live allocation id -> block size
        self._cache: list[int] = []  # sizes of cached (free but reserved) blocks, sorted
        self._allocated = self._cached = 0  # their sums
        self._next = 0
        self._peak = 0
        self._retries_at_reset = 0
        #: Allocation failures raised so far.
        self.out_of_memory_errors = 0
        #: Times the allocator emptied its cache to retry an allocation.
        self.alloc_retries = 0

    def allocated_bytes(self) -> int:
        """Bytes in live allocations."""
        return self._allocated

    def reserved_bytes(self) -> int:
        """Bytes the allocator holds: live blocks plus cached ones."""
        return self._allocated + self._cached

    def _fungible(self) -> bool:
        return self.expandable_segments or self.fragmentation == 0.0

    def _set_cache(self, sizes: list[int]) -> None:
        self._cache, self._cached = sizes, sum(sizes)

    def _from_cache(self, n: int) -> int | None:
        if self._fungible():
            pool = self._cached
            if pool < n:
                return None
            self._set_cache([pool - n] if pool > n else [])
            return n
        i = bisect.bisect_left(self._cache, n)
        if i == len(self._cache):
            return None
        size = self._cache.pop(i)  # used whole: what it has beyond the request is fragmentation
        self._cached -= size
        return size

    def _allocate(self, n: int, what: str, *, exact: bool = False) -> int:
        n = -(-n // self.granule) * self.granule
        size = self._from_cache(n)
        if size is None:
            want = n if self._fungible() or exact else int(n * (1.0 + self.fragmentation))
            if self._fungible():  # an expandable segment grows by what the cache cannot give
                want_new, pool = max(0, n - self._cached), self._cached
            else:
                want_new, pool = want, 0
            if self.reserved_bytes() + want_new > self.capacity_bytes() and self._cache:
                self._set_cache([])  # free the cached blocks and try again, as the CUDA allocator does
                self.alloc_retries += 1
                want_new, pool = want, 0
            if self.reserved_bytes() + want_new > self.capacity_bytes():
                self.out_of_memory_errors += 1
                raise self._failure(what, n)
            if pool:
                self._set_cache([])
            size = want
        self._next += 1
        self._blocks[self._next] = size
        self._allocated += size
        self._peak = max(self._peak, self.reserved_bytes())
        return self._next

    def _release(self, block: int | None) -> None:
        size = self._blocks.pop(block, None) if block is not None else None
        if size is not None:
            self._allocated -= size
            bisect.insort(self._cache, size)
            self._cached += size

    def _failure(self, what: str, n: int) -> BaseException:
        raise NotImplementedError

    def total_bytes(self) -> int:
        """Memory of the device."""
        return self.total

    def capacity_bytes(self) -> int:
        """What PyTorch can get: the total less the memory used outside it."""
        return self.total - self.outside_bytes

    def reset_peak(self) -> None:
        """Start a new interval: the peak becomes what is reserved now, as ``torch.cuda.reset_peak_memory_stats``."""
        self._peak = self.reserved_bytes()
        self._retries_at_reset = self.alloc_retries

    def peak_bytes(self) -> int:
        """Highest reserved memory since the last reset."""
        return self._peak

    def pressure(self) -> bool:
        """Whether the allocator emptied its cache to retry an allocation since the last reset."""
        return self.alloc_retries > self._retries_at_reset

    def free(self) -> None:
        """Collect garbage and empty the cache; memory of tensors still alive stays."""
        gc.collect()
        self.empty_cache()

    def empty_cache(self) -> None:
        """Give the cached blocks back; live tensors' memory stays."""
        self._set_cache([])


class _Hold(torch.autograd.Function):
    """Identity whose output owns a simulated allocation; its backward can allocate a transient one."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, sim: SimulatedMemory, backward_bytes: int) -> torch.Tensor:
        ctx.sim, ctx.backward_bytes = sim, backward_bytes
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        if ctx.backward_bytes:
            ctx.sim._release(ctx.sim._allocate(ctx.backward_bytes, "backward"))
        return grad, None, None


class SimulatedMemory(_CachingAllocator):
    """A simulated CUDA device with a caching allocator, for trying and testing without a GPU (docs: "Probes").

    Memory held by live tensors (:meth:`hold`, :meth:`through`) counts until the tensor is garbage, so a reference kept
    alive by a traceback keeps it.

    Args:
        total_bytes: Memory of the simulated device.
        fixed_bytes: Memory held from the start whatever the batch size.
        bytes_per_sample: Activation memory of each sample of a micro-batch.
        noise: Relative standard deviation of the peak read (0 for exact); only the noise-free usage decides failures.
        seed: Seed of the noise.
        outside_bytes: Memory of the device used outside PyTorch.
        fragmentation: Rounding of new blocks when segments do not expand, in [0, 1).
        expandable_segments: Whether the allocator's segments expand (cached memory serves any request).
        seq_len: Sequence length ``bytes_per_sample`` is given for (``None``: per sample, whatever the length).
        activations: Who allocates a micro-batch's activations: :meth:`before_micro_batch` (``"micro_batch"``, freed
            when the next starts) or the module's forward, with :meth:`through` (``"tensors"``, as long as its output).
        backward_bytes_per_sample: Transient memory each sample needs at the start of backward (:meth:`with_backward`).
        fail_as: How a failure is raised: ``"oom"``, ``"cublas"`` or ``"cudnn"``.
        bytes_per_token: Activation memory of each padded token of a micro-batch (its samples × its padded length, as
            :meth:`before_micro_batch` is told), on top of ``bytes_per_sample``.
        eval_bytes_per_sample: ``bytes_per_sample`` of a micro-batch run without gradients (``torch.no_grad`` or
            ``torch.inference_mode``), which keeps no activations for a backward (``None``: the same).

    Raises:
        TypeError: If an argument has the wrong type.
        ValueError: If a size is negative, ``fixed_bytes + outside_bytes`` is not below ``total_bytes``, or a fraction
            is outside [0, 1).

    Example:
        >>> sim = SimulatedMemory(total_bytes=1000, fixed_bytes=200, bytes_per_sample=10)
        >>> sim.before_micro_batch(64)
        >>> sim.peak_bytes()
        840
        >>> sim.before_micro_batch(81)
        Traceback (most recent call last):
          ...
        torch.OutOfMemoryError: simulated out of memory: micro-batch of 81 samples needs 810 bytes; ...
    """

    def __init__(
        self,
        total_bytes: int,
        fixed_bytes: int,
        bytes_per_sample: int,
        *,
        noise: float = 0.0,
        seed: int = 0,
        outside_bytes: int = 0,
        fragmentation: float = 0.0,
        expandable_segments: bool = False,
        seq_len: int | None = None,
        activations: Activations = "micro_batch",
        backward_bytes_per_sample: int = 0,
        fail_as: FailureKind = "oom",
        bytes_per_token: int = 0,
        eval_bytes_per_sample: int | None = None,
    ) -> None:
        super().__init__(total_bytes, outside_bytes, fragmentation, expandable_segments)
        check_int("fixed_bytes", fixed_bytes, minimum=0)
        check_int("bytes_per_sample", bytes_per_sample, minimum=1)
        check_float("noise", noise, low=0.0, high=1.0, high_inclusive=False)
        check_int("seed", seed, minimum=0)
        check_int("seq_len", seq_len, minimum=1, allow_none=True)
        check_choice("activations", activations, _ACTIVATIONS)
        check_int("backward_bytes_per_sample", backward_bytes_per_sample, minimum=0)
        check_choice("fail_as", fail_as, FAILURE_KINDS)
        check_int("bytes_per_token", bytes_per_token, minimum=0)
        check_int("eval_bytes_per_sample", eval_bytes_per_sample, minimum=1, allow_none=True)
        if fixed_bytes + outside_bytes >= total_bytes:
            raise ValueError(
                f"`fixed_bytes` + `outside_bytes` must be below `total_bytes` ({total_bytes}) so that a sample fits, "
                f"got {fixed_bytes} + {outside_bytes}"
            )
        self.fixed_bytes, self.seq_len = fixed_bytes, seq_len
        self.bytes_per_sample, self.bytes_per_token, self.noise = bytes_per_sample, bytes_per_token, noise
        self.eval_bytes_per_sample = eval_bytes_per_sample
        self.activations: Activations = activations
        self.backward_bytes_per_sample = backward_bytes_per_sample
        self.fail_as: FailureKind = fail_as
        self._rng = random.Random(seed)
        self._transient: int | None = None  # the running micro-batch's activations (activations="micro_batch")
        self._length_scale = 1.0
        self._tokens_per_sample = 0  # padded length of the running micro-batch, for bytes_per_token
        self._samples = 0
        self._fixed = self._allocate(fixed_bytes, "fixed memory", exact=True) if fixed_bytes else None
        self._peak = self.reserved_bytes()

    def _failure(self, what: str, n: int) -> BaseException:
        detail = (
            f"{what} needs {n} bytes; {self.allocated_bytes()} allocated, {self.reserved_bytes()} reserved, "
            f"{self.capacity_bytes()} available to PyTorch"
        )
        if self.fail_as == "cublas":
            return RuntimeError(
                f"CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)` ({detail})"
            )
        if self.fail_as == "cudnn":
            return RuntimeError(f"cuDNN error: CUDNN_STATUS_ALLOC_FAILED ({detail})")
        return torch.OutOfMemoryError(f"simulated out of memory: {detail}")

    def hold(self, nbytes: int, owner: torch.Tensor | None = None) -> None:
        """Allocate ``nbytes`` for as long as ``owner`` lives (for good with no owner), or raise as a full device.

        Args:
            nbytes: Bytes to allocate.
            owner: The tensor the memory belongs to; it counts until the tensor is garbage.
        """
        block = self._allocate(nbytes, "an allocation")
        if owner is not None:
            weakref.finalize(owner, self._release, block)

    def through(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` itself, as a new tensor that owns this micro-batch's activations (``activations="tensors"``).

        Use it in the module's forward on an activation that a later operation saves for backward.
        """
        self._samples = int(x.shape[0]) if x.dim() else 1
        out = _Hold.apply(x, self, 0)
        self.hold(self._activation_bytes(self._samples), owner=out)
        return out

    def with_backward(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` itself, whose backward first allocates the backward's transient memory.

        That is ``backward_bytes_per_sample`` per sample of the last :meth:`through`, while every activation is alive.
        """
        return _Hold.apply(loss, self, int(self.backward_bytes_per_sample * self._samples * self._length_scale))

    def usage(self, batch_size: int, seq_len: int | None = None) -> int:
        """Noise-free memory a micro-batch of ``batch_size`` samples padded to ``seq_len`` needs, fixed included."""
        scale = seq_len / self.seq_len if seq_len is not None and self.seq_len is not None else 1.0
        tokens = batch_size * (seq_len or 0)
        return self.fixed_bytes + int(self.bytes_per_sample * batch_size * scale) + self.bytes_per_token * tokens

    def _activation_bytes(self, batch_size: int) -> int:
        tokens = batch_size * self._tokens_per_sample
        per_sample = self.bytes_per_sample
        if self.eval_bytes_per_sample is not None and not torch.is_grad_enabled():  # nothing kept for a backward
            per_sample = self.eval_bytes_per_sample
        return int(per_sample * batch_size * self._length_scale) + self.bytes_per_token * tokens

    def peak_bytes(self) -> int:
        """Highest (noisy) reserved memory since the last reset."""
        if not self.noise:
            return self._peak
        return min(int(self._peak * (1.0 + self._rng.gauss(0.0, self.noise))), self.total)

    def before_micro_batch(self, batch_size: int, seq_len: int | None = None) -> None:
        """Start a micro-batch: allocate its activations (``activations="micro_batch"``), or raise as a full device."""
        self._length_scale = seq_len / self.seq_len if seq_len is not None and self.seq_len is not None else 1.0
        self._tokens_per_sample = seq_len or 0
        if self.activations != "micro_batch":
            return
        self._release(self._transient)  # the previous micro-batch's activations are garbage by now
        self._transient = None
        self._transient = self._allocate(self._activation_bytes(batch_size), f"micro-batch of {batch_size} samples")

    def empty_cache(self) -> None:
        """Empty the cache (the last micro-batch's activations are garbage by now); live tensors' memory stays."""
        self._release(self._transient)
        self._transient = None
        super().empty_cache()

    def __repr__(self) -> str:
        return (
            f"SimulatedMemory(total_bytes={self.total}, fixed_bytes={self.fixed_bytes}, "
            f"bytes_per_sample={self.bytes_per_sample}, noise={self.noise}"
            + (f", bytes_per_token={self.bytes_per_token})" if self.bytes_per_token else ")")
        )


def _cuda_size(n: int) -> str:
    """A size as the CUDA caching allocator's messages print it.

    Example:
        >>> _cuda_size(512), _cuda_size(3 << 19), _cuda_size(5 << 29)
        ('512 bytes', '1.50 MiB', '2.50 GiB')
    """
    if n <= 1 << 10:
        return f"{n} bytes"
    for unit, scale in (("KiB", 1 << 10), ("MiB", 1 << 20)):
        if n <= scale << 10:
            return f"{n / scale:.2f} {unit}"
    return f"{n / (1 << 30):.2f} GiB"


@functools.cache
def _aliases(func: Any) -> bool:
    """Whether an operator's outputs are views of, or are, its inputs (its schema says so): nothing is allocated.

    ``OpOverload._schema`` is private torch API (checked on torch 2.13), the one place that says so for every
    operator; ``tests/test_tracked_memory.py`` fails if views or in-place results start to count.
    """
    return any(ret.alias_info is not None for ret in func._schema.returns)


class TrackedMemory(_CachingAllocator):
    """A device of ``total_bytes`` that holds the real tensors of a run on the CPU, for rehearsing without a GPU.

    Inside :meth:`tracking` each new storage is allocated on it, failing as CUDA does (docs: "Which probe to use").

    Args:
        total_bytes: Memory of the device.
        outside_bytes: Memory of the device used outside PyTorch (a CUDA context, other processes).
        fragmentation: Rounding of new blocks when segments do not expand, in [0, 1).
        expandable_segments: Whether the allocator's segments expand (cached memory serves any request).

    Raises:
        TypeError: If an argument has the wrong type.
        ValueError: If a size is negative, ``outside_bytes`` is not below ``total_bytes``, or ``fragmentation`` is
            outside [0, 1).

    Example:
        >>> memory = TrackedMemory(total_bytes=1 << 20)
        >>> weight = torch.ones(1024)  # 4 KiB, made before tracking: counted because it is handed over
        >>> with memory.tracking(weight):
        ...     y = weight * 2  # 4 KiB more
        ...     view = y[:10]  # a view: no new storage
        ...     print(memory.allocated_bytes())
        ...     del y, view
        8192
        >>> memory.allocated_bytes(), memory.reserved_bytes(), memory.peak_bytes()  # y's block stays cached
        (4096, 8192, 8192)
        >>> with memory.tracking():
        ...     torch.zeros(1 << 18)
        Traceback (most recent call last):
          ...
        torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1024.00 KiB. ...
    """

    granule = 512  # CUDA's allocator rounds every request up to a multiple of 512 bytes

    def __init__(
        self,
        total_bytes: int,
        *,
        outside_bytes: int = 0,
        fragmentation: float = 0.0,
        expandable_segments: bool = False,
    ) -> None:
        from lightning_tune.plan.measured import LiveBytes

        super().__init__(total_bytes, outside_bytes, fragmentation, expandable_segments)
        if outside_bytes >= total_bytes:
            raise ValueError(
                f"`outside_bytes` must be below `total_bytes` ({total_bytes}) so that PyTorch gets some memory, got "
                f"{outside_bytes}"
            )
        memory = self

        class Storages(LiveBytes):  # each storage first seen is a block of this allocator, released when it dies
            op: Any = "a tensor handed to tracking()"

            def _hold(self, size: int) -> int:
                return memory._allocate(size, self.op)

            def _drop(self, size: int, token: int) -> None:
                memory._release(token)

        self._storages = Storages()
        self._mode: Any = None

    @contextlib.contextmanager
    def tracking(self, *objects: torch.nn.Module | torch.optim.Optimizer | torch.Tensor) -> Iterator[TrackedMemory]:
        """Allocate every storage made inside the block, and those of ``objects`` (made before it), on this device.

        Args:
            objects: Modules, optimizers (their state) and tensors made before the block that live on the device: the
                model, typically (docs: "What it counts").

        Raises:
            TypeError: If an object is not a module, an optimizer or a tensor.
            RuntimeError: If this probe is tracking already.
            torch.OutOfMemoryError: If the objects alone do not fit.
        """
        from torch.utils._python_dispatch import TorchDispatchMode

        if self._mode is not None:
            raise RuntimeError("TrackedMemory.tracking() is entered already; enter it once around the whole run")
        for obj in objects:
            check_instance(
                "objects", obj, (torch.nn.Module, torch.optim.Optimizer, torch.Tensor), "modules, optimizers or tensors"
            )
        storages = self._storages
        for obj in objects:
            if isinstance(obj, torch.nn.Module):
                storages.track([*obj.parameters(), *obj.buffers()])
                storages.track([p.grad for p in obj.parameters() if p.grad is not None])
            elif isinstance(obj, torch.optim.Optimizer):
                storages.track([list(state.values()) for state in obj.state.values()])
            else:
                storages.track(obj)

        class Watch(TorchDispatchMode):  # sees every operation's outputs; only non-aliasing ones allocate
            def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
                out = func(*args, **(kwargs or {}))
                if not _aliases(func):
                    storages.op = func
                    storages.track(out)  # a refused block raises here: inside the operation, as CUDA's allocator
                return out

        self._mode = Watch()
        try:
            with self._mode:
                yield self
        finally:
            self._mode = None
            storages.op = "a tensor handed to tracking()"

    def _failure(self, what: str, n: int) -> BaseException:
        reserved, allocated = self.reserved_bytes(), self.allocated_bytes()
        return torch.OutOfMemoryError(
            f"CUDA out of memory. Tried to allocate {_cuda_size(n)}. TrackedMemory has a total capacity of "
            f"{_cuda_size(self.total)} of which {_cuda_size(max(self.capacity_bytes() - reserved, 0))} is free. Of "
            f"the allocated memory {_cuda_size(allocated)} is allocated by PyTorch, and "
            f"{_cuda_size(reserved - allocated)} is reserved by PyTorch but unallocated. (real tensors on the CPU; "
            f"allocated by {what})"
        )

    def before_micro_batch(self, batch_size: int, seq_len: int | None = None) -> None:
        """Nothing to do: the micro-batch's own operations allocate, and fail."""

    def __repr__(self) -> str:
        return f"TrackedMemory(total_bytes={self.total}, allocated_bytes={self.allocated_bytes()})"
