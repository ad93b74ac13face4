"""DynamicBatchSize's CUDA path: the micro-batch runner without a Trainer, and defects 1-8 on a simulated device.

The simulated device (``SimulatedMemory``) models a caching allocator (reserved >= allocated, blocks kept until
``free()``), memory held by live tensors, memory outside PyTorch, allocator retries and failures that are not
``torch.OutOfMemoryError``; each defect test below fails on the callback as it was before the runner.
"""

from __future__ import annotations

import math
import weakref
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import pytest
import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins import MixedPrecision
from torch import nn
from torch.utils.data import DataLoader

import lightning_tune as lt
from lightning_tune.batch.probes import CudaMemory, expandable_segments
from lightning_tune.batch.runner import MicroBatchRunner, cut_step, is_allocation_failure
from lightning_tune.perf.devices import cuda_memory_metrics, reset_run_peak
from tests.batch.test_dynamic_batch import Indexed, Net, Record, _weights, assert_each_sample_once, fit, sim

GIB = 1 << 30


# -- the runner, without a Trainer ---------------------------------------------------------------------------------
def _regression(n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randn(n, generator=g, dtype=torch.float64), torch.randn(n, generator=g, dtype=torch.float64)


def _runner(w: torch.Tensor, fail_above: int = 10**9, error: type[BaseException] = torch.OutOfMemoryError, **kw: Any):  # noqa: ANN202
    calls: dict[str, Any] = {"zero": 0, "free": [], "alive": []}

    def forward(mb: Any) -> torch.Tensor:
        x, y = mb.batch
        activation = w * x  # the micro-batch's activations
        calls["alive"].append(weakref.ref(activation))
        if mb.samples > fail_above:
            raise error("CUDA error: CUBLAS_STATUS_ALLOC_FAILED" if error is RuntimeError else "out of memory")
        return ((activation - y) ** 2).mean()

    def zero() -> None:
        calls["zero"] += 1
        w.grad = None

    def free() -> None:  # what is still alive of the failed forward when memory is freed
        calls["free"].append([ref() is not None for ref in calls["alive"]])

    runner = MicroBatchRunner(
        forward=forward,
        backward=lambda loss: loss.backward(),
        zero_grad=zero,
        free=free,
        shrink=lambda size: size // 2,
        min_size=1,
        **kw,
    )
    return runner, calls


def _hand_gradient(w: float, x: np.ndarray, y: np.ndarray) -> float:
    return float(np.mean(2 * x * (w * x - y)))  # d/dw of mean((w x - y)^2)


def test_runner_gives_the_full_batch_gradient_by_hand() -> None:
    x, y = _regression(8)
    w = torch.tensor(0.7, dtype=torch.float64, requires_grad=True)
    runner, _ = _runner(w)
    outcome = runner.run((x, y), [], lambda b, m: cut_step(b, m, sample_weight=1 / 8), 3)  # 3 + 3 + 2
    assert w.grad is not None
    assert float(w.grad) == pytest.approx(_hand_gradient(0.7, x.numpy(), y.numpy()), rel=1e-12)
    assert float(outcome.output) == pytest.approx(float(np.mean((0.7 * x.numpy() - y.numpy()) ** 2)), rel=1e-12)
    assert outcome.failures == 0 and runner.largest_run == 3


@pytest.mark.parametrize("error", [torch.OutOfMemoryError, RuntimeError], ids=["oom", "cublas"])
def test_runner_recovers_with_nothing_of_the_failure_alive(error: type[BaseException]) -> None:
    x, y = _regression(8)
    w = torch.tensor(-0.3, dtype=torch.float64, requires_grad=True)
    runner, calls = _runner(w, fail_above=2, error=error)
    failures: list[tuple[int, int]] = []
    runner.on_failure = lambda old, new, message: failures.append((old, new))
    outcome = runner.run((x, y), [], lambda b, m: cut_step(b, m, sample_weight=1 / 8), 8)
    assert failures == [(8, 4), (4, 2)] and outcome.failures == 2 and runner.size == 2
    assert float(w.grad) == pytest.approx(_hand_gradient(-0.3, x.numpy(), y.numpy()), rel=1e-12)
    # defect 2: when memory is freed, the failed micro-batch's activations are garbage (no traceback keeps them)
    assert calls["free"] and not any(any(alive) for alive in calls["free"])


def test_runner_lets_other_errors_through() -> None:
    w = torch.tensor(1.0, requires_grad=True)
    runner, _ = _runner(w, fail_above=0, error=ValueError)
    with pytest.raises(ValueError, match="out of memory"):
        runner.run(_regression(4), [], lambda b, m: cut_step(b, m, sample_weight=1 / 4), 4)


def test_runner_agrees_once_per_attempt_and_follows_the_other_ranks() -> None:
    x, y = _regression(8)
    w = torch.tensor(0.5, dtype=torch.float64, requires_grad=True)
    sent: list[list[float]] = []
    replies = iter([[1.0, 7.0], [0.0, 9.0]])  # another rank failed the first attempt; then all fine

    def agree(values: Any) -> list[float]:
        sent.append(list(values))
        return next(replies)

    runner, calls = _runner(w, agree=agree)
    outcome = runner.run((x, y), [5.0], lambda b, m: cut_step(b, m, sample_weight=1 / 8), 4)
    assert sent == [[0.0, 5.0], [0.0, 5.0]]  # one agreement per attempt, for the whole step (2 micro-batches)
    assert runner.size == 2 and outcome.payload == [9.0] and outcome.failures == 1
    assert float(w.grad) == pytest.approx(_hand_gradient(0.5, x.numpy(), y.numpy()), rel=1e-12)


def test_runner_fails_every_rank_at_once_when_nobody_can_shrink() -> None:
    w = torch.tensor(0.5, requires_grad=True)
    runner, _ = _runner(w, agree=lambda values: [2.0, *values[1:]])  # another rank failed at its minimum
    with pytest.raises(torch.OutOfMemoryError, match="smallest allowed micro-batch.*on another rank"):
        runner.run(_regression(4), [], lambda b, m: cut_step(b, m, sample_weight=1 / 4), 4)
    runner, _ = _runner(w, fail_above=0)
    with pytest.raises(torch.OutOfMemoryError, match=r"min_batch_size=1\) on this rank"):
        runner.run(_regression(4), [], lambda b, m: cut_step(b, m, sample_weight=1 / 4), 1)


def test_cut_step_weights_and_padded_length() -> None:
    batch = {"input_ids": torch.zeros(10, 7, dtype=torch.long), "labels": torch.full((10, 7), -100)}
    pieces = cut_step(batch, 4, sample_weight=1 / 16, tail=2, tail_weight=1 / 8)
    assert [(p.samples, p.weight, p.seq_len) for p in pieces] == [(4, 0.25, 7), (4, 0.25, 7), (2, 0.25, 7)]


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        pytest.param(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), True, id="oom-type"),
        pytest.param(RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"), True),
        pytest.param(RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED"), True, id="cudnn"),
        pytest.param(RuntimeError("CUDA error: out of memory"), True, id="cuda-raw"),
        pytest.param(RuntimeError("CUDA error: device-side assert triggered"), False, id="assert"),
        pytest.param(NotImplementedError("CUDA out of memory"), False, id="other-type"),
        pytest.param(ValueError("CUBLAS_STATUS_ALLOC_FAILED"), False, id="value-error"),
    ],
)
def test_allocation_failures_are_classified_by_type_then_message(error: BaseException, expected: bool) -> None:
    assert is_allocation_failure(error) is expected


