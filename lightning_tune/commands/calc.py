"""``lightning-tune calc``: planning calculations that need no GPU (``docs/cli.md``, ``docs/planner.md``)."""

from __future__ import annotations

import argparse
from dataclasses import replace
from typing import Any

from lightning_tune.commands.args import PROG, IntRange, attention, memory, name_in, optimizer, usage_error
from lightning_tune.plan.estimate import PLAN_PRECISIONS, MemoryEstimate, estimate_memory, format_bytes, resolve_model
from lightning_tune.plan.zero import plan_zero
from lightning_tune.vocab import PLAN_MODES, canonical_precision

#: GPU counts the "what would fit" advice tries for sharding.
_GPU_COUNTS = (2, 4, 8, 16, 32, 64)


def add_parser(commands: Any) -> None:
    """Register ``calc`` and its sub-commands on ``commands``, the ``lightning-tune`` parser's sub-parsers action."""
    calc = commands.add_parser(
        "calc",
        help="planning calculations on any machine: what batch size fits a GPU",
        description="Planning calculations that need no GPU.",
    )
    calculations = calc.add_subparsers(title="calculations", dest="calculation", metavar="<calculation>", required=True)
    parser = calculations.add_parser(
        "batch-size",
        help="memory breakdown of training a transformer and the largest batch that fits a GPU",
        description=(
            "Estimate the memory of training a transformer (weights, gradients, optimizer states, activations per "
            "sample) from its shape and print the largest micro-batch that fits one GPU at the safe, optimal and "
            "aggressive margins (20, 10 and 5 % of the GPU kept back). Exit status 1 when no batch fits."
        ),
    )
    parser.add_argument(
        "--model", required=True, help="a known model name (e.g. llama-2-7b) or a path to a Hugging Face config.json"
    )
    parser.add_argument(
        "--gpu-memory",
        type=memory,
        required=True,
        metavar="SIZE",
        help="memory of one GPU with a unit, such as 24GB, 24GiB, 80G or 24000MiB (GB and G mean GiB, as GPU makers "
        "count); a bare number is MiB and must be at least 1024",
    )
    parser.add_argument(
        "--sequence-length",
        "--seq-len",
        type=IntRange(1, 2**24),  # 16M tokens, past any model's context
        required=True,
        metavar="N",
        help="tokens per sample",
    )
    parser.add_argument(
        "--precision",
        type=name_in(canonical_precision, PLAN_PRECISIONS),
        default="bf16-mixed",
        help="precision, e.g. bf16 (default: %(default)s)",
    )
    parser.add_argument("--optimizer", type=optimizer, default="adamw", help="optimizer (default: %(default)s)")
    parser.add_argument(
        "--lora-rank", type=IntRange(1), default=None, metavar="R", help="train LoRA adapters of rank R only"
    )
    parser.add_argument("--grad-checkpointing", action="store_true", help="recompute activations in backward")
    parser.add_argument("--loss-swap", action="store_true", help="compute the loss without the logits (LossSwap)")
    parser.add_argument("--attention", type=attention, default="flash", help="attention kernel (default: %(default)s)")
    parser.add_argument(
        "--no-master-weights",
        action="store_true",
        help="no float32 master copy of 16-bit weights (default: kept under bf16-mixed and 16-mixed)",
    )
    parser.add_argument(
        "--mode",
        choices=PLAN_MODES,
        default="train",
        help="plan training, evaluation (validate/test: no gradients or optimizer state, the loss computed) or "
        "predict (no labels, the logits returned) (default: %(default)s)",
    )
    parser.set_defaults(handler=_run_batch_size)
    # `calc --model ...` names the calculation that takes the flag
    flags = (flag for action in parser._actions for flag in action.option_strings if flag not in ("-h", "--help"))
    calc.hints = dict.fromkeys(flags, f"{PROG} calc batch-size")


def _estimate(args: argparse.Namespace, **changes: Any) -> MemoryEstimate:
    options: dict[str, Any] = {
        "sequence_length": args.sequence_length,
        "precision": args.precision,
        "optimizer": args.optimizer,
        "master_weights": False if args.no_master_weights else None,
        "attention": args.attention,
        "gradient_checkpointing": args.grad_checkpointing,
        "lora_rank": args.lora_rank,
        "loss_swap": args.loss_swap,
        "mode": args.mode,
    }
    options.update(changes)
    return estimate_memory(args.shape, **options)


def _run_batch_size(args: argparse.Namespace) -> int:
    try:
        args.shape = resolve_model(args.model)
        estimate = _estimate(args)
    except (ValueError, TypeError, OSError) as err:
        return usage_error("calc batch-size", err)
    budget = args.gpu_memory
    sizes = estimate.batch_sizes(budget)
    print(_format_breakdown(args, estimate, budget))
    if sizes["optimal"] == 0:
        print(f"\n{_format_advice(args, estimate, budget)}")
    print(f"\nRecommended: {sizes['safe']} (safe), {sizes['optimal']} (optimal), {sizes['aggressive']} (aggressive)")
    if args.mode != "predict":
        print(_format_evaluation(estimate if args.mode == "eval" else _estimate(args, mode="eval"), budget))
    return 0 if sizes["aggressive"] > 0 else 1


def _format_evaluation(estimate: MemoryEstimate, budget: int) -> str:
    """The evaluation batch that fits (optimal margin) inside ``fit``, the training state resident, and alone."""
    assert estimate.fit_fixed_bytes is not None  # an "eval" estimate always has it
    in_fit = replace(estimate, fixed_bytes=estimate.fit_fixed_bytes).max_batch_size(budget)
    alone = estimate.max_batch_size(budget)
    return (
        f"Evaluation: batch {in_fit} fits inside fit (the training state resident), {alone} in trainer.validate or "
        f"test (optimal margin; {format_bytes(estimate.bytes_per_sample)} a sample, no gradients kept)"
    )


