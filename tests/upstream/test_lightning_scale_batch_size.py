"""Parity with Lightning's ``BatchSizeFinder`` (``tests/tests_pytorch/tuner/test_scale_batch_size.py``).

Lightning's finder (``Tuner.scale_batch_size``, modes ``"power"`` and ``"binsearch"``, ``init_val``, ``max_trials``)
and :func:`lightning_tune.find_batch_size` are run against the same limit: a training step that raises CUDA's
out-of-memory error above 45 samples, on the CPU. The engine must find the largest size that fits on its grid.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.tuner import Tuner
from torch import nn
from torch.utils.data import DataLoader

import lightning_tune as lt
from lightning_tune.batch import BatchSizeController

LIMIT = 45  # the largest batch that fits


def step(batch: torch.Tensor, layer: nn.Module) -> torch.Tensor:
    if batch.shape[0] > LIMIT:
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB.")
    return layer(batch).sum()


class Model(LightningModule):
    def __init__(self, batch_size: int = 2) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.layer = nn.Linear(4, 1)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return step(batch, self.layer)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(torch.randn(512, 4), batch_size=self.batch_size)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def lightning_finds(mode: str, tmp_path: Path) -> int:
    trainer = Trainer(
        accelerator="cpu",
        max_epochs=1,
        default_root_dir=tmp_path,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    found = Tuner(trainer).scale_batch_size(Model(), mode=mode, init_val=2, max_trials=25, steps_per_trial=1)
    assert found is not None
    return found


def try_batch(size: int) -> bool:
    """One training step at ``size``, as the finder runs one: the step's out-of-memory error means "does not fit"."""
    layer = nn.Linear(4, 1)
    step(torch.randn(size, 4), layer).backward()
    return True


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore")
def test_engine_finds_the_largest_size_lightnings_finder_misses(tmp_path: Path) -> None:
    lightning = lightning_finds("binsearch", tmp_path)  # doubles to 64, which fails, then bisects
    ours = lt.find_batch_size(try_batch, mode="binsearch", init_val=2, max_trials=25)
    assert lightning < ours.batch_size == LIMIT  # every size up to the limit fits, the next does not
    assert dict(ours.trials)[LIMIT] and not dict(ours.trials)[LIMIT + 1]
    power = lt.find_batch_size(try_batch, mode="power", init_val=2, max_trials=25)
    assert power.batch_size == 32  # the doubling alone stops at the last power of two, as Lightning's power mode
    assert power.trials == ours.trials[: len(power.trials)]


def test_engine_stays_on_the_controllers_grid() -> None:
    """DynamicBatchSize's grid (multiples of 8): 40, the largest multiple of 8 that fits, in 8 trials."""
    grid = BatchSizeController(target=0.9, min_batch_size=1, max_batch_size=None, multiple_of=8)
    found = lt.find_batch_size(try_batch, controller=grid)
    assert found.batch_size == 40
    assert all(size % 8 == 0 or size < 8 for size, _ in found.trials)
    assert len(found.trials) == 8


def test_a_failing_start_halves_until_one_fits_then_bisects() -> None:
    found = lt.find_batch_size(try_batch, init_val=200)
    assert found.batch_size == LIMIT
    assert [size for size, _ in found.trials[:3]] == [200, 100, 50]


def test_other_errors_propagate_and_nothing_fitting_is_an_error() -> None:
    def broken(size: int) -> bool:
        raise ValueError("mat1 and mat2 shapes cannot be multiplied")

    with pytest.raises(ValueError, match="mat1 and mat2"):
        lt.find_batch_size(broken)
    with pytest.raises(RuntimeError, match=r"no batch size fits from `init_val`=2 .*tried 2, 1"):
        lt.find_batch_size(lambda size: False)
