"""The whole pack on the demo GPT against plain Lightning and against an expert's hand-tuned run.

Three configurations of the same model (GPT-2 small's width and depth with a 32k vocabulary, sequence 1024), each
training optimizer steps of exactly ``--effective-batch`` samples of random tokens:

- ``plain``: Lightning's defaults: fp32, the module's own AdamW and attention, at the hand-tuned run's micro-batch or,
  when that does not fit in fp32, the largest power-of-two fraction of it that does (stated in the row);
- ``hand_tuned``: what an expert writes by hand: bf16-mixed, the module's SDPA call held to PyTorch's FlashAttention
  kernel (``sdpa_kernel(SDPBackend.FLASH_ATTENTION)`` around training), fused AdamW in ``configure_optimizers``, and
  the fixed micro-batch with the best samples/s in a sweep of powers of two up to the effective batch;
- ``lightning_tune``: no hand tuning: ``TunePlugin(precision="auto", attention="auto", optimizer="adamw_fused")`` and
  ``DynamicBatchSize`` started from the planner's prior (``measure_memory``).

The configurations run interleaved in ``--rounds`` rounds in one process; each run is timed over its last
``--measure`` optimizer steps (one synchronisation at each end, after warm-up and, for DynamicBatchSize, after it
settled). MFU is samples/s × the FLOPs of one sample's forward and backward (counted on a meta-device copy of the
model with the package's own count, the convention of ``docs/peak_flops.md``) over the device's dense bf16 peak, the
same denominator for every row. Goal: lightning_tune >= 3x plain and >= 0.95x hand-tuned.

    python benchmarks/pack.py --out benchmarks/results/pack_gpu
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from _data import RandomTokenDataModule, window_sizes
from _results import QUIET_TRAINER, device_name, header_lines, run_header, write_results
from lightning.pytorch.callbacks import Callback
from swaps import Probe, _free
from torch.nn.attention import SDPBackend, sdpa_kernel

import lightning_tune as lt
from lightning_tune.demos import DemoGPT, GPTConfig
from lightning_tune.perf.counting import count_step_flops
from lightning_tune.perf.flops import peak_flops


class ExpertGPT(DemoGPT):
    """The demo module as an expert would hand-tune it: the same parameter groups, with fused AdamW."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        groups = [
            {"params": g["params"], "weight_decay": g["weight_decay"]}
            for g in super().configure_optimizers().param_groups
        ]
        return torch.optim.AdamW(groups, lr=self.lr, betas=(0.9, 0.95), fused=True)


class FlashOnly(Callback):
    """Hold the module's SDPA calls to PyTorch's FlashAttention kernel while training runs (hand-tuned run)."""

    def __init__(self) -> None:
        self._context: Any = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        kernels = [SDPBackend.FLASH_ATTENTION] if trainer.strategy.root_device.type == "cuda" else [SDPBackend.MATH]
        self._context = sdpa_kernel(kernels)
        self._context.__enter__()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._context.__exit__(None, None, None)


def flops_per_sample(config: GPTConfig) -> float:
    """FLOPs of one sample's forward and backward, counted as ThroughputLatencyMonitor counts them for MFU: on a
    meta-device copy (nothing is allocated), causal attention by the pairs it attends (``docs/peak_flops.md``)."""
    tokens = torch.zeros(1, config.seq_len, dtype=torch.long)
    counted, _ = count_step_flops(
        _meta_model(config), (tokens, tokens), lambda m, batch: m.training_step(batch, 0), samples=1
    )
    return counted.total


