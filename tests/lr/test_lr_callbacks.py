"""Schedule callbacks on a real Trainer, checked against torch's schedulers."""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import LearningRateMonitor
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset

import lightning_tune as lt
from lightning_tune.lr import warmup_cosine_lr
from tests.helpers import LRRecorder, Regressor, csv_rows, make_trainer, regression_data


def _torch_reference(scheduler_cls: type, lrs: list[float], steps: int, optimizer: str = "adamw", **kwargs: object):
    params = [{"params": [torch.zeros(1, requires_grad=True)], "lr": lr} for lr in lrs]
    opt = torch.optim.AdamW(params) if optimizer == "adamw" else torch.optim.SGD(params, momentum=0.9)
    sched = scheduler_cls(opt, **kwargs)
    out = []
    for _ in range(steps):
        out.append([g["lr"] for g in opt.param_groups])
        opt.step()
        sched.step()
    return out


@pytest.mark.parametrize("accumulate", [1, 3])
def test_one_cycle_equals_torch_per_optimizer_step_with_accumulation(tmp_path: Path, accumulate: int) -> None:
    rec = LRRecorder()
    trainer = make_trainer(tmp_path, [lt.OneCycle(max_lr=0.1), rec], max_epochs=2, accumulate_grad_batches=accumulate)
    trainer.fit(Regressor(optimizer="adamw", lr=1e-2))
    steps = math.ceil(16 / accumulate) * 2  # 16 batches per epoch
    assert trainer.global_step == steps and len(rec.lrs) == steps  # stepped once per optimizer step, not per batch
    assert rec.batches == 32
    expected = _torch_reference(torch.optim.lr_scheduler.OneCycleLR, [1e-2], steps, max_lr=0.1, total_steps=steps)
    assert [lr for (lr,) in rec.lrs] == pytest.approx([lr for (lr,) in expected], rel=1e-12)  # to rounding
    assert rec.lrs[-1][0] == pytest.approx(0.1 / 25 / 1e4, rel=1e-3)  # the schedule ends where the run ends


def test_one_cycle_keeps_group_ratios_and_equals_torch_given_per_group_peaks(tmp_path: Path) -> None:
    rec = LRRecorder()
    trainer = make_trainer(tmp_path, [lt.OneCycle(max_lr=0.2, pct_start=0.25), rec], max_steps=20)
    trainer.fit(Regressor(group_lrs=[0.02, 0.005]))
    expected = _torch_reference(
        torch.optim.lr_scheduler.OneCycleLR,
        [0.02, 0.005],
        20,
        optimizer="sgd",
        max_lr=[0.2, 0.05],
        total_steps=20,
        pct_start=0.25,
    )
    for got, want in zip(rec.lrs, expected, strict=True):
        assert got == pytest.approx(want, rel=1e-12)
    assert all(a == pytest.approx(4 * b) for a, b in rec.lrs)
    # SGD momentum is cycled too, as torch does by default
    assert rec.momenta[0] == [0.95, 0.95] and min(m[0] for m in rec.momenta) == pytest.approx(0.85, abs=1e-3)


def test_warmup_cosine_uses_the_formula_over_the_trainers_real_length(tmp_path: Path) -> None:
    rec = LRRecorder()
    trainer = make_trainer(tmp_path, [lt.WarmupCosine(warmup_ratio=0.1, min_lr=0.001), rec], max_epochs=3)
    trainer.fit(Regressor(group_lrs=[0.05, 0.01]))
    total = 48  # 3 epochs x 16 batches: total_steps=None means what the Trainer runs
    warmup = math.ceil(0.1 * total)
    assert len(rec.lrs) == total
    for step, (lr0, lr1) in enumerate(rec.lrs):
        assert lr0 == pytest.approx(
            warmup_cosine_lr(step, base_lr=0.05, warmup_steps=warmup, total_steps=total, min_lr=0.001)
        )
        assert lr1 == pytest.approx(lr0 / 5)  # the second group keeps its ratio, floor included
    assert rec.lrs[warmup][0] == pytest.approx(0.05)


def test_linear_warmup_then_configured_lr(tmp_path: Path) -> None:
    rec = LRRecorder()
    trainer = make_trainer(tmp_path, [lt.LinearWarmup(warmup_steps=4), rec], max_steps=8)
    trainer.fit(Regressor(lr=0.08))
    assert [r[0] for r in rec.lrs] == pytest.approx([0.0, 0.02, 0.04, 0.06, 0.08, 0.08, 0.08, 0.08])


