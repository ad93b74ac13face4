"""ThroughputLatencyMonitor on a mocked clock: exact figures, against numpy's percentiles."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import pytest
import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, Dataset

import lightning_tune as lt
from lightning_tune.demos import DemoGPT
from lightning_tune.perf.batch import count_samples, count_tokens
from tests.helpers import Regressor, csv_rows, make_trainer, regression_data

CLOCK = "lightning_tune.perf.timing.perf_counter"


class ScriptedClock:
    """A perf_counter stand-in: each batch takes a scripted time, each gap a scripted wait."""

    def __init__(self, step_s: list[float], gap_s: list[float]) -> None:
        self.now = 0.0
        self.step_s, self.gap_s = list(step_s), list(gap_s)
        self.calls = 0

    def __call__(self) -> float:
        self.calls += 1
        return self.now

    def on_batch_start(self) -> None:
        self.now += self.gap_s.pop(0)

    def on_batch_end(self) -> None:
        self.now += self.step_s.pop(0)


class ClockDriver(Regressor):
    """Advances the scripted clock by the batch's duration inside the step, between the monitor's two marks."""

    clock: ScriptedClock

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if batch[0].device.type != "meta":  # the monitor's FLOP count runs this on a meta copy: no time passes
            self.clock.on_batch_end()
        return super().training_step(batch, batch_idx)


def _run(tmp_path: Path, monitor: lt.ThroughputLatencyMonitor, steps: list[float], gaps: list[float], **kwargs: Any):
    clock = ScriptedClock(steps, gaps)
    model = ClockDriver(batch_size=4, n=4 * len(steps))
    model.clock = clock
    logger = CSVLogger(str(tmp_path), name="csv")
    original = monitor.on_train_batch_start

    def start(trainer, pl_module, batch, batch_idx):  # type: ignore[no-untyped-def]
        clock.on_batch_start()  # the wait for this batch passes before the monitor's start mark
        original(trainer, pl_module, batch, batch_idx)

    monitor.on_train_batch_start = start  # type: ignore[method-assign]
    trainer = make_trainer(tmp_path, [monitor], max_epochs=1, logger=logger, **kwargs)
    with mock.patch(CLOCK, clock):
        trainer.fit(model)
    return [row for row in csv_rows(logger.log_dir) if row.get("perf/train/samples_per_sec")]


def test_rates_and_percentiles_are_exact_on_a_mocked_clock(tmp_path: Path) -> None:
    steps = [0.010, 0.020, 0.030, 0.040, 0.100, 0.012, 0.013, 0.014, 0.015, 0.016]
    gaps = [0.005, 0.001, 0.002, 0.001, 0.001, 0.050, 0.001, 0.001, 0.001, 0.001]
    rows = _run(tmp_path, lt.ThroughputLatencyMonitor(window=8, log_every_n_steps=5), steps, gaps)
    assert [int(r["step"]) for r in rows] == [4, 9]  # Lightning's numbering: the steps before the logged one
    first, second = rows
    wall1 = sum(steps[:5]) + sum(gaps[:5])
    assert float(first["perf/train/samples_per_sec"]) == pytest.approx(20 / wall1)
    assert float(first["perf/train/batches_per_sec"]) == pytest.approx(5 / wall1)
    assert float(first["perf/train/data_wait_frac"]) == pytest.approx(sum(gaps[:5]) / wall1)
    ms = np.array(steps) * 1000
    for q in (50, 95, 99):
        assert float(first[f"perf/train/step_ms_p{q}"]) == pytest.approx(np.percentile(ms[:5], q))
        # the window holds the last 8 steps only
        assert float(second[f"perf/train/step_ms_p{q}"]) == pytest.approx(np.percentile(ms[2:10], q))
    assert float(second["perf/train/step_ms_max"]) == pytest.approx(100.0)
    wall2 = sum(steps[5:]) + sum(gaps[5:])
    assert float(second["perf/train/samples_per_sec"]) == pytest.approx(20 / wall2)
    assert not first.get("perf/train/tokens_per_sec")  # float regression data holds no tokens
    assert not first.get("perf/train/mfu") and not first.get("perf/vram_used_frac")  # CPU: absent, quietly


def test_accumulation_counts_all_micro_batches_of_a_step(tmp_path: Path) -> None:
    steps = [0.01] * 8
    gaps = [0.002] * 8
    rows = _run(tmp_path, lt.ThroughputLatencyMonitor(log_every_n_steps=2), steps, gaps, accumulate_grad_batches=2)
    assert [int(r["step"]) for r in rows] == [1, 3]
    # a step spans two micro-batches and the gap between them; the gap before it is the time between steps
    step_ms = (0.01 + 0.002 + 0.01) * 1000
    assert float(rows[0]["perf/train/step_ms_p50"]) == pytest.approx(step_ms)
    wall = 2 * step_ms / 1000 + 2 * 0.002
    assert float(rows[0]["perf/train/samples_per_sec"]) == pytest.approx(16 / wall)
    assert float(rows[0]["perf/train/batches_per_sec"]) == pytest.approx(4 / wall)
    assert float(rows[0]["perf/train/data_wait_frac"]) == pytest.approx(4 * 0.002 / wall)


@pytest.mark.parametrize(
    ("batch", "samples", "tokens"),
    [
        pytest.param(
            (torch.zeros(3, 7, dtype=torch.long), torch.zeros(3, 7, dtype=torch.long)), 3, 21, id="ids-targets"
        ),
        pytest.param(
            {
                "input_ids": torch.zeros(2, 4, dtype=torch.long),
                "attention_mask": torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0]]),
            },
            2,
            5,
            id="dict-with-mask",
        ),
        pytest.param([torch.zeros(5, 3), torch.ones(5, 3, dtype=torch.bool)], 5, 15, id="bool-mask-in-list"),
        pytest.param((torch.randn(6, 8), torch.randn(6, 1)), 6, None, id="floats-no-tokens"),
        pytest.param({"x": {"ids": torch.zeros(4, 9, dtype=torch.int32)}}, 4, 36, id="nested"),
    ],
)
def test_samples_and_tokens_are_found_in_common_batch_layouts(batch: Any, samples: int, tokens: int | None) -> None:
    assert count_samples(batch) == samples
    found = count_tokens(batch)
    assert (None if found is None else int(found)) == tokens


class TokenData(Dataset):
    def __len__(self) -> int:
        return 24

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        length = 3 + i % 5
        mask = torch.zeros(8, dtype=torch.long)
        mask[:length] = 1
        return {"input_ids": torch.full((8,), i % 7), "attention_mask": mask, "y": torch.tensor([float(i)])}


class TokenModel(Regressor):
    def __init__(self, batch_sizes: list[int]) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(8, 8)
        self.batch_sizes = batch_sizes

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        h = self.emb(batch["input_ids"]).mean(1)
        return torch.nn.functional.mse_loss(self.net(h), batch["y"])

    def train_dataloader(self) -> DataLoader:
        from torch.utils.data import BatchSampler

        class Varying(BatchSampler):
            def __init__(self, sizes: list[int]) -> None:
                self.sizes = sizes

            def __iter__(self):  # type: ignore[no-untyped-def]
                start = 0
                for size in self.sizes:
                    yield list(range(start, start + size))
                    start += size

            def __len__(self) -> int:
                return len(self.sizes)

        return DataLoader(TokenData(), batch_sampler=Varying(self.batch_sizes))


def test_tokens_exclude_padding_and_batch_sizes_may_vary(tmp_path: Path) -> None:
    sizes = [2, 5, 3, 6, 4, 4]
    logger = CSVLogger(str(tmp_path), name="csv")
    monitor = lt.ThroughputLatencyMonitor(log_every_n_steps=3)
    trainer = make_trainer(tmp_path, [monitor], max_epochs=1, logger=logger)
    trainer.fit(TokenModel(sizes))
    rows = [r for r in csv_rows(logger.log_dir) if r.get("perf/train/samples_per_sec")]
    assert len(rows) == 2
    assert monitor.stats.total.samples == sum(sizes)
    assert monitor.stats.total.tokens == sum(3 + i % 5 for i in range(sum(sizes)))  # real tokens, padding excluded
    assert monitor.stats.total.batches == 6 and monitor.stats.total.steps == 6
    samples_rate = float(rows[0]["perf/train/samples_per_sec"])
    tokens_rate = float(rows[0]["perf/train/tokens_per_sec"])
    expected_ratio = sum(3 + i % 5 for i in range(10)) / 10  # first three batches: samples 0..9
    assert tokens_rate / samples_rate == pytest.approx(expected_ratio)


def test_validation_and_predict_latencies_reach_the_logger(tmp_path: Path) -> None:
    logger = CSVLogger(str(tmp_path), name="csv")
    monitor = lt.ThroughputLatencyMonitor(log_every_n_steps=4)
    trainer = make_trainer(tmp_path, [monitor], max_epochs=2, limit_val_batches=2, logger=logger)
    model = Regressor()
    trainer.fit(model)
    trainer.predict(model, dataloaders=DataLoader(torch.randn(10, 8), batch_size=3))
    logger.save()
    rows = csv_rows(logger.log_dir)
    val = [r for r in rows if r.get("perf/val/batch_ms_p50")]
    predict = [r for r in rows if r.get("perf/predict/batch_ms_p50")]
    assert len(val) == 2  # one per validation run, sanity check excluded
    assert len(predict) == 1
    for row in (val[0], predict[0]):
        stage = "val" if row is val[0] else "predict"
        p50, p95, p99 = (float(row[f"perf/{stage}/batch_ms_p{q}"]) for q in (50, 95, 99))
        assert 0 < p50 <= p95 <= p99
        assert float(row[f"perf/{stage}/samples_per_sec"]) > 0


def test_no_logger_no_crash_and_a_summary_at_the_end(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    monitor = lt.ThroughputLatencyMonitor(log_every_n_steps=2)
    trainer = make_trainer(tmp_path, [monitor], max_steps=6, logger=False)
    with caplog.at_level("INFO"):
        trainer.fit(Regressor())
    assert monitor.summary["steps"] == 6
    assert monitor.summary["samples_per_sec"] > 0
    assert "ThroughputLatencyMonitor summary" in caplog.text and "step time" in caplog.text


def test_mfu_uses_flops_per_batch_over_the_device_peak(tmp_path: Path) -> None:
    steps, gaps = [0.01] * 4, [0.0] * 4
    monitor = lt.ThroughputLatencyMonitor(log_every_n_steps=4, flops_per_batch=1e9)
    with mock.patch.object(lt.ThroughputLatencyMonitor, "device_peak_flops", return_value=1e12):
        rows = _run(tmp_path, monitor, steps, gaps)
    # 4 batches x 1e9 FLOPs in 0.04 s = 1e11 FLOP/s on a 1e12 FLOP/s device
    assert float(rows[0]["perf/train/mfu"]) == pytest.approx(0.1)


def test_mfu_counts_flops_on_the_first_batch_when_not_given(tmp_path: Path) -> None:
    monitor = lt.ThroughputLatencyMonitor(log_every_n_steps=3, peak_flops=1e12)
    rows = _run(tmp_path, monitor, [0.01] * 7, [0.0] * 7)
    # Regressor: Linear(8,16) and Linear(16,1) on 4 samples; forward 2*4*(8*16+16*1) FLOPs, backward twice that
    # for the second layer (input and weight grads) and once for the first (weight grad only: its input needs none)
    forward = 2 * 4 * (8 * 16 + 16 * 1)
    backward = 2 * 4 * 8 * 16 + 2 * 2 * 4 * 16 * 1
    assert monitor.flop_model is not None and monitor.flop_model.total == forward + backward
    # counted on a copy, so no step is left out: the first log covers steps 1 to 3, on CPU with the explicit peak
    assert monitor.stats.total.steps == 7
    assert float(rows[0]["perf/train/mfu"]) == pytest.approx((forward + backward) * 3 / 0.03 / 1e12)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        pytest.param({"window": 1}, ValueError, "`window` must be an integer from 2 to 1000000, got 1", id="window"),
        pytest.param(
            {"percentiles": (50, 100)}, ValueError, "`percentiles[1]` must be in (0, 100), got 100", id="p100"
        ),
        pytest.param({"percentiles": (0, 50)}, ValueError, "`percentiles[0]` must be in (0, 100), got 0", id="p0"),
        pytest.param(
            {"percentiles": ()}, ValueError, "`percentiles` must hold at least one percentile, got ()", id="empty"
        ),
        pytest.param(
            {"percentiles": (50, 50)}, ValueError, "`percentiles` must not repeat a percentile, got (50, 50)", id="dup"
        ),
        pytest.param({"percentiles": "p50"}, TypeError, "`percentiles` must be a sequence of numbers", id="str"),
        pytest.param(
            {"batch_size_fn": 4},
            TypeError,
            "`batch_size_fn` must be a callable taking a batch, or None, got 4",
            id="bs-fn",
        ),
        pytest.param(
            {"tokens_fn": "ids"},
            TypeError,
            "`tokens_fn` must be a callable taking a batch, or None, got 'ids'",
            id="tok-fn",
        ),
        pytest.param(
            {"log_every_n_steps": 0}, ValueError, "`log_every_n_steps` must be an integer >= 1, got 0", id="every"
        ),
        pytest.param(
            {"flops_per_batch": -1.0}, ValueError, "`flops_per_batch` must be in (0, inf], got -1.0", id="flops"
        ),
        pytest.param({"gpu_stats": "yes"}, TypeError, "`gpu_stats` must be True or False, got 'yes' (str)", id="gpu"),
    ],
)
def test_bad_arguments(kwargs: dict, error: type[Exception], message: str) -> None:
    import re

    with pytest.raises(error, match=re.escape(message)):
        lt.ThroughputLatencyMonitor(**kwargs)


def test_arguments_past_window_are_keyword_only() -> None:
    with pytest.raises(TypeError, match="positional argument"):
        lt.ThroughputLatencyMonitor(50, 10)  # type: ignore[misc]


@pytest.mark.parametrize("resumed_at", [0, 3], ids=["fresh-fit", "resumed-fit"])
def test_warmup_steps_are_the_first_steps_of_each_fit_a_resumed_one_included(tmp_path: Path, resumed_at: int) -> None:
    checkpoint = None
    if resumed_at:
        first = make_trainer(tmp_path, [], max_steps=resumed_at)
        first.fit(Regressor())
        checkpoint = tmp_path / "resume.ckpt"
        first.save_checkpoint(checkpoint)
    monitor = lt.ThroughputLatencyMonitor(warmup_steps=2)
    make_trainer(tmp_path, [monitor], max_steps=resumed_at + 5).fit(Regressor(), ckpt_path=checkpoint)
    assert monitor.summary["steps"] == 3  # the fit's 5 steps, its first 2 left out


def test_trainer_that_never_logs_per_step_does_not_break_the_monitor(tmp_path: Path) -> None:
    monitor = lt.ThroughputLatencyMonitor()
    trainer = make_trainer(tmp_path, [monitor], max_steps=4, log_every_n_steps=0)
    trainer.fit(Regressor())
    assert monitor.summary["steps"] == 4  # nothing logged per step, the run and its summary intact


# ---------------------------------------------------------------------------------------------- latency budget


class InferenceClock(Regressor):
    """Each validation or predict batch takes the next of ``durations_ms`` on a clock the monitor reads."""

    def __init__(self, durations_ms: list[float], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.durations_ms = list(durations_ms)
        self.now = 0.0

    def clock(self) -> float:
        return self.now

    def _tick(self) -> None:
        self.now += self.durations_ms.pop(0) / 1000.0

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self._tick()
        super().validation_step(batch, batch_idx)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(regression_data(self.n, seed=1), batch_size=self.batch_size)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self._tick()
        return self(batch)


def test_predict_batches_over_the_latency_budget_are_counted_logged_and_warned(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    durations = [20.0, 20.0, 5.0, 5.0, 5.0, 12.0, 5.0, 5.0]  # 3 of 8 over 10 ms; 1 of the last 4
    model = InferenceClock(durations)
    logger = CSVLogger(str(tmp_path), name="csv")
    monitor = lt.ThroughputLatencyMonitor(window=4, latency_budget_ms=10.0)
    trainer = make_trainer(tmp_path, [monitor], logger=logger)
    with mock.patch(CLOCK, model.clock), caplog.at_level("INFO"), pytest.warns(RuntimeWarning) as warned:
        trainer.predict(model, dataloaders=DataLoader(torch.randn(16, 8), batch_size=2))
    logger.save()
    (row,) = [r for r in csv_rows(logger.log_dir) if r.get("perf/predict/over_budget_frac")]
    assert float(row["perf/predict/over_budget_frac"]) == 0.25  # the window: the last 4 batches
    assert float(row["perf/predict/batch_ms_p50"]) == pytest.approx(np.percentile(durations[-4:], 50))
    assert "ThroughputLatencyMonitor: 3 of 8 predict batches (37.5 %) took longer than the latency budget of 10 ms" in (
        caplog.text
    )
    budget_warnings = [w for w in warned if "latency budget" in str(w.message)]
    assert len(budget_warnings) == 1
    assert str(budget_warnings[0].message).startswith("37.5 % of predict batches took longer than the latency budget")


def test_validation_share_is_summed_over_the_fit_and_five_percent_is_not_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, recwarn: pytest.WarningsRecorder
) -> None:
    # two validation runs of 10 batches: one batch of the 20 over 8 ms, exactly 5 %
    model = InferenceClock([1.0] * 3 + [9.0] + [1.0] * 6 + [7.9] * 10, batch_size=2, n=20)
    logger = CSVLogger(str(tmp_path), name="csv")
    monitor = lt.ThroughputLatencyMonitor(latency_budget_ms=8.0)
    trainer = make_trainer(
        tmp_path, [monitor], max_epochs=2, limit_train_batches=2, limit_val_batches=10, logger=logger
    )
    with mock.patch(CLOCK, model.clock), caplog.at_level("INFO"):
        trainer.fit(model)
    logger.save()
    key = "perf/val/over_budget_frac"
    assert [float(r[key]) for r in csv_rows(logger.log_dir) if r.get(key)] == [0.1, 0.0]
    assert caplog.text.count("latency budget") == 1
    assert "1 of 20 validation batches (5.0 %) took longer than the latency budget of 8 ms" in caplog.text
    assert not [w for w in recwarn if "latency budget" in str(w.message)]


def test_without_a_budget_nothing_about_it_is_logged(tmp_path: Path) -> None:
    model = InferenceClock([50.0] * 4)
    logger = CSVLogger(str(tmp_path), name="csv")
    trainer = make_trainer(tmp_path, [lt.ThroughputLatencyMonitor()], logger=logger)
    with mock.patch(CLOCK, model.clock):
        trainer.predict(model, dataloaders=DataLoader(torch.randn(8, 8), batch_size=2))
    logger.save()
    keys = {k for row in csv_rows(logger.log_dir) for k, v in row.items() if v}
    assert "perf/predict/batch_ms_p50" in keys and not any("over_budget" in k for k in keys)


@pytest.mark.parametrize(
    ("budget", "error", "message"),
    [
        pytest.param(0, ValueError, "`latency_budget_ms` must be in (0, inf], got 0", id="zero"),
        pytest.param(-5.0, ValueError, "`latency_budget_ms` must be in (0, inf], got -5.0", id="negative"),
        pytest.param(float("nan"), ValueError, "`latency_budget_ms` must be a finite number, got nan", id="nan"),
        pytest.param(float("inf"), ValueError, "`latency_budget_ms` must be a finite number, got inf", id="inf"),
        pytest.param("50", TypeError, "`latency_budget_ms` must be a number, got '50' (str)", id="str"),
        pytest.param(True, TypeError, "`latency_budget_ms` must be a number, got True (bool)", id="bool"),
    ],
)
def test_bad_latency_budget(budget: Any, error: type[Exception], message: str) -> None:
    import re

    with pytest.raises(error, match=re.escape(message) + "$"):
        lt.ThroughputLatencyMonitor(latency_budget_ms=budget)


# ---------------------------------------------------------------------------------------------- MFU, issue 11 and 15

GPT_CONFIG = {"vocab_size": 64, "seq_len": 32, "d_model": 32, "n_layers": 2, "n_heads": 4}


def gpt_step_flops(batch: int, seq: int, config: dict[str, int] = GPT_CONFIG) -> int:
    """Hand count of one DemoGPT training step (forward and backward), the convention of docs/peak_flops.md."""
    d, layers, vocab = config["d_model"], config["n_layers"], config["vocab_size"]
    linear = layers * (3 * d * d + d * d + 8 * d * d) + d * vocab  # qkv, proj, MLP, head weights
    dense = 6 * batch * seq * linear  # 2 per multiply-add forward, twice that backward (input and weight grads)
    attention = 3 * layers * 4 * batch * d * (seq * (seq + 1) // 2)  # QK^T and AV over the causal pairs
    return dense + attention


class VaryingLengthGPT(DemoGPT):
    """DemoGPT fed batches whose sequence length changes from step to step."""

    def __init__(self, lengths: list[int], batch: int = 2) -> None:
        super().__init__(GPT_CONFIG)
        self.lengths, self.batch = lengths, batch

    def train_dataloader(self) -> DataLoader:
        batches = []
        for length in self.lengths:
            ids = torch.randint(0, GPT_CONFIG["vocab_size"], (self.batch, length))
            batches.append((ids, ids))
        return DataLoader(batches, batch_size=None)


def test_flops_follow_each_steps_tokens_and_the_square_of_its_length(tmp_path: Path) -> None:
    lengths = [8, 32, 16, 32, 4]
    monitor = lt.ThroughputLatencyMonitor(log_every_n_steps=5, peak_flops=1e12)
    make_trainer(tmp_path, [monitor], max_epochs=1).fit(VaryingLengthGPT(lengths))
    assert monitor.stats.total.steps == 5
    assert monitor.stats.total.flops == pytest.approx(sum(gpt_step_flops(2, n) for n in lengths), rel=1e-9)
    wall_s = monitor.stats.total.wall_ms / 1000
    assert monitor.summary["mfu"] == pytest.approx(monitor.stats.total.flops / wall_s / 1e12)


def test_a_compiled_model_stays_compiled_and_its_compiling_steps_are_not_timed(tmp_path: Path) -> None:
    compiled: list[int] = []
    runs: list[int] = []

    def counting_backend(graph: torch.fx.GraphModule, inputs: list[torch.Tensor]) -> Any:
        compiled.append(1)

        def run(*args: Any) -> Any:
            runs.append(1)
            return graph.forward(*args)

        return run

    torch._dynamo.reset()
    module = VaryingLengthGPT([16] * 4)
    module.model = torch.compile(module.model, backend=counting_backend)  # type: ignore[assignment]
    monitor = lt.ThroughputLatencyMonitor(log_every_n_steps=2, peak_flops=1e12)
    make_trainer(tmp_path, [monitor], max_epochs=1).fit(module)
    torch._dynamo.reset()
    assert compiled, "the backend was never called: the model ran eagerly"
    assert len(runs) >= 4, "later steps did not run the compiled graph"
    assert monitor.stats.total.steps == 3  # the step that compiled is left out of the timings
    assert monitor.stats.total.flops == pytest.approx(3 * gpt_step_flops(2, 16), rel=1e-9)


class RetriedFirstStep(DemoGPT):
    """Runs its first step's forward twice, as a step retried after an out-of-memory error does."""

    retried = False

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if not self.retried and batch[0].device.type != "meta":
            self.retried = True
            super().training_step(batch, batch_idx).backward()  # the attempt that "ran out of memory"
            self.zero_grad()
        return super().training_step(batch, batch_idx)

    def train_dataloader(self) -> DataLoader:
        ids = torch.randint(0, GPT_CONFIG["vocab_size"], (6, 16))
        return DataLoader(torch.utils.data.TensorDataset(ids, ids), batch_size=2)


