"""Parity with Lightning's ``LearningRateMonitor`` tests (``tests/tests_pytorch/callbacks/test_lr_monitor.py``).

A schedule of this package is a torch scheduler in the Trainer's configuration, so Lightning's own monitor must see it
as it sees ``StepLR`` in its cases: the names it expects (``lr-Adam/pg1``, ``lr-Adam/pg2`` for two parameter groups;
``lr-SGD-momentum`` with ``log_momentum=True``), as many values as its cases count (``global_step //
log_every_n_steps``), and each value the one the schedule gives the optimizer at that step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import LearningRateMonitor
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.loggers import CSVLogger

import lightning_tune as lt
from lightning_tune.lr import one_cycle_lr, one_cycle_momentum, warmup_cosine_lr
from tests.helpers import csv_rows, make_trainer

STEPS, LOG_EVERY = 12, 2  # a step is logged when (step + 1) % LOG_EVERY == 0, Lightning's rule
LOGGED = [step for step in range(STEPS) if (step + 1) % LOG_EVERY == 0]


class TwoGroups(BoringModel):
    """Lightning's ``test_lr_monitor_param_groups`` optimizer: Adam over two groups, the first at a tenth of the LR."""

    lr = 0.02

    def configure_optimizers(self) -> Any:
        first, *rest = self.parameters()
        return torch.optim.Adam([{"params": [first], "lr": self.lr * 0.1}, {"params": rest, "lr": self.lr}])


class Sgd(BoringModel):
    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def fit(tmp_path: Path, model: BoringModel, schedule: Any, monitor: LearningRateMonitor) -> list[dict[str, str]]:
    """Train ``STEPS`` steps; the rows the logger wrote."""
    logger = CSVLogger(str(tmp_path))
    trainer = make_trainer(tmp_path, [schedule, monitor], max_steps=STEPS, log_every_n_steps=LOG_EVERY, logger=logger)
    trainer.fit(model)
    assert trainer.global_step == STEPS
    return csv_rows(logger.log_dir)


@pytest.mark.filterwarnings(r"ignore:WarmupCosine\(min_lr=")  # the note on per-group floors
def test_two_parameter_groups_under_warmup_cosine(tmp_path: Path) -> None:
    monitor = LearningRateMonitor()
    fit(tmp_path, TwoGroups(), lt.WarmupCosine(warmup_steps=3, min_lr=1e-3, log_lr=False), monitor)
    assert list(monitor.lrs) == ["lr-Adam/pg1", "lr-Adam/pg2"]  # Lightning's names for two groups
    assert all(len(values) == STEPS // LOG_EVERY for values in monitor.lrs.values())  # and its count
    for key, peak in (("lr-Adam/pg1", 0.002), ("lr-Adam/pg2", 0.02)):
        floor = 1e-3 * peak / 0.02  # the floor of the largest group, the others' in proportion
        expected = [
            warmup_cosine_lr(step, base_lr=peak, warmup_steps=3, total_steps=STEPS, min_lr=floor) for step in LOGGED
        ]
        assert monitor.lrs[key] == pytest.approx(expected, rel=1e-6), key


def test_momentum_under_one_cycle(tmp_path: Path) -> None:
    monitor = LearningRateMonitor(log_momentum=True)
    rows = fit(tmp_path, Sgd(), lt.OneCycle(max_lr=0.1, log_lr=False), monitor)
    assert list(monitor.lrs) == ["lr-SGD"]
    assert monitor.lrs["lr-SGD"] == pytest.approx([one_cycle_lr(s, max_lr=0.1, total_steps=STEPS) for s in LOGGED])
    logged = [(int(row["step"]), float(row["lr-SGD-momentum"])) for row in rows if row.get("lr-SGD-momentum")]
    assert logged == [(step, pytest.approx(one_cycle_momentum(step, total_steps=STEPS))) for step in LOGGED]
