"""The pure schedules against references: the formula in numpy, and torch's own schedulers."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from lightning_tune.lr import (
    LinearWarmupSchedule,
    OneCycleSchedule,
    ScheduleLR,
    WarmupCosineSchedule,
    WarmupPolynomialSchedule,
    linear_warmup_lr,
    one_cycle_lr,
    warmup_cosine_lr,
)
from lightning_tune.lr.schedules import schedule_from_dict, schedule_to_dict


def _torch_sequence(optimizer: torch.optim.Optimizer, scheduler: object, steps: int, key: str = "lr") -> list[list]:
    out = []
    for _ in range(steps):
        out.append([g[key] if key != "beta1" else g["betas"][0] for g in optimizer.param_groups])
        optimizer.step()
        scheduler.step()  # type: ignore[attr-defined]
    return out


@pytest.mark.parametrize(
    ("base", "warmup", "total", "min_lr"),
    [
        pytest.param(3e-4, 20, 100, 3e-5, id="seed-config-scaled"),
        pytest.param(1.0, 0, 10, 0.0, id="no-warmup"),
        pytest.param(0.1, 1, 2, 0.01, id="shortest"),
        pytest.param(5e-3, 7, 33, 0.0, id="odd-lengths"),
    ],
)
def test_warmup_cosine_matches_the_formula(base: float, warmup: int, total: int, min_lr: float) -> None:
    steps = np.arange(total + 5)
    progress = np.clip((steps - warmup) / (total - warmup), 0.0, 1.0)
    expected = np.where(
        steps < warmup, base * steps / max(warmup, 1), min_lr + (base - min_lr) * 0.5 * (1 + np.cos(np.pi * progress))
    )
    got = [warmup_cosine_lr(int(s), base_lr=base, warmup_steps=warmup, total_steps=total, min_lr=min_lr) for s in steps]
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=0)
    assert got[warmup] == pytest.approx(base)  # peak exactly at the end of warm-up
    assert got[-1] == pytest.approx(min_lr)  # floor held after the end


def test_warmup_cosine_decay_equals_torch_cosine_annealing() -> None:
    base, warmup, total, min_lr = 0.1, 10, 60, 0.002
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=base)
    ref = _torch_sequence(
        opt, torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=total - warmup, eta_min=min_lr), 50
    )
    ours = [
        warmup_cosine_lr(warmup + k, base_lr=base, warmup_steps=warmup, total_steps=total, min_lr=min_lr)
        for k in range(50)
    ]
    np.testing.assert_allclose(ours, [r[0] for r in ref], rtol=1e-9)


def test_linear_warmup_then_constant() -> None:
    assert [linear_warmup_lr(s, base_lr=2.0, warmup_steps=4) for s in range(7)] == [0.0, 0.5, 1.0, 1.5, 2.0, 2.0, 2.0]


ONE_CYCLE_CASES = [
    pytest.param({}, 100, id="defaults"),
    pytest.param({"anneal_strategy": "linear"}, 57, id="linear"),
    pytest.param({"three_phase": True, "pct_start": 0.25}, 80, id="three-phase"),
    pytest.param({"div_factor": 10.0, "final_div_factor": 100.0, "pct_start": 0.1}, 31, id="factors"),
    pytest.param({"pct_start": 0.45, "three_phase": True, "anneal_strategy": "linear"}, 23, id="three-phase-linear"),
]


@pytest.mark.parametrize(("kwargs", "total"), ONE_CYCLE_CASES)
def test_one_cycle_equals_torch_one_cycle_lr_at_every_step(kwargs: dict, total: int) -> None:
    opt = torch.optim.AdamW([torch.zeros(1, requires_grad=True)], lr=1.0)
    ref_lr = _torch_sequence(
        opt, torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.3, total_steps=total, **kwargs), total
    )
    opt2 = torch.optim.AdamW([torch.zeros(1, requires_grad=True)], lr=1.0)
    ref_beta = _torch_sequence(
        opt2, torch.optim.lr_scheduler.OneCycleLR(opt2, max_lr=0.3, total_steps=total, **kwargs), total, "beta1"
    )

    ours = OneCycleSchedule(max_lrs=(0.3,), total_steps=total, base_momentums=(0.85,), max_momentums=(0.95,), **kwargs)
    assert [ours.lr_at(s, 0) for s in range(total)] == [r[0] for r in ref_lr]
    assert [ours.momentum_at(s, 0) for s in range(total)] == [r[0] for r in ref_beta]
    # Past the end the last value is kept rather than raising.
    assert ours.lr_at(total + 10, 0) == ours.lr_at(total - 1, 0)
    assert one_cycle_lr(0, max_lr=0.3, total_steps=total, **kwargs) == pytest.approx(
        0.3 / kwargs.get("div_factor", 25.0)
    )


def test_schedule_lr_preserves_group_ratios_and_fills_tensor_lrs() -> None:
    w1, w2 = torch.zeros(2, requires_grad=True), torch.zeros(2, requires_grad=True)
    opt = torch.optim.SGD([{"params": [w1], "lr": torch.tensor(0.2)}, {"params": [w2], "lr": 0.02}], lr=0.1)
    tensor_lr = opt.param_groups[0]["lr"]
    sched = ScheduleLR(
        opt, WarmupCosineSchedule(base_lrs=(0.2, 0.02), min_lrs=(0.02, 0.002), warmup_steps=3, total_steps=20)
    )
    for _ in range(15):
        opt.step()
        sched.step()
        lr0, lr1 = float(opt.param_groups[0]["lr"]), float(opt.param_groups[1]["lr"])
        assert lr0 == pytest.approx(10 * lr1)
    assert opt.param_groups[0]["lr"] is tensor_lr  # filled in place, never replaced


def test_schedule_state_round_trips_through_plain_data() -> None:
    for schedule in (
        WarmupCosineSchedule(base_lrs=(0.1, 0.2), min_lrs=(0.0, 0.0), warmup_steps=2, total_steps=9),
        LinearWarmupSchedule(base_lrs=(1.0,), warmup_steps=3),
        OneCycleSchedule(max_lrs=(0.1,), total_steps=10, three_phase=True, base_momentums=(0.8,), max_momentums=(0.9,)),
    ):
        data = schedule_to_dict(schedule)
        assert all(isinstance(v, (str, int, float, bool, list)) for v in data.values())
        assert schedule_from_dict(data) == schedule
    with pytest.raises(ValueError, match="unknown schedule kind 'nope'"):
        schedule_from_dict({"kind": "nope"})


def test_schedule_lr_checkpoint_loads_with_weights_only(tmp_path: object) -> None:
    opt = torch.optim.AdamW([torch.zeros(1, requires_grad=True)], lr=1.0)
    sched = ScheduleLR(opt, OneCycleSchedule(max_lrs=(0.1,), total_steps=10))
    for _ in range(4):
        opt.step()
        sched.step()
    path = f"{tmp_path}/s.pt"
    torch.save(sched.state_dict(), path)
    opt2 = torch.optim.AdamW([torch.zeros(1, requires_grad=True)], lr=1.0)
    fresh = ScheduleLR(opt2, LinearWarmupSchedule(base_lrs=(1.0,), warmup_steps=1))
    fresh.load_state_dict(torch.load(path, weights_only=True))
    assert fresh.schedule == sched.schedule and fresh.last_epoch == 4
    assert math.isclose(fresh.get_lr()[0], sched.get_lr()[0])


def _run(optimizer: torch.optim.Optimizer, scheduler: object, steps: int, at: int = -1, total: int = 0) -> list:
    """Each step's LR and ``beta1``; a :class:`ScheduleLR` is re-aimed at ``total`` steps once at step ``at``."""
    seen = []
    for step in range(steps):
        seen.append((float(optimizer.param_groups[0]["lr"]), optimizer.param_groups[0]["betas"][0]))
        optimizer.step()
        scheduler.step()  # type: ignore[attr-defined]
        if step + 1 == at:  # its LR for step `at` is set: the new length counts from the next step on
            scheduler.retarget(total)  # type: ignore[attr-defined]
    return seen


