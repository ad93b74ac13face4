"""Resuming twice through a checkpoint at an epoch's last batch trains what the uninterrupted run trains.

Lightning 2.6.6 alone, resumed from a step checkpoint taken at an epoch's last batch, writes later checkpoints one
epoch behind; a second resume from one of them then repeats or skips batches (``docs/dynamic_batch.md``, "Resuming
twice through an epoch's last batch"). With DynamicBatchSize the counter is set right.
"""

from __future__ import annotations

import collections
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, Dataset

import lightning_tune as lt

EPOCHS, SAMPLES, BATCH = 4, 64, 4  # 16 optimizer steps an epoch, 64 in all


class Indexed(Dataset):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(SAMPLES, 8, generator=g)
        self.y = self.x @ torch.randn(8, 1, generator=g)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.x[i], self.y[i], i


class Net(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, _ = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(Indexed(), batch_size=BATCH, shuffle=True)


class Seen(Callback):
    """The samples each epoch trained, as (epoch, index) pairs, over all runs of a chain."""

    def __init__(self) -> None:
        self.seen: collections.Counter[tuple[int, int]] = collections.Counter()

    def on_train_batch_end(self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.seen.update((trainer.current_epoch, int(i)) for i in batch[2])


def fit(
    tmp_path: Path, callbacks: list[Callback], *, ckpt: str | None = None, every: int = 0, max_steps: int = -1
) -> tuple[Net, Trainer]:
    torch.manual_seed(1)  # the shuffle's seed: drawn again by each resumed run, as a process restarted
    saving = [ModelCheckpoint(tmp_path / "ckpt", filename="{step}", every_n_train_steps=every, save_top_k=-1)]
    trainer = Trainer(
        default_root_dir=tmp_path,
        callbacks=[*callbacks, *(saving if every else [])],
        max_epochs=EPOCHS,
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=bool(every) or any(isinstance(c, ModelCheckpoint) for c in callbacks),
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        devices=1,
    )
    model = Net()
    trainer.fit(model, ckpt_path=ckpt)
    return model, trainer


def resume_twice(tmp_path: Path, seen: Seen, pack: bool) -> tuple[Net, Trainer]:
    """Stop at epoch 0's last batch (step 16), resume and stop mid-epoch 1 (step 24), resume to the end."""

    def callbacks() -> list[Callback]:
        return [seen, *([lt.DynamicBatchSize()] if pack else [])]

    ckpt = tmp_path / "ckpt"
    fit(tmp_path, callbacks(), every=16, max_steps=16)
    fit(tmp_path, callbacks(), ckpt=str(ckpt / "step=16.ckpt"), every=8, max_steps=24)
    return fit(tmp_path, callbacks(), ckpt=str(ckpt / "step=24.ckpt"))


def test_lightning_alone_repeats_batches_after_resuming_twice_through_an_epochs_last_batch(tmp_path: Path) -> None:
    """The upstream defect the pack corrects: when this fails, Lightning fixed it and the correction can go."""
    seen = Seen()
    _, trainer = resume_twice(tmp_path, seen, pack=False)
    assert trainer.global_step == EPOCHS * 16 + 8  # epoch 1's first 8 batches trained twice
    assert max(seen.seen.values()) == 2


def test_resuming_twice_through_an_epochs_last_batch_trains_the_uninterrupted_run(tmp_path: Path) -> None:
    seen = Seen()
    reference, uninterrupted = fit(tmp_path / "uninterrupted", [seen, lt.DynamicBatchSize()])
    assert set(seen.seen.values()) == {1} and len(seen.seen) == EPOCHS * SAMPLES
    resumed = Seen()
    model, trainer = resume_twice(tmp_path, resumed, pack=True)
    assert resumed.seen == seen.seen  # each epoch's samples, each once
    assert trainer.global_step == uninterrupted.global_step == EPOCHS * 16
    middle = torch.load(tmp_path / "ckpt" / "step=24.ckpt", weights_only=False)
    assert middle["loops"]["fit_loop"]["epoch_progress"]["current"]["ready"] == 2  # epoch 1 runs
    for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)


def _one_behind(path: Path) -> None:
    """Write ``path`` again as Lightning 2.6.6 alone writes it after the resume: the running epoch not counted."""
    checkpoint = torch.load(path, weights_only=False)
    for counts in checkpoint["loops"]["fit_loop"]["epoch_progress"].values():
        counts["ready"], counts["started"] = counts["ready"] - 1, counts["started"] - 1
    del checkpoint["callbacks"]["DynamicBatchSize"]["epoch_counted"]  # as a version before the marker wrote it
    torch.save(checkpoint, path)


def test_a_checkpoint_written_one_epoch_behind_resumes_where_it_was_saved(tmp_path: Path) -> None:
    reference, _ = fit(tmp_path / "uninterrupted", [lt.DynamicBatchSize()])
    ckpt = tmp_path / "ckpt"
    fit(tmp_path, [lt.DynamicBatchSize()], every=16, max_steps=16)
    fit(tmp_path, [lt.DynamicBatchSize()], ckpt=str(ckpt / "step=16.ckpt"), every=8, max_steps=24)
    _one_behind(ckpt / "step=24.ckpt")
    model, trainer = fit(tmp_path, [lt.DynamicBatchSize()], ckpt=str(ckpt / "step=24.ckpt"))
    assert trainer.global_step == EPOCHS * 16
    for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)


def test_a_checkpoint_one_epoch_behind_without_the_packs_state_is_named_in_a_warning(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    fit(tmp_path, [], every=16, max_steps=16)
    fit(tmp_path, [], ckpt=str(ckpt / "step=16.ckpt"), every=8, max_steps=24)  # Lightning alone: one behind
    with pytest.warns(UserWarning, match=r"step=24\.ckpt was saved after 8 batches of epoch 1.*Add 1 to checkpoint"):
        fit(tmp_path, [lt.DynamicBatchSize()], ckpt=str(ckpt / "step=24.ckpt"), max_steps=25)


@pytest.mark.parametrize("save", ["epoch-end", "after-fit"])
def test_a_run_stopped_by_max_steps_mid_epoch_resumes_as_lightning_alone(tmp_path: Path, save: str) -> None:
    """Counters that look like the defect's but are right: the pack leaves them alone and warns about nothing."""

    def chain(root: Path, pack: bool) -> tuple[Seen, Trainer]:
        seen = Seen()
        callbacks: list[Callback] = [seen, *([lt.DynamicBatchSize()] if pack else [])]
        saving = [ModelCheckpoint(root / "ckpt", filename="{step}")] if save == "epoch-end" else []  # at epoch ends
        _, first = fit(root, [*callbacks, *saving], max_steps=24)  # stopped mid-epoch 1
        if save == "after-fit":
            first.save_checkpoint(root / "ckpt" / "step=24.ckpt")
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=".*epoch counter.*")
            _, trainer = fit(root, callbacks, ckpt=str(root / "ckpt" / "step=24.ckpt"))
        return seen, trainer

    alone, lightning = chain(tmp_path / "alone", pack=False)
    packed, ours = chain(tmp_path / "pack", pack=True)
    assert ours.global_step == lightning.global_step
    assert collections.Counter(e for e, _ in packed.seen.elements()) == collections.Counter(
        e for e, _ in alone.seen.elements()
    )  # the samples each epoch trained
