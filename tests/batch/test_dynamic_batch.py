"""DynamicBatchSize: settling, OOM recovery, exactly-once sampling, weights equal to a fixed-batch run, resume."""

from __future__ import annotations

import collections
import math
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, Dataset, IterableDataset, SequentialSampler

import lightning_tune as lt
from lightning_tune.batch import BatchSizeController
from lightning_tune.batch.control import Decision
from lightning_tune.batch.memory import MemoryModel
from lightning_tune.batch.sampler import ResizableBatchSampler
from lightning_tune.batch.split import split_batch
from lightning_tune.callbacks import _resizable_loader
from tests import helpers

MiB = 1 << 20


class Indexed(Dataset):
    """Regression samples that also return their own index, so the test can count what was trained."""

    def __init__(self, n: int = 256) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 8, generator=g)
        self.y = self.x @ torch.randn(8, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.x[i], self.y[i], i


class Net(LightningModule):
    def __init__(
        self,
        batch_size: int = 8,
        n: int = 256,
        shuffle: bool = False,
        lr: float = 0.05,
        workers: int = 0,
        persistent: bool = False,
    ) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        self.batch_size, self.n, self.shuffle, self.lr = batch_size, n, shuffle, lr
        self.workers, self.persistent = workers, persistent

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, _ = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            Indexed(self.n),
            batch_size=self.batch_size,
            shuffle=self.shuffle,
            num_workers=self.workers,
            persistent_workers=self.persistent,
        )