def test_existing_scheduler_is_an_error_unless_replace(tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path, [lt.WarmupCosine(warmup_steps=2)], max_steps=4)
    with pytest.raises(
        MisconfigurationException, match=r"already returns a learning-rate scheduler \(StepLR\).*replace=True"
    ):
        trainer.fit(Regressor(scheduler=True))
    rec = LRRecorder()
    trainer = make_trainer(tmp_path, [lt.WarmupCosine(warmup_steps=2, total_steps=6, replace=True), rec], max_steps=6)
    trainer.fit(Regressor(scheduler=True, lr=0.1))
    assert [r[0] for r in rec.lrs] == pytest.approx(
        [warmup_cosine_lr(s, base_lr=0.1, warmup_steps=2, total_steps=6) for s in range(6)]
    )
    assert len(trainer.lr_scheduler_configs) == 1


def test_two_schedules_on_one_optimizer_conflict(tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path, [lt.LinearWarmup(warmup_steps=2), lt.OneCycle(max_lr=0.1)], max_steps=4)
    with pytest.raises(MisconfigurationException, match="already returns a learning-rate scheduler"):
        trainer.fit(Regressor())


def test_manual_optimization_is_refused_clearly(tmp_path: Path) -> None:
    class Manual(Regressor):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
            opt = self.optimizers()
            loss = super().training_step(batch, batch_idx)
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()

    trainer = make_trainer(tmp_path, [lt.WarmupCosine(warmup_steps=1)], max_steps=3)
    with pytest.raises(MisconfigurationException, match="uses manual optimization"):
        trainer.fit(Manual())


class _Stream(IterableDataset):
    """Samples with no length, as a streaming dataset gives them."""

    def __iter__(self):  # type: ignore[no-untyped-def]
        yield from regression_data(16)


class _OnData(Regressor):
    def __init__(self, data: Dataset) -> None:
        super().__init__()
        self.data = data

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=4)


@pytest.mark.parametrize(
    ("data", "trainer_kwargs", "reason"),
    [
        pytest.param(
            regression_data(16),
            {"max_epochs": -1},
            "the Trainer runs without end (max_epochs=-1, max_steps=-1); set `max_steps` or `max_epochs`",
            id="unbounded",
        ),
        pytest.param(
            _Stream(),
            {"max_epochs": 2},
            "the training DataLoader has no length (an IterableDataset without `__len__`), so the Trainer cannot count "
            "an epoch's steps and `max_epochs=2` does not bound them; set `max_steps`, give the dataset a `__len__`",
            id="iterable-dataset",
        ),
        pytest.param(
            TensorDataset(torch.zeros(0, 8), torch.zeros(0, 1)),
            {"max_epochs": 2},
            "the training DataLoader yields no batches (an empty dataset, or `limit_train_batches` of 0), so there is "
            "no optimizer step to schedule; give the run training data",
            id="empty-dataset",
        ),
    ],
)
def test_a_run_of_unknown_length_is_refused_with_its_reason_and_fix(
    tmp_path: Path, data: Dataset, trainer_kwargs: dict[str, int], reason: str
) -> None:
    trainer = make_trainer(tmp_path, [lt.WarmupCosine(warmup_steps=1)], **trainer_kwargs)
    with pytest.raises(MisconfigurationException) as caught:
        trainer.fit(_OnData(data))
    assert str(caught.value) == (
        f"WarmupCosine could not tell how many optimizer steps this run will take: {reason}, or pass `total_steps=` "
        "to WarmupCosine."
    )


@pytest.mark.parametrize(
    ("callback", "reference"),
    [
        pytest.param(lambda: lt.WarmupCosine(), "get_cosine_schedule_with_warmup", id="cosine"),
        pytest.param(lambda: lt.WarmupPolynomial(), "get_linear_schedule_with_warmup", id="linear"),
    ],
)
def test_no_warmup_argument_warms_up_for_two_percent_of_the_run(tmp_path: Path, callback, reference: str) -> None:  # type: ignore[no-untyped-def]
    """torchtitan's default proportion (200 of 10,000 steps): 2 steps of 100, against Hugging Face's schedule."""
    import transformers

    rec = LRRecorder()
    make_trainer(tmp_path, [callback(), rec], max_steps=100).fit(Regressor(lr=0.1))
    expected = _torch_reference(
        getattr(transformers, reference), [0.1], 100, num_warmup_steps=2, num_training_steps=100
    )
    assert [lr for (lr,) in rec.lrs] == pytest.approx([lr for (lr,) in expected], rel=1e-12, abs=1e-15)
    rec = LRRecorder()
    make_trainer(tmp_path, [callback(), rec], max_steps=1).fit(Regressor(lr=0.1))  # a one-step run: no warm-up
    assert rec.lrs == [[0.1]]


