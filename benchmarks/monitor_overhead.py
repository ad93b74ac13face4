"""Overhead of ThroughputLatencyMonitor against no monitor and against Lightning's ThroughputMonitor.

In one process, rounds of short training runs of the demo GPT are interleaved (the order of the three settings
shuffled each round); each run's steady-state time per optimizer step is measured by a timing callback between a
warm-up step and the last step. The report gives the median step time of each setting and its ratio to no monitor.

    python benchmarks/monitor_overhead.py --rounds 7 --steps 60 --out benchmarks/results/monitor_overhead_cpu

writes ``<out>.json`` and ``<out>.md`` with the device, date, commit and command.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from _results import (
    BASELINE,
    EXTRA,
    MARGIN,
    SCENARIO,
    Row,
    Rows,
    device_name,
    header_lines,
    plan,
    run_header,
    transformer_work,
    write_results,
)
from lightning.pytorch.callbacks import Callback, ThroughputMonitor

import lightning_tune as lt
from lightning_tune.demos import DemoGPT, GPTConfig, SyntheticTokenDataModule

LOG_DIR = tempfile.mkdtemp(prefix="lightning_tune_bench_")


class StepClock(Callback):
    """Wall time per optimizer step between the end of warm-up and the end of the run (synchronised on CUDA)."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.start: float | None = None
        self.end: float | None = None
        self.steps = 0

    def _sync(self, trainer: pl.Trainer) -> None:
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if trainer.global_step == self.warmup:
            self._sync(trainer)
            self.start = time.perf_counter()
        elif trainer.global_step == trainer.max_steps:
            self._sync(trainer)
            self.end = time.perf_counter()
            self.steps = trainer.global_step - self.warmup

    @property
    def ms_per_step(self) -> float:
        assert self.start is not None and self.end is not None
        return (self.end - self.start) * 1000 / self.steps


HOOKS = (
    "on_train_batch_start",
    "on_train_batch_end",
    "on_before_backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "on_train_epoch_start",
    "on_train_epoch_end",
)


