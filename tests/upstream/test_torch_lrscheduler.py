"""Parity with PyTorch's own scheduler tests (``test/optim/test_lrscheduler.py``).

torch's fixture is an SGD optimizer over two parameter groups: the default LR 0.05, and a second group whose LR is a
0-dim tensor (0.5). Each case below drives :class:`~lightning_tune.lr.ScheduleLR` over that same fixture with the
inputs of torch's case and checks the values torch's case expects, and the values torch's scheduler itself produces
on a twin fixture. Where torch has a scheduler this package has a factor function equivalent to:

- ``OneCycleLR``: :func:`~lightning_tune.lr.one_cycle` (the LR, and the momentum as ``ScheduleLR``'s ``momentum``);
- ``CosineAnnealingLR`` (one half-wave): :func:`~lightning_tune.lr.warmup_cosine` without warm-up;
- ``LinearLR`` rising to the base LR: the warm-up of :func:`~lightning_tune.lr.warmup_stable_decay`, which starts at
  ``min_ratio`` (``linear_warmup`` starts at 0, which ``LinearLR`` refuses);
- ``PolynomialLR``: :func:`~lightning_tune.lr.warmup_polynomial` without warm-up;
- ``CosineAnnealingWarmRestarts`` with ``T_mult=1``: ``warmup_cosine(hard_restarts=True)`` (equal cycles, as Hugging
  Face's; growing cycles have no equivalent here);
- ``ReduceLROnPlateau``: :class:`~lightning_tune.lr.PlateauDetector`'s decisions, each reduction applied as
  ``AdaptiveLROnPlateau`` applies it (``max(lr * factor, min_lr)``, skipped when the change is at most ``eps``).
"""

from __future__ import annotations

import math
from functools import partial

import pytest
import torch
from torch.optim.lr_scheduler import (
    CosineAnnealingLR,
    CosineAnnealingWarmRestarts,
    LinearLR,
    OneCycleLR,
    PolynomialLR,
    ReduceLROnPlateau,
)

from lightning_tune.lr import (
    PlateauDetector,
    ScheduleLR,
    one_cycle,
    warmup_cosine,
    warmup_polynomial,
    warmup_stable_decay,
)


def torch_fixture(optimizer: type[torch.optim.Optimizer] = torch.optim.SGD) -> torch.optim.Optimizer:
    """Two parameter groups, the second with a tensor learning rate, as torch's ``setUp`` builds them."""
    first, second = torch.nn.Conv2d(1, 1, 1), torch.nn.Conv2d(1, 1, 1)
    return optimizer(
        [{"params": first.parameters()}, {"params": second.parameters(), "lr": torch.tensor(0.5)}], lr=0.05
    )


def run(optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler, steps: int):
    """Per step, every group's (lr, momentum-or-beta1) before the step, then step the optimizer and the scheduler."""
    seen = []
    for _ in range(steps):
        seen.append(
            [
                (float(g["lr"]), float(g["betas"][0] if "betas" in g else g.get("momentum", math.nan)))
                for g in optimizer.param_groups
            ]
        )
        optimizer.step()
        scheduler.step()
    return seen


def cos_anneal(start: float, end: float, pct: float) -> float:
    return end + (start - end) * (1 + math.cos(math.pi * pct)) / 2


# torch's expected values: max_lr=25 for both groups, momentum cycled between 1 and 22, ten steps.
LINEAR_LR = [1, 13, 25, 21.5, 18, 14.5, 11, 7.5, 4, 0.5]
LINEAR_MOMENTUM = [22, 11.5, 1, 4, 7, 10, 13, 16, 19, 22]
COS_LR = [1, 13, 25, *(cos_anneal(25, 0.5, k / 7) for k in range(1, 7)), 0.5]
COS_MOMENTUM = [22, 11.5, 1, *(cos_anneal(1, 22, k / 7) for k in range(1, 7)), 22]


