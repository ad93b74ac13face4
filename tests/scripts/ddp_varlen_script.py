"""Run by test_dynamic_batch_varlen.py: two CPU processes (gloo), DynamicBatchSize on padded variable-length batches.

Each rank trims its own step's samples and budgets tokens; both must keep the same budget after every decision,
train every sample once and end with the same weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, Trainer

import lightning_tune as lt
from tests.batch.test_dynamic_batch_varlen import Cheap
from tests.helpers import finish_ddp
from tests.hf_data import TokenDataset, long_tailed_lengths


class Seen(Cheap):
    def __init__(self, dataset: Any) -> None:
        torch.manual_seed(0)
        super().__init__(dataset)
        self.seen: list[int] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.seen += [
            int(ids[0]) * 1000 + int(mask.sum())
            for ids, mask in zip(batch["input_ids"], batch["attention_mask"], strict=True)
        ]
        return super().training_step(batch, batch_idx)


class Budgets(Callback):
    def __init__(self, dyn: lt.DynamicBatchSize) -> None:
        self.dyn, self.budgets = dyn, []

    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        self.budgets.append(self.dyn.micro_batch_tokens)


def main(out: Path) -> None:
    data = TokenDataset(long_tailed_lengths(64 * 2 * 6, median=64, max_len=1024, seed=4))
    probe = lt.SimulatedMemory(total_bytes=20_000_000, fixed_bytes=2_000_000, bytes_per_sample=1, bytes_per_token=4000)
    dyn = lt.DynamicBatchSize(probe=probe, adjust_every=2, loss_weight="tokens")
    budgets = Budgets(dyn)
    module = Seen(data)
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_epochs=1,
        accumulate_grad_batches=8,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[dyn, budgets],
        default_root_dir=str(out),
    )
    trainer.fit(module)
    payload = {
        "budgets": budgets.budgets,
        "decisions": dyn.decisions,
        "seen": module.seen,
        "steps": trainer.global_step,
        "weights": [float(p.sum()) for p in module.parameters()],
        "expected": sorted(int(s[0]) * 1000 + len(s) for s in data.samples),
    }
    finish_ddp(out, trainer.global_rank, payload)
