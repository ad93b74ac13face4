"""Attention and optimizer swaps on the demo GPT: step time, peak memory and optimizer-state bytes, side by side.

Settings run interleaved in one process, in rounds:

- attention: the demo GPT's explicit eager attention, versus SDPA restricted to its flash/memory-efficient kernels
  through ``TunePlugin(attention="sdpa")``, versus flash-attn through ``TunePlugin(attention="flash")`` when it is
  installed;
- optimizer: torch AdamW versus bitsandbytes AdamW8bit through ``TunePlugin(optimizer="adamw8bit")``.

    python benchmarks/swaps.py --seq-len 2048 --batch-size 8 --out benchmarks/results/swaps_gpu

Needs a CUDA GPU for meaningful figures (``--device cpu --seq-len 128`` runs a smoke test).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from _results import run_header, write_results
from lightning.pytorch.callbacks import Callback

from lightning_tune import TunePlugin, _imports
from lightning_tune.demos import DemoGPT, GPTConfig, SyntheticTokenDataModule
from lightning_tune.swaps.optimizer import optimizer_state_bytes


class Probe(Callback):
    """Steady-state ms per optimizer step (synchronised), peak memory and optimizer-state bytes."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.start = self.end = 0.0
        self.state_bytes = 0
        self.peak_bytes = 0

    def _now(self, trainer: pl.Trainer) -> float:
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if trainer.global_step == self.warmup:
            if trainer.strategy.root_device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            self.start = self._now(trainer)
        elif trainer.global_step == trainer.max_steps:
            self.end = self._now(trainer)
            self.state_bytes = optimizer_state_bytes(trainer.optimizers[0])
            if trainer.strategy.root_device.type == "cuda":
                self.peak_bytes = torch.cuda.max_memory_allocated()


def run(setting: dict[str, Any], args: argparse.Namespace) -> dict[str, float]:
    pl.seed_everything(0, verbose=False)
    config = GPTConfig(
        seq_len=args.seq_len,
        d_model=args.d_model,
        n_layers=args.n_layers,
        n_heads=args.n_heads,
        attention=setting.get("model_attention", "sdpa"),
    )
    probe = Probe(args.warmup)
    plugin = TunePlugin(args.precision, attention=setting.get("attention"), optimizer=setting.get("optimizer"))
    trainer = pl.Trainer(
        accelerator=args.device,
        devices=1,
        plugins=[plugin],
        max_steps=args.steps,
        callbacks=[probe],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    data = SyntheticTokenDataModule(args.batch_size, seq_len=args.seq_len, vocab_size=config.vocab_size, seed=0)
    trainer.fit(DemoGPT(config), datamodule=data)
    return {
        "ms_per_step": (probe.end - probe.start) * 1000 / (args.steps - args.warmup),
        "peak_gib": probe.peak_bytes / 2**30,
        "optimizer_state_mib": probe.state_bytes / 2**20,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--n-layers", type=int, default=8)
    parser.add_argument("--n-heads", type=int, default=8)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    settings: dict[str, dict[str, Any]] = {
        "eager attention, AdamW": {"model_attention": "eager"},
        "SDPA flash/mem-efficient attention, AdamW": {"attention": "sdpa"},
        "SDPA attention, AdamW8bit": {"attention": "sdpa", "optimizer": "adamw8bit"},
    }
    if _imports.is_available("flash_attn"):
        settings["flash-attn attention, AdamW"] = {"attention": "flash"}
    if not _imports.is_available("bitsandbytes"):
        del settings["SDPA attention, AdamW8bit"]
    results: dict[str, list[dict[str, float]]] = {name: [] for name in settings}
    for round_index in range(args.rounds):
        for name, setting in settings.items():
            results[name].append(run(setting, args))
        print(f"round {round_index + 1}/{args.rounds} done")
    summary = {
        name: {key: statistics.median(r[key] for r in runs) for key in runs[0]} for name, runs in results.items()
    }
    device = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    record = {
        **run_header("swaps", device),
        "args": {k: str(v) for k, v in vars(args).items()},
        "runs": results,
        "median": summary,
    }
    base = summary["eager attention, AdamW"]
    lines = [
        f"# Swaps on the demo GPT — {device}",
        "",
        f"{record['date']}, commit `{record['commit'][:12]}`, torch {torch.__version__}, {args.precision}, "
        f"sequence {args.seq_len}, batch {args.batch_size}, d_model {args.d_model}, {args.n_layers} layers; "
        f"medians of {args.rounds} interleaved rounds.",
        "",
        f"Command: `{record['command']}`",
        "",
        "| Setting | ms/step | vs eager | peak GiB | vs eager | optimizer state MiB |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, row in summary.items():
        peak_ratio = f"{row['peak_gib'] / base['peak_gib']:.2f}x" if base["peak_gib"] else "-"
        lines.append(
            f"| {name} | {row['ms_per_step']:.1f} | {row['ms_per_step'] / base['ms_per_step']:.2f}x "
            f"| {row['peak_gib']:.2f} | {peak_ratio} | {row['optimizer_state_mib']:.1f} |"
        )
    write_results(args.out, record, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
