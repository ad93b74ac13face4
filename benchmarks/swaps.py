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
from functools import partial
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
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
    header_lines,
    plan,
    run_header,
    transformer_work,
    write_results,
)
from lightning.pytorch.callbacks import Callback

import lightning_tune as lt
from lightning_tune._imports import is_available
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
    settings: dict[tuple[Any, str], dict[str, Any]],
    roles: dict[str, str],
    *,
    lo: int,
    hi: int,
    max_rounds: int,
    works: dict[Any, Work],
    kwargs: dict[Any, dict[str, Any]],
) -> dict[tuple[Any, str], dict[str, Any]]:
    """Calibrate the first setting of each group (one 3-step run; the others are priced at :data:`SLOWER` times
    it), pick steps for the share, then plan rounds, each (group, setting) run a row as it ends: round 1's rows take
    ``roles`` (the first group's; later groups' are extras), later rounds are extras. Returns the medians of the
    settings that ran (``{"oom": True}`` for those that did not fit in memory)."""
    groups = list(dict.fromkeys(group for group, _ in settings))
    costs = {}
    for group in groups:
        first = next(name for g, name in settings if g == group)
        run_first = lambda n, g=group, s=settings[group, first]: run(s, **kwargs[g], steps=n, warmup=1)  # noqa: E731
        costs[group] = rows.calibrate(f"{group} {first}", run_first, work=works[group])[0]
    total = sum(costs[g].overhead * SLOWER for g, _ in settings), sum(costs[g].step * SLOWER for g, _ in settings)
    steps, rounds = plan(rows.left() / MARGIN, [Cost(*total)], lo=lo, hi=hi, max_rounds=max_rounds)
    warmup = max(1, min(5, steps // 4))
    rows.choose(steps=steps, warmup_steps=warmup, rounds=rounds)
    rows.text(f"Each run's first {warmup} of {steps} steps are warm-up, not timed (cuBLAS start-up, any compile).")
    rows.table("Setting", "ms/step", "peak allocated GiB", "peak reserved GiB", "loss", "kernel")
    runs: dict[tuple[Any, str], list[dict[str, Any]]] = {key: [] for key in settings}

    def measure(key: tuple[Any, str], index: int) -> dict[str, Any]:
        result = run(settings[key], **kwargs[key[0]], steps=steps, warmup=warmup)
        runs[key].append(result)
        rows.add("run", {"what": key[0], "round": index + 1, "setting": key[1], **result},
                 _cells(f"{key[0]}: {labels[key[1]]}", result))  # fmt: skip
        return result

    planned = []
    for index in range(max(rounds, 1 if max_rounds == 1 else 2)):
        order = list(settings) if index % 2 == 0 else list(reversed(settings))
        for key in order:
            role = roles[key[1]] if index == 0 and key[0] == groups[0] else EXTRA
            seconds = costs[key[0]](steps) * (1.0 if key[1] == next(iter(roles)) else SLOWER)
            planned.append(Row(f"{key[0]}, round {index + 1}: {key[1]}", seconds, partial(measure, key, index), role))
    rows.run_plan(planned)
    summary: dict[tuple[Any, str], dict[str, Any]] = {}
    for key, results in runs.items():
        ok = [r for r in results if not r.get("oom")]
        if ok:
            summary[key] = {k: statistics.median(r[k] for r in ok) for k in ok[0] if k != "kernel"}
            summary[key].update(kernel=ok[0]["kernel"], runs=len(ok), oom_runs=len(results) - len(ok))
        elif results:
            summary[key] = {"oom": True}
    return summary


#: a setting that was not calibrated is priced at this many times its group's calibrated one (AdamW8bit took 1.29x
#: AdamW's step and PagedAdamW8bit 1.37x on the H200)
SLOWER = 1.5
ATTENTION_ROLES = {"sdpa_untouched": BASELINE, "eager": BASELINE, "swap_sdpa": SCENARIO, "swap_flash": SCENARIO}
OPTIMIZER_ROLES = {"adamw": BASELINE, "adamw8bit": SCENARIO, "adamw_fused": EXTRA, "paged_adamw8bit": EXTRA}


def _work(config: GPTConfig, batch: int) -> Work:
    with torch.device("meta"):
        params = sum(p.numel() for p in DemoGPT(config).parameters())
    return transformer_work(params=params, layers=config.n_layers, width=config.d_model, seq=config.seq_len,
                            vocab=config.vocab_size, samples=batch, micro=batch)  # fmt: skip


def attention_part(rows: Rows, *, smoke: bool) -> str:
    """The suite's attention part: the model as written (SDPA) calibrated at each sequence, then one plan: round 1 at
    the first sequence (eager and SDPA first, then the swaps), the second sequence and later rounds after; every
    (sequence, setting) run is a row written as it ends, so a cut keeps what was measured."""
    if smoke:
        sizes = {"seq_lens": [32, 64], "batch_tokens": 128, "d_model": 32, "n_layers": 1, "n_heads": 2}
        precision, accelerator = "32-true", "cpu"
    else:  # 8k tokens a batch at both lengths: eager attention's L^2 scores take ~40 GB at 4096
        sizes = {"seq_lens": [2048, 4096], "batch_tokens": 8192, "d_model": 1024, "n_layers": 8, "n_heads": 16}
        precision, accelerator = "bf16-mixed", "cuda"
    labels = {name: label for name, (label, _) in ATTENTION_ROWS.items()}
    hi = 4 if smoke else 40
    settings, kwargs, works, notes = {}, {}, {}, {}
    for seq in sizes["seq_lens"]:
        config = GPTConfig(seq_len=seq, d_model=sizes["d_model"], n_layers=sizes["n_layers"], n_heads=sizes["n_heads"])
        batch = max(1, sizes["batch_tokens"] // seq)
        data = SyntheticTokenDataModule(
            batch, seq_len=seq, vocab_size=config.vocab_size, train_sequences=batch * hi, val_sequences=1
        )
        kwargs[seq] = {"config": config, "data": data, "precision": precision, "accelerator": accelerator}
        works[seq] = _work(config, batch)
        if rows.device is None:
            notes[seq] = _flash_check(config, accelerator, precision)
        else:  # a rehearsal cannot run the swap: the row is planned when flash-attn-4 is installed here
            notes[seq] = None if is_available("flash_attn.cute") else "flash-attn-4 is not installed"
        for name in ATTENTION_ROLES:  # the model as written first: it is calibrated
            if name != "swap_flash" or notes[seq] is None:
                settings[seq, name] = ATTENTION_ROWS[name][1]
        rows.text(f"Sequence {seq}, batch {batch}, {precision}, {config}.")
    summary = _measured_rows(rows, labels, settings, ATTENTION_ROLES, lo=3, hi=hi, max_rounds=1 if smoke else 3,
                             works=works, kwargs=kwargs)  # fmt: skip
    headline = []
    rows.table("Attention", "median ms/step", "vs model as written", "peak reserved GiB", "rounds")
    for seq in sizes["seq_lens"]:
        base = summary.get((seq, "sdpa_untouched"), {})
        for (at, name), row in summary.items():
            if at != seq:
                continue
            ok = not row.get("oom") and not base.get("oom") and base
            rows.add("median", {"seq_len": seq, "setting": name, **row}, [
                f"{seq}: {labels[name]}", "out of memory" if row.get("oom") else f"{row['ms_per_step']:.1f}",
                f"{row['ms_per_step'] / base['ms_per_step']:.2f}x" if ok else "-",
                "" if row.get("oom") else f"{row['peak_reserved_gib']:.2f}", row.get("runs", 0)])  # fmt: skip
        if notes[seq] is not None:
            rows.add("flash_note", {"seq_len": seq, "flash_note": notes[seq]})
            rows.text(f"flash-attn at {seq}: not measured. {notes[seq]}.")
        swapped = summary.get((seq, "swap_sdpa"), {})
        if swapped and base and not base.get("oom") and not swapped.get("oom"):
            headline.append(f"{seq}: swap_sdpa {swapped['ms_per_step'] / base['ms_per_step']:.2f}x")
    return "; ".join(headline) or "no sequence measured"


def optimizers_part(rows: Rows, *, smoke: bool) -> str:
    """The suite's optimizers part: AdamW calibrated, then rounds for the share (AdamW first, then AdamW8bit, then the
    others), each run a row."""
    if smoke:
        config, batch = GPTConfig(seq_len=16, d_model=64, n_layers=1, n_heads=2), 4
        precision, accelerator = "32-true", "cpu"
    else:
        config, batch = GPTConfig(seq_len=512, d_model=1024, n_layers=12, n_heads=16), 16
        precision, accelerator = "bf16-mixed", "cuda"
    names = list(OPTIMIZER_ROLES)
    if not is_available("bitsandbytes"):
        names = [n for n in names if "8bit" not in n]
        rows.text("bitsandbytes is not installed: the 8-bit rows were not measured.")
    hi = 4 if smoke else 80
    data = SyntheticTokenDataModule(
        batch, seq_len=config.seq_len, vocab_size=config.vocab_size, train_sequences=batch * hi, val_sequences=1
    )
    work = _work(config, batch)
    rows.text(f"{precision}, {work.params / 1e6:.1f} M parameters ({config}), batch {batch}.")
    labels = {name: label for name, (label, _) in OPTIMIZER_ROWS.items()}
    summary = _measured_rows(
        rows, labels, {("optimizers", n): OPTIMIZER_ROWS[n][1] for n in names}, OPTIMIZER_ROLES, lo=3, hi=hi,
        max_rounds=1 if smoke else 3, works={"optimizers": work},
        kwargs={"optimizers": {"config": config, "data": data, "precision": precision, "accelerator": accelerator}},
    )  # fmt: skip
    base = summary.get(("optimizers", "adamw"), {})
    rows.table("Optimizer", "state MiB", "vs AdamW", "median ms/step", "vs AdamW", "loss after the last step")
    for (_, name), row in summary.items():
        if row.get("oom") or not base or base.get("oom"):
            rows.add("median", {"setting": name, **row}, [labels[name], "out of memory" if row.get("oom") else "-"])
            continue
        rows.add("median", {"setting": name, **row}, [
            labels[name], f"{row['optimizer_state_mib']:.1f}",
            f"{row['optimizer_state_mib'] / base['optimizer_state_mib']:.3f}", f"{row['ms_per_step']:.1f}",
            f"{row['ms_per_step'] / base['ms_per_step']:.2f}x", f"{row['loss']:.4f}"])  # fmt: skip
    eight = summary.get(("optimizers", "adamw8bit"))
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
