"""Run by test_ddp.py: two CPU processes (gloo) training with a schedule and a plateau callback.

Each rank logs a different validation loss, so ranks deciding on their own would disagree; every rank writes the LR
it used at each optimizer step to ``<out>/rank<r>.json``.
"""

from __future__ import annotations

from pathlib import Path

import torch
from lightning.pytorch import Trainer

import lightning_tune as lt
from tests.helpers import LRRecorder, Regressor, finish_ddp


class PerRankLoss(Regressor):
    def validation_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        # rank 0 improves every epoch; rank 1 is flat and, alone, would trigger a reduction every other epoch
        value = 1.0 - 0.1 * self.current_epoch if self.global_rank == 0 else 1.0
        self.log("val_loss", torch.tensor(value), batch_size=1)


def main(out: Path) -> None:
    rec = LRRecorder()
    plateau = lt.AdaptiveLROnPlateau(patience=0, factor=0.5, min_lr=0.0)
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_epochs=4,
        accumulate_grad_batches=2,
        limit_val_batches=1,
        num_sanity_val_steps=0,
        callbacks=[lt.WarmupCosine(warmup_steps=3, min_lr=0.001), plateau, rec],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(PerRankLoss(lr=0.1, optimizer="adamw"))
    payload = {
        "lrs": rec.lrs,
        "batches": rec.batches,
        "global_step": trainer.global_step,
        "reductions": plateau.reductions,
    }
    finish_ddp(out, trainer.global_rank, payload)