# -- the simulated device ------------------------------------------------------------------------------------------
def test_simulated_caching_allocator_keeps_blocks_until_free_and_fragments() -> None:
    fragmented = lt.SimulatedMemory(10_000, 2_000, 100, fragmentation=0.25)
    fragmented.before_micro_batch(32)  # 3200 -> a 4000 block
    fragmented.before_micro_batch(16)  # served by the cached 4000 block: used whole
    assert fragmented.allocated_bytes() == 6_000 and fragmented.reserved_bytes() == 6_000
    fragmented.before_micro_batch(48)  # 4800 fits no cached block: a new 6000 one; 12000 > 10000: cache dropped
    assert fragmented.pressure() and fragmented.reserved_bytes() == 8_000
    fragmented.before_micro_batch(8)  # the 48-sample block goes to the cache, the 8-sample one reuses it
    assert fragmented.reserved_bytes() == 8_000 and fragmented.allocated_bytes() == 8_000
    expandable = lt.SimulatedMemory(10_000, 2_000, 100, fragmentation=0.25, expandable_segments=True)
    for size in (32, 16, 48):
        expandable.before_micro_batch(size)
    assert not expandable.pressure() and expandable.reserved_bytes() == 6_800  # one growing segment, no waste
    expandable.before_micro_batch(8)
    assert expandable.reserved_bytes() == 6_800 and expandable.allocated_bytes() == 2_800  # kept until free()
    expandable.free()
    assert expandable.reserved_bytes() == 2_000


