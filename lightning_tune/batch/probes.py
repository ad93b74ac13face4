"""Memory probes: where :class:`~lightning_tune.DynamicBatchSize` reads device memory.

A probe reports the device's total memory, the peak used since it was last reset, and whether the allocator came
under pressure (had to free cached blocks and retry an allocation, the step before an out-of-memory error). It is
also told the size of every micro-batch just before that micro-batch runs, which lets :class:`SimulatedMemory`
raise ``torch.OutOfMemoryError`` exactly where a real device would.
"""

from __future__ import annotations

import gc
import random
from typing import Protocol, runtime_checkable

import torch

from lightning_tune._validation import check_float, check_int

__all__ = ["CudaMemory", "MemoryProbe", "SimulatedMemory"]


@runtime_checkable
class MemoryProbe(Protocol):
    """What :class:`~lightning_tune.DynamicBatchSize` needs from a memory probe."""

    def total_bytes(self) -> int:
        """Memory the device has in all, in bytes."""
        ...

    def reset_peak(self) -> None:
        """Start a new measurement interval: forget the peak and the pressure seen so far."""
        ...

    def peak_bytes(self) -> int:
        """Highest memory use (bytes) since the last :meth:`reset_peak`."""
        ...

    def pressure(self) -> bool:
        """Whether the allocator had to retry an allocation since the last :meth:`reset_peak`."""
        ...

    def before_micro_batch(self, batch_size: int) -> None:
        """Called just before a micro-batch of ``batch_size`` samples runs its forward pass."""
        ...

    def free(self) -> None:
        """Give cached memory back after an out-of-memory error."""
        ...


class CudaMemory:
    """Memory of a CUDA device, read from the caching allocator's statistics.

    The peak is ``torch.cuda.max_memory_reserved``: what the allocator holds, fragmentation included, which is what
    runs out. Pressure is a rise of ``num_alloc_retries`` (the allocator freed its cache and tried again). Reading the
    peak resets ``torch.cuda``'s peak counters, so ``torch.cuda.max_memory_allocated`` elsewhere then means "since
    the last batch-size decision".

    Args:
        device: The CUDA device; ``None`` is the current one.

    Raises:
        RuntimeError: If CUDA is not available.
    """

    def __init__(self, device: torch.device | int | str | None = None) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("CudaMemory needs a CUDA device; for a trial run without one use SimulatedMemory")
        self.device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
        self._retries = self._alloc_retries()

    def _alloc_retries(self) -> int:
        return int(torch.cuda.memory_stats(self.device).get("num_alloc_retries", 0))

    def total_bytes(self) -> int:
        """Total memory of the device in bytes."""
        return int(torch.cuda.get_device_properties(self.device).total_memory)

    def reset_peak(self) -> None:
        """Reset the allocator's peak statistics and remember the retry count."""
        torch.cuda.reset_peak_memory_stats(self.device)
        self._retries = self._alloc_retries()

    def peak_bytes(self) -> int:
        """Peak reserved memory since the last reset."""
        return int(torch.cuda.max_memory_reserved(self.device))

    def pressure(self) -> bool:
        """Whether the allocator retried an allocation since the last reset."""
        return self._alloc_retries() > self._retries

    def before_micro_batch(self, batch_size: int) -> None:
        """Nothing to do: a real device raises by itself."""

    def free(self) -> None:
        """Collect garbage and empty the allocator's cache."""
        gc.collect()
        torch.cuda.empty_cache()

    def __repr__(self) -> str:
        return f"CudaMemory(device={str(self.device)!r})"


class SimulatedMemory:
    """A device that does not exist: memory is ``fixed_bytes + bytes_per_sample × batch``.

    Made for trying :class:`~lightning_tune.DynamicBatchSize` on a machine without a GPU, and for testing it: a
    micro-batch whose memory would exceed ``total_bytes`` raises ``torch.OutOfMemoryError`` before its forward pass,
    as a real device would, so growth, settling and recovery from out-of-memory errors all run on a CPU. The
    attributes can be changed while training runs (say, ``bytes_per_sample`` doubled to simulate longer sequences).

    Args:
        total_bytes: Memory of the simulated device.
        fixed_bytes: Memory used whatever the batch size (weights, gradients, optimizer states, workspace).
        bytes_per_sample: Memory each sample of a micro-batch adds (activations).
        noise: Relative standard deviation of the measured peak (0 for an exact device); a noisy reading never
            raises, only the noise-free usage decides out-of-memory.
        seed: Seed of the noise.

    Raises:
        TypeError: If an argument has the wrong type.
        ValueError: If a size is negative, ``fixed_bytes`` is not below ``total_bytes``, or ``noise`` is outside
            [0, 1).

    Example:
        >>> sim = SimulatedMemory(total_bytes=1000, fixed_bytes=200, bytes_per_sample=10)
        >>> sim.before_micro_batch(64)
        >>> sim.peak_bytes()
        840
        >>> sim.before_micro_batch(81)
        Traceback (most recent call last):
          ...
        torch.OutOfMemoryError: simulated out of memory: 81 samples need 1010 bytes, the device has 1000
    """

    def __init__(
        self, total_bytes: int, fixed_bytes: int, bytes_per_sample: int, noise: float = 0.0, *, seed: int = 0
    ) -> None:
        check_int("total_bytes", total_bytes, minimum=1)
        check_int("fixed_bytes", fixed_bytes, minimum=0)
        check_int("bytes_per_sample", bytes_per_sample, minimum=1)
        check_float("noise", noise, low=0.0, high=1.0, high_inclusive=False)
        check_int("seed", seed, minimum=0)
        if fixed_bytes >= total_bytes:
            raise ValueError(
                f"`fixed_bytes` must be below `total_bytes` ({total_bytes}) so that a sample fits, got {fixed_bytes}"
            )
        self.total = total_bytes
        self.fixed_bytes = fixed_bytes
        self.bytes_per_sample = bytes_per_sample
        self.noise = noise
        self._rng = random.Random(seed)
        self._peak = 0
        self.out_of_memory_errors = 0

    def usage(self, batch_size: int) -> int:
        """Noise-free memory a micro-batch of ``batch_size`` samples needs."""
        return self.fixed_bytes + self.bytes_per_sample * batch_size

    def total_bytes(self) -> int:
        """Memory of the simulated device."""
        return self.total

    def reset_peak(self) -> None:
        """Forget the peak."""
        self._peak = 0

    def peak_bytes(self) -> int:
        """Highest (noisy) usage recorded since the last reset."""
        return self._peak

    def pressure(self) -> bool:
        """Never: the simulated allocator has no cache to retry with."""
        return False

    def before_micro_batch(self, batch_size: int) -> None:
        """Record the usage of a micro-batch, or raise ``torch.OutOfMemoryError`` if it does not fit."""
        need = self.usage(batch_size)
        if need > self.total:
            self.out_of_memory_errors += 1
            raise torch.OutOfMemoryError(
                f"simulated out of memory: {batch_size} samples need {need} bytes, the device has {self.total}"
            )
        seen = need * (1.0 + self._rng.gauss(0.0, self.noise)) if self.noise else need
        self._peak = max(self._peak, min(int(seen), self.total))

    def free(self) -> None:
        """Nothing is cached."""

    def __repr__(self) -> str:
        return (
            f"SimulatedMemory(total_bytes={self.total}, fixed_bytes={self.fixed_bytes}, "
            f"bytes_per_sample={self.bytes_per_sample}, noise={self.noise})"
        )
