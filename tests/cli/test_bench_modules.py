"""LightningModules the bench tests load by name (``tests.cli.test_bench_modules:ClockedModule``); no tests here.

``ClockedModule`` runs on a fake clock: each training or predict step moves :data:`CLOCK` forward by the next of
its ``durations_ms``, and the tests make the monitor read that clock, so every figure of a sweep is exact.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import LightningDataModule, LightningModule
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

SEQ = 8
VOCAB = 16


class FakeClock:
    """A ``perf_counter`` stand-in that moves only when a step says so."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def advance_ms(self, ms: float) -> None:
        self.now += ms / 1000.0


CLOCK = FakeClock()


def token_data(n: int) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randint(0, VOCAB, (n, SEQ), generator=g), torch.randn(n, 1, generator=g))


class ClockedModule(LightningModule):
    """Token ids ``(batch, 8)`` -> embedding -> linear; every step takes the next of ``durations_ms`` on CLOCK.

    ``ms_per_sample``: each step takes that much longer per sample, so latency grows with the batch size.
    ``oom_above``: a step with more samples raises ``torch.OutOfMemoryError``; ``fail_above``: raises ValueError.
    """

    def __init__(
        self,
        batch_size: int = 2,
        durations_ms: list[float] | None = None,
        ms_per_sample: float = 0.0,
        oom_above: int | None = None,
        fail_above: int | None = None,
    ) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.durations_ms = list(durations_ms or [10.0])
        self.ms_per_sample = ms_per_sample
        self.oom_above = oom_above
        self.fail_above = fail_above
        self.calls = 0
        self.embed = nn.Embedding(VOCAB, 4)
        self.head = nn.Linear(4, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids).mean(dim=1))

    def _tick(self, samples: int) -> None:
        if self.oom_above is not None and samples > self.oom_above:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        if self.fail_above is not None and samples > self.fail_above:
            raise ValueError(f"this module cannot take {samples} samples")
        CLOCK.advance_ms(self.durations_ms[min(self.calls, len(self.durations_ms) - 1)] + self.ms_per_sample * samples)
        self.calls += 1

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids, y = batch
        self._tick(len(ids))
        return nn.functional.mse_loss(self(ids), y)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids, _ = batch
        self._tick(len(ids))
        return self(ids)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(token_data(64 * self.batch_size), batch_size=self.batch_size)

    def predict_dataloader(self) -> DataLoader:
        return DataLoader(token_data(64 * self.batch_size), batch_size=self.batch_size)


class NoBatchSize(ClockedModule):
    """Keeps its batch size under another name: bench cannot set it."""

    def __init__(self) -> None:
        super().__init__()
        del self.batch_size
        self.per_device = 2

    def train_dataloader(self) -> DataLoader:
        return DataLoader(token_data(16), batch_size=self.per_device)


class IgnoresBatchSize(ClockedModule):
    """Has a batch_size attribute but its dataloader always yields 3 samples."""

    def train_dataloader(self) -> DataLoader:
        return DataLoader(token_data(192), batch_size=3)


class NeedsArguments(ClockedModule):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.width = width


class TrainOnly(ClockedModule):
    """Defines no predict_dataloader (it cannot be benchmarked in predict mode on its own)."""

    predict_dataloader = LightningModule.predict_dataloader  # type: ignore[assignment]


class ModelWithoutData(ClockedModule):
    """Gets its data (and batch size) from :class:`TokenData`."""

    def __init__(self) -> None:
        super().__init__()
        del self.batch_size

    train_dataloader = LightningModule.train_dataloader  # type: ignore[assignment]
    predict_dataloader = LightningModule.predict_dataloader  # type: ignore[assignment]


class TokenData(LightningDataModule):
    def __init__(self, batch_size: int = 1) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.batch_size = batch_size

    def train_dataloader(self) -> DataLoader:
        return DataLoader(token_data(64 * self.batch_size), batch_size=self.batch_size)

    def predict_dataloader(self) -> DataLoader:
        return DataLoader(token_data(64 * self.batch_size), batch_size=self.batch_size)