def test_simulated_memory_held_by_live_tensors_and_outside_pytorch() -> None:
    memory = lt.SimulatedMemory(10_000, 2_000, 100, outside_bytes=3_000, activations="tensors")
    assert memory.capacity_bytes() == 7_000
    kept = memory.through(torch.ones(40, 2))
    assert memory.allocated_bytes() == 6_000
    with pytest.raises(torch.OutOfMemoryError):
        memory.through(torch.ones(20, 2))  # 2000 more do not fit next to the live 40
    del kept
    memory.free()
    memory.through(torch.ones(20, 2))
    cublas = lt.SimulatedMemory(1_000, 0, 10, fail_as="cublas")
    with pytest.raises(RuntimeError, match="CUBLAS_STATUS_ALLOC_FAILED"):
        cublas.before_micro_batch(101)


def test_expandable_segments_is_read_from_the_allocator_config(monkeypatch: pytest.MonkeyPatch) -> None:
    assert expandable_segments("max_split_size_mb:64,expandable_segments:True")
    assert not expandable_segments("expandable_segments:False")
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    with _fake_cuda():
        assert CudaMemory("cuda:0").expandable_segments


# -- defect 1: validation memory left out of decisions --------------------------------------------------------------
class ValidatedNet(Net):
    def __init__(self, memory: lt.SimulatedMemory, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.memory = memory

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.memory.before_micro_batch(80)  # evaluation at a larger batch: 2000 + 8000, over the 9000 target

    def val_dataloader(self) -> DataLoader:
        return DataLoader(Indexed(16), batch_size=16)


class Decisions(Callback):
    def __init__(self, dyn: lt.DynamicBatchSize) -> None:
        self.dyn, self.reasons = dyn, []  # type: ignore[var-annotated]

    def on_train_batch_end(self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.dyn.last_decision is not None:
            self.reasons.append(self.dyn.last_decision.reason)


def test_validation_memory_stays_out_of_decisions(tmp_path: Path) -> None:
    memory = sim()
    dyn = lt.DynamicBatchSize(adjust_every=2, probe=memory)
    decisions = Decisions(dyn)
    model = ValidatedNet(memory, batch_size=8, n=1024)
    fit(model, [dyn, decisions], tmp_path, accumulate_grad_batches=16, val_check_interval=16, num_sanity_val_steps=0)
    assert "shrink" not in decisions.reasons
    assert dyn.batch_size == 64  # where it settles without validation


# -- defect 2: recovery outside the except block --------------------------------------------------------------------
class HoldingNet(Net):
    """Activations owned by real tensors; a further allocation inside forward fails at more than ``limit`` samples."""

    def __init__(self, memory: lt.SimulatedMemory | None, limit: int = 10**9, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.memory, self.limit = memory, limit

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, _ = batch
        hidden = self.net[1](self.net[0](x))
        if self.memory is not None:
            hidden = self.memory.through(hidden)  # owned by `hidden`, which mul saves for backward (autocast or not)
            if x.shape[0] > self.limit:
                self.memory.hold(10**6)  # a workspace that cannot fit: out of memory inside forward
        loss = nn.functional.mse_loss(self.net[2](hidden * hidden), y)
        return loss if self.memory is None else self.memory.with_backward(loss)


def test_recovery_frees_the_failed_forward_before_measuring(tmp_path: Path) -> None:
    memory = lt.SimulatedMemory(10_000, 2_000, 120, activations="tensors")  # 64 samples: 9680 reserved, over 9000
    dyn = lt.DynamicBatchSize(adjust_every=2, multiple_of=32, probe=memory)
    decisions = Decisions(dyn)
    model = HoldingNet(memory, limit=32, batch_size=64, n=512)
    fit(model, [dyn, decisions], tmp_path)
    assert dyn.oom_recoveries == 1  # 64 -> 32, once
    assert "shrink" not in decisions.reasons and dyn.batch_size == 32  # no second shrink from a stale peak


# -- defect 3: an OOM in backward under 16-mixed --------------------------------------------------------------------
def _fp16() -> list[Any]:
    return [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**10))]


def test_backward_oom_under_16_mixed_recovers_in_one_shrink(tmp_path: Path) -> None:
    reference = HoldingNet(None, batch_size=16)
    fit(reference, [], tmp_path, plugins=_fp16(), max_steps=6)
    # 16 samples: 1000 + 1600 forward + 1600 backward > 3000; 8 samples fit only if nothing of the 16 stays alive
    memory = lt.SimulatedMemory(3_000, 1_000, 100, activations="tensors", backward_bytes_per_sample=100)
    dyn = lt.DynamicBatchSize(adjust_every=1000, multiple_of=4, probe=memory)
    model = HoldingNet(memory, batch_size=16)
    fit(model, [dyn], tmp_path, plugins=_fp16(), max_steps=6)
    assert dyn.oom_recoveries == 1 and dyn.batch_size == 8
    for ours, theirs in zip(_weights(model), _weights(reference), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-3, atol=2e-4)


# -- defect 5: the budget is what PyTorch can get ----------------------------------------------------------------
def test_memory_outside_pytorch_is_left_out_of_the_budget(tmp_path: Path) -> None:
    memory = lt.SimulatedMemory(10_000, 2_000, 100, outside_bytes=3_000)  # 7000 for PyTorch: 0.9 x 7000 = 6300
    dyn = lt.DynamicBatchSize(adjust_every=2, probe=memory)
    record = Record(dyn)
    fit(Net(batch_size=8, n=1024), [dyn, record], tmp_path, accumulate_grad_batches=16)
    assert dyn.batch_size == 40 and memory.out_of_memory_errors == 0  # (6300 - 2000) / 100 = 43 -> 40
    assert_each_sample_once(record, 1024)


def test_reserve_gib_is_kept_free(tmp_path: Path) -> None:
    def settle(**kwargs: Any) -> int | None:
        memory = lt.SimulatedMemory(16 * GIB, 2 * GIB, GIB // 4)
        dyn = lt.DynamicBatchSize(adjust_every=2, probe=memory, **kwargs)
        fit(Net(batch_size=8, n=1024), [dyn], tmp_path, accumulate_grad_batches=16)
        return dyn.batch_size

    assert settle() == 48  # 0.9 x 16 GiB = 14.4: (14.4 - 2) x 4 = 49.6
    assert settle(reserve_gib=4.0) == 40  # 16 - 4 = 12 GiB: (12 - 2) x 4 = 40


class _FakeCuda:
    """``torch.cuda``'s memory functions over a device whose numbers the test sets."""

    def __init__(self) -> None:
        self.current, self.free, self.reserved, self.allocated, self.peak = 0, 6 * GIB, 2 * GIB, GIB, 5 * GIB
        self.devices: list[Any] = []

    def patches(self) -> list[Any]:
        def seen(result: Any) -> Any:
            def call(device: Any = None) -> Any:
                self.devices.append(torch.device(device) if device is not None else None)
                return result() if callable(result) else result

            return call

        def reset(device: Any = None) -> None:
            self.peak = self.allocated

        def stats(device: Any = None) -> dict[str, int]:  # what torch's memory_allocated() & co. read
            self.devices.append(torch.device(device) if device is not None else None)
            return {
                "allocated_bytes.all.current": self.allocated,
                "allocated_bytes.all.peak": self.peak,
                "reserved_bytes.all.current": self.reserved,
                "num_alloc_retries": 0,
            }

        cuda = "torch.cuda."
        return [
            mock.patch(cuda + "is_available", return_value=True),
            mock.patch(cuda + "current_device", side_effect=lambda: self.current),
            mock.patch(cuda + "mem_get_info", side_effect=seen(lambda: (self.free, 16 * GIB))),
            mock.patch(cuda + "memory_reserved", side_effect=seen(lambda: self.reserved)),
            mock.patch(cuda + "memory_allocated", side_effect=seen(lambda: self.allocated)),
            mock.patch(cuda + "max_memory_allocated", side_effect=seen(lambda: self.peak)),
            mock.patch(cuda + "max_memory_reserved", side_effect=seen(lambda: self.peak)),
            mock.patch(cuda + "memory_stats", side_effect=stats),
            mock.patch(cuda + "reset_peak_memory_stats", side_effect=reset),
        ]


class _fake_cuda:  # noqa: N801
    def __init__(self) -> None:
        self.fake = _FakeCuda()
        self._patches = self.fake.patches()

    def __enter__(self) -> _FakeCuda:
        for patch in self._patches:
            patch.start()
        return self.fake

    def __exit__(self, *exc: object) -> None:
        for patch in reversed(self._patches):
            patch.stop()


def test_cuda_budget_is_free_memory_plus_reserved() -> None:
    with _fake_cuda():
        assert CudaMemory("cuda:0").capacity_bytes() == 8 * GIB  # 6 free + 2 held by the allocator, not 16


# -- defect 6: allocation failures that are not torch.OutOfMemoryError, and in the optimizer step ----------------------
@pytest.mark.parametrize("kind", ["cublas", "cudnn"])
def test_library_allocation_failures_are_recovered(tmp_path: Path, kind: str) -> None:
    reference = Net(batch_size=32)
    fit(reference, [], tmp_path)
    memory = lt.SimulatedMemory(10_000, 2_000, 500, fail_as=kind)  # type: ignore[arg-type]
    dyn = lt.DynamicBatchSize(adjust_every=3, multiple_of=4, probe=memory)
    model = Net(batch_size=32)
    fit(model, [dyn], tmp_path)
    assert dyn.oom_recoveries >= 1 and memory.out_of_memory_errors == dyn.oom_recoveries
    for ours, theirs in zip(_weights(model), _weights(reference), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


class StateOomSGD(torch.optim.SGD):
    """SGD with momentum whose first ``fail`` steps run out of memory while creating the momentum buffers."""

    fail = 1

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        loss = closure() if closure is not None else None
        if StateOomSGD.fail > 0:
            StateOomSGD.fail -= 1
            first = self.param_groups[0]["params"][0]
            self.state[first]["momentum_buffer"] = torch.zeros_like(first)  # state started, then the device is full
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB (optimizer state)")
        super().step()
        return loss


class MomentumNet(Net):
    def __init__(self, optimizer: type[torch.optim.SGD], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.optimizer = optimizer

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return self.optimizer(self.parameters(), lr=self.lr, momentum=0.9)


def test_optimizer_step_oom_is_retried_once_then_explained(tmp_path: Path) -> None:
    reference = MomentumNet(torch.optim.SGD, batch_size=16)
    fit(reference, [], tmp_path, max_steps=5)
    StateOomSGD.fail = 1
    model = MomentumNet(StateOomSGD, batch_size=16)
    with pytest.warns(UserWarning, match="out of memory in the optimizer step.*retrying once"):
        fit(model, [lt.DynamicBatchSize(probe=sim())], tmp_path, max_steps=5)
    for ours, theirs in zip(_weights(model), _weights(reference), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)
    StateOomSGD.fail = 2
    with pytest.raises(torch.OutOfMemoryError, match="optimizer step.*does not fit.*lightning-tune calc"):
        fit(MomentumNet(StateOomSGD, batch_size=16), [lt.DynamicBatchSize(probe=sim())], tmp_path, max_steps=5)


class GroupOomAdamW(torch.optim.AdamW):
    """torch's AdamW, out of memory once while creating the state of group ``fail_group`` (its own code runs)."""

    fail_group: int | None = None

    def _init_group(self, group: dict[str, Any], *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        if GroupOomAdamW.fail_group is None or group is not self.param_groups[GroupOomAdamW.fail_group]:
            return super()._init_group(group, *args, **kwargs)
        GroupOomAdamW.fail_group = None
        zeros_like, calls = torch.zeros_like, []

        def full(*a: Any, **k: Any) -> torch.Tensor:  # the second state tensor does not fit
            calls.append(1)
            if len(calls) == 2:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB (optimizer state)")
            return zeros_like(*a, **k)

        with mock.patch.object(torch, "zeros_like", full):
            return super()._init_group(group, *args, **kwargs)


class TwoGroupNet(Net):
    """Weight decay on the weights, none on the biases: the two groups of a usual fine-tune."""

    def __init__(self, optimizer: type[torch.optim.AdamW], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.optimizer = optimizer

    def configure_optimizers(self) -> torch.optim.Optimizer:
        weights = [p for n, p in self.named_parameters() if n.endswith("weight")]
        biases = [p for n, p in self.named_parameters() if n.endswith("bias")]
        return self.optimizer([{"params": weights}, {"params": biases, "weight_decay": 0.0}], lr=0.01)


def test_optimizer_step_oom_after_a_group_was_updated_is_not_retried(tmp_path: Path) -> None:
    reference = TwoGroupNet(torch.optim.AdamW, batch_size=16)
    fit(reference, [], tmp_path, max_steps=3)
    GroupOomAdamW.fail_group = 0  # before any update: retried, the weights are AdamW's own
    model = TwoGroupNet(GroupOomAdamW, batch_size=16)
    with pytest.warns(UserWarning, match="retrying once"):
        fit(model, [lt.DynamicBatchSize(probe=sim())], tmp_path, max_steps=3)
    for ours, theirs in zip(_weights(model), _weights(reference), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)
    GroupOomAdamW.fail_group = 1  # the weights were updated already: a retry would update them twice
    with pytest.raises(torch.OutOfMemoryError, match="optimizer step.*does not fit"):
        fit(TwoGroupNet(GroupOomAdamW, batch_size=16), [lt.DynamicBatchSize(probe=sim())], tmp_path, max_steps=3)


def test_only_ddps_reducing_backward_is_called_unrecoverable() -> None:
    """A micro-batch's backward under ``no_sync`` is recovered by the runner: its OOM must not say training stops."""
    import types

    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ddp = nn.parallel.DistributedDataParallel(nn.Linear(2, 1))
        dyn = lt.DynamicBatchSize(probe=sim())
        dyn._trainer = types.SimpleNamespace(world_size=2, strategy=types.SimpleNamespace(model=ddp))  # type: ignore[assignment]
        dyn.runner = mock.Mock()

        def backward(loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")

        dyn._originals["backward"] = backward
        loss = ddp(torch.ones(1, 2)).sum()
        with ddp.no_sync(), pytest.raises(torch.OutOfMemoryError) as inside:  # the runner's micro-batch
            dyn._backward(loss)
        assert str(inside.value) == "CUDA out of memory. Tried to allocate 2.00 MiB"
        with pytest.raises(torch.OutOfMemoryError, match="last micro-batch's backward.*training stops"):
            dyn._backward(loss)  # Lightning's, which all-reduces: it cannot be agreed
    finally:
        dist.destroy_process_group()


# -- defects 7 and 8: the monitor's peak and the probe's device ------------------------------------------------------
def test_interval_resets_keep_the_runs_peak_for_the_monitor() -> None:
    with _fake_cuda() as fake:
        probe = CudaMemory("cuda:0")
        probe.reset_peak()  # a decision: torch's peak counter now reads 1 GiB
        assert probe.peak_bytes() == GIB
        assert cuda_memory_metrics(torch.device("cuda:0"))["vram_peak_gib"] == 5.0  # the run's peak stays
        fake.allocated = fake.peak = 6 * GIB
        assert cuda_memory_metrics(torch.device("cuda:0"))["vram_peak_gib"] == 6.0
        reset_run_peak(torch.device("cuda:0"))  # a new run (the bench runner's next batch size): nothing kept
        fake.peak = 2 * GIB
        assert cuda_memory_metrics(torch.device("cuda:0"))["vram_peak_gib"] == 2.0


def test_a_probe_without_a_device_reads_the_device_set_later() -> None:
    with _fake_cuda() as fake:
        probe = CudaMemory()  # built before the Trainer sets each rank's device
        fake.current = 1  # DDP's set_device on rank 1
        assert probe.device == torch.device("cuda", 1)
        fake.devices.clear()
        probe.capacity_bytes()
        assert set(fake.devices) == {torch.device("cuda", 1)}


# -- what the user sees ----------------------------------------------------------------------------------------------
def test_changes_recoveries_and_a_summary_are_reported(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    memory = sim(per_sample=500)  # 32 never fits
    dyn = lt.DynamicBatchSize(adjust_every=3, multiple_of=4, probe=memory)
    again = "out of memory at a micro-batch of 32 samples.*again at 16 samples"
    with caplog.at_level("INFO"), pytest.warns(UserWarning, match=again):
        fit(Net(batch_size=32, n=256), [dyn], tmp_path)
    assert "DynamicBatchSize: micro-batch 32 samples -> 16 samples (oom)" in caplog.text
    assert f"settled at micro-batch {dyn.batch_size}" in caplog.text
    assert dyn.oom_recoveries == 1 and f"{dyn.decisions} decisions, 1 out-of-memory error recovered" in caplog.text


# -- issue 15: resuming under another configuration, and Lightning's resume warning ---------------------------------
def _checkpoint(tmp_path: Path, batch_size: int, steps: int) -> Path:
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=steps, save_top_k=-1)
    fit(
        Net(batch_size=batch_size, shuffle=True),
        [lt.DynamicBatchSize(adjust_every=2, multiple_of=4, probe=sim()), ckpt],
        tmp_path / "a",
        max_steps=steps,
        enable_checkpointing=True,
    )
    return tmp_path / "ckpt" / f"epoch=0-step={steps}.ckpt"


def test_resume_with_another_dataloader_batch_uses_it_and_says_so(tmp_path: Path) -> None:
    path = _checkpoint(tmp_path, 16, 4)
    dyn = lt.DynamicBatchSize(adjust_every=2, multiple_of=4, probe=sim())
    record = Record(dyn)
    with pytest.warns(UserWarning, match="DataLoader batch 16 x accumulate_grad_batches 1; this run configures 32 x 1"):
        fit(Net(batch_size=32, shuffle=True), [dyn, record], tmp_path / "b", ckpt_path=str(path))
    assert dyn.effective_batch_size == 32
    assert {n for n, _ in record.lrs} == {32}  # every resumed step has the new effective batch
    assert len(record.seen[0]) == len(set(record.seen[0])) == 256 - 4 * 16  # the rest of the epoch, each once


def test_mid_epoch_resume_does_not_claim_the_loader_is_not_resumable(tmp_path: Path) -> None:
    path = _checkpoint(tmp_path, 16, 4)
    with pytest.warns(UserWarning, match="dataloader is not resumable"):  # Lightning's warning without the callback
        fit(Net(batch_size=16, shuffle=True), [], tmp_path / "plain", ckpt_path=str(path))
    dyn = lt.DynamicBatchSize(adjust_every=2, multiple_of=4, probe=sim())
    record = Record(dyn)
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(Net(batch_size=16, shuffle=True), [dyn, record], tmp_path / "b", ckpt_path=str(path))
    assert not [w for w in caught if "not resumable" in str(w.message)]
    assert len(record.seen[0]) == 256 - 4 * 16  # it really resumed mid-epoch, after the 64 samples trained


# -- on a GPU --------------------------------------------------------------------------------------------------------
class Wide(Net):
    """A model whose activations are large enough to fill a GPU at a batch of a few thousand."""

    def __init__(self, width: int = 8192, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        torch.manual_seed(0)
        layers = [nn.Linear(8, width), nn.GELU(), nn.Linear(width, width), nn.GELU(), nn.Linear(width, 1)]
        self.net = nn.Sequential(*layers)


def _gpu_fit(model: Net, callbacks: list[Callback], tmp_path: Path, **kwargs: Any) -> Trainer:
    trainer = Trainer(
        default_root_dir=tmp_path,
        accelerator="gpu",
        devices=1,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )
    trainer.fit(model)
    return trainer


@pytest.mark.gpu
def test_gpu_real_oom_is_recovered_and_memory_freed(tmp_path: Path) -> None:
    free, _ = torch.cuda.mem_get_info()
    per_sample = 2 * 8192 * 4 * 4  # two hidden layers, kept for backward, fp32, with GELU copies
    huge = int(2 * free / per_sample)  # cannot fit
    reserved: list[int] = []

    class Watch(Callback):
        def on_train_batch_end(self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, i: int) -> None:
            reserved.append(torch.cuda.memory_reserved())

    dyn = lt.DynamicBatchSize(target_vram=0.8, adjust_every=1000, multiple_of=64)
    fit_trainer = _gpu_fit(Wide(batch_size=huge, n=huge), [dyn, Watch()], tmp_path, max_steps=1)
    assert dyn.oom_recoveries >= 1 and fit_trainer.global_step == 1
    assert reserved[0] < free  # what the failed attempts had reserved was given back


@pytest.mark.gpu
def test_gpu_validation_is_left_out_and_peak_settles_under_target(tmp_path: Path) -> None:
    class Validated(Wide):
        def validation_step(self, batch: Any, batch_idx: int) -> None:
            with torch.no_grad():
                self.net(batch[0]).sum()

        def val_dataloader(self) -> DataLoader:
            return DataLoader(Indexed(4096), batch_size=4096)

    dyn = lt.DynamicBatchSize(target_vram=0.5, adjust_every=4, multiple_of=1, min_change=0.0)
    decisions = Decisions(dyn)
    model = Validated(batch_size=4096, n=4096 * 24)
    # memory must bind before the effective batch of 4096 on any device: tensors held beside the model (as a large
    # model's weights would be) leave half the device for about 1,024 samples (about 42 bytes a sample per unit of
    # width, as measured on an H200), on 24 GB as on 141 GB
    free, _ = torch.cuda.mem_get_info()
    half = (free + torch.cuda.memory_reserved()) // 2
    held = torch.empty(max(0, half - 1024 * 42 * 8192), dtype=torch.uint8, device="cuda")
    torch.cuda.reset_peak_memory_stats()
    _gpu_fit(model, [dyn, decisions], tmp_path, max_steps=24, val_check_interval=8, num_sanity_val_steps=0)
    assert held.numel() > 0 and dyn.batch_size is not None and dyn.batch_size < 4096  # memory bound, not the batch
    capacity = dyn.probe.capacity_bytes()  # type: ignore[union-attr]
    assert "shrink" not in decisions.reasons and dyn.oom_recoveries == 0
    model_peak = dyn.controller.model.predict(dyn.batch_size or 1) or math.inf
    step = dyn.controller.model.bytes_per_sample or 0
    assert model_peak <= 0.5 * capacity and model_peak + step > 0.5 * capacity - step  # within one grid step
