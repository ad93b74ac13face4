"""ThroughputLatencyMonitor under DDP: two CPU processes with gloo."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest


@pytest.mark.slow
def test_throughput_is_summed_over_ranks_and_the_straggler_is_seen(two_ranks: Callable[[str], list[Any]]) -> None:
    ranks = two_ranks("throughput")
    local = [rank["intervals"] for rank in ranks]
    assert len(local[0]) == len(local[1]) == 2  # both ranks took part in both collectives
    rows = [r for r in ranks[0]["rows"] if r.get("perf/train/samples_per_sec")]
    assert [int(r["step"]) for r in rows] == [3, 7]  # Lightning's step numbering, as its own rows
    for row, rank0, rank1 in zip(rows, local[0], local[1], strict=True):
        assert float(row["perf/train/samples_per_sec"]) == pytest.approx(
            rank0["samples_per_sec"] + rank1["samples_per_sec"], rel=1e-6
        )
        # rank 1's forward takes 30 ms longer: its own time per step dominates the median of two ranks
        assert float(row["perf/train/straggler_ratio"]) > 1.4
