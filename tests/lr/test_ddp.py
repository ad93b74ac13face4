"""The LR callbacks under DDP: two CPU processes with gloo."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from lightning_tune.lr import warmup_cosine_lr


@pytest.mark.slow
def test_two_ranks_use_identical_lrs_and_agree_on_plateau_decisions(two_ranks: Callable[[str], list[Any]]) -> None:
    ranks = two_ranks("lr")
    # 64 samples split over 2 ranks, batch 4 -> 8 batches per rank per epoch, accumulation 2 -> 4 steps, 4 epochs
    assert ranks[0]["global_step"] == ranks[1]["global_step"] == 16
    assert ranks[0]["batches"] == 32
    assert ranks[0]["lrs"] == ranks[1]["lrs"]
    assert ranks[0]["reductions"] == ranks[1]["reductions"] == 0  # rank 0's improving metric decided for both
    expected = [warmup_cosine_lr(s, base_lr=0.1, warmup_steps=3, total_steps=16, min_lr=0.001) for s in range(16)]
    assert [lr[0] for lr in ranks[0]["lrs"]] == pytest.approx(expected)
