"""Attention and optimizer swaps on the demo GPT, side by side: step time, peak memory, optimizer-state bytes, loss.

Settings run interleaved in rounds in one process; each run's time per optimizer step is taken between the end of
the warm-up steps and the last step, with one device synchronisation at each end. Medians over the rounds.

- ``--part attention``, at each of ``--seq-lens`` in bf16 (the same tokens per batch at every length): the model's
  explicit eager attention (``GPTConfig(attention="eager")``); the model as written, its own
  ``F.scaled_dot_product_attention`` call untouched; ``AttentionSwap("sdpa")``; and ``AttentionSwap("flash")``. The
  flash row is kept only when the swap really routes attention through flash-attn; otherwise the report says why
  instead of showing SDPA a second time under another name.
- ``--part optimizers``: the module's own torch AdamW; fused AdamW (``OptimizerSwap("adamw_fused")``);
  bitsandbytes AdamW8bit and PagedAdamW8bit. State bytes are measured on the optimizer's state tensors; the loss is
  the training loss after the last step (the same seed and data for every row).

    python benchmarks/swaps.py --part attention --out benchmarks/results/attention_gpu
    python benchmarks/swaps.py --part optimizers --out benchmarks/results/optimizers_gpu

Needs a CUDA GPU for meaningful figures; ``--device cpu`` runs the same code at whatever size it is given.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import statistics
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from _results import QUIET_TRAINER, Rows, calibrate, device_name, header_lines, now, plan, run_header, write_results
from lightning.pytorch.callbacks import Callback

import lightning_tune as lt
from lightning_tune.demos import DemoGPT, GPTConfig, SyntheticTokenDataModule
from lightning_tune.swaps.optimizer import optimizer_state_bytes

GIB = float(1 << 30)


class Probe(Callback):
    """Steady-state time per optimizer step (one synchronisation at each end), peak memory, state bytes, loss."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.start = self.end = 0.0
        self.state_bytes = 0
        self.peak_allocated = self.peak_reserved = 0
        self.loss = float("nan")
        self.kernel: str | None = None

    def _now(self, trainer: pl.Trainer) -> float:
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if trainer.global_step == self.warmup and self.start == 0.0:
            self.start = self._now(trainer)
        elif trainer.global_step == trainer.max_steps:
            self.end = self._now(trainer)
            self.state_bytes = optimizer_state_bytes(trainer.optimizers[0])
            self.loss = float(trainer.callback_metrics["train_loss"])
            for callback in trainer.callbacks:  # type: ignore[attr-defined]
                if isinstance(callback, lt.AttentionSwap) and callback.result is not None:
                    self.kernel = "; ".join(sorted({entry.detail for entry in callback.result.entries}))
            if trainer.strategy.root_device.type == "cuda":
                self.peak_allocated = torch.cuda.max_memory_allocated()
                self.peak_reserved = torch.cuda.max_memory_reserved()


def _free() -> None:
    if torch.cuda.is_available():  # what the last run left must not count in the next one's peak
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def run(
    setting: dict[str, Any],
    *,
    config: GPTConfig,
    data: pl.LightningDataModule,
    precision: str,
    accelerator: str,
    steps: int,
    warmup: int,
) -> dict[str, Any]:
    """One training run of ``steps`` optimizer steps; an out-of-memory error is a result (``"oom": True``)."""
    _free()
    pl.seed_everything(0, verbose=False)
    probe = Probe(warmup)
    callbacks: list[Callback] = [probe]
    if setting.get("attention"):
        callbacks.append(lt.AttentionSwap(setting["attention"], verbose=False))
    if setting.get("optimizer"):
        callbacks.append(lt.OptimizerSwap(setting["optimizer"]))
    trainer = pl.Trainer(
        accelerator=accelerator,
        devices=1,
        precision=precision,  # type: ignore[arg-type]
        max_steps=steps,
        callbacks=callbacks,
        **QUIET_TRAINER,
        limit_val_batches=0,
    )
    model = DemoGPT(dataclasses.replace(config, attention=setting.get("model_attention", config.attention)))
    try:
        trainer.fit(model, datamodule=data)
    except torch.OutOfMemoryError:
        return {"oom": True}
    finally:
        del trainer, model
        _free()
    return {
        "ms_per_step": (probe.end - probe.start) * 1000 / (steps - warmup),
        "peak_allocated_gib": probe.peak_allocated / GIB,
        "peak_reserved_gib": probe.peak_reserved / GIB,
        "optimizer_state_mib": probe.state_bytes / 2**20,
        "loss": probe.loss,
        "kernel": probe.kernel,
    }


