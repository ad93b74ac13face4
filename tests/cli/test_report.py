from __future__ import annotations

import math
import os
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from lightning_tune.cli import main
from lightning_tune.report import (
    PANEL_TITLES,
    ReportError,
    ReportWarning,
    Runs,
    default_title,
    read_scalars,
    render_report,
    summarise,
)
from tests.helpers import alarm

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
STEPS = list(range(0, 100, 5))


def full_metrics(step: int) -> dict[str, float]:
    """Every key the report knows, as a GPU run would log them."""
    wave = math.sin(step / 15)
    return {
        "perf/train/samples_per_sec": 1200.0 + 40.0 * wave,
        "perf/train/tokens_per_sec": (1200.0 + 40.0 * wave) * 512,
        "perf/train/batches_per_sec": 37.5,
        "perf/train/step_ms_p50": 26.0 + wave,
        "perf/train/step_ms_p95": 30.0 + wave,
        "perf/train/step_ms_p99": 34.0 + wave,
        "perf/train/step_ms_max": 45.0 + 3 * wave,
        "perf/train/data_wait_frac": 0.04 + 0.01 * wave,
        "perf/train/mfu": 0.41,
        "perf/train/straggler_ratio": 1.05,
        "perf/val/batch_ms_p50": 12.0,
        "perf/val/batch_ms_p95": 15.0,
        "perf/val/batch_ms_p99": 19.0,
        "perf/val/samples_per_sec": 5000.0,
        "perf/vram_allocated_gib": 20.0,
        "perf/vram_reserved_gib": 24.0,
        "perf/vram_peak_gib": 31.5,
        "perf/vram_used_frac": 0.6 + step / 1000,
        "perf/alloc_retries": 0.0,
        "perf/gpu_util_pct": 93.0,
        "tune/lr": 3e-3 * min(1.0, (step + 1) / 30) * (0.1 + 0.45 * (1 + math.cos(math.pi * step / 100))),
        "tune/lr/pg1": 3e-4,
        "tune/batch_size": 32.0 if step < 50 else 64.0,
        "tune/accumulate_grad_batches": 4.0 if step < 50 else 2.0,
        "tune/effective_batch_size": 128.0,
        "tune/micro_batch_tokens": 4096.0 if step < 50 else 6144.0,
        "perf/train/padding_frac": 0.26 + 0.02 * wave,
        "train_loss": 1.5 + 2.5 * math.exp(-step / 30) + 0.05 * wave,
        "val_loss": 1.6 + 2.5 * math.exp(-step / 30),
    }


SUBSET_KEYS = ("perf/train/samples_per_sec", "perf/train/step_ms_p50", "perf/train/step_ms_p95", "tune/lr")


def cpu_metrics(step: int) -> dict[str, float]:
    """What a CPU run without token counts logs."""
    return {key: 0.8 * value for key, value in full_metrics(step).items() if key in SUBSET_KEYS}


def write_run(directory: Path, metrics: Any, steps: list[int] = STEPS) -> dict[str, list[tuple[int, float]]]:
    """Write ``metrics(step)`` for each step as TensorBoard scalars; return what TensorBoard stores (float32)."""
    from torch.utils.tensorboard import SummaryWriter

    written: dict[str, list[tuple[int, float]]] = {}
    with SummaryWriter(str(directory)) as writer:
        for step in steps:
            for key, value in metrics(step).items():
                writer.add_scalar(key, value, step)
                written.setdefault(key, []).append((step, float(np.float32(value))))
    return written


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, dict[str, list[tuple[int, float]]]]]:
    logdir = tmp_path_factory.mktemp("lightning_logs")
    written = {
        "version_0": write_run(logdir / "version_0", full_metrics),
        "version_1": write_run(logdir / "version_1", cpu_metrics, steps=STEPS[:12]),
    }
    return logdir, written


def in_memory(metrics: Any, keys: tuple[str, ...] | None = None) -> dict[str, list[tuple[int, float]]]:
    out: dict[str, list[tuple[int, float]]] = {}
    for step in STEPS:
        for key, value in metrics(step).items():
            if keys is None or key in keys:
                out.setdefault(key, []).append((step, value))
    return out


