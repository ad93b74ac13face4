"""Device readings for the monitor: CUDA allocator memory, driver memory and NVML utilisation.

None of them waits for the device. The monitor reads the allocator at its logging steps only, and the driver
(``mem_get_info``, NVML) at most every :data:`DRIVER_READ_EVERY_S` seconds. On a machine without CUDA they return
nothing, quietly.
"""

from __future__ import annotations

import contextlib
import math
import platform
import time
from collections.abc import Callable
from typing import Any

import torch

from lightning_tune import _imports, keys
from lightning_tune._validation import check_instance

GIB = float(1 << 30)
#: Seconds between two driver reads (``mem_get_info``, NVML): NVML's utilisation is itself an average over the
#: driver's last sample period (up to a second), and each query costs tens to hundreds of microseconds of host time.
DRIVER_READ_EVERY_S = 1.0

_EARLIER_PEAK: dict[int, int] = {}  # device index -> highest allocated peak before an interval reset


def reset_interval_peak(device: torch.device) -> None:
    """Reset ``torch.cuda``'s peak counters for an interval; :func:`allocator_metrics` still reads the run's peak."""
    index = torch.device(device).index or 0
    _EARLIER_PEAK[index] = max(_EARLIER_PEAK.get(index, 0), int(torch.cuda.max_memory_allocated(device)))
    torch.cuda.reset_peak_memory_stats(device)


def reset_run_peak(device: torch.device) -> None:
    """Start a new run's peak: ``torch.cuda.reset_peak_memory_stats`` and the peak kept across interval resets."""
    _EARLIER_PEAK.pop(torch.device(device).index or 0, None)
    torch.cuda.reset_peak_memory_stats(device)


def cuda_memory_metrics(device: torch.device) -> dict[str, float]:
    """Memory of a CUDA device (nothing for another): :func:`allocator_metrics` and :func:`driver_metrics` together."""
    return {**allocator_metrics(device), **driver_metrics(device)}


def allocator_metrics(device: torch.device) -> dict[str, float]:
    """What the caching allocator holds on a CUDA device (else nothing), from one ``memory_stats`` read (host only).

    ``vram_peak_gib`` is the peak allocated since the last :func:`reset_run_peak`, across DynamicBatchSize's interval
    resets; ``alloc_retries`` counts retries after a failed ``cudaMalloc`` (memory pressure short of an OOM).
    """
    if device.type != "cuda" or not torch.cuda.is_available():
        return {}
    stats = torch.cuda.memory_stats(device)  # torch's memory_allocated() & co. each read all of it again
    peak = max(int(stats.get("allocated_bytes.all.peak", 0)), _EARLIER_PEAK.get(device.index or 0, 0))
    return {
        "vram_allocated_gib": stats.get("allocated_bytes.all.current", 0) / GIB,
        "vram_reserved_gib": stats.get("reserved_bytes.all.current", 0) / GIB,
        "vram_peak_gib": peak / GIB,
        "alloc_retries": float(stats.get("num_alloc_retries", 0)),
    }


def driver_metrics(device: torch.device) -> dict[str, float]:
    """``vram_used_frac``: the share of a CUDA device's memory in use by all processes (``mem_get_info``)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return {}
    free, total = torch.cuda.mem_get_info(device)
    return {"vram_used_frac": (total - free) / total}


class DeviceReader:
    """The monitor's device figures at its logging steps, read as the module says; ``warn`` hears of an NVML failure.

    ``vram_peak_gib`` is the highest read since :meth:`start`, so it survives resets of torch's peak counters.
    """

    def __init__(self, warn: Callable[[str], object]) -> None:
        self.warn = warn
        self.nvml: NvmlSampler | None = None  #: Set by the owner, for GPU utilisation.
        self.nvml_off = False  #: NVML failed: not to be set up again.
        self.device, self.peak_gib, self._due = torch.device("cpu"), 0.0, -math.inf

    def start(self, device: torch.device) -> None:
        """A new run on ``device`` (nothing is read off CUDA): its peak from now, the driver read at its first log."""
        self.device, self.peak_gib, self._due = device, 0.0, -math.inf
        if device.type == "cuda" and torch.cuda.is_available():
            reset_run_peak(device)

    def read(self) -> dict[str, float]:
        """The allocator's figures, and the driver's and NVML's when they are due, keyed as in ``perf/...``."""
        out = allocator_metrics(self.device)
        if "vram_peak_gib" in out:
            out["vram_peak_gib"] = self.peak_gib = max(self.peak_gib, out["vram_peak_gib"])
        now = time.monotonic()
        if now >= self._due:
            self._due = now + DRIVER_READ_EVERY_S
            out.update(driver_metrics(self.device))
            try:
                out.update(self.nvml.sample() if self.nvml is not None else {})
            except Exception as err:  # noqa: BLE001 - e.g. NVMLError_NotSupported on a MIG device: stop asking
                self.nvml, self.nvml_off = None, True
                self.warn(
                    f"NVML could not read GPU utilisation ({type(err).__name__}: {err}); `{keys.GPU_UTIL_PCT}` and "
                    f"`{keys.GPU_MEM_BW_PCT}` are not logged from now on."
                )
        return out

    def peak(self) -> float | None:
        """The run's peak allocated GiB, read now (``None`` off CUDA)."""
        peak = allocator_metrics(self.device).get("vram_peak_gib")
        return None if peak is None else max(self.peak_gib, peak)


def describe_device(device: torch.device) -> str:
    """Name a device for the results: ``"cuda:0 (NVIDIA H100 80GB HBM3)"``, ``"cpu (<CPU model>, 8 threads)"``."""
    check_instance("device", device, torch.device, "a torch.device")
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    if device.type == "cpu":
        threads = torch.get_num_threads()
        return f"cpu ({_cpu_model()}, {threads} thread{'s' if threads != 1 else ''})"
    return str(device)


def _cpu_model() -> str:
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as handle:
        for line in handle:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "unknown model"


class NvmlSampler:
    """GPU utilisation and memory-bandwidth utilisation of one CUDA device from NVML (nvidia-ml-py).

    Raises:
        ModuleNotFoundError: If nvidia-ml-py is not installed (the message names the ``gpu`` extra).
    """

    def __init__(self, device: torch.device) -> None:
        self._nvml: Any = _imports.require("pynvml", feature="GPU utilisation in ThroughputLatencyMonitor")
        self._nvml.nvmlInit()
        index = device.index if device.index is not None else torch.cuda.current_device()
        uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
        self._handle = None
        if uuid is not None:  # robust to CUDA_VISIBLE_DEVICES reordering
            with contextlib.suppress(Exception):  # older drivers: fall back to the index
                self._handle = self._nvml.nvmlDeviceGetHandleByUUID(f"GPU-{uuid}")
        if self._handle is None:
            self._handle = self._nvml.nvmlDeviceGetHandleByIndex(index)

    def sample(self) -> dict[str, float]:
        """Percent of the driver's last sample period a kernel ran, and device memory was read or written."""
        rates = self._nvml.nvmlDeviceGetUtilizationRates(self._handle)
        return {"gpu_util_pct": float(rates.gpu), "gpu_mem_bw_pct": float(rates.memory)}
