"""DynamicBatchSize on the demo GPT: settled micro-batch, peak memory against the target, samples/s, time to settle.

Three runs in one process, each from the same seed and every optimizer step of exactly the same effective batch
(``--batch-size`` × ``--accumulate`` samples):

- ``fixed``: the micro-batch stays at ``--batch-size``;
- ``batch_size_finder``: Lightning's ``BatchSizeFinder`` (binary search, before training) picks the micro-batch,
  and training runs at it; when the pick does not divide the effective batch, each step's last micro-batch is the
  remainder (the loader's batches cycle through that split, with ``accumulate_grad_batches`` its length);
- ``dynamic``: ``DynamicBatchSize(target_vram=--target)`` starts at ``--batch-size`` and adjusts while training.

Every run is timed per optimizer step, with one device synchronisation at the end of each step and none inside it.
Samples/s is measured over the last ``--measure`` steps of each run (after settling). ``--doubling`` adds a second
scenario: sequences double in length after half of ``--double-steps``; BatchSizeFinder's pick, kept, must run out of
memory or be searched again (both are run), while DynamicBatchSize recovers and settles again. On a machine without a
GPU, ``--simulate`` runs the same code against a ``SimulatedMemory`` device (a smoke run: figures say nothing about
real memory; BatchSizeFinder's search there is bounded by ``--finder-trials`` alone).

``--overhead`` measures instead what the callback costs when it has nothing to change (the configured batch
already at the top of its grid): rounds of runs with and without it, interleaved in one process, the median step
time of each, and the time spent in the callback's own code per step (its hooks and its wrapper around
``training_step``, minus the module's own ``training_step``).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.callbacks import BatchSizeFinder

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _data import RandomTokenDataModule, RandomTokens, window_sizes  # noqa: E402
from _results import (  # noqa: E402
    BASELINE,
    EXTRA,
    MARGIN,
    QUIET_TRAINER,
    SCENARIO,
    Cost,
    Row,
    Rows,
    Work,
    device_name,
    header_lines,
    plan,
    run_header,
    transformer_work,
    write_results,
)

import lightning_tune as lt  # noqa: E402
from lightning_tune.demos import DemoGPT, GPTConfig, SyntheticTokenDataModule  # noqa: E402


class _Clock(Callback):
    """Wall time at the end of each optimizer step (one device synchronisation per optimizer step, none inside an
    accumulation window), and the micro-batch DynamicBatchSize used in it."""

    def __init__(self, dynamic: lt.DynamicBatchSize | None) -> None:
        self.dynamic = dynamic
        self.ends: list[float] = []
        self.sizes: list[int] = []
        self._step = 0

    def _sync(self) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def on_train_start(self, trainer: Trainer, pl_module: Any) -> None:
        self._step = trainer.global_step
        self._sync()
        self.ends.append(time.perf_counter())

    def on_train_batch_end(self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self._step:  # a micro-batch inside an accumulation window: not timed
            return
        self._step = trainer.global_step
        self._sync()
        self.ends.append(time.perf_counter())
        if self.dynamic is not None and self.dynamic.batch_size is not None:
            self.sizes.append(self.dynamic.batch_size)


class _SimulatedLimit(Callback):
    """Runs without DynamicBatchSize meet the same simulated device: a micro-batch too large for it raises."""

    def __init__(self, probe: lt.SimulatedMemory) -> None:
        self.probe = probe

    def on_train_batch_start(self, trainer: Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.probe.before_micro_batch(int(batch[0].shape[0]))


class _DoubleSequences(Callback):
    """After optimizer step ``at``, every sequence is twice as long (and, simulated, every sample twice as large)."""

    def __init__(self, at: int, dataset: RandomTokens, probe: lt.SimulatedMemory | None) -> None:
        self.at, self.dataset, self.probe = at, dataset, probe

    def on_train_batch_end(self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.at and self.dataset.seq_len == self.at_len:
            self.dataset.seq_len *= 2
            if self.probe is not None:
                self.probe.bytes_per_sample *= 2

    def on_train_start(self, trainer: Trainer, pl_module: Any) -> None:
        self.at_len = self.dataset.seq_len


def _track_peak(probe: lt.SimulatedMemory) -> None:
    """Keep the largest memory a micro-batch that ran needed (``max_used``), as the device's peak would."""
    original = probe.before_micro_batch
    probe.max_used = 0

    def before_micro_batch(batch_size: int, *args: Any, **kwargs: Any) -> None:
        original(batch_size, *args, **kwargs)  # raises when it does not fit
        used = probe.reserved_bytes() if hasattr(probe, "reserved_bytes") else probe.usage(batch_size)
        probe.max_used = max(probe.max_used, used)

    probe.before_micro_batch = before_micro_batch


