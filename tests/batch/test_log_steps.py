"""Every key of the pack stands on Lightning's step numbering, so its curves overlay ``self.log``'s in a logger."""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import LearningRateMonitor
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_tune as lt
from lightning_tune import keys


class Regression(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(4, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        x = torch.randn(400, 4, generator=torch.Generator().manual_seed(1))
        return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)


def steps_of(rows: list[dict[str, str]], key: str) -> list[int]:
    return [int(row["step"]) for row in rows if row.get(key)]


def test_pack_keys_stand_on_the_steps_of_self_log_and_the_final_lr_is_logged(tmp_path: Path) -> None:
    logger = CSVLogger(tmp_path, name="run", version=0)
    callbacks = [
        lt.DynamicBatchSize(probe=lt.SimulatedMemory(total_bytes=1 << 30, fixed_bytes=1 << 20, bytes_per_sample=1)),
        lt.ThroughputLatencyMonitor(gpu_stats=False),
        lt.WarmupCosine(warmup_steps=2, min_lr=1e-3),
        LearningRateMonitor(),
    ]
    trainer = Trainer(
        default_root_dir=tmp_path,
        logger=logger,
        callbacks=callbacks,
        max_steps=23,  # the last step is no logging step
        log_every_n_steps=5,
        accumulate_grad_batches=2,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
    )
    trainer.fit(Regression())
    with open(Path(logger.log_dir) / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    loss_steps = steps_of(rows, "train_loss")
    assert loss_steps == [4, 9, 14, 19]
    for key in (keys.BATCH_SIZE, keys.EFFECTIVE_BATCH_SIZE, keys.SAMPLES_PER_SEC, keys.BATCHES_PER_SEC, "lr-SGD"):
        assert steps_of(rows, key) == loss_steps, key
    # tune/lr: on the same steps, with the LR LearningRateMonitor shows for them, then where the run ended
    assert steps_of(rows, keys.LR) == [*loss_steps, 23]
    ours = [float(row[keys.LR]) for row in rows if row.get(keys.LR)]
    theirs = [float(row["lr-SGD"]) for row in rows if row.get("lr-SGD")]
    assert ours[:-1] == pytest.approx(theirs)
    # the cosine's own formula (docs/lr_schedules.md) at the end of its 23 steps: the floor
    at = lambda s: 1e-3 + (0.1 - 1e-3) * 0.5 * (1 + math.cos(math.pi * (s - 2) / 21))  # noqa: E731
    assert ours == pytest.approx([at(s) for s in loss_steps] + [1e-3])


def test_a_cut_steps_logs_combine_as_lightning_takes_them_without_reading_a_signature_each_step() -> None:
    from unittest import mock

    from lightning_tune.batch import logs

    logged: list[tuple[str, float, dict[str, Any]]] = []

    class Module:
        def log(self, name: str, value: Any, prog_bar: bool = False, reduce_fx: Any = "mean", **_: Any) -> None:
            logged.append((name, float(value), {"prog_bar": prog_bar, "reduce_fx": reduce_fx}))

    module, step_logs = Module(), logs.StepLogs()
    with mock.patch.object(logs.inspect, "signature", wraps=logs.inspect.signature) as signature:
        for _ in range(3):  # three steps of two micro-batches: the first weighs 3/4
            with step_logs.collecting(module):
                step_logs.weight = 0.75
                module.log("loss", torch.tensor(2.0), True)  # positionally, as Lightning's log takes it
                module.log("peak", 1.0, reduce_fx="max")
                step_logs.weight = 0.25
                module.log(name="loss", value=torch.tensor(4.0), prog_bar=True)
                module.log("peak", 3.0, reduce_fx="max")
    assert signature.call_count <= 1  # read once, not once a step
    assert logged == 3 * [
        ("loss", 2.5, {"prog_bar": True, "reduce_fx": "mean"}),
        ("peak", 3.0, {"prog_bar": False, "reduce_fx": "max"}),
    ]
    with pytest.raises(TypeError), step_logs.collecting(module):
        module.log("loss")  # a call `log` does not take: its own error
