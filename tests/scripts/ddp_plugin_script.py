"""Run by test_plugin_ddp.py: two CPU processes (gloo) training the demo GPT through TunePlugin's swaps."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from lightning.pytorch import Trainer

import lightning_tune as lt
from lightning_tune.demos import DemoGPT, GPTConfig, SyntheticTokenDataModule
from tests.helpers import finish_ddp


def main(out: Path) -> None:
    if importlib.util.find_spec("bitsandbytes") is None:  # the test skips; the later scenarios still run
        finish_ddp(out, int(os.environ.get("LOCAL_RANK", 0)), {})
        return
    config = GPTConfig(d_model=64, n_layers=2, n_heads=4, seq_len=32)
    plugin = lt.TunePlugin("32-true", optimizer="adamw8bit", attention="sdpa")
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_steps=6,
        plugins=[plugin],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    model = DemoGPT(config)
    trainer.fit(model, datamodule=SyntheticTokenDataModule(8, seq_len=32, vocab_size=config.vocab_size, seed=0))
    checksum = float(sum(p.detach().double().sum() for p in model.parameters()))
    payload = {"optimizer": type(trainer.optimizers[0]).__name__, "checksum": checksum, "steps": trainer.global_step}
    finish_ddp(out, trainer.global_rank, payload)