def assert_png(path: Path, min_width: int = 1000) -> None:
    from matplotlib.image import imread

    assert path.read_bytes()[:8] == PNG_SIGNATURE
    image = imread(str(path))
    assert image.shape[1] > min_width
    assert image[..., :3].min() < 0.5, "the image is blank"


# ------------------------------------------------------------------------------------------------ read_scalars


def test_read_scalars_returns_exactly_what_was_written(two_runs: tuple[Path, Runs]) -> None:
    logdir, written = two_runs
    runs = read_scalars(logdir)
    assert list(runs) == ["version_0", "version_1"]
    for name, expected in written.items():
        assert set(runs[name]) == set(expected)
        for key, points in expected.items():
            assert runs[name][key] == points, (name, key)
            assert all(isinstance(s, int) and isinstance(v, float) for s, v in runs[name][key])


def test_read_scalars_sorts_by_step_and_names_runs_naturally(tmp_path: Path) -> None:
    from torch.utils.tensorboard import SummaryWriter

    for version in (10, 2):
        with SummaryWriter(str(tmp_path / f"version_{version}")) as writer:
            for step in (30, 10, 20):
                writer.add_scalar("tune/lr", step / 100, step)
    with SummaryWriter(str(tmp_path)) as writer:  # events in the log directory itself: run "."
        writer.add_scalar("tune/batch_size", 8.0, 0)
    runs = read_scalars(str(tmp_path))
    assert list(runs) == [".", "version_2", "version_10"]
    assert [s for s, _ in runs["version_2"]["tune/lr"]] == [10, 20, 30]
    assert runs["."] == {"tune/batch_size": [(0, 8.0)]}


