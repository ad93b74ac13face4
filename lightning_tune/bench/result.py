"""The figures of one batch size: :class:`BenchResult`, the row the table, the JSON and the CSV are made of."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Final, Literal

#: ``"ok"``: measured; ``"oom"``: the setting ran out of device memory and has no figures.
Status = Literal["ok", "oom"]

#: Latency percentiles every result reports.
PERCENTILES: Final[tuple[float, ...]] = (50.0, 95.0, 99.0)


@dataclass(frozen=True)
class BenchResult:
    """Figures of one batch size, over its measured steps (train) or predict batches (predict) only.

    Figures that do not apply are ``None``: every figure of an out-of-memory setting, ``tokens_per_sec`` when the
    batches hold no token ids, ``peak_vram_gib`` off CUDA, ``mfu`` where the device's peak FLOP/s is unknown (CPUs,
    GPUs missing from ``docs/peak_flops.md``).

    Args:
        batch_size: The batch size asked for.
        status: ``"ok"`` or ``"oom"``.
        steps: Measured optimizer steps (train) or predict batches (predict).
        seconds: Wall time of the measured steps, in seconds.
        samples_per_sec: Samples per second.
        tokens_per_sec: Input tokens per second (padding excluded when batches carry an attention mask).
        p50_ms: Median step (train) or request (predict) latency, in milliseconds.
        p95_ms: 95th percentile latency, in milliseconds.
        p99_ms: 99th percentile latency, in milliseconds.
        peak_vram_gib: Peak memory held by tensors during the setting, in GiB (CUDA).
        mfu: Model FLOPs utilisation, 0-1.
        message: Why the setting has no figures (the first line of the out-of-memory error).

    Example:
        >>> BenchResult(batch_size=64, status="oom", message="CUDA out of memory").as_dict()["status"]
        'oom'
    """

    batch_size: int
    status: Status
    steps: int = 0
    seconds: float | None = None
    samples_per_sec: float | None = None
    tokens_per_sec: float | None = None
    p50_ms: float | None = None
    p95_ms: float | None = None
    p99_ms: float | None = None
    peak_vram_gib: float | None = None
    mfu: float | None = None
    message: str | None = None

    def as_dict(self) -> dict[str, Any]:
        """The result as a flat mapping in :data:`COLUMNS` order (the CSV's row, a JSON ``results`` entry)."""
        return {name: getattr(self, name) for name in COLUMNS}


#: Column names of a result, in order.
COLUMNS: Final[tuple[str, ...]] = tuple(f.name for f in fields(BenchResult))
