"""Measurement engine: step statistics, latency windows, timers, batch counting, device readings and peak FLOPs.

Plain classes and functions with no Trainer in them; :class:`~lightning_tune.ThroughputLatencyMonitor` wires
Lightning's hooks to them, and the command line reuses them.
"""

from lightning_tune.perf.batch import count_samples, count_tokens, sequence_length
from lightning_tune.perf.counting import FlopModel, attention_pairs, count_step_flops, meta_copy
from lightning_tune.perf.devices import NvmlSampler, cuda_memory_metrics, describe_device
from lightning_tune.perf.flops import PEAK_FLOPS, canonical_device, mfu, peak_flops
from lightning_tune.perf.stats import StepStats, Totals
from lightning_tune.perf.timing import CudaTimer, HostTimer, Timer, compiled_graphs, timer_for
from lightning_tune.perf.window import MAX_WINDOW, LatencyWindow, check_percentiles, percentile_suffix

__all__ = [
    "CudaTimer",
    "FlopModel",
    "HostTimer",
    "LatencyWindow",
    "MAX_WINDOW",
    "NvmlSampler",
    "PEAK_FLOPS",
    "StepStats",
    "Timer",
    "Totals",
    "attention_pairs",
    "canonical_device",
    "check_percentiles",
    "compiled_graphs",
    "count_samples",
    "count_step_flops",
    "count_tokens",
    "cuda_memory_metrics",
    "describe_device",
    "meta_copy",
    "mfu",
    "peak_flops",
    "percentile_suffix",
    "sequence_length",
    "timer_for",
]