@pytest.mark.parametrize(
    ("kwargs", "lr_target", "momentum_target", "optimizer"),
    [
        pytest.param(
            {"final_div_factor": 2, "anneal_strategy": "linear"},
            LINEAR_LR,
            LINEAR_MOMENTUM,
            torch.optim.SGD,
            id="linear_annealing",
        ),
        pytest.param(
            {
                "div_factor": 25,
                "pct_start": 0.4,
                "final_div_factor": 4,
                "anneal_strategy": "linear",
                "three_phase": True,
            },
            [1, 9, 17, 25, 17, 9, 1, 0.75, 0.5, 0.25],
            [22, 15, 8, 1, 8, 15, 22, 22, 22, 22],
            torch.optim.SGD,
            id="linear_annealing_three_phases",
        ),
        pytest.param(
            {"final_div_factor": 2, "anneal_strategy": "cos"}, COS_LR, COS_MOMENTUM, torch.optim.SGD, id="cos_annealing"
        ),
        pytest.param(
            {"final_div_factor": 2, "anneal_strategy": "linear"},
            LINEAR_LR,
            LINEAR_MOMENTUM,
            torch.optim.Adam,
            id="cycle_lr_with_adam_beta1",
        ),
    ],
)
def test_one_cycle_matches_torch_expected_values(kwargs, lr_target, momentum_target, optimizer) -> None:
    opt = torch_fixture(optimizer)
    for group in opt.param_groups:
        group["lr_scale"] = 25.0 / float(group["lr"])  # both groups peak at torch's max_lr=25
    start = 1 / kwargs.pop("div_factor", 25.0)
    cycle = partial(one_cycle, total_steps=10, **{k: v for k, v in kwargs.items() if k != "final_div_factor"})
    factor = partial(cycle, start=start, end=start / kwargs.get("final_div_factor", 1e4))
    seen = run(opt, ScheduleLR(opt, factor, momentum=partial(cycle, start=22.0, peak=1.0, end=22.0)), 10)
    for group in range(2):
        assert [lr for lr, _ in (step[group] for step in seen)] == pytest.approx(lr_target, rel=1e-6, abs=1e-6)
        assert [m for _, m in (step[group] for step in seen)] == pytest.approx(momentum_target, rel=1e-6, abs=1e-6)


@pytest.mark.parametrize("anneal_strategy", ["cos", "linear"])
@pytest.mark.parametrize("three_phase", [False, True])
def test_peak_taken_from_the_optimizers_tensor_lr_is_not_overwritten(anneal_strategy: str, three_phase: bool) -> None:
    """The peak of each group is its configured LR, read straight from the optimizer (the tensor included).

    ``ScheduleLR`` fills a tensor ``lr`` in place every step; a scheduler that kept the optimizer's tensor as its peak
    would be rewritten by its own output (torch: 0.02, 0.26, 0.5, ...; aliased: 0.02, 0.0104, 0.0104, ...).
    """
    ours, theirs = torch_fixture(), torch_fixture()
    kwargs = {"total_steps": 10, "anneal_strategy": anneal_strategy, "three_phase": three_phase}
    momentum = partial(one_cycle, **kwargs, start=0.95, peak=0.85, end=0.95)
    got = run(ours, ScheduleLR(ours, partial(one_cycle, **kwargs), momentum=momentum), 12)
    expected = run(theirs, OneCycleLR(theirs, max_lr=[g["lr"] for g in theirs.param_groups], **kwargs), 10)
    # torch raises past total_steps; ours holds the final value there.
    torch.testing.assert_close(torch.tensor(got[:10]), torch.tensor(expected), rtol=1e-5, atol=1e-8)
    assert got[10] == got[11] == got[9]
    assert max(step[1][0] for step in got) == pytest.approx(0.5)
    assert isinstance(ours.param_groups[1]["lr"], torch.Tensor)  # still the optimizer's own tensor, filled in place


def test_an_lr_scale_that_is_not_a_number_is_refused() -> None:
    opt = torch_fixture()
    opt.param_groups[1]["lr_scale"] = torch.tensor([1.0, 2.0])
    with pytest.raises(TypeError, match=r"`param_groups\[1\]\['lr_scale'\]` must be a number, got tensor"):
        ScheduleLR(opt, partial(one_cycle, total_steps=10))


