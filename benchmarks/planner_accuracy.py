"""How close the memory planner's predicted peak is to what CUDA allocates: the demo GPT at three batch sizes.

For each batch size, the prediction of ``measure_memory`` (fake-tensor step, linear in the batch) and of
``estimate_memory`` (analytic, from the equivalent GPT-2-family shape) are compared with
``torch.cuda.max_memory_allocated`` over real training steps after a warm-up step (the steady state: optimizer
state allocated, gradients freed by ``zero_grad``).

    python benchmarks/planner_accuracy.py --out benchmarks/results/planner_accuracy_gpu

Needs a CUDA GPU. Goal: the measured prediction within +-10 % of the real peak at every batch size.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch
from _results import run_header, write_results

from lightning_tune.demos import DemoGPT, GPTConfig
from lightning_tune.plan import TransformerShape, estimate_memory, measure_memory

_PRECISION = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16, "32-true": None}


def token_batch(n: int, seq: int, vocab: int, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    return (
        torch.randint(0, vocab, (n, seq), device=device),
        torch.randint(0, vocab, (n, seq), device=device),
    )


def real_peak(config: GPTConfig, batch_size: int, precision: str, steps: int) -> int:
    """Peak bytes allocated over ``steps`` training steps after one warm-up step."""
    torch.manual_seed(0)
    model = DemoGPT(config).cuda()
    optimizer = model.configure_optimizers()
    dtype = _PRECISION[precision]
    for step in range(steps + 1):
        if step == 1:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        batch = token_batch(batch_size, config.seq_len, config.vocab_size, "cuda")
        with torch.autocast("cuda", dtype=dtype or torch.float32, enabled=dtype is not None):
            loss = model.training_step(batch, step)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        del loss, batch
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    del model, optimizer
    torch.cuda.empty_cache()
    return peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precision", choices=sorted(_PRECISION), default="bf16-mixed")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--n-layers", type=int, default=8)
    parser.add_argument("--n-heads", type=int, default=8)
    parser.add_argument("--batch-sizes", type=int, nargs=3, default=[8, 16, 32])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("planner_accuracy.py needs a CUDA GPU")

    config = GPTConfig(
        vocab_size=64, seq_len=args.seq_len, d_model=args.d_model, n_layers=args.n_layers, n_heads=args.n_heads
    )
    measured = measure_memory(
        DemoGPT(config),
        token_batch(1, config.seq_len, config.vocab_size),
        precision=args.precision,
    )
    shape = TransformerShape(
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
    analytic = estimate_memory(
        shape,
        sequence_length=config.seq_len,
        precision="fp32" if args.precision == "32-true" else "bf16",
        master_weights=None if args.precision == "32-true" else True,
    )
    rows: list[dict[str, Any]] = []
    for batch_size in args.batch_sizes:
        real = real_peak(config, batch_size, args.precision, args.steps)
        row = {
            "batch_size": batch_size,
            "real_bytes": real,
            "measured_bytes": measured.total_bytes(batch_size),
            "analytic_bytes": analytic.total_bytes(batch_size),
        }
        row["measured_error"] = (row["measured_bytes"] - real) / real
        row["analytic_error"] = (row["analytic_bytes"] - real) / real
        rows.append(row)
        print(f"batch {batch_size}: real {real / 2**30:.3f} GiB, measured error {row['measured_error']:+.1%}")

    device = torch.cuda.get_device_name()
    record = {
        **run_header("planner_accuracy", device),
        "args": {k: str(v) for k, v in vars(args).items()},
        "measured_estimate": {"fixed_bytes": measured.fixed_bytes, "bytes_per_sample": measured.bytes_per_sample},
        "analytic_estimate": {"fixed_bytes": analytic.fixed_bytes, "bytes_per_sample": analytic.bytes_per_sample},
        "rows": rows,
        "within_10_percent": all(abs(r["measured_error"]) <= 0.10 for r in rows),
    }
    lines = [
        f"# Memory planner accuracy on the demo GPT — {device}",
        "",
        f"{record['date']}, commit `{record['commit'][:12]}`, torch {torch.__version__}, {args.precision}, sequence "
        f"{args.seq_len}, d_model {args.d_model}, {args.n_layers} layers; real peak = "
        f"`torch.cuda.max_memory_allocated` over {args.steps} steps after a warm-up step.",
        "",
        f"Command: `{record['command']}`",
        "",
        "| Batch | Real GiB | measure_memory GiB | error | estimate_memory GiB | error |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['batch_size']} | {r['real_bytes'] / 2**30:.3f} | {r['measured_bytes'] / 2**30:.3f} "
            f"| {r['measured_error']:+.1%} | {r['analytic_bytes'] / 2**30:.3f} | {r['analytic_error']:+.1%} |"
        )
    lines += ["", f"measure_memory within ±10 % at every batch size: {'yes' if record['within_10_percent'] else 'no'}"]
    write_results(args.out, record, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
