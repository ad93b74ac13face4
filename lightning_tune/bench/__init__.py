"""Benchmark engine behind ``lightning-tune bench``: batch-size sweeps of throughput and latency, no command line."""

from typing import TYPE_CHECKING

from lightning_tune._lazy import lazy_exports as _lazy_exports
from lightning_tune.bench.budget import LatencyBudget
from lightning_tune.bench.result import BenchResult
from lightning_tune.bench.settings import BenchSettings
from lightning_tune.bench.table import format_table

if TYPE_CHECKING:
    from lightning_tune.bench.runner import BenchRunner, SettingFailed

# The runner needs Lightning; the command line parses its flags without it.
__getattr__, __dir__ = _lazy_exports(
    __name__, dict.fromkeys(("BenchRunner", "SettingFailed"), "lightning_tune.bench.runner")
)

__all__ = ["BenchResult", "BenchRunner", "BenchSettings", "LatencyBudget", "SettingFailed", "format_table"]