# torch's LR-only cases: (its scheduler and arguments, ours, epochs, torch's expected LR of the first group).
# The second group's targets are ten times the first's (its LR is 0.5), as in torch's cases.
ETA_MIN = 1e-10
COSINE = [ETA_MIN + (0.05 - ETA_MIN) * (1 + math.cos(math.pi * x / 10)) / 2 for x in range(10)]
LINEAR = [0.05 * (0.5 + i * 0.5 / 4) for i in range(4)] + [0.05] * 6
POLYNOMIAL = [(1.0 - x / 5) ** 0.9 * 0.05 for x in range(5)] + [0.0] * 5
RESTARTS = [ETA_MIN + (0.05 - ETA_MIN) * (1 + math.cos(math.pi * (x % 10) / 10)) / 2 for x in range(100)]


@pytest.mark.parametrize(
    ("theirs", "ours", "epochs", "target"),
    [
        pytest.param(
            lambda opt: CosineAnnealingLR(opt, T_max=10, eta_min=ETA_MIN),
            partial(warmup_cosine, warmup_steps=0, total_steps=10, min_ratio=ETA_MIN / 0.05),
            10,
            COSINE,
            id="test_cos_anneal_lr",
        ),
        pytest.param(
            lambda opt: LinearLR(opt, start_factor=0.5, total_iters=4),
            partial(warmup_stable_decay, warmup_steps=4, decay_steps=0, total_steps=10, min_ratio=0.5),
            10,
            LINEAR,
            id="test_linearlr",
        ),
        pytest.param(
            lambda opt: PolynomialLR(opt, power=0.9, total_iters=5),
            partial(warmup_polynomial, warmup_steps=0, total_steps=5, power=0.9),
            10,
            POLYNOMIAL,
            id="test_poly_lr",
        ),
        pytest.param(
            lambda opt: CosineAnnealingWarmRestarts(opt, T_0=10, T_mult=1, eta_min=ETA_MIN),
            partial(
                warmup_cosine,
                warmup_steps=0,
                total_steps=100,
                min_ratio=ETA_MIN / 0.05,
                num_cycles=10,
                hard_restarts=True,
            ),
            100,
            RESTARTS,
            id="test_CosineAnnealingWarmRestarts_lr1-T_mult-1",
        ),
    ],
)
def test_lr_schedules_match_torch_expected_values(theirs, ours, epochs: int, target: list[float]) -> None:  # noqa: ANN001
    """Torch's expected values and its scheduler's, with one factor for both groups.

    The floor is a ratio of each group's LR, and torch's ``eta_min`` one absolute LR: the second group's floor here is
    ten times torch's 1e-10, a difference far inside torch's tolerance.
    """
    opt, twin = torch_fixture(), torch_fixture()
    seen = run(opt, ScheduleLR(opt, ours), epochs)
    for group, scale in enumerate((1, 10)):
        assert [lr for lr, _ in (step[group] for step in seen)] == pytest.approx(
            [t * scale for t in target], rel=0, abs=1e-5
        )  # torch's tolerance
    lrs = [[lr for lr, _ in step] for step in seen]
    expected = [[lr for lr, _ in step] for step in run(twin, theirs(twin), epochs)]
    torch.testing.assert_close(torch.tensor(lrs), torch.tensor(expected), rtol=1e-6, atol=1e-9)
    assert isinstance(opt.param_groups[1]["lr"], torch.Tensor)  # still the optimizer's own tensor


