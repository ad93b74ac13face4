"""The schedules against references: the formula in numpy, and torch's own schedulers (``LambdaLR`` included)."""

from __future__ import annotations

import cProfile
import functools
import math
import pstats
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np
import pytest
import torch

from lightning_tune.lr import (
    ScheduleLR,
    linear_warmup,
    linear_warmup_lr,
    one_cycle,
    one_cycle_lr,
    one_cycle_momentum,
    warmup_cosine,
    warmup_cosine_lr,
    warmup_polynomial,
    warmup_polynomial_lr,
    warmup_stable_decay_lr,
)
from lightning_tune.lr.scheduler import from_data, to_data


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
    reference = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.3, total_steps=total, **kwargs)
    ref_lr = _torch_sequence(opt, reference, total)
    opt2 = torch.optim.AdamW([torch.zeros(1, requires_grad=True)], lr=1.0)
    reference = torch.optim.lr_scheduler.OneCycleLR(opt2, max_lr=0.3, total_steps=total, **kwargs)
    ref_beta = _torch_sequence(opt2, reference, total, "beta1")

    cycle = {k: v for k, v in kwargs.items() if k not in ("div_factor", "final_div_factor")}
    lrs = [one_cycle_lr(s, max_lr=0.3, total_steps=total, **kwargs) for s in range(total + 10)]
    assert lrs[:total] == pytest.approx([r[0] for r in ref_lr], rel=1e-12)
    assert [one_cycle_momentum(s, total_steps=total, **cycle) for s in range(total)] == [r[0] for r in ref_beta]
    assert lrs[total:] == [lrs[total - 1]] * 10  # past the end the last value is kept rather than raising


def test_schedule_lr_preserves_group_ratios_and_fills_tensor_lrs() -> None:
    w1, w2 = torch.zeros(2, requires_grad=True), torch.zeros(2, requires_grad=True)
    opt = torch.optim.SGD([{"params": [w1], "lr": torch.tensor(0.2)}, {"params": [w2], "lr": 0.02}], lr=0.1)
    tensor_lr = opt.param_groups[0]["lr"]
    sched = ScheduleLR(opt, partial(warmup_cosine, warmup_steps=3, total_steps=20, min_ratio=0.1))
    for _ in range(15):
        opt.step()
        sched.step()
        lr0, lr1 = float(opt.param_groups[0]["lr"]), float(opt.param_groups[1]["lr"])
        assert lr0 == pytest.approx(10 * lr1)
    assert opt.param_groups[0]["lr"] is tensor_lr  # filled in place, never replaced


def _groups(lrs: list[float], **extra: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD([{"params": [torch.zeros(1, requires_grad=True)], "lr": lr, **extra} for lr in lrs])


@pytest.mark.parametrize(
    "factor",
    [
        pytest.param(partial(warmup_cosine, warmup_steps=5, total_steps=30, min_ratio=0.1), id="cosine"),
        pytest.param(partial(one_cycle, total_steps=30, three_phase=True, pct_start=0.2), id="one-cycle"),
        pytest.param(lambda step: 0.9**step, id="any-callable"),
    ],
)
def test_schedule_lr_equals_lambda_lr_with_the_same_factor_and_lr_scale_multiplies_a_group(factor) -> None:  # noqa: ANN001
    """torch's ``LambdaLR`` is the reference; a group's ``lr_scale`` (timm's field) multiplies its LR at every step."""
    lrs = [0.1 * (i + 1) for i in range(48)]
    ours, theirs, scaled = _groups(lrs), _groups(lrs), _groups(lrs, lr_scale=0.25)
    got = np.array(_torch_sequence(ours, ScheduleLR(ours, factor), 35))
    expected = _torch_sequence(theirs, torch.optim.lr_scheduler.LambdaLR(theirs, factor), 35)
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=0)
    np.testing.assert_allclose(_torch_sequence(scaled, ScheduleLR(scaled, factor), 35), got * 0.25, rtol=1e-12, atol=0)


def _calls(step: Callable[[], None]) -> int:
    profile = cProfile.Profile()
    profile.enable()
    step()
    profile.disable()
    return int(pstats.Stats(profile).total_calls)  # type: ignore[attr-defined]


def test_a_step_makes_no_more_python_calls_than_lambda_lr() -> None:
    """One factor call a step, whatever the number of groups: no introspection, no checks on the step path."""
    factor = partial(warmup_cosine, warmup_steps=5, total_steps=100, min_ratio=0.1)
    ours, theirs = _groups([0.1] * 48), _groups([0.1] * 48)
    scheduler, reference = ScheduleLR(ours, factor), torch.optim.lr_scheduler.LambdaLR(theirs, factor)
    ours.step()
    theirs.step()
    assert _calls(scheduler.step) <= _calls(reference.step) - 40  # LambdaLR calls the factor once per group