def test_read_scalars_missing_directory(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(ReportError, match=r"`logdir` '.*nope' does not exist; .* usually under ./lightning_logs"):
        read_scalars(missing)


def test_read_scalars_file_instead_of_directory(tmp_path: Path) -> None:
    file = tmp_path / "events.txt"
    file.write_text("x")
    with pytest.raises(ReportError, match=r"`logdir` must be a directory of TensorBoard logs, got the file '.*txt'"):
        read_scalars(file)


def test_read_scalars_empty_directory_says_where_it_looked(tmp_path: Path) -> None:
    (tmp_path / "version_0").mkdir()
    (tmp_path / "version_0" / "hparams.yaml").write_text("{}")
    with pytest.raises(ReportError) as info:
        read_scalars(tmp_path)
    message = str(info.value)
    assert "no TensorBoard event files (events.out.tfevents.*)" in message
    assert str(tmp_path) in message and "or its subdirectories" in message
    assert "usually under ./lightning_logs" in message


def test_read_scalars_without_perf_or_tune_keys_lists_what_it_found(tmp_path: Path) -> None:
    write_run(tmp_path / "version_0", lambda step: {"train_loss": 1.0, "epoch": 0.0})
    with pytest.raises(ReportError, match=r"no perf/ or tune/ scalars in the 1 run\(s\) under .*found only: epoch, "):
        read_scalars(tmp_path)
    write_run(tmp_path / "version_1", lambda step: {f"metric_{i:02d}": 1.0 for i in range(12)})
    with pytest.raises(ReportError, match=r"found only: epoch, metric_00, .*, metric_08 and 4 more\)"):
        read_scalars(tmp_path)


def test_read_scalars_rejects_a_non_path() -> None:
    with pytest.raises(TypeError, match=r"`logdir` must be a path \(str or os.PathLike\), got 3 \(int\)"):
        read_scalars(3)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------------ render_report


@pytest.mark.slow
def test_render_report_from_event_files_draws_every_panel(two_runs: tuple[Path, Runs], tmp_path: Path) -> None:
    logdir, _ = two_runs
    out = tmp_path / "report.png"
    panels = render_report(read_scalars(logdir), out, title="two runs")
    assert panels == list(PANEL_TITLES)
    assert panels == [
        "Throughput",
        "Step time",
        "Loss",
        "Learning rate",
        "Batch size",
        "Token budget",
        "Padding",
        "GPU memory",
        "Utilisation",
        "Validation latency",
    ]
    assert_png(out, min_width=1500)
    assert [p.name for p in tmp_path.iterdir()] == ["report.png"], "a temporary file was left behind"


@pytest.mark.parametrize(
    ("keys", "expected"),
    [
        pytest.param(("tune/lr",), ["Learning rate"], id="lr-only"),
        pytest.param(("tune/lr/pg1",), ["Learning rate"], id="second-param-group-only"),
        pytest.param(SUBSET_KEYS, ["Throughput", "Step time", "Learning rate"], id="cpu-subset"),
        pytest.param(("perf/train/tokens_per_sec",), ["Throughput"], id="tokens-only"),
        pytest.param(("perf/train/step_ms_max",), ["Step time"], id="max-only"),
        pytest.param(("tune/effective_batch_size",), ["Batch size"], id="effective-batch"),
        pytest.param(("perf/vram_used_frac",), ["GPU memory"], id="vram-fraction"),
        pytest.param(("perf/vram_peak_gib", "perf/vram_reserved_gib"), ["GPU memory"], id="vram-gib"),
        pytest.param(("perf/train/mfu", "perf/gpu_util_pct"), ["Utilisation"], id="utilisation"),
        pytest.param(("perf/val/batch_ms_p99",), ["Validation latency"], id="validation"),
        pytest.param(("train_loss", "val_loss", "perf/train/step_ms_p50"), ["Step time", "Loss"], id="losses"),
        pytest.param(("perf/train/padding_frac",), ["Padding"], id="padding"),
        pytest.param(("perf/train/data_wait_frac",), ["Utilisation"], id="data-wait-of-4-percent"),
        pytest.param(
            ("tune/batch_size", "tune/micro_batch_tokens"), ["Token budget"], id="token-budget-decides-the-micro-batch"
        ),
        pytest.param(
            ("tune/batch_size", "tune/micro_batch_tokens", "tune/effective_batch_size"),
            ["Batch size", "Token budget"],
            id="effective-batch-beside-a-token-budget",
        ),
        pytest.param(
            ("perf/train/samples_per_sec", "tune/batch_size", "perf/alloc_retries", "perf/train/straggler_ratio"),
            ["Throughput", "Batch size"],
            id="unplotted-keys-ignored",
        ),
    ],
)
def test_render_report_draws_only_panels_with_data(keys: tuple[str, ...], expected: list[str], tmp_path: Path) -> None:
    out = tmp_path / "r.png"
    assert render_report({"version_0": in_memory(full_metrics, keys)}, out, dpi=40) == expected
    assert out.read_bytes()[:8] == PNG_SIGNATURE


def test_a_cpu_run_has_no_flat_utilisation_panel(tmp_path: Path) -> None:
    """Without MFU or GPU readings, a data wait under 1 % would be a flat line at 0 %: the panel is left out."""
    run = in_memory(lambda step: {"perf/train/samples_per_sec": 600.0, "perf/train/data_wait_frac": 0.002})
    assert render_report({"cpu": run}, tmp_path / "r.png", dpi=40) == ["Throughput"]


def test_the_batch_size_panel_draws_what_was_decided(tmp_path: Path) -> None:
    """Under a token budget ``tune/batch_size`` is the largest micro-batch of a step, not a decision: not drawn."""
    import matplotlib.figure

    drawn: list[list[float]] = []
    original = matplotlib.axes.Axes.step

    def step(self: Any, x: Any, y: Any, *args: Any, **kwargs: Any) -> Any:
        drawn.append(list(y))
        return original(self, x, y, *args, **kwargs)

    runs = {
        "tokens": in_memory(full_metrics, ("tune/batch_size", "tune/micro_batch_tokens", "tune/effective_batch_size")),
        "samples": in_memory(full_metrics, ("tune/batch_size",)),
    }
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(matplotlib.axes.Axes, "step", step)
        assert render_report(runs, tmp_path / "r.png", dpi=40) == ["Batch size", "Token budget"]
    assert matplotlib.figure is not None
    assert sorted(max(y) for y in drawn) == [64.0, 128.0, 6144.0]  # samples' micro-batch, tokens' effective, budget


def test_read_scalars_follows_a_symlinked_run_directory(tmp_path: Path) -> None:
    elsewhere, logdir = tmp_path / "elsewhere" / "run", tmp_path / "lightning_logs"
    written = write_run(elsewhere, cpu_metrics)
    logdir.mkdir()
    (logdir / "version_0").symlink_to(elsewhere, target_is_directory=True)
    (logdir / "loop").symlink_to(logdir, target_is_directory=True)  # a link back up is read once, not forever
    assert read_scalars(logdir) == {"version_0": written}


def test_render_report_lr_only_run_is_a_readable_single_panel(tmp_path: Path) -> None:
    out = tmp_path / "lr.png"
    assert render_report({".": in_memory(full_metrics, ("tune/lr",))}, out) == ["Learning rate"]
    assert_png(out)


def test_render_report_skips_non_finite_values(tmp_path: Path) -> None:
    runs = {"v": {"perf/train/mfu": [(0, math.nan), (5, 0.4), (10, math.inf)], "tune/lr": [(0, math.nan)]}}
    assert render_report(runs, tmp_path / "r.png", dpi=40) == ["Utilisation"]


def test_render_report_creates_parent_directories_and_replaces_atomically(tmp_path: Path) -> None:
    out = tmp_path / "a" / "b" / "report.PNG"
    runs = {"v": in_memory(full_metrics, ("tune/lr",))}
    render_report(runs, out, dpi=40)
    first = out.read_bytes()
    render_report(runs, out, title="again", dpi=40)
    assert out.read_bytes() != first
    assert [p.name for p in out.parent.iterdir()] == ["report.PNG"]


def test_render_report_failure_leaves_the_old_file_and_no_temporary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from matplotlib.figure import Figure

    out = tmp_path / "report.png"
    out.write_bytes(b"old")

    def crash(self: Figure, *args: object, **kwargs: object) -> None:
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(Figure, "savefig", crash)
    with pytest.raises(RuntimeError, match="disk on fire"):
        render_report({"v": in_memory(full_metrics, ("tune/lr",))}, out, dpi=40)
    assert out.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["report.png"]


@pytest.mark.parametrize("name", ["report.jpg", "report", "report.png.txt"])
def test_render_report_refuses_non_png_output(name: str, tmp_path: Path) -> None:
    with pytest.raises(ReportError, match=rf"`output` must be a path ending in .png, got '.*{name}'"):
        render_report({"v": {"tune/lr": [(0, 1.0)]}}, tmp_path / name)
    assert not list(tmp_path.iterdir())


def test_render_report_refuses_a_directory_output(tmp_path: Path) -> None:
    (tmp_path / "out.png").mkdir()
    with pytest.raises(ReportError, match=r"`output` must be a .png file path, got the directory '.*out.png'"):
        render_report({"v": {"tune/lr": [(0, 1.0)]}}, tmp_path / "out.png")


def test_render_report_with_nothing_to_plot(tmp_path: Path) -> None:
    with pytest.raises(ReportError, match=r"nothing to plot: .* \(found only: epoch, tune/plateau/reductions\)"):
        render_report({"v": {"epoch": [(0, 0.0)], "tune/plateau/reductions": [(0, 1.0)]}}, tmp_path / "r.png")
    with pytest.raises(ReportError, match=r"nothing to plot: .* \(no scalars at all\)"):
        render_report({}, tmp_path / "r.png")
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        pytest.param({"dpi": 5}, ValueError, r"`dpi` must be an integer >= 10, got 5", id="dpi-low"),
        pytest.param({"dpi": 401}, ValueError, r"`dpi` must be an integer from 10 to 400, got 401", id="dpi-high"),
        pytest.param({"output": ""}, ReportError, r"`output` must be a non-empty path", id="output-empty"),
        pytest.param({"dpi": 72.0}, TypeError, r"`dpi` must be an integer, got 72.0 \(float\)", id="dpi-float"),
        pytest.param({"title": 3}, TypeError, r"`title` must be a string or None, got 3 \(int\)", id="title"),
        pytest.param({"output": None}, TypeError, r"`output` must be a path .*, got None \(NoneType\)", id="output"),
        pytest.param({"runs": [1]}, TypeError, r"`runs` must be a mapping of run name .*, got list", id="runs"),
        pytest.param(
            {"runs": {"v": {"tune/lr": [(0, "x")]}}},
            TypeError,
            r"`runs\['v'\]\['tune/lr'\]` must be a sequence of \(step, value\) number pairs",
            id="points",
        ),
    ],
)
def test_render_report_rejects_bad_arguments(
    kwargs: dict[str, Any], error: type[Exception], message: str, tmp_path: Path
) -> None:
    call: dict[str, Any] = {"runs": {"v": {"tune/lr": [(0, 1.0)]}}, "output": tmp_path / "r.png", **kwargs}
    with pytest.raises(error, match=message):
        render_report(call.pop("runs"), call.pop("output"), **call)