def time_hooks(callback: Callback) -> dict[str, float]:
    """Wrap the callback's per-step hooks so the time spent inside them is summed (seconds) in the returned dict."""
    spent = {"seconds": 0.0}
    for name in HOOKS:
        hook = getattr(callback, name)

        def timed(*args: Any, _hook: Any = hook, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return _hook(*args, **kwargs)
            finally:
                spent["seconds"] += time.perf_counter() - start

        setattr(callback, name, timed)
    return spent


def run_once(
    setting: str,
    *,
    steps: int,
    warmup: int,
    batch_size: int,
    accelerator: str,
    precision: str,
    config: GPTConfig | None = None,
) -> tuple[float, float]:
    pl.seed_everything(0, verbose=False)
    config = config or GPTConfig()
    clock = StepClock(warmup)
    callbacks: list[Callback] = [clock]
    monitor: Callback | None = None
    if setting == "lightning_tune":
        monitor = lt.ThroughputLatencyMonitor(log_every_n_steps=10)
    elif setting == "lightning":
        monitor = ThroughputMonitor(batch_size_fn=lambda batch: batch[0].shape[0], length_fn=lambda b: b[0].numel())
    spent = {"seconds": 0.0}
    if monitor is not None:
        spent = time_hooks(monitor)
        callbacks.append(monitor)
    trainer = pl.Trainer(
        accelerator=accelerator,
        devices=1,
        precision=precision,  # type: ignore[arg-type]
        max_steps=steps,
        logger=pl.loggers.TensorBoardLogger(LOG_DIR, name="monitor_overhead"),
        log_every_n_steps=10,
        callbacks=callbacks,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    data = SyntheticTokenDataModule(
        batch_size,
        seq_len=config.seq_len,
        vocab_size=config.vocab_size,
        seed=0,
        train_sequences=batch_size * steps,  # one pass: generating more would only slow the rounds down
        val_sequences=1,
    )
    trainer.fit(DemoGPT(config), datamodule=data)
    return clock.ms_per_step, spent["seconds"] * 1e6 / steps


def measure(
    *,
    rounds: int,
    steps: int,
    warmup: int,
    batch_size: int,
    accelerator: str = "auto",
    precision: str | None = None,
    config: GPTConfig | None = None,
) -> tuple[dict[str, Any], str]:
    """Interleaved rounds of the three settings; returns the JSON record and the Markdown report."""
    cuda = torch.cuda.is_available() and accelerator in ("auto", "gpu", "cuda")
    precision = precision or ("bf16-mixed" if cuda else "32-true")
    device = device_name() if cuda else f"CPU, {torch.get_num_threads()} threads"

    settings = ["none", "lightning_tune", "lightning"]
    times: dict[str, list[float]] = {s: [] for s in settings}
    hook_us: dict[str, list[float]] = {s: [] for s in settings}
    rng = random.Random(0)
    for round_index in range(rounds):
        order = settings[:]
        rng.shuffle(order)
        for setting in order:
            ms, us = run_once(
                setting,
                steps=steps,
                warmup=warmup,
                batch_size=batch_size,
                accelerator=accelerator,
                precision=precision,
                config=config,
            )
            times[setting].append(ms)
            hook_us[setting].append(us)
        print(f"round {round_index + 1}/{rounds}: " + ", ".join(f"{s} {times[s][-1]:.2f} ms" for s in settings))
    medians = {s: statistics.median(v) for s, v in times.items()}
    # each round's ratio to that round's run without a monitor: robust to the machine drifting between rounds
    paired = {s: statistics.median(t / n for t, n in zip(times[s], times["none"], strict=True)) - 1.0 for s in settings}
    hook_medians = {s: statistics.median(v) for s, v in hook_us.items()}
    result = {
        **run_header("monitor_overhead", device),
        "precision": precision,
        "lightning": pl.__version__,
        "rounds": rounds,
        "steps_per_run": steps - warmup,
        "batch_size": batch_size,
        "ms_per_step": times,
        "median_ms_per_step": medians,
        "overhead_vs_none": {s: medians[s] / medians["none"] - 1.0 for s in settings},
        "paired_overhead_vs_none": paired,
        "hook_us_per_step": hook_us,
        "median_hook_us_per_step": hook_medians,
        "hook_share_of_step": {s: hook_medians[s] / 1000 / medians["none"] for s in settings},
    }
    lines = [
        f"# Monitor overhead — {device}",
        "",
        *header_lines(result),
        f"Precision {precision}, demo GPT {config or GPTConfig()}, batch {batch_size}, {rounds} interleaved rounds of "
        f"{steps - warmup} timed steps.",
        "",
        "| Setting | median ms/step | vs none (medians) | vs none (median of per-round ratios) "
        "| time inside the monitor's hooks | hooks / step |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    names = {
        "none": "no monitor",
        "lightning_tune": "lightning_tune ThroughputLatencyMonitor",
        "lightning": "Lightning ThroughputMonitor",
    }
    for s in settings:
        lines.append(
            f"| {names[s]} | {medians[s]:.3f} | {100 * result['overhead_vs_none'][s]:+.2f} % "
            f"| {100 * paired[s]:+.2f} % "
            f"| {hook_medians[s]:.1f} µs/step | {100 * result['hook_share_of_step'][s]:.3f} % |"
        )
    lines += [
        "",
        "Step-time ratios between whole runs carry the machine's run-to-run noise (the per-round ratio pairs each "
        "run with the run without a monitor of the same round); the time spent inside the monitor's own hooks "
        "(summed per step, medians over rounds) is the direct measure of what the monitor itself costs. Both monitors "
        "log every 10 steps here (the Trainer's default is 50), so logging is 5x more frequent than by default.",
    ]
    return result, "\n".join(lines) + "\n"


NAMES = {
    "none": "no monitor",
    "lightning_tune": "lightning_tune ThroughputLatencyMonitor",
    "lightning": "Lightning ThroughputMonitor",
}


#: what the monitor part's header says about which comparison is fair
FAIR = (
    "Only the paired step-time ratio (each round's run against that round's run without a monitor) compares the "
    "monitors fairly: Lightning's ThroughputMonitor calls `torch.cuda.synchronize()` in its hook, so its µs in hooks "
    "include waiting for the GPU, while ThroughputLatencyMonitor's do not."
)


def part(rows: Rows, *, smoke: bool) -> str:
    """The suite's part: one calibration run per setting, then as many interleaved rounds (up to 7 of up to 100
    timed steps) as the part's share allows, round 1 first and whole, each run a row as it ends."""
    gpu = not smoke
    config = GPTConfig(seq_len=16, d_model=32, n_layers=1, n_heads=2) if smoke else GPTConfig()
    kwargs: dict[str, Any] = {
        "batch_size": 4 if smoke else 64,
        "accelerator": "cuda" if gpu else "cpu",
        "precision": "bf16-mixed" if gpu else "32-true",
        "config": config,
    }
    warmup = 1 if smoke else 20
    with torch.device("meta"):
        params = sum(p.numel() for p in DemoGPT(config).parameters())
    batch = kwargs["batch_size"]
    work = transformer_work(params=params, layers=config.n_layers, width=config.d_model, seq=config.seq_len,
                            vocab=config.vocab_size, samples=batch, micro=batch)  # fmt: skip
    costs = {s: rows.calibrate(s, lambda n, s=s: run_once(s, steps=n, warmup=1, **kwargs), work=work)[0] for s in NAMES}
    steps, rounds = plan(rows.left() / MARGIN, list(costs.values()), lo=warmup + 3, hi=warmup + (3 if smoke else 100),
                         max_rounds=1 if smoke else 7)  # fmt: skip
    rows.choose(batch=kwargs["batch_size"], precision=kwargs["precision"], steps=steps, warmup=warmup, rounds=rounds)
    rows.text(f"Each run's first {warmup} steps are warm-up, not timed. {FAIR}")
    rows.table("Round", "Setting", "ms/step", "µs/step in the monitor's hooks")
    times: dict[str, dict[int, float]] = {s: {} for s in NAMES}
    hooks: dict[str, dict[int, float]] = {s: {} for s in NAMES}

    def measure(setting: str, index: int) -> tuple[float, float]:
        ms, us = run_once(setting, steps=steps, warmup=warmup, **kwargs)
        times[setting][index], hooks[setting][index] = ms, us
        rows.add("run", {"round": index + 1, "setting": setting, "ms_per_step": ms, "hook_us_per_step": us},
                 [index + 1, NAMES[setting], f"{ms:.3f}", f"{us:.1f}"])  # fmt: skip
        return ms, us

    rng = random.Random(0)
    planned = []
    for index in range(max(rounds, 1 if smoke else 3)):  # rounds past the plan's are listed, to be dropped
        order = list(NAMES)
        rng.shuffle(order)
        roles = {s: (BASELINE if s == "none" else SCENARIO) if index == 0 else EXTRA for s in order}
        planned += [Row(f"round {index + 1}: {NAMES[s]}", costs[s](steps), partial(measure, s, index), roles[s])
                    for s in order]  # fmt: skip
    rows.run_plan(planned)
    whole = [i for i in times["none"] if all(i in times[s] for s in NAMES)]  # only whole rounds are paired
    if not whole:
        return "no whole round measured"
    medians = {s: statistics.median(times[s][i] for i in whole) for s in NAMES}
    paired = {s: statistics.median(times[s][i] / times["none"][i] for i in whole) - 1 for s in NAMES}
    rows.table("Setting", "median ms/step", "vs none (median of per-round ratios: the fair comparison)",
               "µs/step in the hooks (Lightning's include a device synchronisation)")  # fmt: skip
    for s in NAMES:
        summary = {"setting": s, "median_ms_per_step": medians[s], "paired_overhead_vs_none": paired[s],
                   "median_hook_us_per_step": statistics.median(hooks[s][i] for i in whole),
                   "rounds": len(whole)}  # fmt: skip
        rows.add("median", summary, [NAMES[s], f"{medians[s]:.3f}", f"{100 * paired[s]:+.2f} %",
                                     f"{summary['median_hook_us_per_step']:.1f}"])  # fmt: skip
    return (
        f"paired step-time ratio over {len(whole)} rounds: ThroughputLatencyMonitor "
        f"{100 * paired['lightning_tune']:+.1f} %, "
        f"Lightning's ThroughputMonitor {100 * paired['lightning']:+.1f} % on a {medians['none']:.2f} ms step"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--accelerator", default="auto")
    parser.add_argument("--precision", default=None)
    parser.add_argument("--out", type=Path, default=None, help="write <out>.json and <out>.md")
    args = parser.parse_args()
    record, report = measure(
        rounds=args.rounds,
        steps=args.steps,
        warmup=args.warmup,
        batch_size=args.batch_size,
        accelerator=args.accelerator,
        precision=args.precision,
    )
    write_results(args.out, record, report)


if __name__ == "__main__":
    main()