class Record(Callback):
    """Sample indices trained per epoch, and the callback's batch size after every step."""

    def __init__(self, dyn: lt.DynamicBatchSize | None = None) -> None:
        self.dyn = dyn
        self.seen: dict[int, list[int]] = collections.defaultdict(list)
        self.sizes: list[int | None] = []
        self.lrs: list[tuple[int, float]] = []  # (samples in the step, LR it used)

    def on_train_batch_end(self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.seen[trainer.current_epoch].extend(batch[2].tolist())
        self.lrs.append((len(batch[2]), trainer.optimizers[0].param_groups[0]["lr"]))
        if self.dyn is not None:
            self.sizes.append(self.dyn.batch_size)


def fit(model: LightningModule, callbacks: list[Callback], tmp_path: Path, **kwargs: Any) -> Trainer:
    """:func:`tests.helpers.fit` with Lightning's own validation defaults: these modules validate."""
    defaults = {"limit_val_batches": None, "num_sanity_val_steps": None, "deterministic": None}
    return helpers.fit(model, callbacks, tmp_path, **{**defaults, **kwargs})


def sim(total: int = 10_000, fixed: int = 2_000, per_sample: int = 100) -> lt.SimulatedMemory:
    return lt.SimulatedMemory(total_bytes=total, fixed_bytes=fixed, bytes_per_sample=per_sample)


def assert_each_sample_once(record: Record, n: int) -> None:
    for epoch, seen in record.seen.items():
        counts = collections.Counter(seen)
        assert sorted(counts) == list(range(n)), f"epoch {epoch}: samples missing"
        assert set(counts.values()) == {1}, f"epoch {epoch}: samples trained twice"


# -- the engine ------------------------------------------------------------------------------------------
def test_memory_model_recovers_a_line_exactly() -> None:
    model = MemoryModel()
    for b in (8, 16, 40):
        model.observe(b, 2_000 + 100 * b)
    assert model.fixed_bytes == pytest.approx(2_000)
    assert model.bytes_per_sample == pytest.approx(100)
    assert model.largest_batch(9_000) == pytest.approx(70)


def test_memory_model_overestimates_from_one_point_and_restarts_on_a_change() -> None:
    model = MemoryModel()
    model.observe(10, 3_000)
    assert model.predict(20) == 6_000  # no fixed part assumed: the real 4_000 is below
    model.observe(20, 4_000)
    assert model.predict(30) == pytest.approx(5_000)
    model.observe(30, 5_000)
    model.observe(20, 6_000)  # per-sample memory doubled: one miss may be noise, the fit is kept
    assert model.sizes_seen == 3
    model.observe(30, 8_000)  # a second miss running: older points dropped
    assert model.sizes_seen == 1


def test_controller_holds_within_min_change() -> None:
    ctl = BatchSizeController(target=0.9, min_batch_size=1, max_batch_size=None, multiple_of=8, min_change=0.5)
    ctl.model.observe(40, 6_000)
    decision = ctl.decide(64, peak_bytes=8_400, total_bytes=10_000)  # 100/sample: 70 fits, 64 -> 64 (+0 %)
    assert decision == Decision(64, 0.84, "hold")


@pytest.mark.parametrize(
    ("size", "cap", "expected"),
    [
        pytest.param(70.0, None, 64, id="multiple"),
        pytest.param(5.5, None, 4, id="halving-below-multiple"),
        pytest.param(0.3, None, 1, id="min"),
        pytest.param(100.0, 36, 36, id="cap-on-grid"),
        pytest.param(35.0, 36, 32, id="below-cap"),
    ],
)
def test_grid_rounding(size: float, cap: int | None, expected: int) -> None:
    ctl = BatchSizeController(target=0.9, min_batch_size=1, max_batch_size=None, multiple_of=8)
    assert ctl.round_down(size, cap) == expected


def test_resizable_sampler_keeps_order_and_counts_length() -> None:
    sampler = ResizableBatchSampler(SequentialSampler(range(10)), batch_size=3)
    assert len(sampler) == 4
    it = iter(sampler)
    assert next(it) == [0, 1, 2]
    sampler.batch_size = 5
    assert len(sampler) == 1 + 2
    assert list(it) == [[3, 4, 5, 6, 7], [8, 9]]


def test_resizable_sampler_drop_last_matches_batch_sampler() -> None:
    reference = [i for batch in BatchSampler(SequentialSampler(range(10)), 4, drop_last=True) for i in batch]
    ours = ResizableBatchSampler(SequentialSampler(range(10)), batch_size=8, drop_last=True, granule=4)
    assert [i for batch in ours for i in batch] == reference


def test_split_batch_round_trips() -> None:
    x = torch.arange(10).reshape(5, 2)
    parts = split_batch((x, {"m": torch.ones(5)}), 2)
    assert [p[0].shape[0] for p in parts] == [2, 2, 1]
    assert torch.equal(torch.cat([p[0] for p in parts]), x)
    with pytest.raises(TypeError, match="cannot split a batch of type str"):
        split_batch("text", 2)


# -- settling ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("loader_batch", "accumulation"),
    [pytest.param(8, 16, id="too-small-start"), pytest.param(128, 1, id="too-large-start")],
)
def test_settles_at_the_largest_size_under_target_within_three_decisions(
    tmp_path: Path, loader_batch: int, accumulation: int
) -> None:
    # 2000 fixed + 100 per sample, target 90 % of 10000: 70 samples fit, 64 is the largest multiple of 8
    dyn = lt.DynamicBatchSize(target_vram=0.9, adjust_every=2, probe=sim())
    record = Record(dyn)
    fit(Net(batch_size=loader_batch, n=1024), [dyn, record], tmp_path, accumulate_grad_batches=accumulation)
    decisions_done = 3
    assert record.sizes[2 * decisions_done - 1 :] == [64] * (len(record.sizes) - 2 * decisions_done + 1)
    assert dyn.effective_batch_size == 128
    assert dyn.accumulate_grad_batches == 2
    assert_each_sample_once(record, 1024)


def test_growth_stops_at_max_batch_size(tmp_path: Path) -> None:
    dyn = lt.DynamicBatchSize(max_batch_size=24, adjust_every=1, probe=sim())
    record = Record(dyn)
    fit(Net(batch_size=8, n=512), [dyn, record], tmp_path, accumulate_grad_batches=16)
    assert max(s for s in record.sizes if s is not None) == 24
    assert record.sizes[-1] == 24


