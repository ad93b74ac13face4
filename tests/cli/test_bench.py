"""The bench engine: exact figures on a fake clock, OOM rows, predict mode, user modules, swaps, table and plot."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from lightning_tune import _imports
from lightning_tune.bench import BenchResult, BenchRunner, BenchSettings, SettingFailed, format_table
from lightning_tune.bench.plot import check_png_path, plot_tradeoff
from lightning_tune.bench.settings import parse_batch_sizes
from lightning_tune.callbacks.throughput import ThroughputLatencyMonitor
from tests.cli.test_bench_modules import CLOCK, SEQ, ClockedModule, token_data

MODULES = "tests.cli.test_bench_modules"
TINY_GPT = {"d_model": 16, "n_layers": 1, "n_heads": 2}


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The monitor's host timer reads the fake clock that ClockedModule's steps move."""
    monkeypatch.setattr("lightning_tune.perf.timing.perf_counter", CLOCK)
    return CLOCK


def clocked(**kwargs: Any) -> BenchSettings:
    defaults: dict[str, Any] = {"model": f"{MODULES}:ClockedModule", "accelerator": "cpu", "warmup": 2, "steps": 8}
    return BenchSettings(**{**defaults, **kwargs})


def demo(**kwargs: Any) -> BenchSettings:
    defaults: dict[str, Any] = {
        "sequence_length": 16,
        "model_args": TINY_GPT,
        "accelerator": "cpu",
        "steps": 3,
        "warmup": 1,
    }
    return BenchSettings(**{**defaults, **kwargs})


# ---------------------------------------------------------------------------------------------- exact figures

WARMUP_MS = [500.0, 700.0]  # slow warm-up steps: any leak into the figures would show
MEASURED_MS = [10.0, 12.0, 30.0, 11.0, 50.0, 13.0, 14.0, 90.0]


@pytest.mark.parametrize("mode", ["train", "predict"])
def test_figures_are_exact_on_a_fake_clock_and_leave_the_warmup_out(clock: Any, mode: str) -> None:
    batch_size = 4
    durations = WARMUP_MS + MEASURED_MS
    settings = clocked(mode=mode, batch_sizes=(batch_size,), model_args={"durations_ms": durations})
    (result,) = BenchRunner(settings, progress=False).sweep()

    seconds = sum(MEASURED_MS) / 1000.0
    assert result.status == "ok"
    assert result.steps == len(MEASURED_MS)
    assert result.seconds == pytest.approx(seconds)
    assert result.samples_per_sec == pytest.approx(batch_size * len(MEASURED_MS) / seconds)
    assert result.tokens_per_sec == pytest.approx(result.samples_per_sec * SEQ)
    expected = np.percentile(MEASURED_MS, [50, 95, 99])
    assert [result.p50_ms, result.p95_ms, result.p99_ms] == pytest.approx(list(expected))
    assert result.peak_vram_gib is None and result.mfu is None  # CPU: no VRAM, no peak FLOP/s