def test_factors_save_as_plain_data_and_load_back() -> None:
    for factor in (
        partial(warmup_cosine, warmup_steps=2, total_steps=9),
        partial(linear_warmup, warmup_steps=3),
        partial(one_cycle, total_steps=10, three_phase=True, start=0.9, peak=0.8, end=0.9),
        partial(warmup_polynomial, warmup_steps=0, total_steps=5, power=2.0),
    ):
        data = to_data(factor)
        assert data is not None and all(isinstance(v, (str, int, float, bool)) for v in data.values())
        assert [from_data(data)(s) for s in range(12)] == [factor(s) for s in range(12)]
    assert to_data(lambda step: 1.0) is None  # any other callable is not saved, as LambdaLR saves no function
    with pytest.raises(ValueError, match="unknown factor 'nope' in saved state"):
        from_data({"name": "nope"})


def test_schedule_lr_checkpoint_loads_with_weights_only(tmp_path: object) -> None:
    opt = torch.optim.AdamW([torch.zeros(1, requires_grad=True)], lr=0.1)
    sched = ScheduleLR(opt, partial(one_cycle, total_steps=10), momentum=partial(one_cycle, total_steps=10, start=0.9))
    for _ in range(4):
        opt.step()
        sched.step()
    sched.scale_group(0, 0.5)
    path = f"{tmp_path}/s.pt"
    torch.save(sched.state_dict(), path)
    opt2 = torch.optim.AdamW([torch.zeros(1, requires_grad=True)], lr=1.0)
    fresh = ScheduleLR(opt2, partial(linear_warmup, warmup_steps=1))
    fresh.load_state_dict(torch.load(path, weights_only=True))
    assert fresh.schedule == sched.schedule and fresh.last_epoch == 4 and fresh.scales == [0.5]
    assert fresh.get_lr() == sched.get_lr() and opt2.param_groups[0]["betas"] == opt.param_groups[0]["betas"]


def test_a_state_saved_by_the_per_group_schedules_of_56799b8_resumes() -> None:
    """The format of earlier releases (a ``schedule`` with one value per group) loads into the factor functions."""
    old = {
        "schedule": {
            "kind": "one_cycle",
            "max_lrs": [0.3, 0.03],
            "total_steps": 20,
            "pct_start": 0.25,
            "div_factor": 10.0,
            "final_div_factor": 100.0,
            "anneal_strategy": "linear",
            "three_phase": True,
            "base_momentums": [0.8, 0.8],
            "max_momentums": [0.9, 0.9],
        },
        "scales": [0.5, 1.0],
        "base_lrs": [0.1, 0.01],
        "last_epoch": 6,
        "_step_count": 7,
        "_is_initial": False,
        "_get_lr_called_within_step": False,
        "_last_lr": [0.1, 0.01],
    }
    opt = torch.optim.SGD([{"params": [torch.zeros(1, requires_grad=True)], "lr": lr} for lr in (0.1, 0.01)])
    for group in opt.param_groups:
        group["momentum"] = 0.0
    scheduler = ScheduleLR(opt, partial(linear_warmup, warmup_steps=1))
    scheduler.load_state_dict(old)
    cycle = {"pct_start": 0.25, "anneal_strategy": "linear", "three_phase": True}
    # what 888232c's scheduler, saved as above, went on to set: (LRs, momentum) at steps 7 to 11
    recorded = [(0.04875, 0.00975, 0.875), (0.015, 0.003, 0.9), (0.01365, 0.00273, 0.9), (0.0123, 0.00246, 0.9)]
    recorded.append((0.01095, 0.00219, 0.9))
    for step, old_run in zip(range(7, 12), recorded, strict=True):
        opt.step()
        scheduler.step()
        lr = partial(one_cycle_lr, step, total_steps=20, div_factor=10.0, final_div_factor=100.0, **cycle)
        expected = [0.5 * lr(max_lr=0.3), lr(max_lr=0.03)]
        assert [g["lr"] for g in opt.param_groups] == pytest.approx(expected, rel=1e-12)
        momentum = one_cycle_momentum(step, total_steps=20, base_momentum=0.8, max_momentum=0.9, **cycle)
        assert [g["momentum"] for g in opt.param_groups] == [momentum] * 2
        assert (*expected, momentum) == pytest.approx(old_run, rel=1e-12)


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


def _one_cycle(opt: torch.optim.Optimizer, total: int) -> ScheduleLR:
    opt.param_groups[0]["lr_scale"] = 3.0  # peak 0.3 over the configured 0.1
    cycle = partial(one_cycle, total_steps=total, three_phase=True)
    return ScheduleLR(opt, cycle, momentum=partial(cycle, start=0.95, peak=0.85, end=0.95))