def test_oom_after_memory_doubles_is_survived_and_settles_lower(tmp_path: Path) -> None:
    memory = sim()
    dyn = lt.DynamicBatchSize(adjust_every=2, probe=memory)

    class Double(Callback):
        def on_train_epoch_start(self, trainer: Trainer, pl_module: Any) -> None:
            if trainer.current_epoch == 1:
                memory.bytes_per_sample = 200  # now 35 samples fit the target

    record = Record(dyn)
    fit(Net(batch_size=8, n=1024), [dyn, Double(), record], tmp_path, accumulate_grad_batches=16, max_epochs=2)
    assert memory.out_of_memory_errors >= 1
    assert dyn.oom_recoveries == memory.out_of_memory_errors
    assert record.sizes[-1] == 32
    assert_each_sample_once(record, 1024)


# -- the training mathematics ------------------------------------------------------------------------------------------
def _weights(model: LightningModule) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def test_keep_effective_gives_the_weights_of_a_fixed_batch_run(tmp_path: Path) -> None:
    reference = Net(batch_size=8)
    fit(reference, [], tmp_path, accumulate_grad_batches=4, max_epochs=2)
    # 32 samples per step; the simulated device fits 17.5 within target: the first step runs 4 x 8, the rest 16 + 16
    memory = sim(total=10_000, fixed=2_000, per_sample=400)
    dyn = lt.DynamicBatchSize(adjust_every=1, multiple_of=4, probe=memory)
    model = Net(batch_size=8)
    record = Record(dyn)
    fit(model, [dyn, record], tmp_path, accumulate_grad_batches=4, max_epochs=2)
    assert set(record.sizes) == {16}  # the split really changed (sizes are recorded after each step's decision)
    for ours, theirs in zip(_weights(model), _weights(reference), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


def test_keep_effective_through_oom_recoveries_matches_too(tmp_path: Path) -> None:
    reference = Net(batch_size=32)
    fit(reference, [], tmp_path, max_epochs=1)
    memory = sim(total=10_000, fixed=2_000, per_sample=500)  # 32 samples never fit: OOM on the first step
    dyn = lt.DynamicBatchSize(adjust_every=3, multiple_of=4, probe=memory)
    model = Net(batch_size=32)
    fit(model, [dyn], tmp_path, max_epochs=1)
    assert dyn.oom_recoveries >= 1
    for ours, theirs in zip(_weights(model), _weights(reference), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


class OomInBackward(torch.autograd.Function):
    """Identity whose backward raises OutOfMemoryError when the micro-batch is larger than ``limit``."""

    limit = 10**9

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.rows = x.shape[0]
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        if ctx.rows > OomInBackward.limit:
            raise torch.OutOfMemoryError(f"backward of {ctx.rows} rows")
        return grad


class BackwardOomNet(Net):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, _ = batch
        hidden = OomInBackward.apply(self.net[1](self.net[0](x)))  # on an activation, so its backward runs
        return nn.functional.mse_loss(self.net[2](hidden), y)


def test_oom_in_backward_is_recovered_with_the_same_weights(tmp_path: Path) -> None:
    reference = Net(batch_size=16)
    fit(reference, [], tmp_path)
    OomInBackward.limit = 6
    try:
        dyn = lt.DynamicBatchSize(adjust_every=1000, multiple_of=2, probe=sim(total=10**9, fixed=0, per_sample=1))
        model = BackwardOomNet(batch_size=16)
        record = Record(dyn)
        fit(model, [dyn, record], tmp_path)
    finally:
        OomInBackward.limit = 10**9
    assert dyn.oom_recoveries == 2  # 16 -> 8 -> 4
    assert dyn.batch_size == 4
    assert_each_sample_once(record, 256)
    for ours, theirs in zip(_weights(model), _weights(reference), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


def test_keep_lr_rescales_as_scale_lr_says(tmp_path: Path) -> None:
    dyn = lt.DynamicBatchSize(adjust_every=2, keep="lr", lr_rule="sqrt", probe=sim())
    model = Net(batch_size=8, n=1024, lr=0.05)
    record = Record(dyn)
    trainer = fit(model, [dyn, record], tmp_path, accumulate_grad_batches=2)
    assert dyn.batch_size == 64
    assert dyn.effective_batch_size == 128
    assert {n for n, _ in record.lrs} >= {16, 128}  # the effective batch followed the micro-batch (8, then 64)
    for samples, lr in record.lrs:  # every step's LR is the configured one scaled for its effective batch
        assert lr == pytest.approx(lt.scale_lr(0.05, 16, samples, rule="sqrt"))
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(record.lrs[-1][1])
    assert_each_sample_once(record, 1024)


def test_keep_none_changes_the_batch_mid_epoch_without_losing_samples(tmp_path: Path) -> None:
    dyn = lt.DynamicBatchSize(adjust_every=1, keep="none", multiple_of=4, probe=sim(per_sample=150))
    model = Net(batch_size=4, n=500)
    record = Record(dyn)
    trainer = fit(model, [dyn, record], tmp_path, max_epochs=2)
    assert trainer.optimizers[0].param_groups[0]["lr"] == 0.05
    assert dyn.batch_size == 44  # (9000 - 2000) / 150 = 46.7
    assert_each_sample_once(record, 500)


def test_bf16_mixed_with_splitting(tmp_path: Path) -> None:
    reference = Net(batch_size=8)
    fit(reference, [], tmp_path, accumulate_grad_batches=4, precision="bf16-mixed")
    dyn = lt.DynamicBatchSize(adjust_every=1, multiple_of=4, probe=sim(per_sample=400))
    model = Net(batch_size=8)
    fit(model, [dyn], tmp_path, accumulate_grad_batches=4, precision="bf16-mixed")
    for ours, theirs in zip(_weights(model), _weights(reference), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=2e-2, atol=2e-3)


# -- checkpoints -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("workers", [pytest.param(0, id="in-process"), pytest.param(2, id="two-workers")])
def test_resume_mid_epoch_restores_size_position_and_weights(tmp_path: Path, workers: int) -> None:
    def dyn() -> lt.DynamicBatchSize:
        return lt.DynamicBatchSize(adjust_every=2, multiple_of=4, probe=sim(per_sample=400))

    full_dyn = dyn()
    full = Net(batch_size=8, shuffle=True, workers=workers)
    torch.manual_seed(1234)
    fit(full, [full_dyn], tmp_path / "full", accumulate_grad_batches=4, max_epochs=1)

    first_dyn, first = dyn(), Net(batch_size=8, shuffle=True, workers=workers)
    record = Record(first_dyn)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=5, save_top_k=-1)
    torch.manual_seed(1234)
    fit(
        first,
        [first_dyn, record, ckpt],
        tmp_path / "a",
        accumulate_grad_batches=4,
        max_steps=5,
        enable_checkpointing=True,
    )
    path = tmp_path / "ckpt" / "epoch=0-step=5.ckpt"
    assert path.exists()
    saved = torch.load(path, weights_only=False)
    state = next(v for k, v in saved["callbacks"].items() if k.startswith("DynamicBatchSize"))
    assert state["consumed"] == 5 * 32

    second_dyn, second = dyn(), Net(batch_size=8, shuffle=True, workers=workers)
    resumed = Record(second_dyn)
    fit(second, [second_dyn, resumed], tmp_path / "b", accumulate_grad_batches=4, max_epochs=1, ckpt_path=str(path))
    assert second_dyn.oom_recoveries == state["oom_recoveries"]
    epoch0 = record.seen[0] + resumed.seen[0]
    assert sorted(epoch0) == list(range(256))
    assert second_dyn.batch_size == full_dyn.batch_size
    # the interrupted run ends where the whole one does
    for ours, theirs in zip(_weights(second), _weights(full), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


# -- errors and no-ops -------------------------------------------------------------------------------------------------
class Stream(IterableDataset):
    def __iter__(self):  # type: ignore[no-untyped-def]
        yield from Indexed(16)


class FixedBatches(BatchSampler):
    pass


@pytest.mark.parametrize(
    ("loader", "message"),
    [
        pytest.param(lambda: DataLoader(Stream(), batch_size=4), "needs a map-style dataset", id="iterable"),
        pytest.param(
            lambda: DataLoader(Indexed(16), batch_sampler=FixedBatches(SequentialSampler(range(16)), 4, False)),
            "has a custom FixedBatches",
            id="custom-batch-sampler",
        ),
        pytest.param(lambda: DataLoader(Indexed(16), batch_size=None), "batch_size=None", id="no-batch-size"),
    ],
)
def test_unsupported_loaders_fail_at_fit_start(tmp_path: Path, loader: Any, message: str) -> None:
    class Custom(Net):
        def train_dataloader(self) -> DataLoader:
            return loader()

    with pytest.raises(MisconfigurationException, match=message):
        fit(Custom(), [lt.DynamicBatchSize(probe=sim())], tmp_path, max_steps=2)


def test_cpu_without_a_probe_warns_and_leaves_the_batch_alone(tmp_path: Path) -> None:
    dyn = lt.DynamicBatchSize(adjust_every=1)
    record = Record()
    with pytest.warns(UserWarning, match="no device memory to target.*padding is still trimmed.*SimulatedMemory"):
        fit(Net(batch_size=8), [dyn, record], tmp_path, max_steps=3)
    assert dyn.batch_size == 8 and dyn.decisions == 0  # the DataLoader's micro-batch, nothing decided
    assert [len(record.seen[0][i : i + 8]) for i in range(0, 24, 8)] == [8, 8, 8]


def test_manual_optimization_is_refused(tmp_path: Path) -> None:
    class Manual(Net):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False

    with pytest.raises(MisconfigurationException, match="needs automatic optimization"):
        fit(Manual(), [lt.DynamicBatchSize(probe=sim())], tmp_path, max_steps=1)


def test_module_is_restored_after_fit(tmp_path: Path) -> None:
    model = Net()
    fit(model, [lt.DynamicBatchSize(probe=sim())], tmp_path, max_steps=2)
    assert "training_step" not in vars(model)
    assert model.trainer.accumulate_grad_batches == 1


def test_an_lr_scheduler_sees_its_own_optimizer_step(tmp_path: Path) -> None:
    """torch's scheduler marks ``optimizer.step``; the retrying step keeps the mark and gives the step back after."""

    class Scheduled(Net):
        def configure_optimizers(self) -> Any:
            opt = torch.optim.SGD(self.parameters(), lr=self.lr)
            scheduler = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = fit(Scheduled(n=64), [lt.DynamicBatchSize(probe=sim(), adjust_every=2)], tmp_path, max_steps=3)
    assert not [w for w in caught if "optimizer.step()" in str(w.message)]  # torch's "overridden" warning
    optimizer = trainer.optimizers[0]
    assert getattr(optimizer.step, "_wrapped_by_lr_sched", False)  # the scheduler's wrapper is back
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.05 * 0.5**3)


def test_private_lightning_and_torch_hooks_still_exist() -> None:
    """The three private accesses of the callback, checked against the installed versions."""
    loader = DataLoader(Indexed(8), batch_size=2)
    sampler = ResizableBatchSampler(loader.sampler, 4)  # type: ignore[arg-type]
    _resizable_loader.set_batch_sampler(loader, sampler)
    assert [len(b[0]) for b in loader] == [4, 4]
    from lightning.pytorch.loops.fit_loop import _FitLoop

    fit_loop = _FitLoop(Trainer(logger=False))
    assert hasattr(fit_loop, "_data_fetcher") and hasattr(fit_loop, "_combined_loader")
    from lightning.pytorch.loops.fetchers import _DataFetcher

    assert "length" in vars(_DataFetcher())


BAD = [
    ({"target_vram": 0.0}, ValueError, "`target_vram` must be in (0, 0.98], got 0.0"),
    ({"target_vram": 1.0}, ValueError, "`target_vram` must be in (0, 0.98], got 1.0"),
    ({"reserve_gib": -1}, ValueError, "`reserve_gib` must be in [0, inf], got -1"),
    ({"agree_timeout": 0}, ValueError, "`agree_timeout` must be in (0, inf], got 0"),
    ({"min_batch_size": 0}, ValueError, "`min_batch_size` must be an integer >= 1, got 0"),
    ({"max_batch_size": -4}, ValueError, "`max_batch_size` must be an integer >= 1, got -4"),
    ({"min_batch_size": 16, "max_batch_size": 8}, ValueError, "`min_batch_size` (16) must not exceed `max_batch_size`"),
    ({"multiple_of": 0}, ValueError, "`multiple_of` must be an integer >= 1, got 0"),
    ({"adjust_every": 0}, ValueError, "`adjust_every` must be an integer >= 1, got 0"),
    ({"keep": "both"}, ValueError, "`keep` must be one of 'effective', 'lr', 'none', got 'both'"),
    ({"lr_rule": "cubic"}, ValueError, "`lr_rule` must be one of 'sqrt', 'linear', got 'cubic'"),
    ({"min_batch_size": 2.5}, TypeError, "`min_batch_size` must be an integer, got 2.5 (float)"),
    ({"probe": "cuda"}, TypeError, "`probe` must be a memory probe"),
    ({"prior": 3}, TypeError, "`prior` must be a MemoryEstimate (estimate_memory, measure_memory) or None, got 3"),
    ({"min_change": -0.1}, ValueError, "`min_change` must be in [0, inf], got -0.1"),
    ({"sync_oom": "yes"}, TypeError, "`sync_oom` must be True or False, got 'yes' (str)"),
]


@pytest.mark.parametrize(("kwargs", "error", "message"), BAD, ids=[str(k) for k, _, _ in BAD])
def test_bad_arguments(kwargs: dict[str, Any], error: type[Exception], message: str) -> None:
    with pytest.raises(error) as info:
        lt.DynamicBatchSize(**kwargs)
    assert message in str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"total_bytes": 100, "fixed_bytes": 100, "bytes_per_sample": 1}, "`fixed_bytes` + `outside_bytes` must be"),
        (
            {"total_bytes": 100, "fixed_bytes": 0, "bytes_per_sample": 1, "fragmentation": 1.0},
            "`fragmentation` must be in [0, 1)",
        ),
        ({"total_bytes": 100, "fixed_bytes": 0, "bytes_per_sample": 1, "fail_as": "nccl"}, "`fail_as` must be one of"),
        ({"total_bytes": 100, "fixed_bytes": 0, "bytes_per_sample": 0}, "`bytes_per_sample` must be an integer >= 1"),
        ({"total_bytes": 100, "fixed_bytes": 0, "bytes_per_sample": 1, "noise": 1.0}, "`noise` must be in [0, 1)"),
    ],
)
def test_simulated_memory_bad_arguments(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError) as info:
        lt.SimulatedMemory(**kwargs)
    assert message in str(info.value)


