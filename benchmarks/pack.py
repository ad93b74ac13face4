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

writes each row to ``<out>.jsonl`` and ``<out>.md`` as it is measured.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from functools import partial
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from _data import RandomTokenDataModule, window_sizes
from _results import (
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
    plan,
    run_header,
    transformer_work,
)
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
        prior = _prior(config, plugin.precision, args.batch_device)
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


_PRIORS: dict[tuple[str, str, str], lt.MemoryEstimate] = {}


def _prior(config: GPTConfig, precision: str, batch_device: str) -> lt.MemoryEstimate:
    """``measure_memory``'s prior for the model on the meta device, with a batch made on ``batch_device`` as a loader
    makes it (once per configuration: every lightning_tune run of the part starts from the same prior)."""
    key = (repr(config), precision, batch_device)
    if key not in _PRIORS:
        _PRIORS[key] = lt.measure_memory(
            _meta_model(config),
            lambda n: (torch.zeros(n, config.seq_len, dtype=torch.long, device=batch_device),) * 2,
            precision=precision,  # type: ignore[arg-type]
        )
    return _PRIORS[key]


def _hand_precision(args: argparse.Namespace) -> str:
    return "bf16-mixed" if args.accelerator == "cuda" else "32-true"  # no bf16 autocast worth timing on a CPU


def _meta_model(config: GPTConfig) -> DemoGPT:
    with torch.device("meta"):
        return DemoGPT(config)


LABELS = {
    "plain": "plain Lightning (fp32 defaults)",
    "hand_tuned": "hand-tuned (bf16-mixed on a GPU, SDPA flash, fused AdamW, the sweep's best micro-batch)",
    "lightning_tune": 'lightning_tune (`TunePlugin(precision="auto")`, swaps, DynamicBatchSize from the prior)',
}


