"""A run stopped halfway and resumed from its checkpoint uses the same LR at every step as an uninterrupted run."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

import lightning_tune as lt
from lightning_tune.lr import warmup_cosine_lr
from tests.helpers import LRRecorder, Regressor, make_trainer

VAL = [1.0, 0.9, 0.9, 0.9, 0.95, 0.9, 0.9, 0.9]


# Resuming mid-epoch is the point of the test; Lightning's warnings about it are expected.
@pytest.mark.filterwarnings(
    "ignore:.*ended before the epoch ended.*", "ignore:.*callbacks used to create the checkpoint.*"
)
@pytest.mark.parametrize(
    "schedule",
    [
        pytest.param(lambda: lt.WarmupCosine(warmup_ratio=0.2, min_lr=1e-4), id="warmup-cosine"),
        pytest.param(lambda: lt.OneCycle(max_lr=0.2, three_phase=True, pct_start=0.2), id="one-cycle"),
        pytest.param(lambda: lt.LinearWarmup(warmup_steps=9), id="linear-warmup"),
    ],
)
def test_resume_mid_epoch_gives_the_same_lr_at_every_step(tmp_path: Path, schedule) -> None:  # type: ignore[no-untyped-def]
    def run(callbacks: list, ckpt_path: str | None = None) -> LRRecorder:
        rec = LRRecorder()
        trainer = make_trainer(
            tmp_path,
            [schedule(), lt.AdaptiveLROnPlateau(patience=1, factor=0.5, min_lr=0.0), rec, *callbacks],
            max_epochs=len(VAL),
            limit_train_batches=10,
            limit_val_batches=1,
            accumulate_grad_batches=2,
            enable_checkpointing=bool(callbacks),
        )
        trainer.fit(Regressor(lr=0.1, val_losses=VAL), ckpt_path=ckpt_path)
        return rec

    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=13, save_top_k=-1)
    full = run([checkpoint])
    assert len(full.lrs) == 40
    saved = sorted((tmp_path / "ckpt").glob("*step=13.ckpt"))
    assert saved, list((tmp_path / "ckpt").iterdir())
    resumed = run([], ckpt_path=str(saved[0]))  # step 13 is in the middle of epoch 2 (5 optimizer steps per epoch)
    assert len(resumed.lrs) == 40 - 13
    assert resumed.lrs == full.lrs[13:]
    assert len({lr[0] for lr in full.lrs}) > 10  # the schedule and the plateau both moved the LR


def _fit(tmp_path: Path, schedule: lt.callbacks.lr_schedule.ScheduleCallback, max_steps: int, **kwargs):  # type: ignore[no-untyped-def]
    rec = LRRecorder()
    callbacks = kwargs.pop("callbacks", [])
    ckpt_path = kwargs.pop("ckpt_path", None)
    trainer = make_trainer(tmp_path, [schedule, rec, *callbacks], max_steps=max_steps, **kwargs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(Regressor(lr=0.05), ckpt_path=ckpt_path)
    mine = [str(w.message) for w in caught if "resumes at optimizer step" in str(w.message)]
    return [lr[0] for lr in rec.lrs], mine


def _torch_one_cycle(max_lr: float, total: int) -> list[float]:
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=max_lr, total_steps=total)
    out = []
    for _ in range(total):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


@pytest.fixture(scope="module")
def saved_at_step_6(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[float]]:
    """A WarmupCosine(warmup_steps=5) run of 10 steps (length left to the Trainer), checkpointed at step 6."""
    tmp = tmp_path_factory.mktemp("resume_args")
    checkpoint = ModelCheckpoint(dirpath=tmp / "ckpt", every_n_train_steps=6, save_top_k=-1)
    lrs, _ = _fit(tmp, lt.WarmupCosine(warmup_steps=5), 10, callbacks=[checkpoint], enable_checkpointing=True)
    return next((tmp / "ckpt").glob("*step=6.ckpt")), lrs


@pytest.mark.filterwarnings("ignore:.*callbacks used to create the checkpoint.*", "ignore:.*not resumable.*")
@pytest.mark.parametrize(
    ("schedule", "max_steps", "expected", "warned"),
    [
        pytest.param(lambda: lt.WarmupCosine(warmup_steps=5), 10, None, False, id="same-arguments-continue"),
        pytest.param(lambda: lt.LinearWarmup(5), 10, [0.05] * 4, True, id="linear-warmup-followed"),
        pytest.param(
            lambda: lt.OneCycle(max_lr=0.5, cycle_momentum=False),
            10,
            _torch_one_cycle(0.5, 10)[6:],
            True,
            id="one-cycle-followed",
        ),
        pytest.param(
            lambda: lt.WarmupCosine(warmup_steps=5),
            20,
            [warmup_cosine_lr(s, base_lr=0.05, warmup_steps=5, total_steps=20) for s in range(6, 20)],
            False,
            id="longer-run-stretches-the-schedule",
        ),
    ],
)
def test_resume_follows_the_arguments_it_is_resumed_with(  # type: ignore[no-untyped-def]
    tmp_path: Path, saved_at_step_6, schedule, max_steps: int, expected: list[float] | None, warned: bool
) -> None:
    ckpt, full = saved_at_step_6
    lrs, messages = _fit(tmp_path, schedule(), max_steps, ckpt_path=str(ckpt))
    assert lrs == pytest.approx(full[6:] if expected is None else expected, rel=1e-12, abs=1e-15)
    assert len(messages) == (1 if warned else 0), messages
    if warned:  # names both schedules and the LR before and after
        assert "Checkpoint: factor warmup_cosine(warmup_steps=5, total_steps=10, " in messages[0]
        assert f"LR of group 0 goes from {full[6]:.4g} to {lrs[0]:.4g}" in messages[0]
