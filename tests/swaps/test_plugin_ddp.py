"""TunePlugin under DDP: two CPU processes with gloo; swaps before wrapping, replicas stay identical."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import run_ddp_script


@pytest.mark.slow
def test_swapped_replicas_stay_identical_under_ddp(tmp_path: Path) -> None:
    pytest.importorskip("bitsandbytes")
    ranks = run_ddp_script("ddp_plugin_script.py", tmp_path)
    assert ranks[0]["optimizer"] == ranks[1]["optimizer"] == "AdamW8bit"
    assert ranks[0]["steps"] == ranks[1]["steps"] == 6
    assert ranks[0]["checksum"] == ranks[1]["checksum"]  # gradients were all-reduced: identical weights
