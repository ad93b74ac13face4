"""The planner against real tensors: ``measure_memory`` and ``estimate_memory`` against ``TrackedMemory``'s peak of a
real training step, on small Hugging Face causal LMs built from configs (GPT-2, Llama, Qwen2), fp32, eager attention,
``torch.optim.AdamW`` on its single-tensor path (the CPU's).

``TrackedMemory`` counts every storage the step's real tensors hold on the CPU (rounded to 512 bytes, reserved as a
caching allocator reserves it); the peak is of the second step (AdamW's state made), with the cache emptied before
it. ``measure_memory`` runs the same step on fake tensors; ``estimate_memory`` counts it from the shape alone. Both
predict the peak as ``fixed + per-sample x batch``; the ratios are prediction / real peak.

    python benchmarks/planner_tracked_cpu.py --out benchmarks/results/planner_tracked_cpu
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch
from _results import device_name, header_lines, run_header, write_results
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, Qwen2Config

from lightning_tune import TrackedMemory
from lightning_tune.plan import estimate_memory, from_hf_config, measure_memory

BATCHES = (1, 8)


def _configs(hidden: int, layers: int) -> dict[str, Any]:
    heads, inner, vocab = hidden // 32, 2 * hidden, 1000
    ids = {"bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}
    common = {
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": inner,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": heads // 2,
        **ids,
    }
    return {
        "gpt2": GPT2Config(n_embd=hidden, n_layer=layers, n_head=heads, vocab_size=vocab, **ids),
        "llama": LlamaConfig(**common),
        "qwen2": Qwen2Config(**common),
    }


def tracked_peak(config: Any, batch: int, sequence: int) -> int:
    """The peak reserved bytes of a real training step's second run at ``batch`` samples."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    memory = TrackedMemory(total_bytes=1 << 40)
    ids = torch.randint(0, config.vocab_size, (batch, sequence))
    with memory.tracking(model):
        optimizer = torch.optim.AdamW(model.parameters())
        for _ in range(2):
            memory.empty_cache()
            memory.reset_peak()
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    return memory.peak_bytes()


def compare(hidden: int, layers: int, sequence: int) -> list[dict[str, Any]]:
    rows = []
    for family, config in _configs(hidden, layers).items():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
        ids = torch.zeros(1, sequence, dtype=torch.long)
        measured = measure_memory(model, {"input_ids": ids, "labels": ids}, for_device="cpu", precision="32-true")
        analytic = estimate_memory(
            from_hf_config(config.to_dict()), sequence_length=sequence, precision="32-true", attention="eager"
        )
        row: dict[str, Any] = {"family": family, "hidden": hidden, "layers": layers, "sequence_length": sequence}
        for size in BATCHES:
            real = tracked_peak(config, size, sequence)
            row[f"tracked_peak_batch_{size}"] = real
            row[f"measured_ratio_batch_{size}"] = measured.total_bytes(size) / real
            row[f"analytic_ratio_batch_{size}"] = analytic.total_bytes(size) / real
        rows.append(row)
        print(row, flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="write <out>.json and <out>.md")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = [
        row for hidden, layers, sequence in ((128, 2, 64), (256, 4, 256)) for row in compare(hidden, layers, sequence)
    ]
    record = {**run_header("planner_tracked_cpu", device_name()), "rows": rows}
    lines = [f"# The planner against a real step's tracked memory — {record['device']}", "", *header_lines(record)]
    lines += [
        "Hugging Face causal LMs from configs (vocabulary 1000, heads of 32, MLP 2x the width), fp32, eager "
        "attention, AdamW (single-tensor). Real peak: TrackedMemory's peak reserved bytes of a training step's "
        "second run. Ratios are prediction / real peak: above 1 the prediction is the larger.",
        "",
        "| Family | Width x layers, sequence | Real peak, batch 1 | Real peak, batch 8 | measure_memory, batch 1 "
        "| measure_memory, batch 8 | estimate_memory, batch 1 | estimate_memory, batch 8 |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['family']} | {r['hidden']} x {r['layers']}, {r['sequence_length']} "
            f"| {r['tracked_peak_batch_1'] / 2**20:.2f} MiB | {r['tracked_peak_batch_8'] / 2**20:.2f} MiB "
            f"| {r['measured_ratio_batch_1']:.3f} | {r['measured_ratio_batch_8']:.3f} "
            f"| {r['analytic_ratio_batch_1']:.3f} ({'above' if r['analytic_ratio_batch_1'] > 1 else 'below'}) "
            f"| {r['analytic_ratio_batch_8']:.3f} ({'above' if r['analytic_ratio_batch_8'] > 1 else 'below'}) |"
        )
    for name in ("measured", "analytic"):
        ratios = [r[f"{name}_ratio_batch_{size}"] for r in rows for size in BATCHES]
        lines.append(f"\n{name} / real peak from {min(ratios):.3f} to {max(ratios):.3f}.")
    lines += [
        "",
        "measure_memory's fixed part is the optimizer step's peak where that is above the intercept of its forward "
        "and backward peaks (measured at batches 1 and 2), so its line is above the real peak at small batches.",
        "",
    ]
    write_results(args.out, record, "\n".join(lines))


if __name__ == "__main__":
    main()