def _trainer(
    args: argparse.Namespace, callbacks: list[Callback], steps: int, accumulate: int, root: str | None = None
) -> Trainer:
    return Trainer(
        default_root_dir=root,
        accelerator="cpu" if args.simulate else "gpu",
        devices=1,
        precision=args.precision,
        max_steps=steps,
        accumulate_grad_batches=accumulate,
        callbacks=callbacks,
        **QUIET_TRAINER,
        limit_val_batches=0,
    )


def _free() -> None:
    if torch.cuda.is_available():  # what the last run left must not count in the next one's peak
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _find(args: argparse.Namespace, config: GPTConfig, seq_len: int) -> tuple[int, float]:
    """BatchSizeFinder's pick (binary search before training) at ``seq_len``, and the seconds its search took.

    Simulated, the search runs on the CPU without a memory limit (BatchSizeFinder only recognises CUDA's
    out-of-memory errors), so ``--finder-trials`` bounds it.
    """
    _free()
    seed_everything(args.seed, verbose=False)
    data = RandomTokenDataModule(args.batch_size, seq_len=seq_len, vocab_size=config.vocab_size)
    finder = BatchSizeFinder(mode="binsearch", init_val=args.batch_size, max_trials=args.finder_trials)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as root:  # where the finder saves and restores its checkpoint
        _trainer(args, [finder], 1, 1, root).fit(DemoGPT(config), datamodule=data)
    return int(data.batch_size), time.perf_counter() - start


