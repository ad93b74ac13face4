"""The Fabric examples: the monitor's engine and the schedules in a ``lightning.fabric`` loop, on CPU."""

from __future__ import annotations

import importlib.util
from itertools import count
from pathlib import Path
from types import ModuleType

import pytest
import torch

from lightning_tune.lr import warmup_cosine_lr
from tests.helpers import ROOT


def _example(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_fabric_throughput_gives_exact_rates_and_percentiles_from_the_marks(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(tmp_path)
    clock = count(step=0.010)  # every mark is 10 ms after the previous one
    monkeypatch.setattr("lightning_tune.perf.timing.perf_counter", lambda: next(clock))
    logged = _example("fabric_throughput").main(["--steps", "6", "--log-every", "3", "--batch-size", "8"])
    assert len(logged) == 2
    # steps of 10 ms, 10 ms between them: 3 steps and 2 gaps in the first interval, 3 and 3 in the second
    first, second = logged
    assert first["samples_per_sec"] == pytest.approx(24 / 0.050)
    assert second["samples_per_sec"] == pytest.approx(24 / 0.060)
    assert first["tokens_per_sec"] == pytest.approx(24 * 32 / 0.050)
    assert first["data_wait_frac"] == pytest.approx(0.020 / 0.050)
    assert second["step_ms_p50"] == pytest.approx(10.0) and second["step_ms_p95"] == pytest.approx(10.0)


def test_fabric_schedules_follow_the_schedule_and_reduce_as_torch_reduce_on_plateau(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(tmp_path)
    steps, every, patience = 30, 3, 0
    result = _example("fabric_schedules").main(
        ["--steps", str(steps), "--eval-every", str(every), "--patience", str(patience), "--warmup-steps", "4"]
    )
    # torch's ReduceLROnPlateau, fed the same validation losses, takes the same decisions
    weight = torch.nn.Parameter(torch.zeros(1))
    reference = torch.optim.lr_scheduler.ReduceLROnPlateau(
        torch.optim.SGD([weight], lr=1.0), mode="min", factor=0.5, patience=patience, threshold=1e-4
    )
    expected_reductions = []
    for index, value in enumerate(result["val_losses"]):
        before = reference.get_last_lr()[0]
        reference.step(value)
        if reference.get_last_lr()[0] < before:
            expected_reductions.append(float((index + 1) * every))
    assert result["reductions"] == expected_reductions and expected_reductions  # some were taken
    # each step's LR is the schedule's, halved once per reduction before it
    for step, lr in enumerate(result["lrs"]):
        halvings = sum(1 for at in result["reductions"] if at <= step)
        scheduled = warmup_cosine_lr(step, base_lr=0.05, warmup_steps=4, total_steps=steps, min_lr=0.0005)
        assert lr == pytest.approx(scheduled * 0.5**halvings), step