def _format_breakdown(args: argparse.Namespace, estimate: MemoryEstimate, budget: int) -> str:
    params = estimate.parameters
    trainable = estimate.trainable_parameters or 0
    bytes_per_param = estimate.weight_bytes // max(params, 1)
    train = args.mode == "train"
    rows = [
        ("Parameters", f"{format_count(params)} ({params:,}; {trainable:,} trainable)"),
        ("Model size", f"{format_bytes(estimate.weight_bytes)} ({args.precision}, {bytes_per_param} bytes each)"),
    ]
    if train:
        rows.append(("Gradients", format_bytes(estimate.gradient_bytes)))
    if estimate.master_weight_bytes:
        rows.append(("Master weights", f"{format_bytes(estimate.master_weight_bytes)} (float32)"))
    if train:
        rows.append(("Optimizer states", f"{format_bytes(estimate.optimizer_bytes)} ({args.optimizer})"))
    rows += [("Buffers", format_bytes(estimate.buffer_bytes)), ("Fixed total", format_bytes(estimate.fixed_bytes))]
    if estimate.fit_fixed_bytes is not None:
        rows.append(("Fixed inside fit", f"{format_bytes(estimate.fit_fixed_bytes)} (the training state resident)"))
    per_sample = "Activations per sample" if train else "Working set per sample"
    rows.append((per_sample, f"{format_bytes(estimate.bytes_per_sample)} (sequence length {args.sequence_length})"))
    gpu = f"GPU memory {format_bytes(budget)} ({budget // 2**20} MiB); peak = fixed total + activations x batch"
    return "\n".join([*estimate.notes, gpu, ""] + [f"  {label:<24}{value}" for label, value in rows])


def format_count(n: int) -> str:
    """A parameter count in the largest unit that keeps it at 1 or more, three significant digits.

    Example:
        >>> format_count(6_738_415_616), format_count(1_200_000), format_count(999_999), format_count(96)
        ('6.74 B', '1.2 M', '1 M', '96')
    """
    for unit, size in (("T", 10**12), ("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if float(f"{n / size:.3g}") >= 1:  # as printed: 999,999 is "1 M", not "1e+03 K"
            return f"{float(f'{n / size:.3g}'):g} {unit}"
    return str(n)


def _fit(estimate: MemoryEstimate, budget: int) -> str:
    batch = estimate.max_batch_size(budget, "optimal")
    if batch:
        return f"fits batch {batch} (optimal margin); fixed total {format_bytes(estimate.fixed_bytes)}"
    over = estimate.total_bytes(1) - estimate.usable_bytes(budget, "optimal")
    return f"still does not fit: batch 1 needs {format_bytes(estimate.total_bytes(1))}, {format_bytes(over)} too much"


def _format_advice(args: argparse.Namespace, estimate: MemoryEstimate, budget: int) -> str:
    usable = estimate.usable_bytes(budget, "optimal")
    aggressive = estimate.max_batch_size(budget, "aggressive")
    status = f"Only the aggressive margin fits (batch {aggressive})" if aggressive else "Nothing fits"
    lines = [
        f"{status}: batch 1 needs {format_bytes(estimate.total_bytes(1))} and {format_bytes(usable)} is usable at "
        "the optimal margin. What would fit:"
    ]
    candidates: list[tuple[str, dict[str, Any]]] = [
        ("--optimizer adamw8bit", {"optimizer": "adamw8bit"}),
        ("--grad-checkpointing", {"gradient_checkpointing": True}),
        ("--loss-swap", {"loss_swap": True}),
        ("--precision bf16-true", {"precision": "bf16-true", "master_weights": None}),  # 16-bit all, no master copy
        ("--lora-rank 16", {"lora_rank": 16}),
    ]
    # each change that saves memory here (the loss swap saves nothing on an encoder, bf16-true nothing after
    # bf16-true), then together: those that still train every weight, and all of them
    need = estimate.total_bytes(1)
    changes = [(flag, change) for flag, change in candidates if _estimate(args, **change).total_bytes(1) < need]
    full_weights = [(flag, change) for flag, change in changes if "lora_rank" not in change]
    groups = [full_weights] if len(full_weights) > 1 else []
    if len(changes) > max(len(full_weights), 1):
        groups.append(list(changes))
    for group in groups:
        changes.append((" ".join(flag for flag, _ in group), {k: v for _, change in group for k, v in change.items()}))
    for flag, change in changes:
        lines.append(f"  {flag}: {_fit(_estimate(args, **change), budget)}")
    offload = plan_zero(estimate, gpu_memory_bytes=budget, num_gpus=1, batch_size=1)
    if offload.stage or offload.offload_optimizer:
        lines.append(f"  DeepSpeed on 1 GPU: {offload.reason.split(';')[0]}")
    for count in _GPU_COUNTS:
        plan = plan_zero(estimate, gpu_memory_bytes=budget, num_gpus=count, batch_size=1)
        if plan.fits and not plan.offload_optimizer:
            lines.append(f"  {count} GPUs: {plan.reason.split(';')[0]}")
            break
    else:
        lines.append(f"  {_GPU_COUNTS[-1]} GPUs without offload still do not fit at batch 1")
    lines.append(f"  (see '{PROG} calc batch-size --help' for the flags)")
    return "\n".join(lines)