def _interleave(
    settings: dict[str, dict[str, Any]], rounds: int, **kwargs: Any
) -> tuple[dict[str, list[dict[str, Any]]], dict[str, dict[str, Any]]]:
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in settings}
    for index in range(rounds):
        order = list(settings) if index % 2 == 0 else list(reversed(settings))
        for name in order:
            runs[name].append(run(settings[name], **kwargs))
        print(f"round {index + 1}/{rounds} done", flush=True)
    summary: dict[str, dict[str, Any]] = {}
    for name, results in runs.items():
        ok = [r for r in results if not r.get("oom")]
        if not ok:
            summary[name] = {"oom": True}
            continue
        summary[name] = {k: statistics.median(r[k] for r in ok) for k in ok[0] if k != "kernel"}
        summary[name]["kernel"] = ok[0]["kernel"]
        summary[name]["oom_runs"] = len(results) - len(ok)
    return runs, summary


def _flash_check(config: GPTConfig, accelerator: str, precision: str) -> str | None:
    """Why ``AttentionSwap("flash")`` would not run flash-attn on this model here, or ``None`` when it does."""
    from lightning_tune.swaps.attention import swap_attention
    from lightning_tune.vocab import precision_dtype

    device = torch.device("cuda" if accelerator in ("gpu", "cuda") else accelerator)
    try:
        result = swap_attention(DemoGPT(config), "flash", device=device, dtype=precision_dtype(precision))
    except (ImportError, ValueError, RuntimeError) as err:
        return f"`AttentionSwap('flash')` cannot run here: {err}"
    details = sorted({entry.detail for entry in result.entries})
    result.restore()
    if any("SDPA" in detail for detail in details):
        return (
            f"`AttentionSwap('flash')` resolves to {', '.join(details)} on this model (an sdpa-call module), not to "
            "flash-attn, so its row would repeat the SDPA row"
        )
    return None


ATTENTION_ROWS: dict[str, tuple[str, dict[str, Any]]] = {
    "eager": ("the model's explicit eager attention", {"model_attention": "eager"}),
    "sdpa_untouched": ("the model as written (its SDPA call untouched)", {}),
    "swap_sdpa": ('`AttentionSwap("sdpa")`', {"attention": "sdpa"}),
    "swap_flash": ('`AttentionSwap("flash")` (flash-attn)', {"attention": "flash"}),
}


