"""Device readings for the monitor: CUDA allocator memory and NVML utilisation.

Both are read only at logging time. On a machine without CUDA they return nothing, quietly.
"""

from __future__ import annotations

import contextlib
import platform
from typing import Any

import torch

from lightning_tune import _imports

GIB = float(1 << 30)

_EARLIER_PEAK: dict[int, int] = {}  # device index -> highest allocated peak before an interval reset


def reset_interval_peak(device: torch.device) -> None:
    """Reset ``torch.cuda``'s peak counters for an interval measurement, keeping the run's peak.

    :func:`run_peak_allocated` (and so the monitor's ``perf/vram_peak_gib``) still reads the peak of the whole run.
    """
    index = torch.device(device).index or 0
    _EARLIER_PEAK[index] = max(_EARLIER_PEAK.get(index, 0), int(torch.cuda.max_memory_allocated(device)))
    torch.cuda.reset_peak_memory_stats(device)


def reset_run_peak(device: torch.device) -> None:
    """Start a new run's peak: ``torch.cuda.reset_peak_memory_stats`` and the peak kept across interval resets."""
    _EARLIER_PEAK.pop(torch.device(device).index or 0, None)
    torch.cuda.reset_peak_memory_stats(device)


def run_peak_allocated(device: torch.device) -> int:
    """Peak allocated bytes of the process, across interval resets made by :func:`reset_interval_peak`."""
    index = torch.device(device).index or 0
    return max(int(torch.cuda.max_memory_allocated(device)), _EARLIER_PEAK.get(index, 0))


def cuda_memory_metrics(device: torch.device) -> dict[str, float]:
    """Memory of a CUDA device, from the caching allocator and the driver.

    Args:
        device: The device; anything but a CUDA device gives an empty result.

    Returns:
        ``vram_allocated_gib``, ``vram_reserved_gib``, ``vram_peak_gib`` (peak allocated in the process, across
        DynamicBatchSize's interval resets),
        ``vram_used_frac`` (memory in use on the whole device, all processes, as a fraction of its total) and
        ``alloc_retries`` (allocator retries after a failed ``cudaMalloc``: memory pressure short of an OOM).
    """
    if device.type != "cuda" or not torch.cuda.is_available():
        return {}
    free, total = torch.cuda.mem_get_info(device)
    stats = torch.cuda.memory_stats(device)
    return {
        "vram_allocated_gib": torch.cuda.memory_allocated(device) / GIB,
        "vram_reserved_gib": torch.cuda.memory_reserved(device) / GIB,
        "vram_peak_gib": run_peak_allocated(device) / GIB,
        "vram_used_frac": (total - free) / total,
        "alloc_retries": float(stats.get("num_alloc_retries", 0)),
    }


def describe_device(device: torch.device) -> str:
    """Name a device for the results: ``"cuda:0 (NVIDIA H100 80GB HBM3)"``, ``"cpu (<CPU model>)"``.

    Args:
        device: The device.

    Returns:
        The description.
    """
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

    Args:
        device: The CUDA device to sample.

    Raises:
        ModuleNotFoundError: If nvidia-ml-py is not installed (the message names the ``gpu`` extra).
    """

    def __init__(self, device: torch.device) -> None:
        self._nvml: Any = _imports.require("pynvml", feature="GPU utilisation in ThroughputLatencyMonitor")
        self._nvml.nvmlInit()
        self._handle = self._find_handle(device)

    def _find_handle(self, device: torch.device) -> Any:
        index = device.index if device.index is not None else torch.cuda.current_device()
        uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
        if uuid is not None:  # robust to CUDA_VISIBLE_DEVICES reordering
            try:
                return self._nvml.nvmlDeviceGetHandleByUUID(f"GPU-{uuid}")
            except Exception:  # noqa: BLE001 - older drivers: fall back to the index
                pass
        return self._nvml.nvmlDeviceGetHandleByIndex(index)

    def sample(self) -> dict[str, float]:
        """Utilisation over the driver's last sample period.

        Returns:
            ``gpu_util_pct`` (time a kernel was running) and ``gpu_mem_bw_pct`` (time device memory was being read or
            written), in percent.
        """
        rates = self._nvml.nvmlDeviceGetUtilizationRates(self._handle)
        return {"gpu_util_pct": float(rates.gpu), "gpu_mem_bw_pct": float(rates.memory)}
