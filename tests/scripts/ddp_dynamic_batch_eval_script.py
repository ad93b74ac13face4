"""Run by test_dynamic_batch_eval.py: two CPU processes (gloo) fit, validate and predict, with or without sizing.

203 samples: ``DistributedSampler`` pads validation to 102 a rank; predict's sampler gives 102 and 101. Rank 1's
evaluation steps run out of memory above 40 samples, rank 0's never: rank 1 cuts its batches in pieces, and both ranks
take the next size on the worst rank's figures.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint

import lightning_tune as lt
from tests.batch.test_dynamic_batch_eval import Indices, Tagger, finetune
from tests.helpers import finish_ddp


class Sizes(Callback):
    """The evaluation batch after each validation batch, on this rank."""

    def __init__(self, dyn: lt.DynamicBatchSize | None) -> None:
        self.dyn, self.sizes = dyn, []

    def on_validation_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
        if self.dyn is not None:
            self.sizes.append(self.dyn.step.evaluation["fit"].size)


def main(out: Path, *, sized: bool) -> None:
    dyn = lt.DynamicBatchSize(adjust_every=2, probe=None) if sized else None
    checkpoint = ModelCheckpoint(dirpath=out / "checkpoints", monitor="val_loss")
    stopping = EarlyStopping(monitor="val_loss", patience=1, min_delta=0.05)
    writer, sizes = Indices(), Sizes(dyn)
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_epochs=6,
        callbacks=[c for c in (dyn, checkpoint, stopping, writer, sizes) if c is not None],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        deterministic=True,
    )
    rank = trainer.global_rank
    if dyn is not None:
        dyn.probe = finetune()
    module = Tagger(lr=0.5, fail_above=40 if rank == 1 and sized else None)
    trainer.fit(module)
    fitted = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val_")}
    trainer.validate(module, verbose=False)
    validated = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val_")}
    predictions = trainer.predict(module, return_predictions=True) or []
    payload = {
        "fitted": fitted,
        "validated": validated,
        "best": float(checkpoint.best_model_score or 0),
        "stopped_epoch": stopping.stopped_epoch,
        "index": torch.cat([p["index"] for p in predictions]).tolist(),
        "logits": torch.cat([p["logits"] for p in predictions]).flatten().tolist(),
        "batch_indices": writer.batches,
        "epoch_indices": writer.epoch,
        "sizes": sizes.sizes,
        "eval_sizes": {} if dyn is None else {k: s.size for k, s in dyn.step.evaluation.items()},
        "oom_recoveries": 0 if dyn is None else sum(s.oom_recoveries for s in dyn.step.evaluation.values()),
    }
    finish_ddp(out, rank, payload)