RETARGETS = [  # ours and torch's for a length; re-aimed at step `at` from `old` to `new` steps
    pytest.param(
        lambda opt, total: ScheduleLR(opt, partial(warmup_cosine, warmup_steps=0, total_steps=total, min_ratio=0.01)),
        lambda opt, total: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=total, eta_min=1e-3),
        (4, 10, 25),
        id="cosine-longer",
    ),
    pytest.param(
        lambda opt, total: ScheduleLR(opt, partial(warmup_cosine, warmup_steps=0, total_steps=total)),
        lambda opt, total: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=total),
        (6, 30, 12),
        id="cosine-shorter",
    ),
    pytest.param(
        lambda opt, total: ScheduleLR(opt, partial(warmup_polynomial, warmup_steps=0, total_steps=total, power=2.0)),
        lambda opt, total: torch.optim.lr_scheduler.PolynomialLR(opt, total_iters=total, power=2.0),
        (5, 12, 20),
        id="polynomial",
    ),
    pytest.param(
        _one_cycle,
        lambda opt, total: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.3, total_steps=total, three_phase=True),
        (7, 40, 60),
        id="one-cycle-with-momentum",
    ),
]


def _adamw() -> torch.optim.Optimizer:
    return torch.optim.AdamW([torch.zeros(1, requires_grad=True)], lr=0.1)


@pytest.mark.parametrize(("ours", "theirs", "lengths"), RETARGETS)
def test_retargeted_schedule_lr_follows_torchs_scheduler_for_the_new_length(ours, theirs, lengths) -> None:  # noqa: ANN001
    """Re-aimed at step ``at``, the LR and ``beta1`` of every later step are torch's for the new length."""
    at, old, new = lengths
    opt = _adamw()
    got = _run(opt, ours(opt, old), new, at, new)
    ref = _adamw()
    expected = _run(ref, theirs(ref, new), new)
    unchanged = _adamw()
    assert got[: at + 1] == _run(unchanged, ours(unchanged, old), at + 1)  # the old one until then
    np.testing.assert_allclose(got[at + 1 :], expected[at + 1 :], rtol=1e-9, atol=1e-15)


def test_retarget_keeps_the_warm_up_and_never_ends_before_the_next_step() -> None:
    opt = _groups([0.2, 0.02])
    sched = ScheduleLR(opt, partial(warmup_cosine, warmup_steps=5, total_steps=20, min_ratio=0.1))
    for _ in range(3):
        opt.step()
        sched.step()
    sched.retarget(40)  # in the warm-up: the warm-up keeps its 5 steps
    assert sched.factor.keywords == {"warmup_steps": 5, "total_steps": 40, "min_ratio": 0.1}  # type: ignore[attr-defined]
    for _ in range(6):
        opt.step()
        sched.step()
    sched.retarget(4)  # at step 9, shorter than where the run already is: it ends at the next step
    assert sched.factor.keywords["total_steps"] == 10  # type: ignore[attr-defined]
    sched.scale_group(1, 0.5)
    opt.step()
    sched.step()
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.02, 0.001], rel=1e-12)  # the floor, scale kept
    warmup = ScheduleLR(opt, partial(linear_warmup, warmup_steps=3))
    warmup.retarget(100)  # no length to change
    assert warmup.factor.keywords == {"warmup_steps": 3}  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match=r"`total_steps` must be an integer >= 0, got -1"):
        sched.retarget(-1)


def test_schedule_lr_flags_are_configuration_not_checkpoint_state() -> None:
    """``follows_run`` and ``log_lr`` leave the saved state as it was; a retargeted length is saved and restored."""

    def make(**flags: bool) -> ScheduleLR:
        opt = torch.optim.AdamW([torch.zeros(1, requires_grad=True)], lr=1.0)
        return ScheduleLR(opt, partial(one_cycle, total_steps=10), **flags)

    flagged, plain = make(follows_run=True, log_lr=True), make()
    assert flagged.follows_run and flagged.log_lr and not plain.follows_run and not plain.log_lr
    flagged.retarget(16)
    assert flagged.state_dict() == {**plain.state_dict(), "factor": {**plain.state_dict()["factor"], "total_steps": 16}}
    plain.load_state_dict(flagged.state_dict())
    assert plain.schedule == flagged.schedule and not plain.follows_run
    assert math.isclose(plain.get_lr()[0], flagged.get_lr()[0])


@pytest.mark.parametrize(
    "function", [warmup_cosine_lr, warmup_polynomial_lr, functools.partial(warmup_stable_decay_lr, decay_steps=4)]
)
def test_a_floor_above_a_peak_of_zero_is_refused(function: Any) -> None:
    with pytest.raises(ValueError, match=r"`min_lr` must be 0 when `base_lr` is 0 .*got 0.1"):
        function(5, base_lr=0.0, warmup_steps=2, total_steps=10, min_lr=0.1)
    assert function(5, base_lr=0.0, warmup_steps=2, total_steps=10) == 0.0