def test_mfu_where_the_peak_is_known_matches_a_flop_count(clock: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    peak = 1e9
    monkeypatch.setattr(ThroughputLatencyMonitor, "device_peak_flops", lambda self, trainer: peak)
    batch_size = 4
    ids, y = token_data(batch_size)[:]
    module = ClockedModule()
    with FlopCounterMode(display=False) as train_count:
        torch.nn.functional.mse_loss(module(ids), y).backward()
    with FlopCounterMode(display=False) as predict_count:
        module(ids)
    seconds = sum(MEASURED_MS) / 1000.0
    for mode, flops_per_batch in (
        ("train", train_count.get_total_flops()),
        ("predict", predict_count.get_total_flops()),
    ):
        settings = clocked(mode=mode, batch_sizes=(batch_size,), model_args={"durations_ms": WARMUP_MS + MEASURED_MS})
        (result,) = BenchRunner(settings, progress=False).sweep()
        assert result.mfu == pytest.approx(flops_per_batch * len(MEASURED_MS) / seconds / peak), mode
    # predict counts its FLOPs on a meta copy at the measured run's own first batch: no warm-up needed
    settings = clocked(mode="predict", batch_sizes=(batch_size,), warmup=0, model_args={"durations_ms": MEASURED_MS})
    (result,) = BenchRunner(settings, progress=False).sweep()
    assert result.mfu == pytest.approx(predict_count.get_total_flops() * len(MEASURED_MS) / seconds / peak)


# ---------------------------------------------------------------------------------------------- sweeps


def test_out_of_memory_gives_an_oom_row_and_the_sweep_goes_on(clock: Any) -> None:
    settings = clocked(batch_sizes=(1, 8, 2), model_args={"oom_above": 4}, steps=2, warmup=1)
    seen: list[list[int]] = []
    results = BenchRunner(settings, progress=False).sweep(
        after_each=lambda rows: seen.append([r.batch_size for r in rows])
    )
    assert [(r.batch_size, r.status) for r in results] == [(1, "ok"), (8, "oom"), (2, "ok")]
    oom = results[1]
    assert oom.samples_per_sec is None and oom.p95_ms is None
    assert oom.message == "CUDA out of memory. Tried to allocate 2.00 GiB"
    assert results[2].samples_per_sec is not None and results[2].samples_per_sec > 0
    assert seen == [[1], [1, 8], [1, 8, 2]]
    assert "\n    8        OOM" in format_table(results)


def test_other_errors_stop_the_sweep_after_reporting_what_ran(clock: Any) -> None:
    settings = clocked(batch_sizes=(1, 8, 2), model_args={"fail_above": 4}, steps=2, warmup=1)
    seen: list[list[BenchResult]] = []
    with pytest.raises(SettingFailed, match="batch size 8 failed: ValueError: this module cannot take 8 samples"):
        BenchRunner(settings, progress=False).sweep(after_each=seen.append)
    assert [[r.batch_size for r in rows] for rows in seen] == [[1]]


@pytest.mark.parametrize("mode", ["train", "predict"])
def test_demo_sweep_has_a_row_per_batch_size_with_tokens_equal_to_samples_times_seq_len(
    mode: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    settings = demo(mode=mode, batch_sizes=(1, 3))
    runner = BenchRunner(settings, progress=False)
    results = runner.sweep()
    assert [r.batch_size for r in results] == [1, 3]
    for result in results:
        assert result.status == "ok" and result.steps == 3
        assert result.samples_per_sec is not None and result.samples_per_sec > 0
        assert result.tokens_per_sec == pytest.approx(result.samples_per_sec * 16, rel=1e-9)
        assert result.p50_ms is not None and result.p95_ms is not None and result.p99_ms is not None
        assert 0 < result.p50_ms <= result.p95_ms <= result.p99_ms
    assert runner.describe()["device"].startswith("cpu")
    assert list(tmp_path.iterdir()) == []  # the Trainers write nothing


def test_module_with_a_datamodule_gets_its_batch_size_through_the_datamodule(clock: Any) -> None:
    settings = clocked(
        batch_sizes=(2, 5), model=f"{MODULES}:ModelWithoutData", datamodule=f"{MODULES}:TokenData", steps=2
    )
    results = BenchRunner(settings, progress=False).sweep()
    # 10 ms per step on the fake clock: samples/s = batch size * 100 tells the batch size actually used
    assert [r.samples_per_sec for r in results] == pytest.approx([200.0, 500.0])


def test_a_dataloader_that_ignores_batch_size_is_reported(clock: Any) -> None:
    settings = clocked(batch_sizes=(8,), model=f"{MODULES}:IgnoresBatchSize", steps=2, warmup=0)
    with pytest.warns(UserWarning, match="batch size 8 was asked for but the first batch held 3 samples"):
        BenchRunner(settings, progress=False).sweep()


# ---------------------------------------------------------------------------------------------- swaps


def test_attention_flash_on_cpu_fails_before_any_setting_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    if _imports.is_available("flash_attn"):
        pytest.skip("flash-attn is installed here; the missing-package message cannot be seen")
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'lightning-tune\[flash"):
        BenchRunner(demo(batch_sizes=(1,), attention="flash"), progress=False)
    # installed but on a CPU: the next condition it checks fails, naming it
    monkeypatch.setattr(_imports, "is_available", lambda module: True)
    with pytest.raises(ValueError, match="backend='flash' cannot run here: flash-attn needs a CUDA device"):
        BenchRunner(demo(batch_sizes=(1,), attention="flash"), progress=False)


def test_attention_auto_falls_back_to_sdpa_on_cpu_and_says_so() -> None:
    runner = BenchRunner(demo(batch_sizes=(2,), attention="auto", mode="predict"), progress=False)
    assert runner.attention == "sdpa"
    assert len(runner.notes) == 1 and "attention runs through PyTorch SDPA" in runner.notes[0]
    (result,) = runner.sweep()
    assert result.status == "ok"


def test_eight_bit_optimizer_without_bitsandbytes_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    real_import = importlib.import_module

    def fake_import(name: str, *args: Any) -> Any:
        if name == "bitsandbytes":
            raise ModuleNotFoundError("No module named 'bitsandbytes'", name=name)
        return real_import(name, *args)

    monkeypatch.setattr(_imports.importlib, "import_module", fake_import)
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'lightning-tune\[bnb\]'"):
        BenchRunner(demo(batch_sizes=(1,), optimizer="adamw8bit"), progress=False)


def test_eight_bit_optimizer_runs_on_cpu() -> None:
    pytest.importorskip("bitsandbytes")
    runner = BenchRunner(demo(batch_sizes=(2,), optimizer="adamw8bit", steps=2), progress=False)
    (result,) = runner.sweep()
    assert result.status == "ok" and result.samples_per_sec is not None and result.samples_per_sec > 0
    assert runner.describe()["optimizer"] == "adamw8bit"


# ---------------------------------------------------------------------------------------------- bad inputs


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        pytest.param({"batch_sizes": ()}, ValueError, "`batch_sizes` must hold at least one", id="no-sizes"),
        pytest.param({"batch_sizes": (4, 0)}, ValueError, r"`batch_sizes\[1\]` must be an integer >= 1, got 0", id="0"),
        pytest.param({"batch_sizes": (4, 4)}, ValueError, "must not repeat a batch size, got \\(4, 4\\)", id="repeat"),
        pytest.param({"batch_sizes": "1,2"}, TypeError, "`batch_sizes` must be a sequence of integers", id="string"),
        pytest.param({"mode": "eval"}, ValueError, "`mode` must be one of 'train', 'predict', got 'eval'", id="mode"),
        pytest.param({"steps": 1}, ValueError, "`steps` must be an integer from 2 to 1000000, got 1", id="steps"),
        pytest.param({"warmup": -1}, ValueError, "`warmup` must be an integer from 0 to 1000000, got -1", id="warmup"),
        pytest.param({"model": "mymodel"}, ValueError, "`model` must be 'package.module:ClassName'", id="spec"),
        pytest.param(
            {"model": f"{MODULES}:ClockedModule", "sequence_length": 64},
            ValueError,
            "`sequence_length` applies only to model='demo'",
            id="seq-len-user-model",
        ),
        pytest.param(
            {"datamodule": f"{MODULES}:TokenData"}, ValueError, "`datamodule` must be None with model='demo'", id="dm"
        ),
        pytest.param({"model_args": {"seq_len": 8}}, ValueError, "must not hold 'seq_len'", id="demo-seq-len-arg"),
        pytest.param({"model_args": [1]}, TypeError, "`model_args` must be a mapping", id="model-args"),
        pytest.param({"precision": "8-bit"}, ValueError, "`precision` must be one of 'auto',", id="precision"),
        pytest.param({"optimizer": "sgd9"}, ValueError, "`optimizer` must be one of 'adamw_fused',", id="optimizer"),
        pytest.param(
            {"optimizer": "adamw"},
            ValueError,
            "got 'adamw'; 'adamw' is an optimizer but not one this accepts",
            id="optimizer-not-a-swap",
        ),
        pytest.param({"precision": 16}, TypeError, "`precision` must be a string naming a precision", id="prec-int"),
        pytest.param({"attention": "fast"}, ValueError, "`attention` must be one of 'auto', 'flash',", id="attention"),
        pytest.param({"accelerator": "tpu"}, ValueError, "`accelerator` must be one of 'auto', 'cpu'", id="accel"),
        pytest.param({"seed": -2}, ValueError, "`seed` must be an integer from 0 to 4294967295, got -2", id="seed"),
    ],
)
def test_bad_settings_name_the_argument(kwargs: dict[str, Any], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        BenchSettings(**{"batch_sizes": (1,), **kwargs})


def test_settings_take_the_aliases_of_the_vocabulary_and_keep_the_canonical_names() -> None:
    settings = BenchSettings(
        batch_sizes=(1,), precision="bf16", optimizer="adamw_8bit", attention="flash_attention_2", accelerator="cpu"
    )
    assert (settings.precision, settings.optimizer, settings.attention) == ("bf16-mixed", "adamw8bit", "flash")
    assert settings.as_dict()["precision"] == "bf16-mixed"  # the results file records the canonical name


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        pytest.param(
            {"model": "no_such_package.models:Net"},
            ValueError,
            r"`model` 'no_such_package.models:Net': cannot import module 'no_such_package.models' "
            r"\(ModuleNotFoundError: No module named 'no_such_package'\)",
            id="import-fails",
        ),
        pytest.param(
            {"model": f"{MODULES}:Missing"}, ValueError, f"module '{MODULES}' has no attribute 'Missing'", id="no-attr"
        ),
        pytest.param(
            {"model": "collections:OrderedDict"},
            TypeError,
            "`model` 'collections:OrderedDict' must name a LightningModule subclass",
            id="not-a-module",
        ),
        pytest.param(
            {"model": f"{MODULES}:ClockedModule", "datamodule": "collections:OrderedDict"},
            TypeError,
            "must name a LightningDataModule subclass",
            id="not-a-datamodule",
        ),
        pytest.param(
            {"model": f"{MODULES}:NeedsArguments"},
            ValueError,
            r"NeedsArguments\(\*\*\{\}\) failed \(TypeError: .*width.*\); give its keyword arguments in `model_args`",
            id="constructor-fails",
        ),
        pytest.param(
            {"model": f"{MODULES}:NoBatchSize"},
            ValueError,
            "cannot set the batch size: NoBatchSize has no `batch_size` attribute or hyperparameter",
            id="no-batch-size",
        ),
        pytest.param(
            {"model": f"{MODULES}:TrainOnly", "mode": "predict"},
            ValueError,
            "mode 'predict' needs `predict_dataloader\\(\\)`, which TrainOnly does not define",
            id="no-predict-data",
        ),
        pytest.param(
            {"model_args": {"width": 3}},
            ValueError,
            "`model_args` of the demo must be fields of GPTConfig",
            id="demo-unknown-arg",
        ),
        pytest.param({"precision": "16-mixed", "accelerator": "cpu"}, ValueError, "needs a CUDA GPU", id="fp16-cpu"),
    ],
)
def test_what_cannot_run_fails_before_the_sweep(kwargs: dict[str, Any], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        BenchRunner(BenchSettings(**{"batch_sizes": (1,), **kwargs}), progress=False)


@pytest.mark.parametrize(
    ("text", "expected"),
    [("1,4,8", (1, 4, 8)), (" 16 ", (16,)), ("8, 2", (8, 2))],
)
def test_parse_batch_sizes(text: str, expected: tuple[int, ...]) -> None:
    assert parse_batch_sizes(text) == expected


@pytest.mark.parametrize("text", ["4,x", "0", "", "1,,2", "-1", "2.5", "1,1"])
def test_parse_batch_sizes_rejects(text: str) -> None:
    with pytest.raises(ValueError, match=f"`batch_sizes` must be distinct integers >= 1 .*got {text!r}"):
        parse_batch_sizes(text)


# ---------------------------------------------------------------------------------------------- table and plot

ROWS = [
    BenchResult(1, "ok", 10, 0.5, 20.0, 1280.0, 48.0, 52.0, 55.5),
    BenchResult(4, "ok", 10, 1.0, 40.0, 2560.0, 96.0, 110.0, 130.25, peak_vram_gib=1.5, mfu=0.4125),
    BenchResult(16, "oom", message="CUDA out of memory"),
]


def test_table_rows_and_headers_follow_the_mode() -> None:
    lines = format_table(ROWS, mode="predict").splitlines()
    assert lines[0].split("  ")[0] == "batch" and "request p95 ms" in lines[0]
    assert lines[1].split() == ["1", "20.0", "1,280", "48.00", "52.00", "55.50", "-", "-"]
    assert lines[2].split() == ["4", "40.0", "2,560", "96.00", "110.00", "130.25", "1.50", "41.2"]
    assert lines[3].split() == ["16", "OOM", "-", "-", "-", "-", "-", "-"]
    assert "step p95 ms" in format_table(ROWS)


def test_plot_is_a_png_of_throughput_against_p95_latency(tmp_path: Path) -> None:
    import matplotlib.image

    out = tmp_path / "sub" / "tradeoff.png"
    points = plot_tradeoff(list(reversed(ROWS)), out, subtitle="demo GPT on cpu", dpi=50)
    assert points == [(1, 52.0, 20.0), (4, 110.0, 40.0)]  # batch-size order, OOM left out
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    image = matplotlib.image.imread(out)
    assert image.shape[:2] == (275, 400)  # 8 x 5.5 inches at 50 dpi
    blue = (image[..., 2] > 0.6) & (image[..., 0] < 0.3)  # the line and markers (tab:blue)
    red = (image[..., 0] > 0.7) & (image[..., 1] < 0.3)  # the out-of-memory note (tab:red)
    assert blue.sum() > 50 and red.sum() > 5
    assert list(tmp_path.joinpath("sub").iterdir()) == [out]  # no temporary file left behind


@pytest.mark.parametrize(
    ("path", "message"),
    [("out.jpg", "`plot` must be a path ending in .png, got 'out.jpg'"), (3, "`plot` must be a path ending in .png")],
)
def test_plot_path_is_checked(path: Any, message: str) -> None:
    with pytest.raises((ValueError, TypeError), match=message):
        check_png_path(path)


def test_nothing_to_plot_when_every_setting_ran_out_of_memory(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="nothing to plot"):
        plot_tradeoff([ROWS[2]], tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()


def test_all_is_sorted_and_importable() -> None:
    module = importlib.import_module("lightning_tune.bench")
    assert module.__all__ == sorted(module.__all__)
    for name in module.__all__:
        assert hasattr(module, name), name
    public = {
        k
        for k, v in vars(module).items()
        if not k.startswith("_") and getattr(v, "__module__", "").startswith("lightning_tune.bench")
    }
    assert public <= set(module.__all__)