def attention(
    *,
    seq_lens: list[int],
    batch_tokens: int,
    d_model: int,
    n_layers: int,
    n_heads: int,
    steps: int,
    warmup: int,
    rounds: int,
    precision: str = "bf16-mixed",
    accelerator: str = "cuda",
) -> tuple[dict[str, Any], str]:
    record: dict[str, Any] = {**run_header("attention", device_name()), "precision": precision, "by_seq_len": {}}
    lines = [f"# Attention on the demo GPT — {record['device']}", "", *header_lines(record)]
    lines += [
        f"{precision}, d_model {d_model}, {n_layers} layers, {n_heads} heads, {batch_tokens} tokens per batch, "
        f"medians of {rounds} interleaved rounds of {steps - warmup} timed steps after {warmup} warm-up steps.",
        "",
    ]
    for seq in seq_lens:
        config = GPTConfig(seq_len=seq, d_model=d_model, n_layers=n_layers, n_heads=n_heads)
        batch = max(1, batch_tokens // seq)
        data = SyntheticTokenDataModule(
            batch, seq_len=seq, vocab_size=config.vocab_size, train_sequences=batch * steps, val_sequences=1
        )
        settings = {name: setting for name, (_, setting) in ATTENTION_ROWS.items()}
        flash_note = _flash_check(config, accelerator, precision)
        if flash_note is not None:
            del settings["swap_flash"]
        runs, summary = _interleave(
            settings,
            rounds,
            config=config,
            data=data,
            precision=precision,
            accelerator=accelerator,
            steps=steps,
            warmup=warmup,
        )
        record["by_seq_len"][str(seq)] = {"batch": batch, "runs": runs, "median": summary, "flash_note": flash_note}
        base = summary["sdpa_untouched"]
        lines += [
            f"## Sequence {seq}, batch {batch}",
            "",
            "| Attention | ms/step | vs model as written | peak allocated GiB | peak reserved GiB | kernel |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        for name, row in summary.items():
            label = ATTENTION_ROWS[name][0]
            if row.get("oom"):
                lines.append(f"| {label} | out of memory | | | | |")
                continue
            ratio = f"{row['ms_per_step'] / base['ms_per_step']:.2f}x" if not base.get("oom") else "-"
            lines.append(
                f"| {label} | {row['ms_per_step']:.1f} | {ratio} | {row['peak_allocated_gib']:.2f} "
                f"| {row['peak_reserved_gib']:.2f} | {row['kernel'] or 'as written'} |"
            )
        if flash_note is not None:
            lines += ["", f"flash-attn: not measured. {flash_note}."]
        lines.append("")
    return record, "\n".join(lines)


OPTIMIZER_ROWS: dict[str, tuple[str, dict[str, Any]]] = {
    "adamw": ("torch AdamW (the module's own)", {}),
    "adamw_fused": ('fused AdamW (`OptimizerSwap("adamw_fused")`)', {"optimizer": "adamw_fused"}),
    "adamw8bit": ('bitsandbytes AdamW8bit (`OptimizerSwap("adamw8bit")`)', {"optimizer": "adamw8bit"}),
    "paged_adamw8bit": (
        'bitsandbytes PagedAdamW8bit (`OptimizerSwap("paged_adamw8bit")`)',
        {"optimizer": "paged_adamw8bit"},
    ),
}


def optimizers(
    *,
    config: GPTConfig,
    batch_size: int,
    steps: int,
    warmup: int,
    rounds: int,
    precision: str = "bf16-mixed",
    accelerator: str = "cuda",
) -> tuple[dict[str, Any], str]:
    from lightning_tune import _imports

    settings = {name: setting for name, (_, setting) in OPTIMIZER_ROWS.items()}
    missing = None
    if not _imports.is_available("bitsandbytes"):
        missing = "bitsandbytes is not installed: the 8-bit rows were not measured"
        del settings["adamw8bit"], settings["paged_adamw8bit"]
    data = SyntheticTokenDataModule(
        batch_size,
        seq_len=config.seq_len,
        vocab_size=config.vocab_size,
        train_sequences=batch_size * steps,
        val_sequences=1,
    )
    runs, summary = _interleave(
        settings,
        rounds,
        config=config,
        data=data,
        precision=precision,
        accelerator=accelerator,
        steps=steps,
        warmup=warmup,
    )
    params = sum(p.numel() for p in DemoGPT(config).parameters())
    record = {
        **run_header("optimizers", device_name()),
        "precision": precision,
        "config": config.__dict__,
        "parameters": params,
        "batch_size": batch_size,
        "steps": steps,
        "runs": runs,
        "median": summary,
        "note": missing,
    }
    base = summary["adamw"]
    lines = [f"# Optimizers on the demo GPT — {record['device']}", "", *header_lines(record)]
    lines += [
        f"{precision}, {params / 1e6:.1f} M parameters ({config}), batch {batch_size}; medians of {rounds} "
        f"interleaved rounds; time over the last {steps - warmup} of {steps} steps; loss after step {steps}.",
        "",
        "| Optimizer | state MiB | vs AdamW | ms/step | vs AdamW | loss after N steps | peak reserved GiB |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, row in summary.items():
        label = OPTIMIZER_ROWS[name][0]
        if row.get("oom"):
            lines.append(f"| {label} | out of memory | | | | | |")
            continue
        lines.append(
            f"| {label} | {row['optimizer_state_mib']:.1f} "
            f"| {row['optimizer_state_mib'] / base['optimizer_state_mib']:.3f} "
            f"| {row['ms_per_step']:.1f} | {row['ms_per_step'] / base['ms_per_step']:.2f}x | {row['loss']:.4f} "
            f"| {row['peak_reserved_gib']:.2f} |"
        )
    if missing:
        lines += ["", missing + "."]
    return record, "\n".join(lines) + "\n"


def _cells(label: str, result: dict[str, Any]) -> list[Any]:
    if result.get("oom"):
        return [label, "out of memory", "", "", "", ""]
    return [
        label,
        f"{result['ms_per_step']:.1f}",
        f"{result['peak_allocated_gib']:.2f}",
        f"{result['peak_reserved_gib']:.2f}",
        f"{result['loss']:.4f}",
        result.get("kernel") or "as written",
    ]


def _measured_rows(
    rows: Rows,
    labels: dict[str, str],
    settings: dict[str, dict[str, Any]],
    *,
    what: str,
    lo: int,
    hi: int,
    max_rounds: int,
    seconds: float,
    **kwargs: Any,
) -> dict[str, dict[str, Any]]:
    """Calibrate each setting (one 3-step run), pick steps and rounds for ``seconds``, then run interleaved rounds,
    each run a row as it ends; returns the medians of the settings that ran (``{"oom": True}`` for those that did not
    fit in memory)."""
    begin = now()
    costs = {}
    summary: dict[str, dict[str, Any]] = {}
    for name, setting in settings.items():
        if not rows.fits(0.0, f"{what} {name}: calibration"):
            break
        cost, result = calibrate(rows, f"{what} {name}", lambda n, s=setting: run(s, **kwargs, steps=n, warmup=1))
        if result.get("oom"):
            summary[name] = {"oom": True}
        else:
            costs[name] = cost
    if not costs:
        return summary
    steps, rounds = plan(seconds - (now() - begin), list(costs.values()), lo=lo, hi=hi,
                         max_rounds=max_rounds)  # fmt: skip
    warmup = max(1, min(5, steps // 4))
    rows.choose(**{f"{what} steps": steps, f"{what} warm-up steps": warmup, f"{what} rounds": rounds})
    rows.table("Setting", "ms/step", "peak allocated GiB", "peak reserved GiB", "loss", "kernel")
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in costs}
    for index in range(rounds):
        order = list(costs) if index % 2 == 0 else list(reversed(costs))
        for name in order:
            if not rows.fits(costs[name](steps), f"{what}, round {index + 1}, {name}"):
                break
            result = run(settings[name], **kwargs, steps=steps, warmup=warmup)
            runs[name].append(result)
            rows.add("run", {"what": what, "round": index + 1, "setting": name, **result}, _cells(labels[name], result))
        else:
            continue
        break
    for name, results in runs.items():
        ok = [r for r in results if not r.get("oom")]
        if ok:
            summary[name] = {k: statistics.median(r[k] for r in ok) for k in ok[0] if k != "kernel"}
            summary[name].update(kernel=ok[0]["kernel"], runs=len(ok), oom_runs=len(results) - len(ok))
        elif results:
            summary[name] = {"oom": True}
    return summary


def attention_part(rows: Rows, *, smoke: bool) -> str:
    """The suite's attention part: at each sequence, each setting calibrated, then rounds for that sequence's half of
    the share; every (sequence, setting) run is a row written as it ends, so a cut keeps what was measured."""
    if smoke:
        sizes = {"seq_lens": [32, 64], "batch_tokens": 128, "d_model": 32, "n_layers": 1, "n_heads": 2}
        precision, accelerator = "32-true", "cpu"
    else:  # 8k tokens a batch at both lengths: eager attention's L^2 scores take ~40 GB at 4096
        sizes = {"seq_lens": [2048, 4096], "batch_tokens": 8192, "d_model": 1024, "n_layers": 8, "n_heads": 16}
        precision, accelerator = "bf16-mixed", "cuda"
    labels = {name: label for name, (label, _) in ATTENTION_ROWS.items()}
    headline = []
    seq_lens = sizes["seq_lens"]
    for index, seq in enumerate(seq_lens):
        config = GPTConfig(seq_len=seq, d_model=sizes["d_model"], n_layers=sizes["n_layers"], n_heads=sizes["n_heads"])
        batch = max(1, sizes["batch_tokens"] // seq)
        hi = 4 if smoke else 40
        data = SyntheticTokenDataModule(
            batch, seq_len=seq, vocab_size=config.vocab_size, train_sequences=batch * hi, val_sequences=1
        )
        settings = {name: setting for name, (_, setting) in ATTENTION_ROWS.items()}
        flash_note = _flash_check(config, accelerator, precision)
        if flash_note is not None:
            del settings["swap_flash"]
        rows.text(f"Sequence {seq}, batch {batch}, {precision}, {config}.")
        seconds = rows.left() / (len(seq_lens) - index)
        summary = _measured_rows(
            rows, labels, settings, what=f"sequence {seq}", lo=3, hi=hi, max_rounds=1 if smoke else 3,
            seconds=seconds, config=config, data=data, precision=precision, accelerator=accelerator,
        )  # fmt: skip
        base = summary.get("sdpa_untouched", {})
        rows.table("Attention", "median ms/step", "vs model as written", "peak reserved GiB", "rounds")
        for name, row in summary.items():
            ok = not row.get("oom") and not base.get("oom") and base
            rows.add("median", {"seq_len": seq, "batch": batch, "setting": name, **row}, [
                labels[name], "out of memory" if row.get("oom") else f"{row['ms_per_step']:.1f}",
                f"{row['ms_per_step'] / base['ms_per_step']:.2f}x" if ok else "-",
                "" if row.get("oom") else f"{row['peak_reserved_gib']:.2f}", row.get("runs", 0)])  # fmt: skip
        if flash_note is not None:
            rows.add("flash_note", {"seq_len": seq, "flash_note": flash_note})
            rows.text(f"flash-attn: not measured. {flash_note}.")
        if "swap_sdpa" in summary and base and not base.get("oom") and not summary["swap_sdpa"].get("oom"):
            headline.append(f"{seq}: swap_sdpa {summary['swap_sdpa']['ms_per_step'] / base['ms_per_step']:.2f}x")
    return "; ".join(headline) or "no sequence measured"


def optimizers_part(rows: Rows, *, smoke: bool) -> str:
    """The suite's optimizers part: each optimizer calibrated, then rounds for the share, each run a row."""
    from lightning_tune import _imports

    if smoke:
        config, batch, precision, accelerator = (
            GPTConfig(seq_len=16, d_model=64, n_layers=1, n_heads=2),
            4,
            "32-true",
            "cpu",
        )
    else:
        config, batch, precision, accelerator = (
            GPTConfig(seq_len=512, d_model=1024, n_layers=12, n_heads=16),
            16,
            "bf16-mixed",
            "cuda",
        )
    settings = {name: setting for name, (_, setting) in OPTIMIZER_ROWS.items()}
    if not _imports.is_available("bitsandbytes"):
        del settings["adamw8bit"], settings["paged_adamw8bit"]
        rows.text("bitsandbytes is not installed: the 8-bit rows were not measured.")
    hi = 4 if smoke else 80
    data = SyntheticTokenDataModule(
        batch, seq_len=config.seq_len, vocab_size=config.vocab_size, train_sequences=batch * hi, val_sequences=1
    )
    params = sum(p.numel() for p in DemoGPT(config).parameters())
    rows.text(f"{precision}, {params / 1e6:.1f} M parameters ({config}), batch {batch}.")
    labels = {name: label for name, (label, _) in OPTIMIZER_ROWS.items()}
    summary = _measured_rows(
        rows, labels, settings, what="optimizers", lo=3, hi=hi, max_rounds=1 if smoke else 3, seconds=rows.left(),
        config=config, data=data, precision=precision, accelerator=accelerator,
    )  # fmt: skip
    base = summary.get("adamw", {})
    rows.table("Optimizer", "state MiB", "vs AdamW", "median ms/step", "vs AdamW", "loss after the last step")
    for name, row in summary.items():
        if row.get("oom") or not base or base.get("oom"):
            rows.add("median", {"setting": name, **row}, [labels[name], "out of memory" if row.get("oom") else "-"])
            continue
        rows.add("median", {"setting": name, **row}, [
            labels[name], f"{row['optimizer_state_mib']:.1f}",
            f"{row['optimizer_state_mib'] / base['optimizer_state_mib']:.3f}", f"{row['ms_per_step']:.1f}",
            f"{row['ms_per_step'] / base['ms_per_step']:.2f}x", f"{row['loss']:.4f}"])  # fmt: skip
    eight = summary.get("adamw8bit")
    if eight and not eight.get("oom") and base and not base.get("oom"):
        return f"AdamW8bit state {eight['optimizer_state_mib'] / base['optimizer_state_mib']:.3f} of AdamW's"
    return f"{len(summary)} optimizers measured"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["attention", "optimizers"], required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--batch-tokens", type=int, default=8192, help="tokens per batch (attention part)")
    parser.add_argument("--seq-len", type=int, default=512, help="sequence length (optimizers part)")
    parser.add_argument("--batch-size", type=int, default=16, help="batch (optimizers part)")
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--n-layers", type=int, default=8)
    parser.add_argument("--n-heads", type=int, default=16)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    common = {
        "steps": args.steps,
        "warmup": args.warmup,
        "rounds": args.rounds,
        "precision": args.precision,
        "accelerator": args.device,
    }
    if args.part == "attention":
        record, report = attention(
            seq_lens=args.seq_lens,
            batch_tokens=args.batch_tokens,
            d_model=args.d_model,
            n_layers=args.n_layers,
            n_heads=args.n_heads,
            **common,
        )
    else:
        config = GPTConfig(seq_len=args.seq_len, d_model=args.d_model, n_layers=args.n_layers, n_heads=args.n_heads)
        record, report = optimizers(config=config, batch_size=args.batch_size, **common)
    write_results(args.out, record, report)


if __name__ == "__main__":
    main()
