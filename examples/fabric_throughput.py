"""Samples/s, tokens/s and step-time percentiles in a ``lightning.fabric`` loop, with the monitor's own engine.

``ThroughputLatencyMonitor`` is a thin Trainer adapter over ``lightning_tune.perf``: a timer that hands out marks
without waiting for the device (``timer_for``), and ``StepStats``, which turns resolved step durations into rates and
percentiles. A Fabric loop uses the same two pieces: mark each step's start and end, resolve the marks once per
logging interval (one wait), and sum the ranks' rates with ``fabric.all_reduce``.

Run it (a few seconds on a CPU)::

    python examples/fabric_throughput.py --steps 20 --log-every 5
    python examples/fabric_throughput.py --devices 2   # two CPU processes; the rates printed are the sums
"""

from __future__ import annotations

import argparse
from itertools import cycle
from typing import Any

import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from torch.utils.data import DataLoader, TensorDataset

from lightning_tune.demos import GPT, GPTConfig
from lightning_tune.perf import StepStats, count_samples, count_tokens, timer_for


def main(argv: list[str] | None = None) -> list[dict[str, float]]:
    """Train a small GPT for ``--steps`` steps and print the throughput every ``--log-every`` steps.

    Args:
        argv: Command-line arguments (``None`` reads ``sys.argv``).

    Returns:
        The metrics printed at each logging step (rates summed over processes, this process's percentiles).
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--log-every", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=8)
    args = parser.parse_args(argv)

    fabric = Fabric(accelerator="cpu", devices=args.devices, strategy="ddp" if args.devices > 1 else "auto")
    fabric.launch()
    fabric.seed_everything(0)
    config = GPTConfig(vocab_size=64, seq_len=32, d_model=64, n_layers=2, n_heads=4)
    model = GPT(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, optimizer = fabric.setup(model, optimizer)
    ids = torch.randint(0, config.vocab_size, (256, config.seq_len + 1), generator=torch.Generator().manual_seed(0))
    loader = fabric.setup_dataloaders(DataLoader(TensorDataset(ids[:, :-1], ids[:, 1:]), batch_size=args.batch_size))

    timer = timer_for(fabric.device)
    stats = StepStats(window=100, percentiles=(50.0, 95.0, 99.0))
    pending: list[tuple[Any, Any, Any, int, int]] = []  # (previous end, start, end, samples, tokens)
    previous_end: Any = None
    logged: list[dict[str, float]] = []
    for step, batch in zip(range(1, args.steps + 1), cycle(loader)):
        start = timer.mark()
        inputs, targets = batch
        loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        end = timer.mark()
        pending.append((previous_end, start, end, count_samples(batch) or 0, int(count_tokens(inputs) or 0)))
        previous_end = end
        if step % args.log_every:
            continue
        timer.wait(end)  # the one wait of the interval: every mark before it is now readable
        for before, begin, finish, samples, tokens in pending:
            if before is not None:
                stats.add_between(wait_ms=timer.elapsed_ms(before, begin))
            stats.add_step(step_ms=timer.elapsed_ms(begin, finish), samples=samples, tokens=tokens, batches=1)
        pending.clear()
        metrics = stats.interval_metrics()
        rates = ("samples_per_sec", "tokens_per_sec", "batches_per_sec")
        summed = fabric.all_reduce(torch.tensor([metrics[k] for k in rates], dtype=torch.float64), reduce_op="sum")
        metrics.update({key: float(value) for key, value in zip(rates, summed, strict=True)})
        logged.append(metrics)
        fabric.print(
            f"step {step}: {metrics['samples_per_sec']:.1f} samples/s, {metrics['tokens_per_sec']:.0f} tokens/s, "
            f"step p50 {metrics['step_ms_p50']:.1f} ms, p95 {metrics['step_ms_p95']:.1f} ms"
        )
    return logged


if __name__ == "__main__":
    main()