def test_default_title_names_the_log_directory(tmp_path: Path) -> None:
    assert default_title(tmp_path / "lightning_logs") == "lightning_tune report: lightning_logs"


# ------------------------------------------------------------------------------------------------ summarise


def test_summarise_shows_only_columns_with_data() -> None:
    runs = {
        "version_0": {
            "perf/train/samples_per_sec": [(10, 900.0), (20, 1000.0), (30, 1250.0)],
            "perf/train/step_ms_p50": [(10, 20.0), (20, 25.0), (30, 40.0)],
            "tune/lr": [(10, 1e-3), (30, 3e-4)],
        },
        "version_1": {"tune/lr": [(0, 0.1)], "epoch": [(0, 0.0)]},
    }
    assert summarise(runs) == "\n".join(
        [
            "             samples/s    step ms (median)     LR",
            "run         last  median               p50     final",
            "version_0  1,250   1,000              25.0  3.00e-04",
            "version_1      -       -                 -  1.00e-01",
        ]
    )


def test_summarise_full_and_subset_runs(two_runs: tuple[Path, Runs]) -> None:
    logdir, _ = two_runs
    table = summarise(read_scalars(logdir)).splitlines()
    assert table[0].split() == [
        "samples/s",
        "tokens/s",
        "step",
        "ms",
        "(median)",
        "VRAM",
        "frac",
        "LR",
        "batch",
        "size",
        "token",
        "budget",
        "padding",
        "%",
    ]
    assert table[1].split() == ["run", "last", "median", "last", "median", "p50", "p95", "p99", "peak", "final"] + [
        "last",
        "effective",
        "last",
        "median",
    ]
    version_0, version_1 = table[2].split(), table[3].split()
    padding = sorted(float(np.float32(full_metrics(step)["perf/train/padding_frac"])) for step in STEPS)
    median = (padding[9] + padding[10]) / 2  # 20 points
    assert version_0[0] == "version_0" and version_0[-4:] == ["64", "128", "6,144", f"{100 * median:.1f}"]
    assert version_1[0] == "version_1" and version_1.count("-") == 8  # tokens x2, p99, VRAM, batch x2, budget, padding
    assert f"{np.float32(0.6 + 95 / 1000):.2f}" in version_0  # peak of vram_used_frac, as float32
    assert version_1[1] == f"{0.8 * full_metrics(55)['perf/train/samples_per_sec']:,.0f}"  # last of 12 steps