RETARGETS = [  # ours and torch's for a length; re-aimed at step `at` from `old` to `new` steps
    pytest.param(
        lambda total: WarmupCosineSchedule(base_lrs=(0.1,), min_lrs=(1e-3,), warmup_steps=0, total_steps=total),
        lambda opt, total: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=total, eta_min=1e-3),
        (4, 10, 25),
        id="cosine-longer",
    ),
    pytest.param(
        lambda total: WarmupCosineSchedule(base_lrs=(0.1,), min_lrs=(0.0,), warmup_steps=0, total_steps=total),
        lambda opt, total: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=total),
        (6, 30, 12),
        id="cosine-shorter",
    ),
    pytest.param(
        lambda total: WarmupPolynomialSchedule(
            base_lrs=(0.1,), min_lrs=(0.0,), warmup_steps=0, total_steps=total, power=2.0
        ),
        lambda opt, total: torch.optim.lr_scheduler.PolynomialLR(opt, total_iters=total, power=2.0),
        (5, 12, 20),
        id="polynomial",
    ),
    pytest.param(
        lambda total: OneCycleSchedule(
            max_lrs=(0.3,), total_steps=total, three_phase=True, base_momentums=(0.85,), max_momentums=(0.95,)
        ),
        lambda opt, total: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.3, total_steps=total, three_phase=True),
        (7, 40, 60),
        id="one-cycle-with-momentum",
    ),
]