def part(rows: Rows, args: argparse.Namespace) -> str:
    """Three short calibration runs (plain, hand-tuned, lightning_tune at ``--start-micro``), then the plan, baselines
    first: the expert's sweep (the hand-tuned baseline's search), plain Lightning and the hand-tuned run of round 1,
    lightning_tune's run of round 1, then the next rounds (dropped first when the share is short); each run a row."""
    config = GPTConfig(
        vocab_size=args.vocab_size,
        seq_len=args.seq_len,
        d_model=args.d_model,
        n_layers=args.n_layers,
        n_heads=args.n_heads,
    )
    effective = args.effective_batch
    common = {"config": config, "effective": effective, "args": args}
    params = sum(p.numel() for p in _meta_model(config).parameters())
    per_sample = flops_per_sample(config)
    peak = peak_flops(rows.device.name if rows.device else device_name(), torch.bfloat16) if args.gpu else None
    warm = args.steps - args.measure
    settle = max(0, args.tune_steps - args.steps)  # lightning_tune's extra steps to settle before it is timed
    rows.text(
        f"{params / 1e6:.1f} M parameters ({config}); optimizer steps of exactly {effective} samples. MFU against the "
        f"dense bf16 peak ({'n/a' if peak is None else f'{peak / 1e12:.0f} TFLOP/s'}), {per_sample / 1e9:.1f} GFLOP "
        f"per sample (forward + backward, causal attention by the pairs it attends). Each run's first {warm} steps "
        f"(and lightning_tune's {settle} settling steps) are warm-up, not timed: cuBLAS start-up and any compile "
        "fall there, and in the calibration rows' overhead."
    )

    def work(micro: int, fp32: bool = False) -> Work:
        return transformer_work(params=params, layers=config.n_layers, width=config.d_model, seq=config.seq_len,
                                vocab=config.vocab_size, samples=effective, micro=micro, fp32=fp32)  # fmt: skip

    def calibrate(kind: str, fp32: bool = False) -> Cost:
        run = lambda n: fit(kind, micro=args.start_micro, steps=n, measure=1, **common)  # noqa: E731
        return rows.calibrate(kind, run, steps=2, work=work(args.start_micro, fp32), micro_batch=args.start_micro)[0]

    costs = {"plain": calibrate("plain", fp32=True), "hand_tuned": calibrate("hand_tuned"),
             "lightning_tune": calibrate("lightning_tune")}  # fmt: skip
    sweep_micros = [m for m in (args.sweep_from << k for k in range(12)) if m <= effective]
    sweep_s = sum(costs["hand_tuned"](args.sweep_steps) for _ in sweep_micros)
    measure, _ = plan(
        rows.left() / MARGIN - sweep_s - sum(c.step for c in costs.values()) * warm
        - costs["lightning_tune"].step * settle,
        list(costs.values()), lo=2, hi=args.measure,
    )  # fmt: skip
    rows.choose(timed_steps=measure, warmup_steps=warm, settle_steps=settle, rounds=args.rounds,
                sweep=sweep_micros)  # fmt: skip

    def cells(label: str, result: dict[str, Any]) -> list[Any]:
        if result.get("oom"):
            return [label, result["micro_batch"], "out of memory", "", "", ""]
        sps = result["samples_per_sec"]
        mfu = "n/a" if peak is None else f"{sps * per_sample / peak:.1%}"
        return [label, result["micro_batch"], f"{sps:,.1f}", f"{sps * config.seq_len:,.0f}", mfu,
                f"{result['peak_reserved_gib']:.1f}"]  # fmt: skip

    header = ("Run", "micro-batch", "samples/s", "tokens/s", "MFU", "peak reserved GiB")
    rows.table(*header)
    sweep: dict[int, dict[str, Any]] = {}
    micros: dict[str, int] = {"lightning_tune": args.start_micro}
    runs: dict[str, list[dict[str, Any]]] = {kind: [] for kind in LABELS}

    def sweep_run(micro: int) -> dict[str, Any] | None:
        if any(r.get("oom") for r in sweep.values()):
            return None  # a smaller micro-batch already ran out of memory
        sweep[micro] = fit("hand_tuned", micro=micro, steps=args.sweep_steps, measure=max(1, args.sweep_steps // 2),
                           **common)  # fmt: skip
        rows.add("sweep", {"micro_batch": micro, **sweep[micro]}, cells(f"sweep: hand-tuned at {micro}", sweep[micro]))
        return sweep[micro]

    def best() -> int:
        fitting = [m for m, r in sweep.items() if not r.get("oom")]
        return max(fitting, key=lambda m: sweep[m]["samples_per_sec"]) if fitting else args.start_micro

    def run(kind: str, index: int) -> dict[str, Any]:
        while True:  # plain Lightning: the hand-tuned micro-batch, or the largest power-of-two fraction that fits fp32
            micro = micros.setdefault(kind, best())
            steps = warm + measure + (settle if kind == "lightning_tune" else 0)
            result = fit(kind, micro=micro, steps=steps, measure=measure, **common)
            if kind != "plain" or not result.get("oom") or micro == 1:
                break
            micros[kind] = micro // 2
        runs[kind].append(result)
        rows.add("run", {"round": index + 1, "kind": kind, **result}, cells(f"round {index + 1}: {kind}", result))
        return result

    roles = {"plain": BASELINE, "hand_tuned": BASELINE, "lightning_tune": SCENARIO}
    planned = [Row(f"sweep: hand-tuned at {m}", costs["hand_tuned"](args.sweep_steps), partial(sweep_run, m),
                   BASELINE) for m in sweep_micros]  # fmt: skip
    for index in range(args.rounds):
        order = ["plain", "hand_tuned", "lightning_tune"]
        for kind in order if index % 2 == 0 else reversed(order):
            steps = warm + measure + (settle if kind == "lightning_tune" else 0)
            role = roles[kind] if index == 0 else EXTRA
            planned.append(Row(f"round {index + 1}: {kind}", costs[kind](steps), partial(run, kind, index), role))
    rows.run_plan(planned)
    rows.table(*header)
    medians: dict[str, float] = {}
    for kind, results in runs.items():
        ok = [r for r in results if not r.get("oom")]
        if ok:
            medians[kind] = statistics.median(r["samples_per_sec"] for r in ok)
            median = {
                "micro_batch": ok[-1]["micro_batch"],
                "samples_per_sec": medians[kind],
                "peak_reserved_gib": statistics.median(r["peak_reserved_gib"] for r in ok),
                "runs": len(ok),
            }
            rows.add(
                "median",
                {"kind": kind, **median, "mfu": peak and medians[kind] * per_sample / peak},
                cells(f"median: {LABELS[kind]}", median),
            )
    if len(medians) < 3:
        return f"{len(medians)} of 3 configurations measured"
    plain_x, hand_x = medians["lightning_tune"] / medians["plain"], medians["lightning_tune"] / medians["hand_tuned"]
    rows.add(
        "ratios",
        {
            "lightning_tune_vs_plain": plain_x,
            "lightning_tune_vs_hand_tuned": hand_x,
            "goal_met": plain_x >= 3 and hand_x >= 0.95,
        },
    )
    rows.text(
        f"lightning_tune / plain: {plain_x:.2f}x (goal >= 3x); lightning_tune / hand-tuned: {hand_x:.2f}x "
        "(goal >= 0.95x)."
    )
    return f"lightning_tune {plain_x:.2f}x plain, {hand_x:.2f}x hand-tuned"


def suite_part(rows: Rows, *, smoke: bool) -> str:
    """The suite's part: the GPU sizes (this script's defaults), or tiny ones on the CPU with the planner's batch
    made on the ``meta`` device, another device than the one the planner steps on (as a CPU batch is on a GPU)."""
    argv = "--sweep-steps 4 --tune-steps 20 --gpu"  # the script's GPU sizes, with a shorter sweep and settling
    if smoke:
        argv = "--accelerator cpu --batch-device meta --vocab-size 64 --seq-len 16 --d-model 32 --n-layers 1 "
        argv += "--n-heads 2 --effective-batch 8 --sweep-from 4 --sweep-steps 2 --start-micro 2 --adjust-every 1 "
        argv += "--steps 3 --tune-steps 4 --measure 1 --rounds 1"
    return part(rows, build_parser().parse_args(argv.split()))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--accelerator", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--gpu", action="store_true", help="report MFU against the device's bf16 peak")
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
    parser.add_argument(
        "--batch-device", default="cpu", help="where the planner's example batch is made (the loader's device)"
    )
    parser.add_argument("--out", type=Path, default=Path("pack"), help="writes <out>.jsonl and <out>.md")
    return parser


def main() -> None:
    args = build_parser().parse_args()
    args.gpu = args.gpu or args.accelerator == "cuda"
    part(Rows(args.out, run_header("pack", device_name()), "The pack on the demo GPT"), args)


if __name__ == "__main__":
    main()
