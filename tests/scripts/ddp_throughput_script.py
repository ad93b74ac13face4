"""Run by test_throughput_ddp.py: two CPU processes (gloo); rank 1 is a straggler (a slower forward pass)."""

from __future__ import annotations

import time
from pathlib import Path

from lightning.pytorch import Trainer
from lightning.pytorch.loggers import CSVLogger

import lightning_tune as lt
from tests.helpers import Regressor, csv_rows, finish_ddp


class SlowRank(Regressor):
    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        if self.global_rank == 1:
            time.sleep(0.03)
        return super().training_step(batch, batch_idx)


def main(out: Path) -> None:
    monitor = lt.ThroughputLatencyMonitor(log_every_n_steps=4)
    intervals: list[dict[str, float]] = []

    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_steps=8,
        callbacks=[monitor],
        logger=CSVLogger(str(out), name="csv"),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    original = monitor._train_metrics

    def record(trainer):  # type: ignore[no-untyped-def]
        metrics = original(trainer)
        intervals.append(dict(monitor.last_interval))
        return metrics

    monitor._train_metrics = record  # type: ignore[method-assign]
    trainer.fit(SlowRank())
    rows = csv_rows(trainer.logger.log_dir) if trainer.global_rank == 0 else []  # type: ignore[union-attr]
    finish_ddp(out, trainer.global_rank, {"intervals": intervals, "rows": rows})