def test_summarise_with_no_known_columns() -> None:
    assert summarise({"v": {"epoch": [(0, 1.0)]}}).startswith("no run has throughput")


# ------------------------------------------------------------------------------------------------ command line


@pytest.mark.slow
def test_report_command_writes_the_png_and_prints_the_summary(
    two_runs: tuple[Path, Runs], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    logdir, _ = two_runs
    out = tmp_path / "sub" / "report.png"
    assert main(["report", str(logdir), "-o", str(out), "--dpi", "50"]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    lines = captured.out.strip().splitlines()
    assert "samples/s" in lines[0] and lines[1].startswith("run ")
    assert lines[2].startswith("version_0") and lines[3].startswith("version_1")
    assert lines[-1] == f"wrote {out} (10 panels: {', '.join(PANEL_TITLES)})"
    assert_png(out, min_width=700)


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        pytest.param(["report", "{tmp}/missing"], "`logdir` '{tmp}/missing' does not exist", id="missing"),
        pytest.param(["report", "{tmp}"], "no TensorBoard event files", id="empty"),
        pytest.param(["report", "{tmp}", "-o", "{tmp}/r.svg"], "`output` must be a path ending in .png", id="svg"),
        pytest.param(["report", "{tmp}", "--dpi", "0"], "--dpi: must be an integer from 10 to 400, got '0'", id="dpi"),
        pytest.param(
            ["report", "{tmp}", "--dpi", "100000"],
            "--dpi: must be an integer from 10 to 400, got '100000'",
            id="dpi-huge",
        ),
        pytest.param(
            ["report", ""], "LOGDIR: must be a non-empty path without NUL characters (use '.' for", id="empty-logdir"
        ),
        pytest.param(["report", "{tmp}", "-o", ""], "--output: must be a non-empty path", id="empty-output"),
        pytest.param(["report", "{tmp}", "--title", ""], "--title: must be a non-empty text, got ''", id="empty-title"),
    ],
)
def test_report_command_errors_exit_2_with_one_line(
    argv: list[str], expected: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [arg.replace("{tmp}", str(tmp_path)) for arg in argv]
    assert main([*argv, *([] if "-o" in argv else ["-o", str(tmp_path / "r.png")])]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("lightning-tune report: error: ")
    assert expected.replace("{tmp}", str(tmp_path)) in lines[0]
    assert not (tmp_path / "r.png").exists()


def test_report_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--output" in out and "--title" in out and "LOGDIR" in out


# ------------------------------------------------------------------------------------------------ a real run


@pytest.mark.slow
def test_report_renders_a_real_lightning_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from lightning.pytorch.loggers import TensorBoardLogger

    import lightning_tune as lt
    from lightning_tune.demos import DemoGPT, GPTConfig, SyntheticTokenDataModule
    from tests.helpers import make_trainer

    config = GPTConfig(d_model=32, n_layers=1, seq_len=16)
    trainer = make_trainer(
        tmp_path,
        [lt.ThroughputLatencyMonitor(log_every_n_steps=5), lt.WarmupCosine(warmup_steps=5)],
        logger=TensorBoardLogger(str(tmp_path)),
        max_steps=30,
        log_every_n_steps=5,
        limit_val_batches=2,
        val_check_interval=15,
    )
    trainer.fit(DemoGPT(config), datamodule=SyntheticTokenDataModule(8, seq_len=16, vocab_size=config.vocab_size))
    runs = read_scalars(tmp_path)
    assert list(runs) == ["lightning_logs/version_0"]
    run = runs["lightning_logs/version_0"]
    assert [s for s, _ in run["perf/train/samples_per_sec"]] == [4, 9, 14, 19, 24, 29]  # Lightning's step numbering
    # on the same steps, then once where the run ended: the cosine's floor, the run's final LR
    assert [s for s, _ in run["tune/lr"]] == [4, 9, 14, 19, 24, 29, 30] and run["tune/lr"][-1][1] == 0.0
    out = tmp_path / "report.png"
    assert main(["report", str(tmp_path), "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "lightning_logs/version_0" in printed
    drawn = printed.strip().splitlines()[-1]
    for panel in ("Throughput", "Step time", "Loss", "Learning rate", "Validation latency"):
        assert panel in drawn
    assert_png(out)


def test_read_scalars_refuses_an_empty_path_instead_of_reading_the_current_directory() -> None:
    with pytest.raises(ReportError, match=r"`logdir` must be a non-empty path \(use '\.' for the current directory\)"):
        read_scalars("")


def test_lr_panel_on_a_log_scale_leaves_a_warm_up_from_zero_out() -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from lightning_tune.report import _Canvas, _draw_lr, _normalise_runs

    lrs = [0.0, 1e-4, 1e-3, 1e-2, 5e-3, 1e-3]  # a warm-up from 0, then a decay over two decades
    canvas = _Canvas(_normalise_runs({"v": {"tune/lr": list(enumerate(lrs))}}), colours={"v": "C0"})
    fig = Figure()
    ax = fig.add_subplot()
    _draw_lr(ax, canvas)
    FigureCanvasAgg(fig).draw()
    assert ax.get_yscale() == "log" and ax.get_ylabel() == "learning rate (log scale, 0 left out)"
    (line,) = ax.get_lines()
    drawn = [float(v) for v in line.get_ydata()]
    assert math.isnan(drawn[0]) and drawn[1:] == lrs[1:]  # nothing is drawn below the axis
    assert 1e-5 < ax.get_ylim()[0] <= 1e-4


# ------------------------------------------------------------------------------------------------ hostile inputs


def event_file(path: Path, points: list[tuple[str, int, float]]) -> None:
    """An event file as TensorBoard frames it (length, its CRC, the Event, its CRC), written without a writer."""
    import struct

    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.compat.proto.summary_pb2 import Summary
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c

    records = [Event(wall_time=1.0, file_version="brain.Event:2")]
    records += [Event(step=s, summary=Summary(value=[Summary.Value(tag=t, simple_value=v)])) for t, s, v in points]
    out = bytearray()
    for record in records:
        data = record.SerializeToString()
        header = struct.pack("<Q", len(data))
        out += header + struct.pack("<I", masked_crc32c(header)) + data + struct.pack("<I", masked_crc32c(data))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(bytes(out))


def report_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """``lightning-tune report ...`` within 10 s: exit status, stdout, stderr (no message over 2 KB)."""
    with alarm(10):
        status = main(["report", *argv])
    captured = capsys.readouterr()
    assert len(captured.err.encode()) < 2048
    return status, captured.out, captured.err


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes")
def test_a_fifo_named_like_an_event_file_is_skipped_not_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    beside, alone = tmp_path / "beside", tmp_path / "alone"
    for logdir in (beside, alone):
        (logdir / "version_1").mkdir(parents=True)
        os.mkfifo(logdir / "version_1" / "events.out.tfevents.1")  # reading it would wait for a writer forever
    event_file(beside / "version_1" / "events.out.tfevents.0", [("tune/lr", 0, 0.5)])  # a run's file beside it
    status, out, err = report_cli([str(beside), "-o", str(tmp_path / "r.png")], capsys)
    assert status == 0 and out.endswith("(1 panels: Learning rate)\n")
    assert err == (
        f"lightning-tune report: warning: left out of the report, under {str(beside)!r}: "
        "'version_1/events.out.tfevents.1' (not a regular file)\n"
    )
    status, out, err = report_cli([str(alone), "-o", str(tmp_path / "r.png")], capsys)
    assert (status, out) == (2, "")
    assert err == (
        f"lightning-tune report: error: no scalars could be read under {str(alone)!r}: "
        "'version_1/events.out.tfevents.1' (not a regular file)\n"
    )


def test_a_file_of_random_bytes_is_named_as_unreadable(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "version_0").mkdir()
    (tmp_path / "version_0" / "events.out.tfevents.0").write_bytes(np.random.default_rng(0).bytes(4096))
    status, out, err = report_cli([str(tmp_path), "-o", str(tmp_path / "r.png")], capsys)
    assert (status, out) == (2, "")
    assert err == (
        f"lightning-tune report: error: no scalars could be read under {str(tmp_path)!r}: "
        "'version_0/events.out.tfevents.0' (not a TensorBoard event file)\n"
    )
    good = tmp_path / "version_1" / "events.out.tfevents.0"
    event_file(good, [("tune/lr", step, 0.5) for step in range(5)])
    with (tmp_path / "version_1" / "events.out.tfevents.1").open("wb") as damaged:  # good records, then garbage
        damaged.write(good.read_bytes() + b"\x00" * 7 + b"garbage" * 10)
    with pytest.warns(ReportWarning) as record:
        runs = read_scalars(tmp_path)
    assert str(record[0].message) == (
        f"left out of the report, under {str(tmp_path)!r}: 'version_0/events.out.tfevents.0' (not a TensorBoard "
        f"event file); 'version_1/events.out.tfevents.1' (a damaged record at byte {good.stat().st_size:,})"
    )
    assert runs == {"version_0": {}, "version_1": {"tune/lr": [(s, 0.5) for s in range(5) for _ in (0, 1)]}}


def test_a_record_still_being_written_ends_the_file_quietly(tmp_path: Path) -> None:
    path = tmp_path / "events.out.tfevents.0"
    event_file(path, [("tune/lr", step, 0.5) for step in range(3)])
    path.write_bytes(path.read_bytes()[:-5])  # the last record cut short, as while a run writes it
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert read_scalars(tmp_path) == {".": {"tune/lr": [(0, 0.5), (1, 0.5)]}}


@pytest.mark.parametrize("title", [r"$\frac{", r"cost $x$ and $\frac{$", "$$", "a $5 run"])
def test_a_title_is_drawn_as_written(title: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    event_file(tmp_path / "run$1$" / "events.out.tfevents.0", [("tune/lr", 0, 0.1), ("val_loss$", 0, 1.0)])
    status, out, err = report_cli([str(tmp_path), "-o", str(tmp_path / "r.png"), "--title", title], capsys)
    assert (status, err) == (0, "")
    assert_png(tmp_path / "r.png", min_width=1000)


def test_ten_thousand_event_files_are_read_in_linear_time(tmp_path: Path) -> None:
    """Each file once: 10,000 files took 191 s when each file read listed the directory again."""
    event_file(tmp_path / "template", [("tune/lr", 0, 1.0)])
    template = (tmp_path / "template").read_bytes()
    run = tmp_path / "version_0"
    run.mkdir()
    for index in range(3000):
        (run / f"events.out.tfevents.{index:05d}").write_bytes(template)
    with alarm(10):
        runs = read_scalars(tmp_path)
    assert runs["version_0"]["tune/lr"] == [(0, 1.0)] * 3000


# ------------------------------------------------------------------------------------------------ decisions


def demo_decisions(step: int) -> dict[str, float]:
    """A DynamicBatchSize run that ran out of memory at 32 (step 40) and went on at 16, with the plateau callback."""
    return {
        "tune/lr": 1e-3 if step < 60 else 5e-4,
        "tune/plateau/reductions": 0.0 if step < 60 else 1.0,
        "tune/batch_size": 32.0 if step < 40 else 16.0,
        "tune/effective_batch_size": 64.0,
        "tune/oom_recoveries": 0.0 if step < 40 else 1.0,
        "tune/predicted_vram_frac": 0.93 if step < 40 else 0.62,
        "perf/vram_used_frac": 0.7,
    }


def test_oom_recoveries_plateau_reductions_and_the_predicted_memory_are_shown(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import lightning_tune.report as report

    figures: list[Any] = []
    monkeypatch.setattr(report, "_write_png_atomically", lambda fig, path: figures.append(fig))
    runs = {"version_0": in_memory(demo_decisions)}
    assert render_report(runs, tmp_path / "r.png") == ["Learning rate", "Batch size", "GPU memory"]
    lr, batch, memory = (ax for ax in figures[0].subfigs[1].axes if ax.get_title(loc="left"))

    def legend(ax: Any) -> list[str]:
        return [text.get_text() for text in ax.get_legend().get_texts()]

    def marks(ax: Any) -> list[tuple[float, float]]:
        return [(line.get_xdata()[0], line.get_ydata()[0]) for line in ax.get_lines() if line.get_marker() in "xv"]

    assert "out-of-memory recovery (1)" in legend(batch) and marks(batch) == [(40, 16.0)]  # the 32 -> 16 step
    assert "reduced on plateau (1)" in legend(lr) and marks(lr) == [(60, 5e-4)]
    assert legend(memory)[:2] == [
        "used (all processes)",
        "predicted peak of the chosen batch (of what PyTorch can get)",
    ]
    table = summarise(runs).splitlines()
    assert table[1].split() == [
        "run",
        "peak",
        "predicted",
        "final",
        "reductions",
        "last",
        "effective",
        "OOM",
        "recoveries",
    ]
    assert table[2].split() == ["version_0", "0.70", "0.62", "5.00e-04", "1", "16", "64", "1"]


def test_a_run_without_decisions_draws_no_markers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import lightning_tune.report as report

    figures: list[Any] = []
    monkeypatch.setattr(report, "_write_png_atomically", lambda fig, path: figures.append(fig))
    runs = {"version_0": in_memory(full_metrics)}
    render_report(runs, tmp_path / "r.png")
    for ax in figures[0].subfigs[1].axes:
        assert not [line for line in ax.get_lines() if line.get_marker() in ("x", "v")], ax.get_title(loc="left")
    assert "OOM" not in summarise(runs) and "predicted" not in summarise(runs)
