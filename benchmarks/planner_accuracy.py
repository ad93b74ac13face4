"""How close the memory planner's predicted peak is to what CUDA allocates *and* reserves: the demo GPT at three batch
sizes and two precisions.

For each precision and batch size, the prediction of ``measure_memory`` (fake-tensor step, linear in the batch) and of
``estimate_memory`` (analytic, from the equivalent GPT-2-family shape) are compared with
``torch.cuda.max_memory_allocated`` (the tensors' own peak, what the planner models) and with
``torch.cuda.max_memory_reserved`` (what the caching allocator took from the device: what a run actually runs out of)
over real training steps after a warm-up step (the steady state: optimizer state allocated, gradients freed by
``zero_grad``). The allocator's cache is emptied before each batch size, so reserved bytes are those of that size.

    python benchmarks/planner_accuracy.py --out benchmarks/results/planner_accuracy_gpu

Goal: the measured prediction within +-10 % of the allocated peak at every batch size; the reserved column shows the
margin a memory target needs on top of it. Without CUDA the real columns are left empty (a smoke run of the code).
"""

from __future__ import annotations

import argparse
import gc
from functools import partial
from pathlib import Path
from typing import Any

import torch
from _results import BASELINE, EXTRA, Row, Rows, device_name, header_lines, run_header, transformer_work, write_results

from lightning_tune.demos import DemoGPT, GPTConfig
from lightning_tune.plan import TransformerShape, estimate_memory, measure_memory

_PRECISION = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16, "32-true": None}
GIB = float(1 << 30)