@pytest.mark.parametrize(("ours", "theirs", "lengths"), RETARGETS)
def test_retargeted_schedule_lr_follows_torchs_scheduler_for_the_new_length(ours, theirs, lengths) -> None:  # noqa: ANN001
    """Re-aimed at step ``at``, the LR and ``beta1`` of every later step are torch's for the new length."""
    at, old, new = lengths
    opt = torch.optim.AdamW([torch.zeros(1, requires_grad=True)], lr=0.1)
    got = _run(opt, ScheduleLR(opt, ours(old)), new, at, new)
    ref = torch.optim.AdamW([torch.zeros(1, requires_grad=True)], lr=0.1)
    expected = _run(ref, theirs(ref, new), new)
    assert [lr for lr, _ in got[: at + 1]] == [ours(old).lr_at(s, 0) for s in range(at + 1)]  # the old one until then
    np.testing.assert_allclose(got[at + 1 :], expected[at + 1 :], rtol=1e-9, atol=1e-15)


def test_retarget_keeps_the_warm_up_and_never_ends_before_the_next_step() -> None:
    def cosine(total: int) -> WarmupCosineSchedule:
        return WarmupCosineSchedule(base_lrs=(0.2, 0.02), min_lrs=(0.02, 0.002), warmup_steps=5, total_steps=total)

    opt = torch.optim.SGD([{"params": [torch.zeros(1, requires_grad=True)], "lr": lr} for lr in (0.2, 0.02)])
    sched = ScheduleLR(opt, cosine(20))
    for _ in range(3):
        opt.step()
        sched.step()
    sched.retarget(40)  # in the warm-up: the warm-up keeps its 5 steps
    assert sched.schedule == cosine(40)
    for _ in range(6):
        opt.step()
        sched.step()
    sched.retarget(4)  # at step 9, shorter than where the run already is: it ends at the next step
    assert sched.schedule == cosine(10)
    sched.scale_group(1, 0.5)
    opt.step()
    sched.step()
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.02, 0.001], rel=1e-12)  # the floor, scale kept
    warmup = ScheduleLR(opt, LinearWarmupSchedule(base_lrs=(0.2, 0.02), warmup_steps=3))
    warmup.retarget(100)  # no length to change
    assert warmup.schedule == LinearWarmupSchedule(base_lrs=(0.2, 0.02), warmup_steps=3)
    with pytest.raises(ValueError, match=r"`total_steps` must be an integer >= 0, got -1"):
        sched.retarget(-1)


def test_schedule_lr_flags_are_configuration_not_checkpoint_state() -> None:
    """``follows_run`` and ``log_lr`` leave the saved state as it was; a retargeted length is saved and restored."""

    def make(**flags: bool) -> ScheduleLR:
        opt = torch.optim.AdamW([torch.zeros(1, requires_grad=True)], lr=1.0)
        return ScheduleLR(opt, OneCycleSchedule(max_lrs=(0.1,), total_steps=10), **flags)

    flagged, plain = make(follows_run=True, log_lr=True), make()
    assert flagged.follows_run and flagged.log_lr and not plain.follows_run and not plain.log_lr
    flagged.retarget(16)
    assert flagged.state_dict() == {
        **plain.state_dict(),
        "schedule": {**plain.state_dict()["schedule"], "total_steps": 16},
    }
    plain.load_state_dict(flagged.state_dict())
    assert plain.schedule == flagged.schedule and not plain.follows_run