def test_arguments_past_target_vram_are_keyword_only() -> None:
    with pytest.raises(TypeError, match="positional argument"):
        lt.DynamicBatchSize(0.9, 1)  # type: ignore[misc]


def test_a_memory_plan_is_the_starting_point(tmp_path: Path) -> None:
    plan = lt.MemoryEstimate(parameters=250, weight_bytes=1_000, bytes_per_sample=100, fixed_bytes=2_000)
    dyn = lt.DynamicBatchSize(adjust_every=1, prior=plan, probe=sim())
    record = Record(dyn)
    fit(Net(batch_size=8), [dyn, record], tmp_path, accumulate_grad_batches=16)
    assert record.sizes == [64, 64]  # no probing: the plan's line gives 64 at once
    assert math.isclose(dyn.last_decision.predicted_fraction or 0, 0.84)  # type: ignore[union-attr]


def test_the_loss_callbacks_see_is_the_step_mean(tmp_path: Path) -> None:
    class Outputs(Callback):
        def __init__(self) -> None:
            self.losses: list[float] = []

        def on_train_batch_end(
            self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
        ) -> None:
            self.losses.append(float(outputs["loss"]))

    reference, ours = Outputs(), Outputs()
    fit(Net(batch_size=32), [reference], tmp_path, max_steps=4)
    fit(
        Net(batch_size=32), [lt.DynamicBatchSize(multiple_of=4, probe=sim(per_sample=400)), ours], tmp_path, max_steps=4
    )
    assert ours.losses == pytest.approx(reference.losses, rel=1e-5)  # split in two, shown as the mean over 32