def test_a_retried_first_step_does_not_count_its_flops_twice(tmp_path: Path) -> None:
    monitor = lt.ThroughputLatencyMonitor(log_every_n_steps=3, peak_flops=1e12)
    make_trainer(tmp_path, [monitor], max_epochs=1).fit(RetriedFirstStep(GPT_CONFIG))
    assert monitor.flop_model is not None and monitor.flop_model.total == gpt_step_flops(2, 16)
    assert monitor.stats.total.flops == 3 * gpt_step_flops(2, 16)


def test_activation_checkpointing_logs_hfu_beside_mfu(tmp_path: Path) -> None:
    logger = CSVLogger(str(tmp_path), name="csv")
    monitor = lt.ThroughputLatencyMonitor(log_every_n_steps=2, peak_flops=1e12)
    trainer = make_trainer(tmp_path, [lt.ActivationCheckpointing(), monitor], max_epochs=1, logger=logger)
    trainer.fit(VaryingLengthGPT([16] * 4))
    row = next(r for r in csv_rows(logger.log_dir) if r.get("perf/train/mfu"))
    d, batch, seq, layers = GPT_CONFIG["d_model"], 2, 16, GPT_CONFIG["n_layers"]
    # the backward recomputes each block's forward: its matmuls (12 d^2 per token) and causal attention
    recompute = layers * (2 * batch * seq * 12 * d * d + 4 * batch * d * (seq * (seq + 1) // 2))
    ratio = float(row["perf/train/hfu"]) / float(row["perf/train/mfu"])
    assert ratio == pytest.approx((gpt_step_flops(batch, seq) + recompute) / gpt_step_flops(batch, seq))
    assert monitor.flop_model is not None and monitor.flop_model.total == gpt_step_flops(batch, seq)
    assert monitor.summary["hfu"] / monitor.summary["mfu"] == pytest.approx(ratio)


def test_no_hfu_without_recomputation(tmp_path: Path) -> None:
    logger = CSVLogger(str(tmp_path), name="csv")
    monitor = lt.ThroughputLatencyMonitor(log_every_n_steps=2, peak_flops=1e12)
    make_trainer(tmp_path, [monitor], max_epochs=1, logger=logger).fit(VaryingLengthGPT([16] * 2))
    rows = [r for r in csv_rows(logger.log_dir) if r.get("perf/train/mfu")]
    assert rows and not rows[0].get("perf/train/hfu")


def test_a_step_that_cannot_be_counted_warns_once_and_training_goes_on(tmp_path: Path) -> None:
    class DataDependent(Regressor):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            if batch[0].sum() > 1e9:  # Python control flow on a value: impossible on meta tensors
                raise AssertionError
            return super().training_step(batch, batch_idx)

    monitor = lt.ThroughputLatencyMonitor(log_every_n_steps=2, peak_flops=1e12)
    with pytest.warns(RuntimeWarning, match="could not count the training step's FLOPs.*flops_per_batch="):
        make_trainer(tmp_path, [monitor], max_steps=4).fit(DataDependent())
    assert monitor.stats.total.steps == 4 and "mfu" not in monitor.summary


def test_the_flop_count_leaves_the_modules_step_outputs_alone(tmp_path: Path) -> None:
    # Lightning's documented way to aggregate over an epoch: append in training_step, stack in on_train_epoch_end
    class Collecting(Regressor):
        def __init__(self) -> None:
            super().__init__(n=16)
            self.outputs: list[torch.Tensor] = []
            self.epoch_means: list[float] = []

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = super().training_step(batch, batch_idx)
            self.outputs.append(loss.detach())
            return loss

        def on_train_epoch_end(self) -> None:
            self.epoch_means.append(float(torch.stack(self.outputs).mean()))
            self.outputs.clear()

    model = Collecting()
    monitor = lt.ThroughputLatencyMonitor(log_every_n_steps=2, peak_flops=1e12)
    make_trainer(tmp_path, [monitor], max_epochs=1).fit(model)
    assert monitor.flop_model is not None and len(model.epoch_means) == 1  # counted, and 4 real losses stacked


def test_torchmetrics_in_training_step_are_skipped_by_the_count_and_left_alone(tmp_path: Path) -> None:
    from torchmetrics import MetricCollection
    from torchmetrics.classification import MulticlassAccuracy, MulticlassF1Score

    class Classifier(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(8, 3)
            # the multiclass kernels (bincount) have no meta implementation
            self.metrics = MetricCollection([MulticlassAccuracy(3), MulticlassF1Score(3)])

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            logits = self.net(x)
            self.log_dict(self.metrics(logits, y))
            return torch.nn.functional.cross_entropy(logits, y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self) -> DataLoader:
            data = torch.utils.data.TensorDataset(torch.randn(16, 8), torch.randint(0, 3, (16,)))
            return DataLoader(data, batch_size=4)

    model = Classifier()
    monitor = lt.ThroughputLatencyMonitor(log_every_n_steps=2, peak_flops=1e12)
    make_trainer(tmp_path, [monitor], max_epochs=1).fit(model)
    assert monitor.flop_model is not None and monitor.flop_model.total == 2 * (2 * 4 * 8 * 3)  # forward + weight grad
    assert "mfu" in monitor.summary
    assert {name: metric._update_count for name, metric in model.metrics.items()} == dict.fromkeys(model.metrics, 4)


def test_perf_rows_share_lightnings_step_and_epoch_with_train_loss(tmp_path: Path) -> None:
    logger = CSVLogger(str(tmp_path), name="csv")
    monitor = lt.ThroughputLatencyMonitor(log_every_n_steps=4)
    make_trainer(tmp_path, [monitor], max_steps=12, logger=logger, log_every_n_steps=4).fit(Regressor(n=32))
    rows = csv_rows(logger.log_dir)
    loss_steps = [int(r["step"]) for r in rows if r.get("train_loss_step")]
    perf = [r for r in rows if r.get("perf/train/samples_per_sec")]
    assert loss_steps == [3, 7, 11]
    assert [int(r["step"]) for r in perf] == loss_steps
    assert [r["epoch"] for r in perf] == ["0.0", "0.0", "1.0"]  # 8 batches an epoch: step 11 is in epoch 1


class FakeNvml:
    """nvidia-ml-py on a MIG slice: the utilisation query is not supported."""

    class NVMLError_NotSupported(Exception):  # noqa: N801 - pynvml's own name
        pass

    def __init__(self) -> None:
        self.queries = 0

    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> Any:  # noqa: N802
        self.queries += 1
        raise self.NVMLError_NotSupported("Not Supported")


def test_nvml_failing_in_sample_is_disabled_after_one_message(tmp_path: Path) -> None:
    from lightning_tune.perf.devices import NvmlSampler

    nvml = FakeNvml()
    sampler = NvmlSampler.__new__(NvmlSampler)
    sampler._nvml, sampler._handle = nvml, "MIG-0"

    class InstallSampler(lt.ThroughputLatencyMonitor):
        def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
            super().on_fit_start(trainer, pl_module)
            self._devices.nvml = sampler

    monitor = InstallSampler(log_every_n_steps=2)
    with pytest.warns(RuntimeWarning, match="NVML could not read GPU utilisation") as caught:
        make_trainer(tmp_path, [monitor], max_steps=6).fit(Regressor())
    assert len([w for w in caught if "NVML" in str(w.message)]) == 1
    assert nvml.queries == 1 and monitor._devices.nvml is None and monitor.summary["steps"] == 6


def test_window_too_large_is_a_value_error() -> None:
    with pytest.raises(ValueError, match=r"`window` must be an integer from 2 to 1000000, got 10{30}"):
        lt.ThroughputLatencyMonitor(window=10**30)


@pytest.mark.parametrize(
    ("value", "error", "message"),
    [
        pytest.param(0.0, ValueError, "`peak_flops` must be in (0, inf], got 0.0", id="zero"),
        pytest.param(float("inf"), ValueError, "`peak_flops` must be a finite number, got inf", id="inf"),
        pytest.param("989e12", TypeError, "`peak_flops` must be a number, got '989e12' (str)", id="str"),
    ],
)
def test_bad_peak_flops(value: Any, error: type[Exception], message: str) -> None:
    import re

    with pytest.raises(error, match=re.escape(message)):
        lt.ThroughputLatencyMonitor(peak_flops=value)


@pytest.mark.parametrize("strategy", ["ModelParallelStrategy", "FSDPStrategy", "DeepSpeedStrategy"])
def test_sharded_models_get_no_copied_flop_count_but_one_warning_naming_flops_per_batch(strategy: str) -> None:
    from types import SimpleNamespace

    import lightning.pytorch.strategies as strategies

    cls = getattr(strategies, strategy)
    sharded = SimpleNamespace(trainer=SimpleNamespace(strategy=cls.__new__(cls)))  # parameters would be shards
    monitor = lt.ThroughputLatencyMonitor(peak_flops=1e12)
    with (
        mock.patch("lightning_tune.callbacks.throughput.count_step_flops") as count,
        pytest.warns(RuntimeWarning, match=f"sharded by {strategy}.*flops_per_batch="),
    ):
        monitor._count_flops(sharded, torch.zeros(4, 8), 0, 4)
    count.assert_not_called()
    assert monitor.flop_model is None


def test_counting_a_batch_is_step_time_not_data_wait(tmp_path: Path) -> None:
    clock = ScriptedClock([], [])

    def slow_count(batch: Any) -> int:  # a user's batch_size_fn that takes 50 ms
        clock.now += 0.050
        return count_samples(batch) or 0

    steps, gaps = [0.010] * 4, [0.002] * 4
    clock.step_s, clock.gap_s = list(steps), list(gaps)
    model = ClockDriver(batch_size=4, n=16)
    model.clock = clock
    monitor = lt.ThroughputLatencyMonitor(log_every_n_steps=4, batch_size_fn=slow_count)
    original = monitor.on_train_batch_start

    def start(trainer, pl_module, batch, batch_idx):  # type: ignore[no-untyped-def]
        clock.on_batch_start()
        original(trainer, pl_module, batch, batch_idx)

    monitor.on_train_batch_start = start  # type: ignore[method-assign]
    with mock.patch(CLOCK, clock):
        make_trainer(tmp_path, [monitor], max_epochs=1).fit(model)
    assert monitor.stats.total.steps == 4
    assert monitor.summary["step_ms_p50"] == pytest.approx(60.0)  # the count inside the step, as Lightning's loop
    assert monitor.summary["data_wait_frac"] == pytest.approx(4 * 0.002 / (4 * 0.060 + 4 * 0.002))


def test_a_validate_call_after_a_fit_keeps_its_training_figures(tmp_path: Path) -> None:
    monitor = lt.ThroughputLatencyMonitor(peak_flops=1e12)
    model = Regressor(batch_size=4, n=24)
    trainer = make_trainer(tmp_path, [monitor], max_epochs=1, limit_val_batches=2)
    trainer.fit(model)
    steps, flop_model = monitor.stats.total.steps, monitor.flop_model
    assert steps == 6 and flop_model is not None
    trainer.validate(model, verbose=False)
    assert monitor.stats.total.steps == steps and monitor.flop_model is flop_model
    assert "batches" in monitor.summary  # the last call's own figures


class _TimedData(torch.utils.data.Dataset):
    """Regression samples that each take 0.5 ms of the stand-in clock to load (waiting for data)."""

    def __init__(self, clock: ScriptedClock, n: int) -> None:
        self.clock, self.data = clock, regression_data(n)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> Any:
        self.clock.now += 0.0005
        return self.data[i]


class _SlowValidation(Regressor):
    """1 ms of the stand-in clock per training sample, 200 ms per validation batch."""

    def __init__(self, clock: ScriptedClock) -> None:
        super().__init__(batch_size=4, n=64)
        self.clock = clock

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if batch[0].device.type != "meta":
            self.clock.now += 0.001 * len(batch[0])
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.clock.now += 0.2
        super().validation_step(batch, batch_idx)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_TimedData(self.clock, 64), batch_size=4)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(regression_data(8), batch_size=8)


class _CollectingMemory(lt.SimulatedMemory):
    """A simulated device whose ``free()`` takes 0.3 s, as ``gc.collect()`` does in a process holding a large model."""

    clock: ScriptedClock

    def free(self) -> None:
        self.clock.now += 0.3
        super().free()


def _fit_with_slow_validation(tmp_path: Path, dynamic: bool) -> tuple[dict[str, float], list[float]]:
    clock = ScriptedClock([], [])
    monitor = lt.ThroughputLatencyMonitor(log_every_n_steps=2, gpu_stats=False)
    callbacks: list[Any] = [monitor]
    if dynamic:
        memory = _CollectingMemory(total_bytes=1 << 30, fixed_bytes=1 << 20, bytes_per_sample=1)
        memory.clock = clock
        callbacks.append(lt.DynamicBatchSize(probe=memory))
    logger = CSVLogger(str(tmp_path), name=f"dynamic{int(dynamic)}")
    trainer = make_trainer(
        tmp_path,
        callbacks,
        max_epochs=2,
        accumulate_grad_batches=2,
        val_check_interval=4,  # mid-epoch: the training batches after each validation are the epoch's
        limit_val_batches=1.0,
        logger=logger,
    )
    with mock.patch(CLOCK, clock):
        trainer.fit(_SlowValidation(clock))
    rows = csv_rows(logger.log_dir)
    return monitor.summary, [
        float(r["perf/train/samples_per_sec"]) for r in rows if r.get("perf/train/samples_per_sec")
    ]


def test_validation_is_neither_data_wait_nor_training_time_under_dynamic_batch_size(tmp_path: Path) -> None:
    plain, plain_rates = _fit_with_slow_validation(tmp_path, dynamic=False)
    tuned, tuned_rates = _fit_with_slow_validation(tmp_path, dynamic=True)
    # per optimizer step: 8 samples loaded in 4 ms and trained in 8 ms, whichever cuts the step
    assert plain["data_wait_frac"] == pytest.approx(4 / 12)
    assert tuned["data_wait_frac"] == pytest.approx(plain["data_wait_frac"])
    assert tuned["samples_per_sec"] == pytest.approx(plain["samples_per_sec"]) == pytest.approx(8 / 0.012)
    assert len(tuned_rates) == len(plain_rates) == 8
    assert tuned_rates == pytest.approx(plain_rates)  # no interval after a validation drops


class _Texts:
    """A batch object of the user's: texts the module tokenizes itself, with nothing the monitor can count."""

    def __init__(self, texts: list[str]) -> None:
        self.texts = texts

    def __len__(self) -> int:
        return len(self.texts)


class _TextModule(LightningModule):
    def __init__(self, collate: Any = None) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(()))
        self.collate = collate

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.weight * len(batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader:
        return DataLoader([f"text {i}" for i in range(16)], batch_size=4, collate_fn=self.collate)


def test_batches_of_strings_count_their_strings_as_samples(tmp_path: Path) -> None:
    monitor = lt.ThroughputLatencyMonitor(gpu_stats=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        make_trainer(tmp_path, [monitor], max_epochs=1).fit(_TextModule())  # default_collate: a list of 4 strings
    assert monitor.stats.total.samples == 16
    assert monitor.summary["samples_per_sec"] == pytest.approx(16 / (monitor.stats.total.wall_ms / 1000))


def test_a_batch_it_cannot_count_is_warned_about_once_naming_batch_size_fn(tmp_path: Path) -> None:
    monitor = lt.ThroughputLatencyMonitor(gpu_stats=False)
    with pytest.warns(RuntimeWarning, match=r"cannot count the samples of a train batch of type _Texts") as caught:
        make_trainer(tmp_path, [monitor], max_epochs=1).fit(_TextModule(_Texts))
    assert sum("cannot count the samples" in str(w.message) for w in caught) == 1  # 4 batches, one warning
    assert "batch_size_fn=" in str(next(w.message for w in caught if "cannot count" in str(w.message)))
    assert monitor.stats.total.samples == 0
    counted = lt.ThroughputLatencyMonitor(gpu_stats=False, batch_size_fn=len)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        make_trainer(tmp_path, [counted], max_epochs=1).fit(_TextModule(_Texts))
    assert counted.stats.total.samples == 16
