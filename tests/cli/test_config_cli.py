"""The LightningCLI example: lightning_tune callbacks and the plugin built by jsonargparse from YAML, then trained."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

import lightning_tune as lt
from lightning_tune.callbacks import ActivationCheckpointing
from lightning_tune.config import InitialLR
from tests.helpers import LRRecorder

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "lightning_cli"


def load_example() -> Any:
    spec = importlib.util.spec_from_file_location("lightning_cli_example", EXAMPLE / "train.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_lightning_cli_builds_the_packs_callbacks_from_yaml_and_trains(tmp_path: Path) -> None:
    pytest.importorskip("jsonargparse", reason="LightningCLI needs jsonargparse[signatures] (the `dev` extra)")
    cli = load_example().main(
        [
            "fit",
            "--config",
            str(EXAMPLE / "config.yaml"),
            "--trainer.max_steps=4",
            "--trainer.limit_val_batches=1",
            f"--trainer.default_root_dir={tmp_path}",
            "--trainer.callbacks+=tests.helpers.LRRecorder",
        ]
    )
    trainer = cli.trainer
    by_type = {type(c): c for c in trainer.callbacks}
    assert by_type[InitialLR].lr == 1e-3
    cosine = by_type[lt.WarmupCosine]
    assert (cosine.warmup_steps, cosine.min_lr) == (2, 3e-5)
    assert by_type[lt.AdaptiveLROnPlateau].monitor == "val_loss"
    assert by_type[ActivationCheckpointing].block_types == "Block"
    assert isinstance(trainer.precision_plugin, lt.TunePlugin)
    assert (trainer.precision_plugin.precision, trainer.precision_plugin.attention) == ("bf16-mixed", "sdpa")
    assert trainer.global_step == 4
    recorder = by_type[LRRecorder]
    # InitialLR set the peak to 1e-3 (the module configures 3e-3); WarmupCosine warms up over 2 steps from there
    assert [round(lrs[0], 9) for lrs in recorder.lrs[:3]] == [0.0, 5e-4, 1e-3]
