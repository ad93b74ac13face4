"""Parity with Hugging Face transformers' schedules (``tests/optimization/test_optimization.py``, ``optimization.py``).

HF's ``test_schedulers`` steps each ``get_*_schedule*`` ten times on an optimizer with ``lr=10`` and checks the
learning rates against a table. The same inputs drive lightning_tune's callbacks here (through the schedule each
one builds: a :class:`~lightning_tune.lr.ScheduleLR`), and the values are checked against that table and, at
every step and for more configurations, against the ``LambdaLR`` the installed ``transformers`` returns.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import optimization as hf

import lightning_tune as lt

STEPS = 10


def optimizer(*lrs: float, default: float | None = None) -> torch.optim.Optimizer:
    """One parameter group per LR; the optimizer's default LR is ``default`` (else the first group's)."""
    groups = [{"params": [torch.nn.Parameter(torch.zeros(2))], "lr": lr} for lr in lrs]
    return torch.optim.AdamW(groups, lr=lrs[0] if default is None else default)


def ours(
    callback: lt.callbacks.ScheduleCallback, opt: torch.optim.Optimizer, total: int, steps: int
) -> list[list[float]]:
    """Every group's LR at each of ``steps`` optimizer steps, from the scheduler ``callback`` builds for ``opt``."""
    return record(opt, callback.build_schedule(opt, total), steps)


def flat(rows: list[list[float]]) -> list[float]:
    return [value for row in rows for value in row]


def record(opt: torch.optim.Optimizer, scheduler, steps: int) -> list[list[float]]:  # noqa: ANN001
    seen = []
    for _ in range(steps):
        seen.append([float(g["lr"]) for g in opt.param_groups])
        opt.step()
        scheduler.step()
    return seen


# HF's ``test_schedulers`` table: num_warmup_steps=2, num_training_steps=10, lr=10.
@pytest.mark.parametrize(
    ("callback", "expected"),
    [
        pytest.param(lt.WarmupPolynomial(2), [0.0, 5.0, 10.0, 8.75, 7.5, 6.25, 5.0, 3.75, 2.5, 1.25], id="linear"),
        pytest.param(lt.WarmupCosine(2), [0.0, 5.0, 10.0, 9.61, 8.53, 6.91, 5.0, 3.08, 1.46, 0.38], id="cosine"),
        pytest.param(
            lt.WarmupCosine(2, num_cycles=2, hard_restarts=True),
            [0.0, 5.0, 10.0, 8.53, 5.0, 1.46, 10.0, 8.53, 5.0, 1.46],
            id="cosine_with_hard_restarts",
        ),
        pytest.param(
            lt.WarmupPolynomial(2, power=2.0, min_lr=1e-7),
            [0.0, 5.0, 10.0, 7.656, 5.625, 3.906, 2.5, 1.406, 0.625, 0.156],
            id="polynomial_decay",
        ),
    ],
)
def test_hf_test_schedulers_table(callback, expected) -> None:  # noqa: ANN001
    got = [step[0] for step in ours(callback, optimizer(10.0), STEPS, STEPS)]
    assert got == pytest.approx(expected, abs=1e-2)


