"""Measurement engine (step statistics, timers, batch counting, device readings, peak FLOPs) with no Trainer in it.

:class:`~lightning_tune.ThroughputLatencyMonitor` wires Lightning's hooks to it; a ``lightning.fabric`` loop uses the
names below (``examples/fabric_throughput.py``), and the rest is imported from its module.
"""

from lightning_tune.perf.batch import count_samples, count_tokens
from lightning_tune.perf.stats import StepStats
from lightning_tune.perf.timing import timer_for

__all__ = ["StepStats", "count_samples", "count_tokens", "timer_for"]