def _train(
    args: argparse.Namespace, config: GPTConfig, *, micro: int | None, seq_len: int, steps: int, double_at: int = 0
) -> dict[str, Any]:
    """Train ``steps`` optimizer steps of exactly ``--batch-size × --accumulate`` samples each.

    ``micro=None`` runs DynamicBatchSize starting at ``--batch-size``; otherwise the micro-batch is fixed at ``micro``
    and the loader's batches cycle through the split of one step into micro-batches of ``micro`` (the last one
    smaller when ``micro`` does not divide the step), so every compared run has the same effective batch. With
    ``double_at``, sequences double in length after that step. An out-of-memory error ends the run and is reported.
    """
    _free()
    seed_everything(args.seed, verbose=False)
    effective = args.batch_size * args.accumulate
    probe = None
    if args.simulate:
        probe = lt.SimulatedMemory(args.sim_total, args.sim_fixed, args.sim_per_sample * seq_len // args.seq_len)
        _track_peak(probe)
    dynamic: lt.DynamicBatchSize | None = None
    callbacks: list[Callback] = []
    if micro is None:
        dynamic = lt.DynamicBatchSize(
            target_vram=args.target, adjust_every=args.adjust_every, multiple_of=args.multiple_of, probe=probe
        )
        callbacks.append(dynamic)
        data = RandomTokenDataModule(args.batch_size, seq_len=seq_len, vocab_size=config.vocab_size)
        accumulate = args.accumulate
    else:
        sizes = window_sizes(effective, micro)
        data = RandomTokenDataModule(micro, seq_len=seq_len, vocab_size=config.vocab_size, sizes=sizes)
        accumulate = len(sizes)
        if probe is not None:
            callbacks.append(_SimulatedLimit(probe))
    if double_at:
        callbacks.append(_DoubleSequences(double_at, data.dataset, probe))
    clock = _Clock(dynamic)
    trainer = _trainer(args, [*callbacks, clock], steps, accumulate)
    oom_at_step = None
    try:
        trainer.fit(DemoGPT(config), datamodule=data)
    except torch.OutOfMemoryError:
        oom_at_step = trainer.global_step + 1
    done = len(clock.ends) - 1
    measure = min(args.measure, done)
    seconds = clock.ends[-1] - clock.ends[-1 - measure] if measure else float("nan")
    result: dict[str, Any] = {
        "micro_batch": dynamic.batch_size if dynamic is not None else micro,
        "effective_batch": effective,
        "steps_done": done,
        "oom_at_step": oom_at_step,
        "samples_per_sec": effective * measure / seconds if measure else float("nan"),
        "measured_steps": measure,
    }
    if double_at and done >= double_at:  # samples/s before the switch, over the steps up to it after settling
        before = min(args.measure, double_at)
        result["samples_per_sec_before_doubling"] = (
            effective * before / (clock.ends[double_at] - clock.ends[double_at - before])
        )
    if dynamic is not None:
        changes = [i for i in range(1, len(clock.sizes)) if clock.sizes[i] != clock.sizes[i - 1]]
        first = [i for i in changes if not double_at or i < double_at]
        settled = first[-1] + 1 if first else 0
        result.update(
            start_micro_batch=args.batch_size,
            settle_steps=settled,
            settle_seconds=clock.ends[settled] - clock.ends[0],
            oom_recoveries=dynamic.oom_recoveries,
            sizes=clock.sizes,
            predicted_vram_frac=dynamic.last_decision.predicted_fraction if dynamic.last_decision else None,
        )
        if double_at:
            later = [i for i in changes if i >= double_at]
            resettled = later[-1] + 1 if later else double_at
            result.update(
                size_before_doubling=clock.sizes[double_at - 1] if len(clock.sizes) >= double_at else None,
                resettle_steps=resettled - double_at,
                resettle_seconds=clock.ends[resettled] - clock.ends[double_at],
            )
    if torch.cuda.is_available():
        total = torch.cuda.get_device_properties(0).total_memory
        result["peak_reserved_frac"] = torch.cuda.max_memory_reserved() / total
        result["peak_reserved_over_target"] = result["peak_reserved_frac"] / args.target
    elif probe is not None:
        result["peak_reserved_frac"] = probe.max_used / probe.total
        result["peak_reserved_over_target"] = result["peak_reserved_frac"] / args.target
    del trainer
    _free()
    return result


def _model_config(args: argparse.Namespace, seq_len: int) -> GPTConfig:
    return GPTConfig(
        vocab_size=args.vocab_size,
        d_model=args.d_model,
        n_layers=args.n_layers,
        n_heads=max(1, args.d_model // 64),
        seq_len=seq_len,
    )


def _frac(row: dict[str, Any], key: str) -> str:
    return f"{row[key]:.3f}" if row.get(key) is not None else "n/a"


def compare(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    """A fixed micro-batch, BatchSizeFinder's pick and DynamicBatchSize at the same exact effective batch."""
    config = _model_config(args, args.seq_len)
    pick, search_seconds = _find(args, config, args.seq_len)
    results = {
        "fixed": _train(args, config, micro=args.batch_size, seq_len=args.seq_len, steps=args.steps),
        "batch_size_finder": _train(args, config, micro=pick, seq_len=args.seq_len, steps=args.steps),
        "dynamic": _train(args, config, micro=None, seq_len=args.seq_len, steps=args.steps),
    }
    results["batch_size_finder"]["search_seconds"] = search_seconds
    base = results["fixed"]["samples_per_sec"]
    device = f"simulated memory on {device_name()}" if args.simulate else device_name()
    record = {
        **run_header("dynamic_batch", device),
        "config": vars(args) | {"out": str(args.out) if args.out else None},
        "model": config.__dict__,
        "results": results,
        "samples_per_sec_ratio_to_fixed": {k: v["samples_per_sec"] / base for k, v in results.items()},
    }
    lines = [f"# DynamicBatchSize on the demo GPT — {device}", "", *header_lines(record)]
    lines += [
        f"{args.precision}, {config}; every run takes optimizer steps of exactly {args.batch_size * args.accumulate} "
        f"samples ({args.steps} steps; samples/s over the last {args.measure}, one synchronisation per optimizer "
        "step).",
        "",
        "| Run | Micro-batch | Effective batch | Samples/s | vs fixed | Peak reserved / total "
        "| Peak reserved / target |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, r in results.items():
        lines.append(
            f"| {name} | {r['micro_batch']} | {r['effective_batch']} | {r['samples_per_sec']:,.1f} | "
            f"{r['samples_per_sec'] / base:.2f}x | {_frac(r, 'peak_reserved_frac')} "
            f"| {_frac(r, 'peak_reserved_over_target')} |"
        )
    dyn = results["dynamic"]
    lines += [
        "",
        f"BatchSizeFinder's search took {search_seconds:.1f} s before training (not in its samples/s).",
        f"DynamicBatchSize: {dyn['start_micro_batch']} -> {dyn['micro_batch']} (target {args.target}), settled after "
        f"{dyn['settle_steps']} steps ({dyn['settle_seconds']:.1f} s), {dyn['oom_recoveries']} OOM recoveries, "
        f"predicted peak {dyn['predicted_vram_frac']} of the device.",
        "",
    ]
    return record, "\n".join(lines)


def doubling(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    """Sequences double in length after half the steps: BatchSizeFinder's pick (kept, then re-run at the new length)
    against DynamicBatchSize."""
    long = 2 * args.seq_len
    config = _model_config(args, long)
    half = args.double_steps // 2
    pick, search_seconds = _find(args, config, args.seq_len)
    kept = _train(args, config, micro=pick, seq_len=args.seq_len, steps=args.double_steps, double_at=half)
    repick, research_seconds = _find(args, config, long)
    rerun = _train(args, config, micro=repick, seq_len=long, steps=args.double_steps - half)
    dynamic = _train(args, config, micro=None, seq_len=args.seq_len, steps=args.double_steps, double_at=half)
    device = f"simulated memory on {device_name()}" if args.simulate else device_name()
    record = {
        **run_header("dynamic_batch_doubling", device),
        "config": vars(args) | {"out": str(args.out) if args.out else None},
        "model": config.__dict__,
        "finder_pick": pick,
        "finder_search_seconds": search_seconds,
        "finder_pick_kept": kept,
        "finder_repick": repick,
        "finder_research_seconds": research_seconds,
        "finder_rerun_at_doubled_length": rerun,
        "dynamic": dynamic,
    }
    outcome = (
        f"out of memory at step {kept['oom_at_step']}"
        if kept["oom_at_step"]
        else f"no out-of-memory error; {kept['samples_per_sec']:,.1f} samples/s at the end"
    )
    lines = [f"# Sequence length doubling mid-run — {device}", "", *header_lines(record)]
    lines += [
        f"{args.precision}, {config}; {args.double_steps} optimizer steps of {args.batch_size * args.accumulate} "
        f"samples, sequences of {args.seq_len} tokens, then {long} tokens after step {half}.",
        "",
        "| Run | Micro-batch | Outcome | Samples/s before doubling | Samples/s at the end | Peak reserved / target |",
        "| --- | --- | --- | --- | --- | --- |",
        f"| BatchSizeFinder's pick at {args.seq_len}, kept | {pick} | {outcome} "
        f"| {kept.get('samples_per_sec_before_doubling', float('nan')):,.1f} | "
        f"{'-' if kept['oom_at_step'] else format(kept['samples_per_sec'], ',.1f')} "
        f"| {_frac(kept, 'peak_reserved_over_target')} |",
        f"| BatchSizeFinder re-run at {long} (search {research_seconds:.1f} s) | {repick} | "
        f"{'out of memory' if rerun['oom_at_step'] else 'ran'} | - | {rerun['samples_per_sec']:,.1f} "
        f"| {_frac(rerun, 'peak_reserved_over_target')} |",
        f"| DynamicBatchSize | {dynamic.get('size_before_doubling')} -> {dynamic['micro_batch']} "
        f"| {dynamic['oom_recoveries']} OOM recoveries, re-settled {dynamic['resettle_steps']} steps "
        f"({dynamic['resettle_seconds']:.1f} s) after the switch "
        f"| {dynamic.get('samples_per_sec_before_doubling', float('nan')):,.1f} | {dynamic['samples_per_sec']:,.1f} "
        f"| {_frac(dynamic, 'peak_reserved_over_target')} |",
        "",
    ]
    return record, "\n".join(lines)


def _with(args: argparse.Namespace, **changes: Any) -> argparse.Namespace:
    return argparse.Namespace(**(vars(args) | changes))


_HEADER = ("Run", "Micro-batch", "Effective batch", "Samples/s", "Tokens/s", "Peak reserved / target", "OOMs recovered",
           "Settled after", "Outcome")  # fmt: skip


def _cells(name: str, r: dict[str, Any], seq_len: int) -> list[Any]:
    settled = f"{r['settle_steps']} steps ({r['settle_seconds']:.1f} s)" if "settle_steps" in r else "-"
    outcome = f"out of memory at step {r['oom_at_step']}" if r.get("oom_at_step") else f"{r['steps_done']} steps"
    sps = r["samples_per_sec"]
    return [name, r["micro_batch"], r["effective_batch"], f"{sps:,.1f}", f"{sps * seq_len:,.0f}",
            _frac(r, "peak_reserved_over_target"), r.get("oom_recoveries", "-"), settled, outcome]  # fmt: skip


def part(rows: Rows, *, smoke: bool) -> str:
    """The suite's part, where memory binds on any device: two calibration runs (micro-batches of 8 and 16) give the
    seconds and the share of the device per sample; the effective batch is four times the micro-batch that fits in
    the target. Then the plan, each run a row as it ends: the fixed micro-batch of 8 (the baseline); DynamicBatchSize;
    BatchSizeFinder's search and, sequences doubling mid-run, its pick kept (sized to run out of memory) and
    DynamicBatchSize (the scenario the part exists for); then the finder's pick at the first length, the expert's
    sweep and its best micro-batch, dropped first when the share is short."""
    if smoke:  # a simulated device of 10 000 units: 2 000 fixed, 400 a sample, so 17 samples fit in 0.9 of it
        argv = "--simulate --precision 32-true --seq-len 8 --d-model 32 --n-layers 1 --vocab-size 64 --batch-size 8 "
        argv += "--adjust-every 1 --finder-trials 1 --sim-per-sample 400"
    else:  # the LM head's logits over a 32k vocabulary dominate a sample's memory, as in a fine-tune
        argv = "--seq-len 512 --d-model 512 --n-layers 8 --adjust-every 2"
    args = build_parser().parse_args(argv.split())
    config = _model_config(args, args.seq_len)
    with torch.device("meta"):
        params = sum(p.numel() for p in DemoGPT(config).parameters())

    def work(samples: int, micro: int) -> Work:
        return transformer_work(params=params, layers=config.n_layers, width=config.d_model, seq=args.seq_len,
                                vocab=config.vocab_size, samples=samples, micro=micro)  # fmt: skip

    # calibration: single micro-batches of 8 and 16, one optimizer step each after the first
    measured = {}
    for micro in (8, 16):
        measured[micro] = rows.calibrate(
            "fixed", lambda n, m=micro: _train(_with(args, batch_size=m, accumulate=1, measure=1), config, micro=m,
                                               seq_len=args.seq_len, steps=n),
            work=work(micro, micro), like=lambda peak, total: {"peak_reserved_frac": peak / total}, micro_batch=micro,
        )  # fmt: skip
    (cost8, run8), (cost16, run16) = measured[8], measured[16]
    if run16.get("oom_at_step") or "peak_reserved_frac" not in run16:
        raise RuntimeError(f"a micro-batch of 16 does not fit in {args.target} of this device: nothing to size")
    per_sample = (run16["peak_reserved_frac"] - run8["peak_reserved_frac"]) / 8
    fixed_frac = run8["peak_reserved_frac"] - 8 * per_sample
    fits = max(8, int((args.target - fixed_frac) / max(per_sample, 1e-9)))
    effective = 8 * max(2, round(4 * fits / 8))
    # a micro-batch of m samples takes about a + b x m: an optimizer step of E samples in micro-batches of m,
    # E/m x a + E x b
    b = max((cost16.step - cost8.step) / 8, 1e-9)
    a = max(cost8.step - 8 * b, 0.0)
    settle = 0 if smoke else 8  # DynamicBatchSize's steps to settle before it is timed

    def step_s(micro: int, longer: int = 1) -> float:  # sequences `longer` times as long: a sample costs that much more
        return -(-effective // max(1, micro // longer)) * a + effective * b * longer

    def cost(micro: int, n: int, doubling: bool = False) -> float:  # DynamicBatchSize and the finder settle near `fits`
        return cost16.overhead + n * step_s(micro) + (n * step_s(micro, 2) if doubling else 0.0)

    trials = 2 * max(1, math.ceil(math.log2(fits / 8))) + 2  # BatchSizeFinder: doublings to past `fits`, then halvings
    search_s = trials * (cost16.overhead + 3 * (a + fits / 2 * b))
    sweep_micros = [m for m in (8 << k for k in range(16)) if m <= effective]
    sweep_s = {m: cost16.overhead + 2 * 4 * (a + m * b) for m in sweep_micros}
    # the baseline and the scenario rows: fixed, DynamicBatchSize (+ settle), the search and the two doubling runs
    steps, _ = plan(
        rows.left() / MARGIN - search_s - settle * 2 * step_s(fits),
        [Cost(cost16.overhead, s) for s in (step_s(8), step_s(fits), *[step_s(fits) + step_s(fits, 2)] * 2)],
        lo=4, hi=4 if smoke else 24,
    )  # fmt: skip
    args = _with(args, batch_size=8, accumulate=effective // 8, steps=steps, measure=max(2, steps // 3),
                 double_steps=2 * steps)  # fmt: skip
    rows.choose(model=str(config), fits_in_one_micro_batch=fits, effective_batch=effective, steps=steps,
                measured_steps=args.measure, warmup_steps=steps - args.measure, settle_steps=settle,
                per_sample_share=round(per_sample, 5), fixed_share=round(fixed_frac, 4),
                target=args.target)  # fmt: skip
    rows.text(f"Samples/s over each run's last {args.measure} steps: the {steps - args.measure} steps before them "
              "(and DynamicBatchSize's settling) are warm-up; BatchSizeFinder's search is timed apart.")  # fmt: skip
    results: dict[str, dict[str, Any]] = {}
    found: dict[str, Any] = {}
    long = _model_config(args, 2 * args.seq_len)
    rows.table(*_HEADER)

    def train(name: str, micro: Any, label: str, **kwargs: Any) -> dict[str, Any] | None:
        micro = micro() if callable(micro) else micro
        if micro == "missing":
            rows.text(f"{label}: not run, BatchSizeFinder's search was not.")
            return None
        n = kwargs.pop("steps", steps)
        result = _train(args, kwargs.pop("config", config), micro=micro, seq_len=args.seq_len, steps=n, **kwargs)
        results[name] = result
        rows.add(name, result, _cells(label.format(micro=micro, **found), result, args.seq_len))
        return result

    def search() -> dict[str, Any]:
        found["pick"], found["search_s"] = _find(args, config, args.seq_len)
        rows.add("finder_search", {"pick": found["pick"], "seconds": found["search_s"]})
        return found

    def sweep_run(micro: int) -> dict[str, Any] | None:
        if any(r.get("oom_at_step") for r in found.get("sweep", {}).values()):
            return None  # a smaller micro-batch already ran out of memory
        result = _train(_with(args, batch_size=micro, accumulate=4, measure=1), config, micro=micro,
                        seq_len=args.seq_len, steps=2)  # fmt: skip
        found.setdefault("sweep", {})[micro] = result
        rows.add("sweep", {"micro_batch": micro, **result}, _cells(f"sweep: {micro} x 4", result, args.seq_len))
        return result

    def best() -> int | str:
        sweep = {m: r["samples_per_sec"] for m, r in found.get("sweep", {}).items() if not r.get("oom_at_step")}
        return max(sweep, key=sweep.__getitem__) if sweep else "missing"

    pick = lambda: found.get("pick", "missing")  # noqa: E731
    double = {"config": long, "steps": 2 * steps, "double_at": steps}
    planned = [
        Row("fixed micro-batch 8", cost(8, steps), partial(train, "fixed", 8, "fixed micro-batch 8"), BASELINE),
        Row("DynamicBatchSize", cost(fits, steps + settle), partial(
            train, "dynamic", None, f"DynamicBatchSize from 8 (target {args.target})", steps=steps + settle), SCENARIO),
        Row("BatchSizeFinder's search", search_s, search, SCENARIO),
        Row("DynamicBatchSize, sequences doubling", cost(fits, steps, True) + settle * step_s(fits, 2),
            partial(train, "doubling_dynamic", None, "DynamicBatchSize, sequences doubling",
                    **{**double, "steps": 2 * steps + settle}), SCENARIO),
        Row("BatchSizeFinder's pick kept, sequences doubling", cost(fits, steps, True), partial(
            train, "doubling_finder_kept", pick, "BatchSizeFinder's pick ({micro}) kept, sequences doubling",
            **double), SCENARIO),
        Row("BatchSizeFinder's pick", cost(fits, steps), partial(
            train, "finder", pick, "BatchSizeFinder's pick ({micro}; search {search_s:.1f} s)"), EXTRA),
        *(Row(f"sweep at {m}", sweep_s[m], partial(sweep_run, m), EXTRA) for m in sweep_micros),
        Row("best fixed micro-batch of the sweep", cost(fits, steps), partial(
            train, "best_fixed", best, "best fixed micro-batch of the sweep ({micro})"), EXTRA),
    ]  # fmt: skip
    rows.text(f"Sequences double from {args.seq_len} to {2 * args.seq_len} tokens after step {steps} in the doubling "
              f"rows; the sweep takes about {sum(sweep_s.values()):.0f} s.")  # fmt: skip
    rows.run_plan(planned)
    dynamic = results.get("dynamic")
    if dynamic is None or "fixed" not in results:
        return "DynamicBatchSize or the fixed run not measured"
    ratio = {
        k: dynamic["samples_per_sec"] / r["samples_per_sec"]
        for k, r in results.items()
        if k in ("fixed", "best_fixed", "finder")
    }
    kept = results.get("doubling_finder_kept", {})
    return (
        "DynamicBatchSize "
        + ", ".join(f"{v:.2f}x {k}" for k, v in ratio.items())
        + f" at effective batch {effective}; finder's pick after doubling: "
        + (f"OOM at step {kept['oom_at_step']}" if kept.get("oom_at_step") else "ran" if kept else "not measured")
    )


class _TimedDynamicBatchSize(lt.DynamicBatchSize):
    """DynamicBatchSize that adds up the time spent in its own code (the runner included)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.own = 0.0
        self.steps = 0

    def setup(self, trainer: Trainer, pl_module: Any, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        self.inside = False
        for name in ("training_step", "backward"):  # the module's own work is not the callback's
            original = self._originals[name]

            def timed(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
                start = time.perf_counter()
                try:
                    return _original(*args, **kwargs)
                finally:
                    if self.inside:  # (Lightning's own backward, outside the step, was never counted)
                        self.own -= time.perf_counter() - start

            self._originals[name] = timed

    def _training_step(self, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        self.inside = True
        try:
            return super()._training_step(*args, **kwargs)
        finally:
            self.inside = False
            self.own += time.perf_counter() - start
            self.steps += 1

    def on_train_batch_start(self, *args: Any, **kwargs: Any) -> None:
        start = time.perf_counter()
        super().on_train_batch_start(*args, **kwargs)
        self.own += time.perf_counter() - start

    def on_train_batch_end(self, *args: Any, **kwargs: Any) -> None:
        start = time.perf_counter()
        super().on_train_batch_end(*args, **kwargs)
        self.own += time.perf_counter() - start


#: The overhead runs: (name, strategy of 2 gloo processes or None for one process, callback, sync_oom).
_OVERHEAD_RUNS = (
    ("plain", None, False, True),
    ("dynamic", None, True, True),
    ("ddp_plain", "ddp", False, True),
    ("ddp_dynamic_no_agreement", "ddp", True, False),
    ("ddp_dynamic", "ddp", True, True),
    ("fsdp2_plain", "fsdp2", False, True),
    ("fsdp2_dynamic", "fsdp2", True, True),
)


class _ShardedDemoGPT(DemoGPT):
    """The demo GPT under FSDP2: each block, then the root, sharded in ``configure_model``."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import FSDPModule, fully_shard

        if self.device_mesh is None or isinstance(self.model, FSDPModule):
            return
        for block in self.model.blocks:
            fully_shard(block, mesh=self.device_mesh["data_parallel"])
        fully_shard(self.model, mesh=self.device_mesh["data_parallel"])


def _strategy(name: str | None) -> dict[str, Any]:
    if name is None:
        return {}
    from lightning.pytorch.strategies import ModelParallelStrategy

    strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1) if name == "fsdp2" else name
    return {"accelerator": "cpu", "devices": 2, "strategy": strategy}


def _overhead_run(args: argparse.Namespace, name: str) -> tuple[float, float | None]:
    """Median step time and the callback's own time per step of one run (2 gloo processes for the DDP runs)."""
    _, distributed, with_callback, sync_oom = next(run for run in _OVERHEAD_RUNS if run[0] == name)
    if distributed and not args.ddp_worker:  # a fresh pair of processes: Lightning starts rank 1 from this same command
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "rank0.json"
            command = [sys.executable, __file__, *sys.argv[1:], "--ddp-worker", name, "--worker-out", str(out)]
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
            subprocess.run(command, check=True, env=env, cwd=tmp, capture_output=True, timeout=600)
            step, own = json.loads(out.read_text())
            return step, own
    seed_everything(args.seed, verbose=False)
    config = GPTConfig()
    data = SyntheticTokenDataModule(args.batch_size, seq_len=config.seq_len, vocab_size=config.vocab_size, seed=0)
    clock = _Clock(None)
    callbacks: list[Callback] = [clock]
    timed = None
    if with_callback:
        probe = None if torch.cuda.is_available() else lt.SimulatedMemory(1 << 40, 1 << 20, 1)
        timed = _TimedDynamicBatchSize(adjust_every=args.adjust_every, probe=probe, sync_oom=sync_oom)
        callbacks.append(timed)
    trainer = Trainer(
        max_steps=args.steps,
        callbacks=callbacks,
        **QUIET_TRAINER,
        limit_val_batches=0,
        **_strategy(distributed),
    )
    trainer.fit((_ShardedDemoGPT if distributed == "fsdp2" else DemoGPT)(config), datamodule=data)
    steps = [b - a for a, b in zip(clock.ends[2:], clock.ends[3:], strict=False)]
    own = None if timed is None else timed.own / max(timed.steps, 1)
    if args.ddp_worker and trainer.global_rank == 0:
        args.worker_out.write_text(json.dumps([statistics.median(steps), own]))
    return statistics.median(steps), own


def _overhead(args: argparse.Namespace) -> None:
    if args.ddp_worker:
        _overhead_run(args, args.ddp_worker)
        return
    rows = []
    for _ in range(args.rounds):  # the runs interleaved, so that a slow moment of the machine hits them all
        row: dict[str, Any] = {}
        for name, *_ in _OVERHEAD_RUNS:
            row[f"{name}_step_s"], row[f"{name}_own_s"] = _overhead_run(args, name)
        rows.append(row)

    def median(key: str) -> float:
        return statistics.median(r[key] for r in rows)

    def ratio(ours: str, base: str) -> tuple[float, float]:
        return median(f"{ours}_step_s") / median(f"{base}_step_s"), statistics.median(
            r[f"{ours}_step_s"] / r[f"{base}_step_s"] for r in rows
        )

    pairs = {
        "single process: callback / plain": ratio("dynamic", "plain"),
        "DDP, 2 gloo processes: callback with agreement / plain": ratio("ddp_dynamic", "ddp_plain"),
        "DDP: callback without agreement (sync_oom=False) / plain": ratio("ddp_dynamic_no_agreement", "ddp_plain"),
        "DDP: callback with / without agreement": ratio("ddp_dynamic", "ddp_dynamic_no_agreement"),
        "FSDP2, 2 gloo processes: callback (gathered once per step, agreement) / plain": ratio(
            "fsdp2_dynamic", "fsdp2_plain"
        ),
    }
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"CPU, {torch.get_num_threads()} threads"
    record = {
        **run_header("dynamic_batch_overhead", device),
        "rounds": rows,
        "median_step_s": {name: median(f"{name}_step_s") for name, *_ in _OVERHEAD_RUNS},
        "ratios": {k: {"ratio_of_medians": a, "median_of_round_ratios": b} for k, (a, b) in pairs.items()},
        "own_us_per_step": {name: median(f"{name}_own_s") * 1e6 for name, _, callback, _ in _OVERHEAD_RUNS if callback},
    }
    lines = [
        f"# DynamicBatchSize overhead, nothing to change ({device})",
        "",
        f"`{record['command']}` at commit `{record['commit'][:12]}`, {record['date']}. {args.rounds} rounds, each "
        "running every configuration once (DDP, FSDP2: 2 gloo processes of 1 thread each); medians of the step time "
        "after warm-up.",
        "",
        "| Run | Median step (ms) | Callback's own code per step |",
        "| --- | --- | --- |",
    ]
    for name, _, callback, _ in _OVERHEAD_RUNS:
        own = f"{record['own_us_per_step'][name]:.0f} us" if callback else ""
        lines.append(f"| {name} | {record['median_step_s'][name] * 1e3:.1f} | {own} |")
    lines += ["", "| Ratio | Of medians | Median of rounds |", "| --- | --- | --- |"]
    lines += [f"| {k} | {a:.4f} | {b:.4f} |" for k, (a, b) in pairs.items()]
    write_results(args.out, record, "\n".join([*lines, ""]))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=8, help="starting (and fixed) micro-batch")
    parser.add_argument("--accumulate", type=int, default=32, help="effective batch: --batch-size x --accumulate")
    parser.add_argument("--target", type=float, default=0.9)
    parser.add_argument("--adjust-every", type=int, default=10)
    parser.add_argument("--multiple-of", type=int, default=8)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--measure", type=int, default=40, help="last steps measured for samples/s")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--n-layers", type=int, default=12)
    parser.add_argument("--vocab-size", type=int, default=32768)
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--simulate", action="store_true", help="CPU smoke run against a SimulatedMemory device")
    parser.add_argument("--sim-total", type=int, default=10_000)
    parser.add_argument("--sim-fixed", type=int, default=2_000)
    parser.add_argument("--sim-per-sample", type=int, default=150)
    parser.add_argument("--finder-trials", type=int, default=25, help="BatchSizeFinder's max_trials")
    parser.add_argument("--doubling", action="store_true", help="also run the sequence-doubling scenario")
    parser.add_argument("--double-steps", type=int, default=60, help="steps of the doubling scenario (switch at half)")
    parser.add_argument("--overhead", action="store_true", help="measure the cost when nothing changes (CPU or GPU)")
    parser.add_argument("--rounds", type=int, default=9, help="rounds of the overhead measurement")
    parser.add_argument("--ddp-worker", default=None, help=argparse.SUPPRESS)  # one DDP run of --overhead
    parser.add_argument("--worker-out", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=None, help="write <out>.json and <out>.md")
    return parser


def main() -> None:
    args = build_parser().parse_args()
    if args.overhead:
        _overhead(args)
        return
    if not args.simulate and not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU (or --simulate for a CPU smoke run)")
    write_results(args.out, *compare(args))
    if args.doubling:
        write_results(args.out and args.out.with_name(args.out.name + "_doubling"), *doubling(args))


if __name__ == "__main__":
    main()
