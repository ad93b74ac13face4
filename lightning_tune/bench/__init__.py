"""Benchmark engine behind ``lightning-tune bench``: batch-size sweeps of throughput and latency.

:class:`BenchSettings` says what to run, :class:`BenchRunner` runs each batch size in a fresh Trainer with
:class:`~lightning_tune.ThroughputLatencyMonitor` and returns :class:`BenchResult` rows, which
:func:`format_table`, :func:`write_results` and :func:`plot_tradeoff` turn into a table, JSON/CSV files and a
throughput-against-latency picture. :class:`LatencyBudget` picks the batch size a p95/p99 budget allows and names
the throughput knee beside it. Nothing here parses command lines.
"""

from typing import TYPE_CHECKING

from lightning_tune._lazy import lazy_exports as _lazy_exports
from lightning_tune.bench.budget import (
    KNEE_FRACTION,
    Binds,
    LatencyBudget,
    Recommendation,
    format_recommendation,
    timed_batches_needed,
)
from lightning_tune.bench.files import (
    CSV_NAME,
    JSON_NAME,
    new_version_dir,
    sweep_record,
    write_atomically,
    write_results,
)
from lightning_tune.bench.plot import check_png_path, plot_tradeoff
from lightning_tune.bench.result import COLUMNS, PERCENTILES, STATUSES, BenchResult, Status
from lightning_tune.bench.settings import DEFAULT_SEQ_LEN, DEMO, MODES, BenchSettings, Mode, parse_batch_sizes
from lightning_tune.bench.table import format_table

if TYPE_CHECKING:
    from lightning_tune.bench.progress import SweepProgress
    from lightning_tune.bench.runner import BenchRunner, SettingFailed
    from lightning_tune.bench.target import BenchTarget, load_class, load_target, set_batch_size

# The runner, the target and the progress bars need Lightning; the command line parses its flags without it.
__getattr__, __dir__ = _lazy_exports(
    __name__,
    {
        "SweepProgress": "lightning_tune.bench.progress",
        **dict.fromkeys(("BenchRunner", "SettingFailed"), "lightning_tune.bench.runner"),
        **dict.fromkeys(("BenchTarget", "load_class", "load_target", "set_batch_size"), "lightning_tune.bench.target"),
    },
)

__all__ = [
    "BenchResult",
    "BenchRunner",
    "BenchSettings",
    "BenchTarget",
    "Binds",
    "COLUMNS",
    "CSV_NAME",
    "DEFAULT_SEQ_LEN",
    "DEMO",
    "JSON_NAME",
    "KNEE_FRACTION",
    "LatencyBudget",
    "MODES",
    "Mode",
    "PERCENTILES",
    "Recommendation",
    "STATUSES",
    "SettingFailed",
    "Status",
    "SweepProgress",
    "check_png_path",
    "format_recommendation",
    "format_table",
    "load_class",
    "load_target",
    "new_version_dir",
    "parse_batch_sizes",
    "plot_tradeoff",
    "set_batch_size",
    "sweep_record",
    "timed_batches_needed",
    "write_atomically",
    "write_results",
]