def fit(
    kind: str, *, config: GPTConfig, micro: int, effective: int, steps: int, measure: int, args: argparse.Namespace
) -> dict[str, Any]:
    """One run; returns samples/s over its last ``measure`` steps (``{"oom": True}`` on an out-of-memory error)."""
    _free()
    pl.seed_everything(0, verbose=False)
    probe = Probe(steps - measure)
    callbacks: list[Callback] = [probe]
    plugins: list[Any] = []
    precision: str | None = "32-true"
    module: type[DemoGPT] = DemoGPT
    dynamic = None
    if kind == "hand_tuned":
        precision, module = _hand_precision(args), ExpertGPT
        callbacks.append(FlashOnly())
    if kind == "lightning_tune":
        plugin = lt.TunePlugin("auto", attention="auto", optimizer="adamw_fused")
        plugins, precision = [plugin], None
        prior = lt.measure_memory(
            _meta_model(config),
            lambda n: (torch.zeros(n, config.seq_len, dtype=torch.long),) * 2,
            precision=plugin.precision,
        )
        # without CUDA (the smoke run) memory is simulated, with the planner's own figures
        simulated = None
        if args.accelerator != "cuda":
            total = prior.fixed_bytes + prior.bytes_per_sample * effective
            simulated = lt.SimulatedMemory(total, prior.fixed_bytes, max(1, prior.bytes_per_sample))
        dynamic = lt.DynamicBatchSize(adjust_every=args.adjust_every, prior=prior, probe=simulated)
        callbacks.append(dynamic)
        data = RandomTokenDataModule(micro, seq_len=config.seq_len, vocab_size=config.vocab_size)
        accumulate = effective // micro
    else:
        sizes = window_sizes(effective, micro)
        data = RandomTokenDataModule(micro, seq_len=config.seq_len, vocab_size=config.vocab_size, sizes=sizes)
        accumulate = len(sizes)
    with tempfile.TemporaryDirectory() as root:
        trainer = pl.Trainer(
            default_root_dir=root,
            accelerator=args.accelerator,
            devices=1,
            precision=precision,  # type: ignore[arg-type]
            plugins=plugins,
            max_steps=steps,
            accumulate_grad_batches=accumulate,
            callbacks=callbacks,
            **QUIET_TRAINER,
            limit_val_batches=0,
        )
        try:
            trainer.fit(module(config), datamodule=data)
        except torch.OutOfMemoryError:
            return {"oom": True, "micro_batch": micro}
        finally:
            del trainer
            _free()
    seconds = probe.end - probe.start
    return {
        "micro_batch": dynamic.batch_size if dynamic is not None else micro,
        "samples_per_sec": effective * measure / seconds,
        "peak_reserved_gib": probe.peak_reserved / 2**30,
        "loss": probe.loss,
    }


def _hand_precision(args: argparse.Namespace) -> str:
    return "bf16-mixed" if args.accelerator == "cuda" else "32-true"  # no bf16 autocast worth timing on a CPU


def _meta_model(config: GPTConfig) -> DemoGPT:
    with torch.device("meta"):
        return DemoGPT(config)


