"""TunePlugin under DDP: two CPU processes with gloo; swaps before wrapping, replicas stay identical."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest


@pytest.mark.slow
def test_swapped_replicas_stay_identical_under_ddp(two_ranks: Callable[[str], list[Any]]) -> None:
    pytest.importorskip("bitsandbytes")
    ranks = two_ranks("plugin")
    assert ranks[0]["optimizer"] == ranks[1]["optimizer"] == "AdamW8bit"
    assert ranks[0]["steps"] == ranks[1]["steps"] == 6
    assert ranks[0]["checksum"] == ranks[1]["checksum"]  # gradients were all-reduced: identical weights
