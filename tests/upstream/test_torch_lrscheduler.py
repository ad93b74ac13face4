"""Parity with PyTorch's own scheduler tests (``test/optim/test_lrscheduler.py``, the ``OneCycleLR`` cases).

torch's fixture is an SGD optimizer over two parameter groups: the default LR 0.05, and a second group whose LR is a
0-dim tensor (0.5). Each case below drives :class:`~lightning_tune.lr.ScheduleLR` over that same fixture with the
inputs of torch's case and checks the values torch's case expects, or the values ``OneCycleLR`` itself produces on a
twin fixture.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.optim.lr_scheduler import OneCycleLR

from lightning_tune.lr import OneCycleSchedule, ScheduleLR


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
    schedule = OneCycleSchedule(
        max_lrs=(25.0, 25.0), total_steps=10, base_momentums=(1.0, 1.0), max_momentums=(22.0, 22.0), **kwargs
    )
    seen = run(opt, ScheduleLR(opt, schedule), 10)
    for group in range(2):
        assert [lr for lr, _ in (step[group] for step in seen)] == pytest.approx(lr_target, rel=1e-6, abs=1e-6)
        assert [m for _, m in (step[group] for step in seen)] == pytest.approx(momentum_target, rel=1e-6, abs=1e-6)


@pytest.mark.parametrize("anneal_strategy", ["cos", "linear"])
@pytest.mark.parametrize("three_phase", [False, True])
def test_peak_taken_from_the_optimizers_tensor_lr_is_not_overwritten(anneal_strategy: str, three_phase: bool) -> None:
    """The peak of each group is its configured LR, read straight from the optimizer (the tensor included).

    ``ScheduleLR`` fills a tensor ``lr`` in place every step; a schedule that kept the optimizer's tensor as its peak
    would be rewritten by its own output (torch: 0.02, 0.26, 0.5, ...; aliased: 0.02, 0.0104, 0.0104, ...).
    """
    ours, theirs = torch_fixture(), torch_fixture()
    kwargs = {"total_steps": 10, "anneal_strategy": anneal_strategy, "three_phase": three_phase}
    schedule = OneCycleSchedule(
        max_lrs=tuple(g["lr"] for g in ours.param_groups),
        base_momentums=(0.85, 0.85),
        max_momentums=(0.95, 0.95),
        **kwargs,
    )
    got = run(ours, ScheduleLR(ours, schedule), 12)
    expected = run(theirs, OneCycleLR(theirs, max_lr=[g["lr"] for g in theirs.param_groups], **kwargs), 10)
    # torch raises past total_steps; ours holds the final value there.
    torch.testing.assert_close(torch.tensor(got[:10]), torch.tensor(expected), rtol=1e-5, atol=1e-8)
    assert got[10] == got[11] == got[9]
    assert max(step[1][0] for step in got) == pytest.approx(0.5)
    assert isinstance(ours.param_groups[1]["lr"], torch.Tensor)  # still the optimizer's own tensor, filled in place


def test_schedule_rejects_values_that_are_not_numbers() -> None:
    with pytest.raises(TypeError, match=r"`max_lrs` must be a sequence of numbers, got \(tensor\(\[1\., 2\.\]\),\)"):
        OneCycleSchedule(max_lrs=(torch.tensor([1.0, 2.0]),), total_steps=10)
