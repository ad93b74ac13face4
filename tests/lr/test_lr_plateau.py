"""AdaptiveLROnPlateau against torch's ReduceLROnPlateau, alone and composed with a schedule."""

from __future__ import annotations

import random
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback
from lightning.pytorch.loggers import Logger

import lightning_tune as lt
from lightning_tune.lr import PlateauDetector, warmup_cosine_lr
from tests.helpers import LRRecorder, Regressor, csv_rows, make_trainer

SEQUENCES = {
    "flat": [1.0] * 12,
    "improve-then-stall": [1.0, 0.9, 0.8, 0.8, 0.81, 0.8, 0.79, 0.8, 0.8, 0.8, 0.8, 0.9],
    "noisy": [round(1 + 0.1 * random.Random(3).uniform(-1, 1) - 0.01 * i, 4) for i in range(30)],
    "nan": [1.0, float("nan"), 0.9, float("nan"), float("nan"), 0.95, 0.95],
    "rising": [0.1 * i for i in range(15)],
}
CONFIGS = [
    pytest.param({"mode": "min", "patience": 2, "factor": 0.5}, id="min"),
    pytest.param({"mode": "max", "patience": 1, "factor": 0.3, "threshold": 0.05}, id="max-rel"),
    pytest.param(
        {"mode": "min", "patience": 0, "threshold_mode": "abs", "threshold": 0.02, "cooldown": 2}, id="abs-cooldown"
    ),
    pytest.param({"mode": "min", "patience": 1, "factor": 0.1, "min_lr": 2e-3}, id="floor"),
    pytest.param({"mode": "min", "patience": 1, "factor": 0.9, "eps": 3e-3}, id="eps"),
]


def _reference(values: list[float], lr: float, **kwargs: object) -> list[float]:
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=lr)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, **kwargs)  # type: ignore[arg-type]
    out = []
    for value in values:
        sched.step(value)
        out.append(opt.param_groups[0]["lr"])
    return out


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("name", sorted(SEQUENCES))
def test_detector_takes_torchs_decisions(name: str, config: dict) -> None:
    args = {k: v for k, v in config.items() if k in {"mode", "patience", "threshold", "threshold_mode", "cooldown"}}
    detector = PlateauDetector(**args)
    ours = []
    lr = 1.0
    for value in SEQUENCES[name]:
        if detector.update(value):
            lr *= 0.5
        ours.append(lr)
    assert ours == _reference(SEQUENCES[name], 1.0, factor=0.5, **args)
    if name == "flat":
        assert ours[-1] < 1.0  # the cases do exercise reductions


@pytest.mark.parametrize("config", CONFIGS)
def test_callback_lr_after_each_validation_equals_torch(tmp_path: Path, config: dict) -> None:
    values = SEQUENCES["improve-then-stall"] + SEQUENCES["flat"][:4]
    lrs_after: list[float] = []

    class Probe(lt.AdaptiveLROnPlateau):
        def on_train_epoch_end(self, trainer, pl_module):  # type: ignore[no-untyped-def]
            super().on_train_epoch_end(trainer, pl_module)
            lrs_after.append(trainer.optimizers[0].param_groups[0]["lr"])

    trainer = make_trainer(
        tmp_path,
        [Probe(monitor="val_loss", **config)],
        max_epochs=len(values),
        limit_val_batches=1,
        limit_train_batches=2,
    )
    trainer.fit(Regressor(lr=0.05, val_losses=values))
    reference_args = {"factor": 0.5, "patience": 5, "min_lr": 1e-6} | config  # the callback's defaults
    assert lrs_after == pytest.approx(_reference(values, 0.05, **reference_args), rel=1e-12)
    assert min(lrs_after) < 0.05


def test_reduction_multiplies_the_schedule_instead_of_being_overwritten(tmp_path: Path) -> None:
    values = [1.0] * 6  # patience 1: reductions after the 3rd and 5th evaluations
    rec = LRRecorder()
    plateau = lt.AdaptiveLROnPlateau(monitor="val_loss", patience=1, factor=0.5, min_lr=0.0)
    trainer = make_trainer(
        tmp_path,
        [lt.WarmupCosine(warmup_steps=4), plateau, rec],
        max_epochs=6,
        limit_train_batches=8,
        limit_val_batches=1,
    )
    trainer.fit(Regressor(lr=0.1, val_losses=values))
    total = 48
    reference_scale = [1.0]
    for reduce in _reference(values, 1.0, patience=1, factor=0.5):
        reference_scale.append(reduce)
    for step, (lr,) in enumerate(rec.lrs):
        epoch = step // 8
        scheduled = warmup_cosine_lr(step, base_lr=0.1, warmup_steps=4, total_steps=total)
        assert lr == pytest.approx(scheduled * reference_scale[epoch], rel=1e-9, abs=1e-15), step
    assert plateau.reductions == 2