# torch's ReduceLROnPlateau cases 1-8: the scheduler's arguments, the metric of each epoch and the LR expected after
# each (of the first group; of both with per-group floors). Both groups start at 0.5.
PLATEAU_CASES = [
    pytest.param(
        {"threshold_mode": "abs", "mode": "min", "threshold": 0.01, "patience": 5, "cooldown": 5},
        [10 - i * 0.0167 for i in range(20)],
        [[0.5] * 20],
        id="test_reduce_lr_on_plateau1",
    ),
    pytest.param(
        {"patience": 5, "cooldown": 0, "threshold_mode": "abs", "mode": "min", "threshold": 0.1},
        [10 - i * 0.0165 for i in range(22)],
        [[0.5] * 6 + [0.05] * 7 + [0.005] * 7 + [0.0005] * 2],
        id="test_reduce_lr_on_plateau2",
    ),
    pytest.param(
        {"mode": "max", "patience": 5, "cooldown": 5, "threshold_mode": "abs"},
        [-0.8] * 2 + [-0.234] * 20,
        [[0.5] * (2 + 6) + [0.05] * (5 + 6) + [0.005] * 4],
        id="test_reduce_lr_on_plateau3",
    ),
    pytest.param(
        {"mode": "max", "patience": 3, "threshold_mode": "rel", "threshold": 0.1},
        [1.5 * (1.025**i) for i in range(20)],
        [[0.5] * 20],
        id="test_reduce_lr_on_plateau4",
    ),
    pytest.param(
        {"mode": "max", "threshold_mode": "rel", "threshold": 0.1, "patience": 5, "cooldown": 5},
        [1.5 * (1.005**i) for i in range(20)],
        [[0.5] * 6 + [0.05] * (5 + 6) + [0.005] * 4],
        id="test_reduce_lr_on_plateau5",
    ),
    pytest.param(
        {"mode": "min", "threshold_mode": "rel", "threshold": 0.1},
        [1.5 * (0.85**i) for i in range(20)],
        [[0.5] * 20],
        id="test_reduce_lr_on_plateau6",
    ),
    pytest.param(
        {"mode": "min", "threshold_mode": "rel", "threshold": 0.1, "patience": 5, "cooldown": 5},
        [1] * 7 + [0.6] + [0.5] * 12,
        [[0.5] * 6 + [0.05] * (5 + 6) + [0.005] * 4],
        id="test_reduce_lr_on_plateau7",
    ),
    pytest.param(
        {"mode": "max", "threshold_mode": "rel", "min_lr": [0.4, 0.3], "threshold": 0.1, "patience": 5, "cooldown": 5},
        [1.5 * (1.005**i) for i in range(20)],
        [[0.5] * 6 + [0.4] * 14, [0.5] * 6 + [0.3] * 14],
        id="test_reduce_lr_on_plateau8",
    ),
]


@pytest.mark.parametrize(("kwargs", "metrics", "targets"), PLATEAU_CASES)
def test_plateau_matches_reduce_lr_on_plateau(kwargs, metrics: list[float], targets: list[list[float]]) -> None:
    detector_kwargs = {k: v for k, v in kwargs.items() if k != "min_lr"}
    detector = PlateauDetector(**detector_kwargs)
    floors = kwargs.get("min_lr", [0.0, 0.0])
    factor, eps = 0.1, 1e-8  # ReduceLROnPlateau's defaults
    ours, lrs = [0.5, 0.5], []
    for metric in metrics:
        if detector.update(metric):
            ours = [
                lr if lr - max(lr * factor, floor) <= eps else max(lr * factor, floor)
                for lr, floor in zip(ours, floors, strict=True)
            ]
        lrs.append(list(ours))
    for group, target in enumerate(targets):
        # torch's tolerance; its tables run past the epochs its cases step through
        assert [step[group] for step in lrs] == pytest.approx(target[: len(metrics)], rel=0, abs=1e-5)
    twin = torch_fixture()
    for group in twin.param_groups:
        group["lr"] = 0.5
    scheduler = ReduceLROnPlateau(twin, **kwargs)
    theirs = []
    for metric in metrics:
        twin.step()
        scheduler.step(metric)
        theirs.append([float(g["lr"]) for g in twin.param_groups])
    torch.testing.assert_close(torch.tensor(lrs, dtype=torch.float64), torch.tensor(theirs, dtype=torch.float64))
