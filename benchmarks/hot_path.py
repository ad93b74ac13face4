"""Python calls an optimizer step makes: plain Lightning, Lightning's own callbacks, and this package's.

Each setting trains the tiny demo GPT on the CPU under ``cProfile``: profiling starts at the first batch after
``--warmup`` steps and stops at the first batch ``--steps`` steps later, so the count holds every hook, the model's
forward and backward, the optimizer and the callbacks of exactly those steps, and no start-up. The settings:

- ``plain Lightning``: the module's AdamW, no callback;
- ``Lightning's equivalents``: a ``LambdaLR`` (warm-up then cosine) returned by the module, ``LearningRateMonitor``
  and ``ThroughputMonitor``;
- ``lightning_tune``: ``WarmupCosine``, ``ThroughputLatencyMonitor`` and ``DynamicBatchSize`` on a
  ``SimulatedMemory`` (decisions every ``--adjust-every`` steps).

The report ends with ``benchmarks/lr_step.py``'s table: ``ScheduleLR.step`` against ``LambdaLR.step`` with 48 groups.

Every setting logs to a CSV logger every 50 steps (the Trainer's default). The report is a Markdown table of calls a
step (``cProfile``'s count: Python functions and built-ins) with the ratios to plain Lightning and to Lightning's
equivalents, then where this package's setting makes more calls than Lightning's equivalents: by where the called
function lives (a module of the package, a library, the standard library, built-ins), and by function.

    python benchmarks/hot_path.py --steps 200 > benchmarks/results/hot_path_cpu.md

Other work changes the figure (each callback's hooks, the LR schedule, DynamicBatchSize): the results file names the
commit and the date it was measured at.
"""

from __future__ import annotations

import argparse
import cProfile
import math
import os
import pstats
import shlex
import subprocess
import sys
import tempfile
import warnings
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, LearningRateMonitor, ThroughputMonitor
from lightning.pytorch.loggers import CSVLogger

import lightning_tune as lt
from lightning_tune.demos import DemoGPT, GPTConfig, SyntheticTokenDataModule

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lr_step import main as lr_step_table  # noqa: E402  (benchmarks/lr_step.py)

CONFIG = GPTConfig(vocab_size=64, seq_len=32, d_model=32, n_layers=2, n_heads=2)
BATCH = 8
PACKAGE = str(Path(lt.__file__).resolve().parent)
ROOT = os.path.dirname(PACKAGE)


class Profiled(Callback):
    """Profiles the steps from ``start`` to ``start + steps``: from one batch's start to that of the batch after."""

    def __init__(self, start: int, steps: int) -> None:
        self.start, self.end = start, start + steps
        self.profile = cProfile.Profile()

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.start:
            self.profile.enable()
        elif trainer.global_step == self.end:
            self.profile.disable()


