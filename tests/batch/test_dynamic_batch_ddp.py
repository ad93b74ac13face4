"""DynamicBatchSize under DDP: two CPU processes agree on every decision and retry together after an OOM."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest


@pytest.mark.slow
def test_ranks_agree_on_every_decision_and_retry_together(two_ranks: Callable[[str], list[Any]]) -> None:
    ranks = two_ranks("dynamic_batch")
    assert ranks[0]["sizes"] == ranks[1]["sizes"]  # same micro-batch on both ranks after every step
    assert ranks[0]["local_ooms"] == 0 and ranks[1]["local_ooms"] >= 1  # only rank 1 ran out of memory ...
    assert ranks[0]["oom_recoveries"] == ranks[1]["oom_recoveries"] >= 1  # ... and both retried
    assert ranks[0]["sizes"][-1] == 44  # the worst rank decides: (9000 - 2000) / 150 = 46.7 -> 44
    assert ranks[0]["steps"] == ranks[1]["steps"] == 16  # 1024 samples / (2 ranks x 64) x 2 epochs
    assert ranks[0]["checksum"] == ranks[1]["checksum"]  # gradients were all-reduced: identical weights
    for rank in ranks:  # the agreement: one small all-reduce per attempt at a step, no barrier (defect 4)
        assert rank["collectives"] == {"barrier": 0, "all_reduce": rank["steps"] + rank["oom_recoveries"]}
    for epoch in ("0", "1"):
        both = ranks[0]["seen"][epoch] + ranks[1]["seen"][epoch]
        assert sorted(both) == list(range(1024))  # each sample once per epoch, across the two ranks
    # the same DDP run without the callback: the split micro-batches and the retries left the training unchanged
    reference = two_ranks("dynamic_batch_reference")
    for ours, theirs in zip(ranks[0]["weights"], reference[0]["weights"], strict=True):
        assert ours == pytest.approx(theirs, rel=1e-5, abs=1e-6)