def pack(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    config = GPTConfig(
        vocab_size=args.vocab_size,
        seq_len=args.seq_len,
        d_model=args.d_model,
        n_layers=args.n_layers,
        n_heads=args.n_heads,
    )
    effective = args.effective_batch
    common = {"config": config, "effective": effective, "args": args}

    # the expert's sweep: the fixed micro-batch with the best samples/s (not counted in the comparison)
    sweep: dict[int, dict[str, Any]] = {}
    micro = args.sweep_from
    while micro <= effective:
        sweep[micro] = fit("hand_tuned", micro=micro, steps=args.sweep_steps, measure=args.sweep_steps // 2, **common)
        if sweep[micro].get("oom"):
            break
        micro *= 2
    fitting = [m for m, r in sweep.items() if not r.get("oom")]
    if not fitting:
        raise RuntimeError(f"no micro-batch from {args.sweep_from} fits on this device")
    best = max(fitting, key=lambda m: sweep[m]["samples_per_sec"])

    # plain Lightning: the hand-tuned micro-batch, or the largest power-of-two fraction of it that fits in fp32
    plain_micro = best
    runs: dict[str, list[dict[str, Any]]] = {"plain": [], "hand_tuned": [], "lightning_tune": []}
    for index in range(args.rounds):
        order = list(runs) if index % 2 == 0 else list(reversed(runs))
        for kind in order:
            if kind == "plain":
                result = fit("plain", micro=plain_micro, steps=args.steps, measure=args.measure, **common)
                while result.get("oom") and plain_micro > 1:
                    plain_micro //= 2
                    result = fit("plain", micro=plain_micro, steps=args.steps, measure=args.measure, **common)
            elif kind == "hand_tuned":
                result = fit("hand_tuned", micro=best, steps=args.steps, measure=args.measure, **common)
            else:
                result = fit(
                    "lightning_tune", micro=args.start_micro, steps=args.tune_steps, measure=args.measure, **common
                )
            runs[kind].append(result)
        print(f"round {index + 1}/{args.rounds} done", flush=True)

    per_sample = flops_per_sample(config)
    device = device_name()
    peak = peak_flops(device, torch.bfloat16) if torch.cuda.is_available() else None
    summary: dict[str, dict[str, Any]] = {}
    for kind, results in runs.items():
        ok = [r for r in results if not r.get("oom")]
        if not ok:
            summary[kind] = {"oom": True}
            continue
        sps = statistics.median(r["samples_per_sec"] for r in ok)
        summary[kind] = {
            "micro_batch": ok[-1]["micro_batch"],
            "samples_per_sec": sps,
            "tokens_per_sec": sps * config.seq_len,
            "mfu": sps * per_sample / peak if peak else None,
            "peak_reserved_gib": statistics.median(r["peak_reserved_gib"] for r in ok),
        }
    ratios = {}
    if all(not summary[k].get("oom") for k in summary):
        tuned = summary["lightning_tune"]["samples_per_sec"]
        ratios = {
            "lightning_tune_vs_plain": tuned / summary["plain"]["samples_per_sec"],
            "lightning_tune_vs_hand_tuned": tuned / summary["hand_tuned"]["samples_per_sec"],
        }
    params = sum(p.numel() for p in _meta_model(config).parameters())
    record = {
        **run_header("pack", device),
        "model": config.__dict__,
        "parameters": params,
        "effective_batch": effective,
        "flops_per_sample": per_sample,
        "peak_flops_bf16": peak,
        "sweep": {str(k): v for k, v in sweep.items()},
        "hand_tuned_micro_batch": best,
        "runs": runs,
        "median": summary,
        "ratios": ratios,
        "goal_met": bool(ratios)
        and ratios["lightning_tune_vs_plain"] >= 3
        and ratios["lightning_tune_vs_hand_tuned"] >= 0.95,
    }
    labels = {
        "plain": f"plain Lightning (fp32 defaults, micro-batch {plain_micro})",
        "hand_tuned": f"hand-tuned ({_hand_precision(args)}, SDPA flash, fused AdamW, micro-batch {best}, swept)",
        "lightning_tune": 'lightning_tune (`TunePlugin(precision="auto")`, swaps, DynamicBatchSize from the prior)',
    }
    lines = [f"# The pack on the demo GPT — {device}", "", *header_lines(record)]
    lines += [
        f"{params / 1e6:.1f} M parameters ({config}); optimizer steps of exactly {effective} samples; medians of "
        f"{args.rounds} interleaved rounds, each timed over its last {args.measure} steps. MFU against the dense bf16 "
        f"peak ({'n/a' if peak is None else f'{peak / 1e12:.0f} TFLOP/s'}) for every row, "
        f"{per_sample / 1e9:.1f} GFLOP per sample (forward + backward, causal attention by the pairs it attends).",
        "",
        "| Configuration | micro-batch | samples/s | tokens/s | MFU | peak reserved GiB |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for kind, row in summary.items():
        if row.get("oom"):
            lines.append(f"| {labels[kind]} | | out of memory | | | |")
            continue
        mfu = "n/a" if row["mfu"] is None else f"{row['mfu']:.1%}"
        lines.append(
            f"| {labels[kind]} | {row['micro_batch']} | {row['samples_per_sec']:,.1f} | {row['tokens_per_sec']:,.0f} "
            f"| {mfu} | {row['peak_reserved_gib']:.1f} |"
        )
    lines += [
        "",
        "Sweep of the hand-tuned micro-batch (samples/s): "
        + ", ".join(f"{m}: {'OOM' if r.get('oom') else format(r['samples_per_sec'], ',.1f')}" for m, r in sweep.items())
        + ".",
    ]
    if ratios:
        lines += [
            "",
            f"lightning_tune / plain: {ratios['lightning_tune_vs_plain']:.2f}x (goal >= 3x); lightning_tune / "
            f"hand-tuned: {ratios['lightning_tune_vs_hand_tuned']:.2f}x (goal >= 0.95x).",
        ]
    return record, "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--accelerator", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--vocab-size", type=int, default=32768)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--d-model", type=int, default=768)
    parser.add_argument("--n-layers", type=int, default=12)
    parser.add_argument("--n-heads", type=int, default=12)
    parser.add_argument("--effective-batch", type=int, default=64, help="samples per optimizer step, a power of two")
    parser.add_argument("--sweep-from", type=int, default=4, help="smallest micro-batch of the expert's sweep")
    parser.add_argument("--sweep-steps", type=int, default=8)
    parser.add_argument("--start-micro", type=int, default=8, help="DynamicBatchSize's starting micro-batch")
    parser.add_argument("--adjust-every", type=int, default=4)
    parser.add_argument("--steps", type=int, default=12, help="steps of the fixed runs")
    parser.add_argument("--tune-steps", type=int, default=30, help="steps of the lightning_tune run (settling first)")
    parser.add_argument("--measure", type=int, default=8, help="last steps timed")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    return parser


def main() -> None:
    args = build_parser().parse_args()
    write_results(args.out, *pack(args))


if __name__ == "__main__":
    main()