@pytest.mark.parametrize(
    ("callback", "message"),
    [
        pytest.param(
            lambda: lt.WarmupCosine(warmup_steps=2, min_lr=0.5),
            r"`min_lr` of WarmupCosine must not exceed",
            id="min-lr-above-base",
        ),
        pytest.param(
            lambda: lt.WarmupCosine(warmup_steps=50),
            r"warm-up of WarmupCosine \(50 steps\) must be shorter",
            id="warmup-longer-than-run",
        ),
        pytest.param(
            lambda: lt.OneCycle(max_lr=[0.1, 0.2, 0.3]),
            r"`max_lr` of OneCycle has 3 values but the optimizer has 1",
            id="max-lr-groups",
        ),
        pytest.param(
            lambda: lt.AdaptiveLROnPlateau(min_lr=0.5),
            r"`min_lr` of AdaptiveLROnPlateau \(0.5\) is above",
            id="plateau-min-lr",
        ),
    ],
)
def test_fit_time_configuration_errors(tmp_path: Path, callback, message: str) -> None:  # type: ignore[no-untyped-def]
    trainer = make_trainer(tmp_path, [callback()], max_steps=10)
    with pytest.raises(MisconfigurationException, match=message):
        trainer.fit(Regressor(lr=0.1))


def test_optimizer_without_momentum_needs_cycle_momentum_false(tmp_path: Path) -> None:
    class Adagrad(Regressor):
        def configure_optimizers(self):  # type: ignore[no-untyped-def]
            return torch.optim.Adagrad(self.parameters(), lr=0.1)

    with pytest.raises(MisconfigurationException, match="cycle_momentum=False"):
        make_trainer(tmp_path, [lt.OneCycle(max_lr=0.1)], max_steps=4).fit(Adagrad())
    rec = LRRecorder()
    make_trainer(tmp_path, [lt.OneCycle(max_lr=0.1, cycle_momentum=False), rec], max_steps=4).fit(Adagrad())
    assert len(rec.lrs) == 4


def test_lr_is_logged_per_group_and_learning_rate_monitor_agrees(tmp_path: Path) -> None:
    rec = LRRecorder()
    logger = CSVLogger(str(tmp_path), name="csv")
    trainer = make_trainer(
        tmp_path,
        [lt.WarmupCosine(warmup_steps=3), LearningRateMonitor(logging_interval="step"), rec],
        max_steps=12,
        logger=logger,
        log_every_n_steps=1,
    )
    trainer.fit(Regressor(group_lrs=[0.04, 0.02]))
    rows = csv_rows(logger.log_dir)
    ours = {int(r["step"]): (float(r["tune/lr"]), float(r["tune/lr/pg1"])) for r in rows if r.get("tune/lr")}
    monitor = {int(r["step"]): float(r["lr-SGD/pg1"]) for r in rows if r.get("lr-SGD/pg1")}
    assert sorted(ours) == list(range(13))  # each step's LR, then where the run ended, at the step count
    final = ours.pop(12)
    assert final == pytest.approx(tuple(g["lr"] for g in trainer.optimizers[0].param_groups))
    for step, (lr0, lr1) in ours.items():
        assert (lr0, lr1) == pytest.approx(tuple(rec.lrs[step]))
        assert monitor[step] == pytest.approx(lr0)  # Lightning's LearningRateMonitor sees the same schedule


def test_schedule_under_bf16_mixed_precision_and_accumulation(tmp_path: Path) -> None:
    rec = LRRecorder()
    trainer = make_trainer(
        tmp_path,
        [lt.WarmupCosine(warmup_steps=2, min_lr=0.001), rec],
        max_epochs=1,
        precision="bf16-mixed",
        accumulate_grad_batches=4,
    )
    trainer.fit(Regressor(lr=0.05, optimizer="adamw"))
    assert trainer.global_step == 4
    expected = [warmup_cosine_lr(s, base_lr=0.05, warmup_steps=2, total_steps=4, min_lr=0.001) for s in range(4)]
    assert [r[0] for r in rec.lrs] == pytest.approx(expected)


@pytest.mark.parametrize(
    ("callback", "final"),
    [
        pytest.param(lambda: lt.WarmupCosine(warmup_steps=1, total_steps=5), "0", id="warmup-cosine"),
        pytest.param(lambda: lt.OneCycle(max_lr=0.1, total_steps=3), "4e-07", id="one-cycle"),
    ],
)
def test_explicit_total_steps_shorter_than_the_run_warns_at_fit_start(tmp_path: Path, callback, final: str) -> None:  # type: ignore[no-untyped-def]
    made = callback()
    with pytest.warns(UserWarning, match=r"the Trainer will run 10") as caught:
        make_trainer(tmp_path, [made], max_steps=10).fit(Regressor())
    messages = [str(w.message) for w in caught if "the Trainer will run" in str(w.message)]
    assert len(messages) == 1
    steps = made.total_steps
    assert f"total_steps={steps}) ends after {steps} optimizer steps" in messages[0]
    assert f"the last {10 - steps} steps stay at the schedule's final LR ({final})" in messages[0]


def test_explicit_total_steps_covering_the_run_is_quiet(tmp_path: Path) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer(tmp_path, [lt.WarmupCosine(warmup_steps=1, total_steps=10)], max_steps=10).fit(Regressor())
    assert not [w for w in caught if "the Trainer will run" in str(w.message)]
