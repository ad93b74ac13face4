"""The table a sweep prints: one row per batch size, the same figures the JSON and CSV files hold, rounded."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Final

from lightning_tune._validation import check_choice
from lightning_tune.bench.result import BenchResult
from lightning_tune.bench.settings import MODES

_Format = Callable[[float], str]

# (header, result field, format); "{kind}" is "step" (train) or "request" (predict)
_COLUMNS: Final[tuple[tuple[str, str, _Format], ...]] = (
    ("samples/s", "samples_per_sec", lambda v: f"{v:,.1f}"),
    ("tokens/s", "tokens_per_sec", lambda v: f"{v:,.0f}"),
    ("{kind} p50 ms", "p50_ms", lambda v: f"{v:,.2f}"),
    ("{kind} p95 ms", "p95_ms", lambda v: f"{v:,.2f}"),
    ("{kind} p99 ms", "p99_ms", lambda v: f"{v:,.2f}"),
    ("peak VRAM GiB", "peak_vram_gib", lambda v: f"{v:,.2f}"),
    ("MFU %", "mfu", lambda v: f"{100 * v:.1f}"),
)
_MISSING = "-"


def format_table(results: Sequence[BenchResult], *, mode: str = "train") -> str:
    """One row per batch size: throughput, latency percentiles, peak VRAM and MFU; ``-`` where a figure does not apply.

    Args:
        results: The sweep's results.
        mode: ``"train"`` (latency per optimizer step) or ``"predict"`` (per predict request).

    Raises:
        ValueError: If ``mode`` is not allowed.
        TypeError: If ``results`` holds something other than :class:`BenchResult`.

    Example:
        >>> rows = [BenchResult(1, "ok", 10, 1.0, 10.0, 640.0, 98.0, 101.0, 103.5), BenchResult(64, "oom")]
        >>> print(format_table(rows))
        batch  samples/s  tokens/s  step p50 ms  step p95 ms  step p99 ms  peak VRAM GiB  MFU %
            1       10.0       640        98.00       101.00       103.50              -      -
           64        OOM         -            -            -            -              -      -
    """
    check_choice("mode", mode, MODES)
    for index, result in enumerate(results):
        if not isinstance(result, BenchResult):
            raise TypeError(f"`results[{index}]` must be a BenchResult, got {result!r}")
    kind = "step" if mode == "train" else "request"
    headers = ["batch"] + [header.format(kind=kind) for header, _, _ in _COLUMNS]
    rows = [headers]
    for result in results:
        if result.status == "oom":
            rows.append([str(result.batch_size), "OOM"] + [_MISSING] * (len(_COLUMNS) - 1))
            continue
        figures = [(getattr(result, name), fmt) for _, name, fmt in _COLUMNS]
        rows.append([str(result.batch_size), *(_MISSING if value is None else fmt(value) for value, fmt in figures)])
    return "\n".join(align(rows))


def align(rows: Sequence[Sequence[str]], *, left: int = 0, widths: Sequence[int] | None = None) -> list[str]:
    """Rows as columns two spaces apart, the first ``left`` left-aligned, the others right-aligned, each line stripped.

    Example:
        >>> align([["run", "samples/s"], ["a", "12"]], left=1)
        ['run  samples/s', 'a           12']
    """
    if widths is None:
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [
        "  ".join(
            cell.ljust(w) if i < left else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        ).rstrip()
        for row in rows
    ]
