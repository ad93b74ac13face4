"""DynamicBatchSize on the demo GPT: settled micro-batch, peak memory against the target, samples/s, time to settle.

Three runs in one process, each from the same seed and the same effective batch (``--batch-size`` ×
``--accumulate``):

- ``fixed``: the micro-batch stays at ``--batch-size``;
- ``batch_size_finder``: Lightning's ``BatchSizeFinder`` (binary search, before training) picks the micro-batch,
  and training runs at it;
- ``dynamic``: ``DynamicBatchSize(target_vram=--target)`` starts at ``--batch-size`` and adjusts while training.

Samples/s is measured over the last ``--measure`` steps of each run (after settling), between two device
synchronisations. On a machine without a GPU, ``--simulate`` runs the same comparison against a
``SimulatedMemory`` device (a smoke run: figures say nothing about real memory).

``--overhead`` measures instead what the callback costs when it has nothing to change (the configured batch
already at the top of its grid): rounds of runs with and without it, interleaved in one process, the median step
time of each, and the time spent in the callback's own code per step (its hooks and its wrapper around
``training_step``, minus the module's own ``training_step``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.callbacks import BatchSizeFinder

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _results import run_header, write_results  # noqa: E402

import lightning_tune as lt  # noqa: E402
from lightning_tune.demos import DemoGPT, GPTConfig, SyntheticTokenDataModule  # noqa: E402


class _Clock(Callback):
    """Wall time of each optimizer step's end, and the micro-batch DynamicBatchSize used in it."""

    def __init__(self, dynamic: lt.DynamicBatchSize | None) -> None:
        self.dynamic = dynamic
        self.ends: list[float] = []
        self.sizes: list[int] = []
        self.samples: list[int] = []

    def _sync(self) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def on_train_start(self, trainer: Trainer, pl_module: Any) -> None:
        self._sync()
        self.ends.append(time.perf_counter())

    def on_train_batch_end(self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._sync()
        self.ends.append(time.perf_counter())
        self.samples.append(int(batch.shape[0] if isinstance(batch, torch.Tensor) else batch[0].shape[0]))
        if self.dynamic is not None and self.dynamic.batch_size is not None:
            self.sizes.append(self.dynamic.batch_size)


def _run(name: str, args: argparse.Namespace, config: GPTConfig) -> dict[str, Any]:
    seed_everything(args.seed, verbose=False)
    data = SyntheticTokenDataModule(args.batch_size, seq_len=config.seq_len, vocab_size=config.vocab_size, seed=0)
    model = DemoGPT(config)
    dynamic: lt.DynamicBatchSize | None = None
    callbacks: list[Callback] = []
    probe = lt.SimulatedMemory(args.sim_total, args.sim_fixed, args.sim_per_sample) if args.simulate else None
    if name == "dynamic":
        dynamic = lt.DynamicBatchSize(
            target_vram=args.target, adjust_every=args.adjust_every, multiple_of=args.multiple_of, probe=probe
        )
        callbacks.append(dynamic)
    micro = args.batch_size
    if name == "batch_size_finder":
        if args.simulate:
            raise SystemExit("--simulate cannot run BatchSizeFinder (it needs real out-of-memory errors)")
        finder = BatchSizeFinder(mode="binsearch", init_val=args.batch_size, max_trials=25)
        Trainer(
            accelerator="gpu",
            devices=1,
            precision=args.precision,
            callbacks=[finder],
            max_steps=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        ).fit(model, datamodule=data)
        micro = int(data.batch_size)
        seed_everything(args.seed, verbose=False)
        model = DemoGPT(config)
        data = SyntheticTokenDataModule(micro, seq_len=config.seq_len, vocab_size=config.vocab_size, seed=0)
    accumulate = max(1, (args.batch_size * args.accumulate) // micro) if name != "dynamic" else args.accumulate
    clock = _Clock(dynamic)
    trainer = Trainer(
        accelerator="cpu" if args.simulate else "gpu",
        devices=1,
        precision=args.precision,
        max_steps=args.steps,
        accumulate_grad_batches=accumulate,
        callbacks=[*callbacks, clock],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    trainer.fit(model, datamodule=data)
    window = slice(len(clock.ends) - 1 - args.measure, len(clock.ends) - 1)
    seconds = clock.ends[-1] - clock.ends[window.start]
    samples = sum(clock.samples[window.start :])
    result: dict[str, Any] = {
        "micro_batch": dynamic.batch_size if dynamic is not None else micro,
        "effective_batch": (dynamic.effective_batch_size if dynamic is not None else micro * accumulate),
        "samples_per_sec": samples / seconds,
    }
    if dynamic is not None:
        changes = [i for i in range(1, len(clock.sizes)) if clock.sizes[i] != clock.sizes[i - 1]]
        settled = changes[-1] + 1 if changes else 0
        result.update(
            start_micro_batch=args.batch_size,
            settle_steps=settled,
            settle_seconds=clock.ends[settled] - clock.ends[0],
            oom_recoveries=dynamic.oom_recoveries,
            sizes=clock.sizes,
            predicted_vram_frac=dynamic.last_decision.predicted_fraction if dynamic.last_decision else None,
        )
    if torch.cuda.is_available():
        total = torch.cuda.get_device_properties(0).total_memory
        result["peak_reserved_frac"] = torch.cuda.max_memory_reserved() / total
    return result


class _TimedDynamicBatchSize(lt.DynamicBatchSize):
    """DynamicBatchSize that adds up the time spent in its own code."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.own = 0.0
        self.steps = 0

    def _patch_module(self, pl_module: Any) -> None:
        super()._patch_module(pl_module)
        original = self._originals["training_step"]

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.own -= time.perf_counter() - start  # the module's own time is not the callback's

        self._originals["training_step"] = timed

    def _training_step(self, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return super()._training_step(*args, **kwargs)
        finally:
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


def _overhead_run(args: argparse.Namespace, with_callback: bool) -> tuple[float, float | None]:
    seed_everything(args.seed, verbose=False)
    config = GPTConfig()
    data = SyntheticTokenDataModule(args.batch_size, seq_len=config.seq_len, vocab_size=config.vocab_size, seed=0)
    clock = _Clock(None)
    callbacks: list[Callback] = [clock]
    timed = None
    if with_callback:
        probe = None if torch.cuda.is_available() else lt.SimulatedMemory(1 << 40, 1 << 20, 1)
        timed = _TimedDynamicBatchSize(adjust_every=args.adjust_every, probe=probe)
        callbacks.append(timed)
    Trainer(
        max_steps=args.steps,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    ).fit(DemoGPT(config), datamodule=data)
    steps = [b - a for a, b in zip(clock.ends[2:], clock.ends[3:], strict=False)]
    own = None if timed is None else timed.own / max(timed.steps, 1)
    return statistics.median(steps), own


def _overhead(args: argparse.Namespace) -> None:
    rows = []
    for _ in range(args.rounds):
        plain, _ = _overhead_run(args, False)
        dynamic, own = _overhead_run(args, True)
        rows.append({"plain_step_s": plain, "dynamic_step_s": dynamic, "own_s_per_step": own})
    ratio_of_medians = statistics.median(r["dynamic_step_s"] for r in rows) / statistics.median(
        r["plain_step_s"] for r in rows
    )
    median_ratio = statistics.median(r["dynamic_step_s"] / r["plain_step_s"] for r in rows)
    own = statistics.median(r["own_s_per_step"] for r in rows)
    step = statistics.median(r["dynamic_step_s"] for r in rows)
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"CPU, {torch.get_num_threads()} threads"
    record = {
        **run_header("dynamic_batch_overhead", device),
        "rounds": rows,
        "ratio_of_medians": ratio_of_medians,
        "median_of_round_ratios": median_ratio,
        "own_us_per_step": own * 1e6,
    }
    report = "\n".join(
        [
            f"# DynamicBatchSize overhead, nothing to change ({device})",
            "",
            f"`{record['command']}` at commit `{record['commit'][:12]}`, {record['date']}.",
            "",
            "| Figure | Value |",
            "| --- | --- |",
            f"| Step time with / without the callback, ratio of medians | {ratio_of_medians:.4f} |",
            f"| Median of the rounds' ratios | {median_ratio:.4f} |",
            f"| Time in the callback's own code per step | {own * 1e6:.0f} us ({own / step * 100:.2f} % of a step) |",
            "",
        ]
    )
    write_results(args.out, record, report)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=8, help="starting (and fixed) micro-batch")
    parser.add_argument("--accumulate", type=int, default=64, help="accumulation of the fixed run: effective batch")
    parser.add_argument("--target", type=float, default=0.9)
    parser.add_argument("--adjust-every", type=int, default=10)
    parser.add_argument("--multiple-of", type=int, default=8)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--measure", type=int, default=40, help="last steps measured for samples/s")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--n-layers", type=int, default=12)
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--simulate", action="store_true", help="CPU smoke run against a SimulatedMemory device")
    parser.add_argument("--sim-total", type=int, default=10_000)
    parser.add_argument("--sim-fixed", type=int, default=2_000)
    parser.add_argument("--sim-per-sample", type=int, default=100)
    parser.add_argument("--overhead", action="store_true", help="measure the cost when nothing changes (CPU or GPU)")
    parser.add_argument("--rounds", type=int, default=9, help="rounds of the overhead measurement")
    parser.add_argument("--out", type=Path, default=None, help="write <out>.json and <out>.md")
    args = parser.parse_args()
    if args.overhead:
        _overhead(args)
        return
    if not args.simulate and not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU (or --simulate for a CPU smoke run)")
    config = GPTConfig(
        d_model=args.d_model, n_layers=args.n_layers, n_heads=max(1, args.d_model // 64), seq_len=args.seq_len
    )
    names = ["fixed", "dynamic"] if args.simulate else ["fixed", "batch_size_finder", "dynamic"]
    results = {name: _run(name, args, config) for name in names}
    base = results["fixed"]["samples_per_sec"]
    device = "simulated (CPU)" if args.simulate else torch.cuda.get_device_name(0)
    record = {
        **run_header("dynamic_batch", device),
        "config": vars(args) | {"out": str(args.out) if args.out else None},
        "results": results,
        "samples_per_sec_ratio_to_fixed": {k: v["samples_per_sec"] / base for k, v in results.items()},
    }
    lines = [
        f"# DynamicBatchSize on the demo GPT ({device})",
        "",
        f"`{record['command']}` at commit `{record['commit'][:12]}`, {record['date']}.",
        "",
        "| Run | Micro-batch | Effective batch | Samples/s | vs fixed | Peak reserved / total |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, r in results.items():
        peak = f"{r['peak_reserved_frac']:.3f}" if "peak_reserved_frac" in r else "n/a"
        lines.append(
            f"| {name} | {r['micro_batch']} | {r['effective_batch']} | {r['samples_per_sec']:,.1f} | "
            f"{r['samples_per_sec'] / base:.2f}x | {peak} |"
        )
    dyn = results["dynamic"]
    lines += [
        "",
        f"DynamicBatchSize: {dyn['start_micro_batch']} -> {dyn['micro_batch']} (target {args.target}), settled after "
        f"{dyn['settle_steps']} steps ({dyn['settle_seconds']:.1f} s), {dyn['oom_recoveries']} OOM recoveries, "
        f"predicted peak {dyn['predicted_vram_frac']} of the device.",
        "",
    ]
    write_results(args.out, record, "\n".join(lines))


if __name__ == "__main__":
    main()