def test_missing_metric_warns_once_naming_the_metrics_that_exist(tmp_path: Path) -> None:
    trainer = make_trainer(
        tmp_path, [lt.AdaptiveLROnPlateau(monitor="val_acc")], max_epochs=3, limit_train_batches=2, limit_val_batches=1
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(Regressor())
    ours = [w for w in caught if "AdaptiveLROnPlateau is monitoring 'val_acc'" in str(w.message)]
    assert len(ours) == 1
    assert "train_loss_epoch" in str(ours[0].message) and "val_loss" in str(ours[0].message)
    assert trainer.optimizers[0].param_groups[0]["lr"] == 0.05  # nothing adapted, nothing crashed


def test_decisions_are_logged_to_the_loggers(tmp_path: Path) -> None:
    from lightning.pytorch.loggers import CSVLogger

    logger = CSVLogger(str(tmp_path), name="csv")
    trainer = make_trainer(
        tmp_path,
        [lt.AdaptiveLROnPlateau(patience=0, factor=0.5)],
        max_epochs=3,
        limit_train_batches=2,
        limit_val_batches=1,
        logger=logger,
        log_every_n_steps=1,
    )
    trainer.fit(Regressor(val_losses=[1.0, 1.0, 1.0]))
    rows = csv_rows(logger.log_dir)
    reductions = [float(r["tune/plateau/reductions"]) for r in rows if r.get("tune/plateau/reductions")]
    assert reductions == [0.0, 1.0, 2.0]
    lrs = [float(r["tune/lr"]) for r in rows if r.get("tune/lr")]
    # the first evaluation sets the baseline; the second (end of epoch 1) reduces, the third would act on epoch 3;
    # the last row is where the run ended, the third reduction included
    assert lrs == pytest.approx(
        [0.05, 0.05, 0.05, 0.05, 0.025, 0.025, 0.0125]
    )  # logged by the plateau callback when no schedule is on


class Recorded(Logger):
    """Keeps every ``log_metrics`` call, with its step."""

    name, version = "memory", 0  # type: ignore[assignment]

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[int | None, dict[str, float]]] = []

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.calls.append((step, dict(metrics)))

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass


@pytest.mark.parametrize(
    ("schedule_logs", "plateau_first"),
    [
        pytest.param(True, False, id="schedule-logs"),
        pytest.param(True, True, id="schedule-logs-plateau-first"),
        pytest.param(False, False, id="plateau-logs"),
    ],
)
def test_a_schedule_and_the_plateau_callback_log_each_lr_once_per_step(
    tmp_path: Path, schedule_logs: bool, plateau_first: bool
) -> None:
    logger, rec = Recorded(), LRRecorder()
    plateau = lt.AdaptiveLROnPlateau(patience=0, factor=0.5, min_lr=0.0)
    callbacks = [lt.WarmupCosine(2, log_lr=schedule_logs), plateau]
    trainer = make_trainer(
        tmp_path,
        [*(callbacks[::-1] if plateau_first else callbacks), rec],
        max_epochs=3,
        limit_train_batches=3,
        limit_val_batches=1,
        logger=logger,
        log_every_n_steps=1,
    )
    trainer.fit(Regressor(group_lrs=[0.04, 0.02], val_losses=[1.0] * 3))
    assert plateau.reductions > 0  # the logged LRs are the reduced schedule's
    for key, group in (("tune/lr", 0), ("tune/lr/pg1", 1)):
        logged = [(step, metrics[key]) for step, metrics in logger.calls if key in metrics]
        assert [step for step, _ in logged] == list(range(10)), key  # 9 steps, then where the run ended
        expected = [lrs[group] for lrs in rec.lrs] + [trainer.optimizers[0].param_groups[group]["lr"]]
        assert [value for _, value in logged] == pytest.approx(expected, rel=1e-12), key


def test_a_resume_with_another_patience_warns_and_uses_it(tmp_path: Path) -> None:
    values = [1.0] * 8  # no improvement after the first evaluation
    first = make_trainer(
        tmp_path, [lt.AdaptiveLROnPlateau(patience=5)], max_epochs=3, limit_train_batches=2, limit_val_batches=1
    )
    first.fit(Regressor(val_losses=values))
    first.save_checkpoint(tmp_path / "epoch3.ckpt")
    lrs_after: list[float] = []

    class Probe(Callback):  # after the plateau callback: the LR each epoch ends with
        def on_train_epoch_end(self, trainer, pl_module):  # type: ignore[no-untyped-def]
            lrs_after.append(trainer.optimizers[0].param_groups[0]["lr"])

    callbacks = [lt.AdaptiveLROnPlateau(patience=1), Probe()]
    resumed = make_trainer(tmp_path, callbacks, max_epochs=8, limit_train_batches=2, limit_val_batches=1)
    with pytest.warns(UserWarning) as record:
        resumed.fit(Regressor(val_losses=values), ckpt_path=tmp_path / "epoch3.ckpt")
    ours = [str(w.message) for w in record if "AdaptiveLROnPlateau" in str(w.message)]
    assert ours == [
        "AdaptiveLROnPlateau: resumed with other arguments than the checkpoint's, which are used from here on: "
        "patience 5 -> 1 (2 evaluations without improvement so far)"
    ]
    # torch's ReduceLROnPlateau, its patience changed after the same three evaluations
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.05)
    reference = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=5, factor=0.5, min_lr=1e-6)
    for value in values[:3]:
        reference.step(value)
    reference.patience = 1
    expected = []
    for value in values[3:]:
        reference.step(value)
        expected.append(opt.param_groups[0]["lr"])
    assert lrs_after == pytest.approx(expected, rel=1e-12)
    assert expected[0] == 0.025  # the new patience acts at once: 3 bad evaluations > 1
