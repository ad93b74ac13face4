"""The loss swap's default chunk: a training step with ``swap_loss(model, "chunked")`` against the unswapped step.

A Hugging Face Llama built from its config (``--layers`` layers, MLP 4 x hidden, float32) takes forward and backward
passes on ``--tokens`` tokens a step (sequences of ``--seq``), at hidden 64 and 512 with vocabularies of 32,000 and
128,256, with the loss swapped at its default chunk (:func:`~lightning_tune.swaps.cross_entropy.default_chunk_size`)
and without. Each setting takes one warm-up step, left out; then ``--rounds`` rounds run every setting once, in turn
(interleaved, so that a slower stretch of the machine falls on all of them). Reported per configuration: the median
step's wall time and process CPU time (every thread's), and the swapped step over the unswapped one. ``--chunks``
adds settings at given chunk sizes, to see where the cost levels off.

Memory, per configuration: the float32 logits of the step against one default chunk's, and ``measure_memory``'s peak
of an AdamW training step on fake tensors (no memory of its size) at ``--memory-batch`` sequences of ``--memory-seq``
tokens, with and without the swap.

    python benchmarks/loss_chunk.py --out benchmarks/results/loss_chunk_cpu
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import device_name, header_lines, now, run_header, write_results  # noqa: E402

from lightning_tune.plan import measure_memory  # noqa: E402
from lightning_tune.swaps import swap_loss  # noqa: E402
from lightning_tune.swaps.cross_entropy import default_chunk_size  # noqa: E402

CONFIGS = [(64, 32_000), (64, 128_256), (512, 32_000), (512, 128_256)]  # (hidden, vocabulary)
MIB = float(1 << 20)


def llama(hidden: int, vocab: int, layers: int) -> transformers.LlamaForCausalLM:
    heads = max(hidden // 64, 2)
    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
    )
    return transformers.LlamaForCausalLM(config).train()


def timed_step(model: torch.nn.Module, ids: torch.Tensor, setting: str) -> tuple[float, float]:
    """One forward and backward pass, ``"unswapped"``, swapped at the ``"default"`` chunk or at a chunk of
    ``"<n>"`` tokens: wall and CPU seconds."""
    chunk = None if setting in ("unswapped", "default") else int(setting)
    swap = None if setting == "unswapped" else swap_loss(model, "chunked", chunk_size=chunk)
    model.zero_grad(set_to_none=True)
    wall, cpu = now(), time.process_time()
    model(input_ids=ids, labels=ids).loss.backward()
    wall, cpu = now() - wall, time.process_time() - cpu
    if swap is not None:
        swap.restore()
    return wall, cpu


def peak_bytes(model: torch.nn.Module, vocab: int, args: argparse.Namespace, swapped: bool) -> int:
    """``measure_memory``'s peak at ``--memory-batch`` sequences, on fake tensors."""

    def batch(size: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, vocab, (size, args.memory_seq))
        return {"input_ids": ids, "labels": ids}

    sizes = (args.memory_batch // 2, args.memory_batch)
    swap = swap_loss(model, "chunked") if swapped else None
    estimate = measure_memory(model, batch, batch_sizes=sizes, for_device="cuda")
    if swap is not None:
        swap.restore()
    return estimate.fixed_bytes + args.memory_batch * estimate.bytes_per_sample


def measure(hidden: int, vocab: int, args: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(0)
    model = llama(hidden, vocab, args.layers)
    ids = torch.randint(0, vocab, (args.tokens // args.seq, args.seq))
    tokens = ids.numel()  # the labels are shifted: tokens - batch of them have a loss
    settings = ["unswapped", "default", *map(str, args.chunks)]
    times: dict[str, list[tuple[float, float]]] = {s: [] for s in settings}
    for round_ in range(args.rounds + 1):  # round 0: warm-up, left out
        for setting in settings if round_ % 2 else settings[::-1]:
            took = timed_step(model, ids, setting)
            if round_:
                times[setting].append(took)
    wall = {s: statistics.median(t[0] for t in took) for s, took in times.items()}
    cpu = {s: statistics.median(t[1] for t in took) for s, took in times.items()}
    chunk = default_chunk_size(tokens, vocab)
    with torch.device("meta"):
        fake = llama(hidden, vocab, args.layers)
    peak_plain, peak_swapped = (peak_bytes(fake, vocab, args, swapped) for swapped in (False, True))
    return {
        "hidden": hidden,
        "vocab": vocab,
        "tokens": tokens,
        "default_chunk": chunk,
        "wall_s": wall,
        "cpu_s": cpu,
        "wall_ratio": {s: wall[s] / wall["unswapped"] for s in settings[1:]},
        "cpu_ratio": {s: cpu[s] / cpu["unswapped"] for s in settings[1:]},
        "logits_mib": tokens * vocab * 4 / MIB,
        "chunk_logits_mib": chunk * vocab * 4 / MIB,
        "memory_tokens": args.memory_batch * args.memory_seq,
        "memory_chunk": default_chunk_size(args.memory_batch * args.memory_seq, vocab),
        "peak_mib": {"unswapped": peak_plain / MIB, "swapped": peak_swapped / MIB},
    }


def report(record: dict[str, Any], args: argparse.Namespace) -> str:
    rows = record["rows"]
    extra = [f"chunk {c}" for c in args.chunks]  # the columns of --chunks
    lines = [
        f"# Loss swap, default chunk: swapped step / unswapped step — {record['device']}",
        "",
        *header_lines(record),
        f"Llama from its config, {args.layers} layers, float32, {args.tokens} tokens a step (sequences of {args.seq}), "
        f"forward and backward; {args.rounds} interleaved rounds after a warm-up round; medians.",
        "",
        "| Hidden | Vocabulary | Default chunk (tokens) | Unswapped step, wall s | Swapped / unswapped, wall | "
        "Swapped / unswapped, CPU time |" + "".join(f" {e}, wall |" for e in extra),
        "|" + " --- |" * (6 + len(extra)),
    ]
    for r in rows:
        cells = [
            str(r["hidden"]),
            f"{r['vocab']:,}",
            str(r["default_chunk"]),
            f"{r['wall_s']['unswapped']:.3f}",
            f"{r['wall_ratio']['default']:.2f}x",
            f"{r['cpu_ratio']['default']:.2f}x",
            *(f"{r['wall_ratio'][str(c)]:.2f}x" for c in args.chunks),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    worst = max(max(r["wall_ratio"]["default"], r["cpu_ratio"]["default"]) for r in rows)
    lines += [
        "",
        f"Largest swapped / unswapped ratio (wall or CPU time): {worst:.2f}x.",
        "",
        f"Memory: the step's float32 logits against one default chunk's; `measure_memory`'s peak of an AdamW step on "
        f"fake tensors at {args.memory_batch} x {args.memory_seq} tokens (float32, planned for CUDA).",
        "",
        "| Hidden | Vocabulary | Logits of the timed step, MiB | One chunk's, MiB | Chunk at "
        f"{args.memory_batch} x {args.memory_seq} | Peak unswapped, MiB | Peak swapped, MiB | Saved |",
        "|" + " --- |" * 8,
    ]
    for r in rows:
        plain, swapped = r["peak_mib"]["unswapped"], r["peak_mib"]["swapped"]
        lines.append(
            f"| {r['hidden']} | {r['vocab']:,} | {r['logits_mib']:.0f} | {r['chunk_logits_mib']:.0f} | "
            f"{r['memory_chunk']} | {plain:,.0f} | {swapped:,.0f} | {1 - swapped / plain:.1%} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="write <out>.json and <out>.md")
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--chunks", type=lambda s: [int(c) for c in s.split(",")], default=[])
    parser.add_argument("--memory-batch", type=int, default=8)
    parser.add_argument("--memory-seq", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads; default: torch's")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    record: dict[str, Any] = {**run_header("loss_chunk", device_name()), "settings": vars(args), "rows": []}
    for hidden, vocab in CONFIGS:
        record["rows"].append(measure(hidden, vocab, args))
        print(record["rows"][-1], flush=True)
    write_results(args.out, record, report(record, args))


if __name__ == "__main__":
    main()