# -- regressions found in review -----------------------------------------------------------------------------------
def test_persistent_workers_draw_from_the_new_sampler(tmp_path: Path) -> None:
    dyn = lt.DynamicBatchSize(adjust_every=1000, probe=sim())
    record = Record(dyn)
    model = Net(batch_size=8, shuffle=True, workers=2, persistent=True)
    fit(model, [dyn, record], tmp_path, accumulate_grad_batches=4, max_epochs=2)
    assert [n for n, _ in record.lrs] == [32] * 16  # whole steps, not the loader's batches of 8
    assert_each_sample_once(record, 256)


def test_keep_effective_is_exact_with_a_short_last_batch(tmp_path: Path) -> None:
    reference = Net(batch_size=8, n=260)  # 32 batches of 8 and one of 4
    fit(reference, [], tmp_path, accumulate_grad_batches=4, max_epochs=2)
    dyn = lt.DynamicBatchSize(adjust_every=1, multiple_of=4, probe=sim(per_sample=400))
    model = Net(batch_size=8, n=260)
    fit(model, [dyn], tmp_path, accumulate_grad_batches=4, max_epochs=2)
    for ours, theirs in zip(_weights(model), _weights(reference), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


class Validated(Net):
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.validations = getattr(self, "validations", 0) + (batch_idx == 0)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(Indexed(16), batch_size=8)


def test_keep_none_with_workers_keeps_epochs_whole(tmp_path: Path) -> None:
    dyn = lt.DynamicBatchSize(adjust_every=20, keep="none", multiple_of=4, probe=sim(per_sample=150))
    model = Validated(batch_size=4, n=512, workers=2)
    record = Record(dyn)
    fit(model, [dyn, record], tmp_path, max_epochs=2, num_sanity_val_steps=0)
    assert len({n for n, _ in record.lrs}) > 1  # the batch changed mid-epoch
    assert_each_sample_once(record, 512)
    assert model.validations == 2  # once at the end of each epoch, as without the callback


@pytest.mark.parametrize("limit", [pytest.param(0.5, id="fraction"), pytest.param(10, id="count")])
@pytest.mark.parametrize("keep", ["effective", "none"])
def test_limit_train_batches_trains_what_lightning_would(tmp_path: Path, limit: float, keep: str) -> None:
    plain = Record()
    fit(Net(batch_size=8), [plain], tmp_path, accumulate_grad_batches=4, limit_train_batches=limit)
    dyn = lt.DynamicBatchSize(adjust_every=1, keep=keep, multiple_of=4, probe=sim(per_sample=150))  # type: ignore[arg-type]
    ours = Record(dyn)
    fit(Net(batch_size=8), [dyn, ours], tmp_path, accumulate_grad_batches=4, limit_train_batches=limit)
    assert sorted(ours.seen[0]) == sorted(plain.seen[0])


def test_retried_micro_batches_run_under_autocast(tmp_path: Path) -> None:
    class Autocast(BackwardOomNet):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            self.states = [*getattr(self, "states", []), torch.is_autocast_enabled("cpu")]
            return super().training_step(batch, batch_idx)

    OomInBackward.limit = 6
    try:
        dyn = lt.DynamicBatchSize(adjust_every=1000, multiple_of=2, probe=sim(total=10**9, fixed=0, per_sample=1))
        model = Autocast(batch_size=16)
        fit(model, [dyn], tmp_path, max_steps=2, precision="bf16-mixed")
    finally:
        OomInBackward.limit = 10**9
    assert dyn.oom_recoveries == 2
    assert model.states == [True] * len(model.states)


def test_keep_lr_starts_each_fit_from_the_configured_lr(tmp_path: Path) -> None:
    dyn = lt.DynamicBatchSize(adjust_every=2, keep="lr", lr_rule="linear", probe=sim())
    model = Net(batch_size=8, n=512, lr=0.05)
    record = Record(dyn)
    fit(model, [dyn, record], tmp_path)
    record.lrs.clear()
    fit(model, [dyn, record], tmp_path)  # the same callback, a new optimizer at 0.05
    for samples, lr in record.lrs:
        assert lr == pytest.approx(lt.scale_lr(0.05, 8, samples, rule="linear"))


def test_a_kept_dataloader_gets_its_batch_sampler_back(tmp_path: Path) -> None:
    loader = DataLoader(Indexed(64), batch_size=8)
    original = loader.batch_sampler

    class Kept(Net):
        def train_dataloader(self) -> DataLoader:
            return loader

    fit(Kept(), [lt.DynamicBatchSize(probe=sim())], tmp_path, accumulate_grad_batches=4)
    assert loader.batch_sampler is original
    assert [len(b[2]) for b in loader][:2] == [8, 8]


@pytest.mark.parametrize("noise", [0.0, 0.02])
def test_control_law_is_stable_under_measurement_noise(noise: float) -> None:
    import random

    rng = random.Random(0)
    ctl = BatchSizeController(target=0.9, min_batch_size=1, max_batch_size=None, multiple_of=8)
    size, over, changes = 8, 0, 0
    for _ in range(300):
        usage = 2_000 + 100 * size
        assert usage <= 10_000, "ran out of memory"
        over += usage > 9_000
        decision = ctl.decide(size, peak_bytes=usage * (1 + rng.gauss(0, noise)), total_bytes=10_000)
        changes += decision.batch_size != size
        size = decision.batch_size
    assert size == 64
    assert over <= (0 if noise == 0 else 5)  # a noisy slope may overshoot once or twice; the ceiling stops repeats
    assert changes <= (3 if noise == 0 else 12)


def test_keep_none_schedules_still_end_where_the_run_ends(tmp_path: Path) -> None:
    schedule = lt.WarmupCosine(warmup_steps=2, min_lr=0.005)
    dyn = lt.DynamicBatchSize(adjust_every=2, keep="none", multiple_of=4, probe=sim(per_sample=150))
    trainer = fit(Net(batch_size=4, n=512), [schedule, dyn], tmp_path, max_epochs=2)
    assert dyn.batch_size == 44  # far fewer steps than the 256 the Trainer first estimated at batch 4
    assert trainer.global_step < 100
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.005)  # the floor, reached at the end