def token_batch(n: int, seq: int, vocab: int, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    return (
        torch.randint(0, vocab, (n, seq), device=device),
        torch.randint(0, vocab, (n, seq), device=device),
    )


def real_peak(config: GPTConfig, batch_size: int, precision: str, steps: int, device: str) -> tuple[int, int] | None:
    """Peak bytes (allocated, reserved) over ``steps`` training steps after one warm-up step; ``None`` off CUDA (the
    steps still run, so the code path is the same)."""
    cuda = device == "cuda"
    if cuda:
        gc.collect()
        torch.cuda.empty_cache()
    torch.manual_seed(0)
    model = DemoGPT(config).to(device)
    optimizer = model.configure_optimizers()
    dtype = _PRECISION[precision]
    for step in range(steps + 1):
        if step == 1 and cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        batch = token_batch(batch_size, config.seq_len, config.vocab_size, device)
        with torch.autocast(device, dtype=dtype or torch.float32, enabled=dtype is not None):
            loss = model.training_step(batch, step)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        del loss, batch
    peaks = None
    if cuda:
        torch.cuda.synchronize()
        peaks = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
    del model, optimizer
    if cuda:
        gc.collect()
        torch.cuda.empty_cache()
    return peaks


def _shape(config: GPTConfig) -> TransformerShape:
    return TransformerShape(
        "gpt2",
        config.vocab_size,
        config.d_model,
        config.n_layers,
        config.n_heads,
        4 * config.d_model,
        max_position_embeddings=config.seq_len,
        qkv_bias=True,
        output_bias=True,
        mlp_bias=True,
        name="demo-gpt",
    )


def _error(predicted: int, real: int | None) -> float | None:
    return None if real is None else (predicted - real) / real


def accuracy(
    *, config: GPTConfig, batch_sizes: list[int], precisions: list[str], steps: int, device: str = "cuda"
) -> tuple[dict[str, Any], str]:
    rows: list[dict[str, Any]] = []
    for precision in precisions:
        measured = measure_memory(
            DemoGPT(config),
            token_batch(1, config.seq_len, config.vocab_size),
            precision=precision,
        )
        analytic = estimate_memory(
            _shape(config),
            sequence_length=config.seq_len,
            precision=precision,
        )
        for batch_size in batch_sizes:
            peaks = real_peak(config, batch_size, precision, steps, device)
            allocated, reserved = peaks if peaks is not None else (None, None)
            row: dict[str, Any] = {
                "precision": precision,
                "batch_size": batch_size,
                "allocated_bytes": allocated,
                "reserved_bytes": reserved,
                "measured_bytes": measured.total_bytes(batch_size),
                "analytic_bytes": analytic.total_bytes(batch_size),
            }
            for source in ("measured", "analytic"):
                row[f"{source}_error_allocated"] = _error(row[f"{source}_bytes"], allocated)
                row[f"{source}_error_reserved"] = _error(row[f"{source}_bytes"], reserved)
            rows.append(row)
            print(f"{precision} batch {batch_size}: allocated {allocated}, reserved {reserved}", flush=True)

    record = {
        **run_header("planner_accuracy", device_name() if device == "cuda" else f"{device_name()} (no real peak)"),
        "config": config.__dict__,
        "steps": steps,
        "rows": rows,
        "measured_within_10_percent_of_allocated": None
        if device != "cuda"
        else all(abs(r["measured_error_allocated"]) <= 0.10 for r in rows),
    }

    def gib(value: int | None) -> str:
        return "n/a" if value is None else f"{value / GIB:.3f}"

    def pct(value: float | None) -> str:
        return "n/a" if value is None else f"{value:+.1%}"

    lines = [f"# Memory planner accuracy on the demo GPT — {record['device']}", "", *header_lines(record)]
    lines += [
        f"{config}; real peaks over {steps} steps after a warm-up step, the allocator's cache emptied before each "
        "batch size. Errors are (predicted - real) / real.",
        "",
        "| Precision | Batch | allocated GiB | reserved GiB | measure_memory GiB | vs allocated | vs reserved "
        "| estimate_memory GiB | vs allocated | vs reserved |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['precision']} | {r['batch_size']} | {gib(r['allocated_bytes'])} | {gib(r['reserved_bytes'])} "
            f"| {gib(r['measured_bytes'])} | {pct(r['measured_error_allocated'])} "
            f"| {pct(r['measured_error_reserved'])} "
            f"| {gib(r['analytic_bytes'])} | {pct(r['analytic_error_allocated'])} "
            f"| {pct(r['analytic_error_reserved'])} |"
        )
    verdict = record["measured_within_10_percent_of_allocated"]
    lines += [
        "",
        "measure_memory within ±10 % of the allocated peak at every row: "
        + ("n/a (no CUDA device)" if verdict is None else "yes" if verdict else "no"),
        "",
    ]
    return record, "\n".join(lines)


def part(rows: Rows, *, smoke: bool) -> str:
    """The suite's part: the real peak at the first batch size timed as the calibration (a batch's cost taken as
    proportional to its size), then the plan: bf16 at every batch size (the baseline rows), then fp32. Each row is
    the real peaks against both predictions (made once per precision, in its first row)."""
    cuda = torch.cuda.is_available() and not smoke
    device = "cuda" if cuda else "cpu"
    if smoke:
        config, batch_sizes = GPTConfig(seq_len=16, d_model=32, n_layers=1, n_heads=2), [1, 2, 4]
    else:
        config, batch_sizes = GPTConfig(seq_len=1024, d_model=1024, n_layers=12, n_heads=16), [8, 16, 32]
    steps = 3
    rows.choose(batch_sizes=batch_sizes, steps=steps, model=str(config))
    rows.text(f"Real peaks over {steps} steps after one warm-up step (not counted).")
    with torch.device("meta"):
        params = sum(p.numel() for p in DemoGPT(config).parameters())
    first = (config, batch_sizes[0], "bf16-mixed")
    work = transformer_work(params=params, layers=config.n_layers, width=config.d_model, seq=config.seq_len,
                            vocab=config.vocab_size, samples=batch_sizes[0], micro=batch_sizes[0])  # fmt: skip
    cost, _ = rows.calibrate("real peak", lambda n: real_peak(*first, n, device), steps=steps + 1, work=work,
                             batch=batch_sizes[0])  # fmt: skip
    rows.table("Precision", "Batch", "allocated GiB", "reserved GiB", "measure_memory GiB", "vs allocated",
               "vs reserved", "estimate_memory GiB", "vs allocated", "vs reserved")  # fmt: skip

    def gib(value: int | None) -> str:
        return "n/a" if value is None else f"{value / GIB:.3f}"

    def pct(value: float | None) -> str:
        return "n/a" if value is None else f"{value:+.1%}"

    errors = []
    predictions: dict[str, tuple[Any, Any]] = {}

    def measure(precision: str, batch_size: int) -> dict[str, Any]:
        if precision not in predictions:
            predictions[precision] = (
                measure_memory(DemoGPT(config), token_batch(1, config.seq_len, config.vocab_size), precision=precision),
                estimate_memory(_shape(config), sequence_length=config.seq_len, precision=precision),
            )
        measured, analytic = predictions[precision]
        peaks = real_peak(config, batch_size, precision, steps, device)
        allocated, reserved = peaks if peaks is not None else (None, None)
        row: dict[str, Any] = {"precision": precision, "batch_size": batch_size, "allocated_bytes": allocated,
                               "reserved_bytes": reserved, "measured_bytes": measured.total_bytes(batch_size),
                               "analytic_bytes": analytic.total_bytes(batch_size)}  # fmt: skip
        for source in ("measured", "analytic"):
            row[f"{source}_error_allocated"] = _error(row[f"{source}_bytes"], allocated)
            row[f"{source}_error_reserved"] = _error(row[f"{source}_bytes"], reserved)
        errors.append(row["measured_error_allocated"])
        rows.add("peak", row, [
            precision, batch_size, gib(allocated), gib(reserved), gib(row["measured_bytes"]),
            pct(row["measured_error_allocated"]), pct(row["measured_error_reserved"]), gib(row["analytic_bytes"]),
            pct(row["analytic_error_allocated"]), pct(row["analytic_error_reserved"])])  # fmt: skip
        return row

    slower = {"bf16-mixed": 1.0, "32-true": 8.0}  # fp32 steps, as the rehearsal prices them
    rows.run_plan([
        Row(f"{precision}, batch {b}", cost(steps + 1) * b / batch_sizes[0] * slower[precision],
            partial(measure, precision, b), BASELINE if precision == "bf16-mixed" else EXTRA)
        for precision in slower for b in batch_sizes
    ])  # fmt: skip
    if not cuda:
        return f"{len(errors)} rows (no CUDA device: no real peak)"
    return f"measure_memory vs allocated: worst {max(errors, key=abs):+.1%} over {len(errors)} rows"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precisions", nargs="+", choices=sorted(_PRECISION), default=["bf16-mixed", "32-true"])
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--n-layers", type=int, default=12)
    parser.add_argument("--n-heads", type=int, default=16)
    parser.add_argument("--batch-sizes", type=int, nargs=3, default=[8, 16, 32])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    config = GPTConfig(
        vocab_size=64, seq_len=args.seq_len, d_model=args.d_model, n_layers=args.n_layers, n_heads=args.n_heads
    )
    record, report = accuracy(
        config=config, batch_sizes=args.batch_sizes, precisions=args.precisions, steps=args.steps, device=args.device
    )
    write_results(args.out, record, report)


if __name__ == "__main__":
    main()