# (our callback, HF's function and its keyword arguments); two groups, the default LR the largest, as HF configs do.
SAME_CONFIG = [
    pytest.param(
        lambda: lt.WarmupPolynomial(7),
        hf.get_linear_schedule_with_warmup,
        {"num_warmup_steps": 7},
        id="linear",
    ),
    pytest.param(
        lambda: lt.WarmupPolynomial(0, power=0.5, min_lr=2e-5),
        hf.get_polynomial_decay_schedule_with_warmup,
        {"num_warmup_steps": 0, "power": 0.5, "lr_end": 2e-5},
        id="polynomial-sqrt",
    ),
    pytest.param(
        lambda: lt.WarmupPolynomial(5, power=3.0, min_lr=1e-6),
        hf.get_polynomial_decay_schedule_with_warmup,
        {"num_warmup_steps": 5, "power": 3.0, "lr_end": 1e-6},
        id="polynomial-cubic",
    ),
    pytest.param(
        lambda: lt.WarmupCosine(4, num_cycles=1.5),
        hf.get_cosine_schedule_with_warmup,
        {"num_warmup_steps": 4, "num_cycles": 1.5},
        id="cosine-num-cycles",
    ),
    pytest.param(
        lambda: lt.WarmupCosine(4, min_lr=1e-4),
        hf.get_cosine_with_min_lr_schedule_with_warmup,
        {"num_warmup_steps": 4, "min_lr": 1e-4},
        id="cosine-min-lr",
    ),
    pytest.param(
        lambda: lt.WarmupCosine(3, hard_restarts=True, num_cycles=3),
        hf.get_cosine_with_hard_restarts_schedule_with_warmup,
        {"num_warmup_steps": 3, "num_cycles": 3},
        id="hard-restarts",
    ),
    pytest.param(
        lambda: lt.WarmupStableDecay(5, decay_steps=12, min_lr=1e-4, warmup_shape="cosine", decay_shape="1-sqrt"),
        hf.get_wsd_schedule,
        {
            "num_warmup_steps": 5,
            "num_decay_steps": 12,
            "min_lr_ratio": 0.1,
            "warmup_type": "cosine",
            "decay_type": "1-sqrt",
        },
        id="wsd-cosine-1sqrt",
    ),
    pytest.param(
        lambda: lt.WarmupStableDecay(3, decay_steps=9, warmup_shape="1-sqrt", decay_shape="linear"),
        hf.get_wsd_schedule,
        {"num_warmup_steps": 3, "num_decay_steps": 9, "warmup_type": "1-sqrt", "decay_type": "linear"},
        id="wsd-1sqrt-linear",
    ),
]


@pytest.mark.parametrize(("make", "hf_schedule", "kwargs"), SAME_CONFIG)
def test_every_step_equals_hf_lambda_lr(make, hf_schedule, kwargs) -> None:  # noqa: ANN001
    total = 40
    mine, theirs = optimizer(1e-3, 3e-4), optimizer(1e-3, 3e-4)
    expected = record(theirs, hf_schedule(theirs, num_training_steps=total, **kwargs), total + 1)
    got = ours(make(), mine, total, total + 1)
    assert flat(got) == pytest.approx(flat(expected), rel=1e-9, abs=1e-15)


def test_past_the_end_the_final_value_holds() -> None:
    """Where HF's cosine keeps oscillating past ``num_training_steps``, ours holds its last value (documented)."""
    mine, theirs = optimizer(1.0), optimizer(1.0)
    got = ours(lt.WarmupCosine(0), mine, 10, 15)
    expected = record(theirs, hf.get_cosine_schedule_with_warmup(theirs, 0, 10), 15)
    assert flat(got[:11]) == pytest.approx(flat(expected[:11]), abs=1e-15)
    assert [step[0] for step in got[10:]] == [0.0] * 5
    assert expected[12][0] > 0.0


def test_hf_min_lr_with_groups_below_the_default_lr_warns_and_says_how_to_match() -> None:
    """HF reads ``min_lr`` against the optimizer's default LR; here it is the largest group's floor.

    With a default LR of 1e-3 and groups at 1e-4 and 5e-5, HF's floors are 10x lower than ours. The warning names
    the ``min_lr`` that gives HF's floors, and that value does.
    """
    hf_opt = optimizer(1e-4, 5e-5, default=1e-3)
    expected = record(hf_opt, hf.get_cosine_with_min_lr_schedule_with_warmup(hf_opt, 2, 20, min_lr=1e-5), 21)
    with pytest.warns(UserWarning, match=r"default LR \(0\.001\).*floors 10x.*pass min_lr=1e-06") as caught:
        differing = ours(lt.WarmupCosine(2, min_lr=1e-5), optimizer(1e-4, 5e-5, default=1e-3), 20, 21)
    assert len(caught) == 1
    assert differing[-1] == pytest.approx([1e-5, 5e-6])  # ours: the largest group's floor is min_lr
    assert expected[-1] == pytest.approx([1e-6, 5e-7])  # HF's: min_lr relative to the default LR
    with pytest.warns(UserWarning, match="default LR"):  # still warned: which reading was meant cannot be known
        matched = ours(lt.WarmupCosine(2, min_lr=1e-6), optimizer(1e-4, 5e-5, default=1e-3), 20, 21)
    assert flat(matched) == pytest.approx(flat(expected), rel=1e-9)


