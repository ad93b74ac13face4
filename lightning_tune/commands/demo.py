"""``lightning-tune demo``: train the demo GPT on synthetic tokens with the pack's callbacks and print a summary."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from lightning_tune._validation import MAX_SEED
from lightning_tune.commands.args import PROG, IntRange, devices, path, precision, usage_error
from lightning_tune.vocab import ACCELERATORS

if TYPE_CHECKING:
    from lightning_tune.demos.run import DemoSummary


def add_parser(commands: Any) -> None:
    """Register the ``demo`` sub-command on ``commands``, the ``lightning-tune`` parser's sub-parsers action."""
    parser = commands.add_parser(
        "demo",
        help="train a small GPT on synthetic tokens with the pack's callbacks and print a summary",
        description=(
            "Train a small GPT on a synthetic token corpus (generated locally, nothing is downloaded) with "
            "WarmupCosine and AdaptiveLROnPlateau, then print how far the loss fell and where the TensorBoard "
            "logs are. The defaults took 20 s on two otherwise idle CPU cores (14 s of it training), and several "
            "minutes when other work shared them."
        ),
    )
    parser.add_argument("--max-steps", type=IntRange(1), default=300, help="optimizer steps (default: 300)")
    parser.add_argument(
        "--batch-size",
        type=IntRange(1),
        default=32,
        help="sequences per batch, at most the 4096 of the training split (default: 32)",
    )
    parser.add_argument("--accelerator", choices=ACCELERATORS, default="auto", help="where to train (default: auto)")
    parser.add_argument(
        "--devices", type=devices, default=1, help="device count, 'auto' or indices such as '0,1' (default: 1)"
    )
    parser.add_argument(
        "--precision",
        type=precision,
        default="auto",
        help="Lightning precision or an alias such as bf16 (default: auto, which is bf16-mixed or 16-mixed on a "
        "CUDA GPU and 32-true otherwise)",
    )
    parser.add_argument("--seed", type=IntRange(0, MAX_SEED), default=0, help="random seed, below 2**32 (default: 0)")
    parser.add_argument(
        "--root-dir", type=path, default=".", help="where lightning_logs/ goes (default: current directory)"
    )
    parser.add_argument("--no-progress-bar", action="store_true", help="hide the progress bar and model summary")
    parser.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    # Lightning is imported only once a run is asked for: `--help` and usage errors come without it.
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    from lightning_tune.demos.run import fit_demo, prepare_demo

    try:
        # Combinations only Lightning can judge (e.g. --accelerator gpu on a machine without one) fail here.
        demo = prepare_demo(
            max_steps=args.max_steps,
            batch_size=args.batch_size,
            accelerator=args.accelerator,
            devices=args.devices,
            precision=args.precision,
            seed=args.seed,
            default_root_dir=args.root_dir,
            enable_progress_bar=not args.no_progress_bar,
        )
    except (MisconfigurationException, ValueError, TypeError, ModuleNotFoundError) as err:  # e.g. transformer-engine
        return usage_error("demo", err)
    try:
        summary = fit_demo(demo)
    except MisconfigurationException as err:
        return usage_error("demo", err)
    if demo.trainer.global_rank == 0:  # multi-device runs: print the summary once
        print(_format_summary(summary))
    return 0


def _format_summary(summary: DemoSummary) -> str:
    perf = summary.perf
    batch = summary.batch
    if "samples_per_sec" in perf:  # training as the monitor measured it (validation excluded)
        tokens = f", {perf['tokens_per_sec']:,.0f} tokens/s" if "tokens_per_sec" in perf else ""
        rate = f"training {perf['samples_per_sec']:,.0f} samples/s{tokens}"
    else:
        rate = f"{summary.samples_per_sec:,.0f} samples/s over the whole fit"
    micro_batch = []
    if batch:
        gib = f"{batch['device_gib']:.1f} GiB"
        device = f"a simulated {gib} device (no GPU here)" if batch["simulated"] else f"{gib} of device memory"
        ooms = batch["oom_recoveries"]
        recovered = f", {ooms} out-of-memory error{'s' if ooms != 1 else ''} recovered" if ooms else ""
        micro_batch.append(
            f"  micro-batch    {batch['start']} -> {batch['final']} by DynamicBatchSize, 90 % target of {device}"
            f"{recovered}; every step still trained on {batch['start']} sequences"
        )
    drop = summary.loss_drop
    gap = summary.final_loss - summary.entropy_floor
    return "\n".join(
        [
            f"\n{PROG} demo finished on {summary.device}",
            f"  steps          {summary.steps} in {summary.seconds:.1f} s ({rate})",
            f"  train loss     {summary.start_loss:.3f} -> {summary.final_loss:.3f} "
            f"({100 * abs(drop):.1f} % {'lower' if drop >= 0 else 'higher'})",
            f"  entropy floor  {summary.entropy_floor:.3f} nats/token (the best achievable in expectation; "
            + (
                f"final loss is {gap:.3f} above it)"
                if gap >= 0
                else f"the last batches' mean is {-gap:.3f} below it, within sampling noise)"
            ),
            *micro_batch,
            f"  logs           {summary.log_dir}",
            f"  view them with {summary.tensorboard_command}",
        ]
    )