class LambdaGPT(DemoGPT):
    """The demo GPT returning a ``LambdaLR`` of warm-up then cosine, stepped every optimizer step."""

    total_steps = 1

    def configure_optimizers(self) -> Any:
        optimizer = super().configure_optimizers()
        warmup, total = max(1, self.total_steps // 50), self.total_steps

        def factor(step: int) -> float:
            if step < warmup:
                return step / warmup
            return 0.5 * (1.0 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def callbacks(setting: str, adjust_every: int) -> list[Callback]:
    if setting == "lightning":
        return [
            LearningRateMonitor(logging_interval="step"),
            ThroughputMonitor(batch_size_fn=lambda batch: batch[0].shape[0], length_fn=lambda batch: batch[0].shape[1]),
        ]
    if setting == "lightning_tune":
        memory = lt.SimulatedMemory(total_bytes=2 << 30, fixed_bytes=1 << 28, bytes_per_sample=1 << 20)
        return [
            lt.WarmupCosine(),
            lt.ThroughputLatencyMonitor(),
            lt.DynamicBatchSize(probe=memory, adjust_every=adjust_every),
        ]
    return []


def profile(setting: str, *, steps: int, warmup: int, adjust_every: int) -> cProfile.Profile:
    """Train ``setting`` for ``warmup + steps + 1`` steps; the profile of the ``steps`` after the warm-up."""
    pl.seed_everything(0, verbose=False)
    total = warmup + steps + 1
    LambdaGPT.total_steps = total
    model = (LambdaGPT if setting == "lightning" else DemoGPT)(CONFIG)
    profiled = Profiled(warmup, steps)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=total,
        limit_val_batches=0,
        logger=CSVLogger(tempfile.mkdtemp(prefix="hot_path_"), name=setting),
        callbacks=[profiled, *callbacks(setting, adjust_every)],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    data = SyntheticTokenDataModule(BATCH, seq_len=CONFIG.seq_len, vocab_size=CONFIG.vocab_size)
    trainer.fit(model, datamodule=data)
    return profiled.profile


def where(func: tuple[str, int, str]) -> str:
    """The place of a profiled function: a module of the package, a library, the standard library or a built-in."""
    path = func[0]
    if path == "~":
        return "built-ins"
    if path.startswith(ROOT):  # the package, or this script
        return f"`{os.path.relpath(path, ROOT)}`"
    parts = Path(path).parts
    if "site-packages" in parts:
        return parts[parts.index("site-packages") + 1]
    return "standard library" if path.startswith(sys.base_prefix) else os.path.basename(path)


def by_place(stats: pstats.Stats, steps: int) -> Counter[str]:
    """Calls a step by where the called function lives."""
    calls: Counter[str] = Counter()
    for func, entry in stats.stats.items():  # type: ignore[attr-defined]
        calls[where(func)] += entry[1] / steps
    return calls


def by_function(stats: pstats.Stats, steps: int) -> Counter[str]:
    """Calls a step by function."""
    calls: Counter[str] = Counter()
    for func, entry in stats.stats.items():  # type: ignore[attr-defined]
        name = func[2] if func[0] == "~" else f"{os.path.basename(func[0])}:{func[2]}"
        calls[f"`{name}`"] += entry[1] / steps
    return calls


def difference(ours: Counter[str], theirs: Counter[str], top: int) -> list[str]:
    """Table rows of the largest differences of calls a step, ours against theirs."""
    delta = {key: ours[key] - theirs[key] for key in set(ours) | set(theirs)}
    ranked = sorted(delta, key=lambda key: -abs(delta[key]))[:top]
    return [f"| {key} | {ours[key]:,.1f} | {theirs[key]:,.1f} | {delta[key]:+,.1f} |" for key in ranked]


def commit() -> str:
    """The checkout's commit; a working tree with changes is named after it."""

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True, check=False).stdout.strip()

    head = git("rev-parse", "--short=7", "HEAD") or "unknown"
    return f"working tree after {head}" if git("status", "--porcelain", "--", "lightning_tune", "benchmarks") else head


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps profiled")
    parser.add_argument("--warmup", type=int, default=20, help="optimizer steps run before profiling")
    parser.add_argument("--adjust-every", type=int, default=100, help="DynamicBatchSize's steps between decisions")
    parser.add_argument("--top", type=int, default=12, help="rows of each breakdown")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    settings = {
        "plain": "plain Lightning (AdamW, no callback)",
        "lightning": "Lightning's equivalents (LambdaLR + LearningRateMonitor + ThroughputMonitor)",
        "lightning_tune": "lightning_tune (WarmupCosine + ThroughputLatencyMonitor + DynamicBatchSize)",
    }
    stats = {
        name: pstats.Stats(profile(name, steps=args.steps, warmup=args.warmup, adjust_every=args.adjust_every))
        for name in settings
    }
    per_step = {name: s.total_calls / args.steps for name, s in stats.items()}  # type: ignore[attr-defined]
    reference = per_step["lightning"]
    date = datetime.now(timezone.utc).date().isoformat()
    lines = [
        "# Python calls a step: the hot path",
        "",
        f"{date}, {os.cpu_count()}-core CPU, commit {commit()}, torch {torch.__version__}, lightning "
        f"{pl.__version__}. Demo GPT ({CONFIG.n_layers} layers, width {CONFIG.d_model}, {CONFIG.seq_len} tokens), "
        f"batch {BATCH}, {args.steps} optimizer steps profiled after {args.warmup}; DynamicBatchSize decides every "
        f"{args.adjust_every} steps on a SimulatedMemory.",
        "",
        f"Command: `{shlex.join(['python', *sys.argv])}`",
        "",
        "| Setting | calls a step | vs plain Lightning | vs Lightning's equivalents |",
        "| --- | --- | --- | --- |",
    ]
    for name, label in settings.items():
        calls = per_step[name]
        lines.append(f"| {label} | {calls:,.0f} | {calls / per_step['plain']:.2f}x | {calls / reference:.2f}x |")
    ours, theirs = stats["lightning_tune"], stats["lightning"]
    header = ["| {} | lightning_tune | Lightning's equivalents | difference |", "| --- | --- | --- | --- |"]
    lines += [
        "",
        "Calls are `cProfile`'s count (Python functions and built-ins) over the profiled steps, over their number.",
        "",
        "## Where the difference lies",
        "",
        "Calls a step by where the called function lives, largest differences first:",
        "",
        header[0].format("Place"),
        header[1],
        *difference(by_place(ours, args.steps), by_place(theirs, args.steps), args.top),
        "",
        "and by function:",
        "",
        header[0].format("Function"),
        header[1],
        *difference(by_function(ours, args.steps), by_function(theirs, args.steps), args.top),
        "",
        "## `ScheduleLR.step` against `LambdaLR.step` (`benchmarks/lr_step.py`)",
        "",
        lr_step_table([]),
    ]
    print("\n".join(lines))


if __name__ == "__main__":
    main()
