"""``ScheduleLR.step`` against ``torch.optim.lr_scheduler.LambdaLR.step`` with the same factor, side by side.

Both drive an SGD optimizer of ``--groups`` parameter groups with one warm-up + cosine factor
(``functools.partial(warmup_cosine, ...)``). The two ``step`` calls are timed in interleaved rounds (the order
alternating), ``--inner`` steps a round; the median over rounds is reported, with the Python calls one step makes
(cProfile over ``--inner`` steps). Prints a Markdown table::

    python benchmarks/lr_step.py
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch
from torch.optim.lr_scheduler import LambdaLR, LRScheduler

from lightning_tune.lr import ScheduleLR, warmup_cosine


def _optimizer(groups: int) -> torch.optim.Optimizer:
    params = [{"params": [torch.zeros(1, requires_grad=True)], "lr": 1e-3 * (i + 1)} for i in range(groups)]
    return torch.optim.SGD(params, lr=1e-3)


def _calls(step: Callable[[], None], steps: int) -> float:
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(steps):
        step()
    profile.disable()
    return pstats.Stats(profile).total_calls / steps  # type: ignore[attr-defined]


def main(argv: list[str] | None = None) -> str:
    """Time both schedulers and return the Markdown table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=301)
    parser.add_argument("--inner", type=int, default=100)
    args = parser.parse_args(argv)
    factor = partial(warmup_cosine, warmup_steps=1_000, total_steps=10**9, min_ratio=0.1)
    schedulers: dict[str, LRScheduler] = {}
    for name, make in (("ScheduleLR", ScheduleLR), ("LambdaLR", LambdaLR)):
        optimizer = _optimizer(args.groups)
        schedulers[name] = make(optimizer, factor)
        optimizer.step()  # torch warns when a scheduler steps before its optimizer ever did
    times: dict[str, list[float]] = {name: [] for name in schedulers}
    for round_ in range(args.rounds):
        for name in list(schedulers)[:: 1 if round_ % 2 else -1]:
            step = schedulers[name].step
            start = time.perf_counter()
            for _ in range(args.inner):
                step()
            times[name].append((time.perf_counter() - start) / args.inner * 1e6)
    medians = {name: statistics.median(values) for name, values in times.items()}
    calls = {name: _calls(scheduler.step, args.inner) for name, scheduler in schedulers.items()}
    rows = [
        "| Scheduler | median µs/step | vs LambdaLR | Python calls/step |",
        "| --- | --- | --- | --- |",
        *(
            f"| `{name}.step` | {medians[name]:.1f} | {medians[name] / medians['LambdaLR']:.2f}x | {calls[name]:.0f} |"
            for name in schedulers
        ),
    ]
    table = "\n".join(
        [
            f"{args.groups} parameter groups, one `warmup_cosine` factor, torch {torch.__version__}, "
            f"{args.rounds} interleaved rounds of {args.inner} steps (median of the rounds' means).",
            "",
            *rows,
        ]
    )
    return table


if __name__ == "__main__":
    print(main())