def test_no_warning_when_the_default_lr_is_the_largest_group() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ours(lt.WarmupPolynomial(2, min_lr=1e-5), optimizer(1e-3, 1e-4), 20, 3)
        ours(lt.WarmupStableDecay(2, decay_ratio=0.2, min_lr=1e-5), optimizer(1e-4, 1e-3, default=5e-3), 20, 3)


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: lt.WarmupPolynomial(3, power=2.0, min_lr=1e-4), id="polynomial"),
        pytest.param(lambda: lt.WarmupCosine(3, num_cycles=2, hard_restarts=True), id="hard-restarts"),
        pytest.param(lambda: lt.WarmupStableDecay(3, decay_steps=4, decay_shape="1-sqrt"), id="wsd"),
    ],
)
def test_new_schedules_resume_from_their_state_dict(make) -> None:  # noqa: ANN001
    opt = optimizer(1e-3, 3e-4)
    scheduler = make().build_schedule(opt, 12)
    record(opt, scheduler, 5)
    resumed_opt = optimizer(1e-3, 3e-4)
    resumed = make().build_schedule(resumed_opt, 12)
    resumed.load_state_dict(scheduler.state_dict())
    for group in resumed_opt.param_groups:
        group["lr"] = None  # the schedule sets it from the restored step, not from what the optimizer held
    resumed.step()
    scheduler.step()
    assert [g["lr"] for g in resumed_opt.param_groups] == [g["lr"] for g in opt.param_groups]


BAD = [
    pytest.param(lambda: lt.WarmupCosine(2, num_cycles=0), ValueError, r"`num_cycles` must be", id="cycles-zero"),
    pytest.param(lambda: lt.WarmupCosine(2, hard_restarts=1), TypeError, r"`hard_restarts` must be", id="restarts-int"),
    pytest.param(lambda: lt.WarmupPolynomial(2, power=0.0), ValueError, r"`power` must be", id="power-zero"),
    pytest.param(lambda: lt.WarmupStableDecay(2), ValueError, r"exactly one of `decay_steps`", id="wsd-no-decay"),
    pytest.param(
        lambda: lt.WarmupStableDecay(2, decay_steps=3, decay_ratio=0.1),
        ValueError,
        r"exactly one of `decay_steps`",
        id="wsd-both-decays",
    ),
    pytest.param(
        lambda: lt.WarmupStableDecay(2, decay_steps=9, total_steps=10),
        ValueError,
        r"`warmup_steps` \+ `decay_steps` must not exceed `total_steps` \(10\), got 2 \+ 9",
        id="wsd-too-long",
    ),
    pytest.param(
        lambda: lt.WarmupStableDecay(2, decay_steps=2, decay_shape="cos"),
        ValueError,
        r"`decay_shape` must be one of",
        id="wsd-shape",
    ),
    pytest.param(lambda: lt.WarmupStableDecay(2, decay_ratio=1.5), ValueError, r"`decay_ratio` must be", id="ratio"),
]


@pytest.mark.parametrize(("make", "error", "message"), BAD)
def test_bad_arguments_are_refused_at_construction(make, error, message) -> None:  # noqa: ANN001
    with pytest.raises(error, match=message):
        make()


def test_wsd_retargeted_to_a_longer_run_stretches_only_the_stable_phase() -> None:
    """Re-aimed at 30 steps after 6, WSD follows HF's ``get_wsd_schedule`` for 30 steps: same warm-up and decay."""
    callback = lt.WarmupStableDecay(4, decay_steps=5, min_lr=1e-4)
    opt = optimizer(1e-3, 3e-4)
    callback.schedulers = [callback.build_schedule(opt, 20)]
    early = record(opt, callback.schedulers[0], 6)
    callback.retarget(30)
    late = record(opt, callback.schedulers[0], 25)
    theirs = optimizer(1e-3, 3e-4)
    expected = record(theirs, hf.get_wsd_schedule(theirs, 4, 5, num_training_steps=30, min_lr_ratio=0.1), 31)
    assert flat(early + late) == pytest.approx(flat(expected), rel=1e-9)