def test_fp16_grad_scaler_through_splitting_and_oom(tmp_path: Path) -> None:
    from lightning.pytorch.plugins import MixedPrecision

    def plugins() -> list[Any]:
        return [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**10))]

    reference = Net(batch_size=32)
    plain = fit(reference, [], tmp_path, plugins=plugins())
    dyn = lt.DynamicBatchSize(adjust_every=3, multiple_of=4, probe=sim(per_sample=500))  # 32 never fits
    model = Net(batch_size=32)
    ours = fit(model, [dyn], tmp_path, plugins=plugins())
    assert dyn.oom_recoveries >= 1
    assert ours.precision_plugin.scaler.get_scale() == plain.precision_plugin.scaler.get_scale()  # type: ignore[attr-defined]
    for a, b in zip(_weights(model), _weights(reference), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=2e-4)


def test_the_last_batch_counted_is_let_go_at_the_end_of_the_run(tmp_path: Path) -> None:
    """The counts a step's readers share hold the batch; without the monitor, DynamicBatchSize lets it go at teardown
    (on a GPU the batch's tensors would otherwise stay allocated after the fit)."""
    from lightning_tune.perf.batch import LAST_BATCH

    seen: list[Any] = []

    class Keep(Callback):
        def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
            seen.append(LAST_BATCH.batch)

    fit(Net(n=32), [lt.DynamicBatchSize(probe=sim()), Keep()], tmp_path, max_steps=2)
    assert seen and all(batch is not None for batch in seen)  # the counts were shared during the run
    assert LAST_BATCH.batch is None and LAST_BATCH.counts == {}
