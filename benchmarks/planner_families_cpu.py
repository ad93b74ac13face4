"""How the analytic estimate compares with a measured step: ``estimate_memory`` / ``measure_memory`` on small Hugging
Face models of each family the planner describes (GPT-2, Llama, BERT, T5), built from configs, fp32, eager attention.

``measure_memory`` runs the model's own training step (forward, backward, ``torch.optim.AdamW.step``) on fake tensors
and counts the live bytes; ``estimate_memory`` counts the same run from the model's shape alone. Both predict the peak
as ``fixed + per-sample x batch``; the ratios below are analytic / measured, for the optimizer's single-tensor path
(``for_device="cpu"``) and its multi-tensor path, torch's default on a GPU (``for_device="cuda"``).

    python benchmarks/planner_families_cpu.py --out benchmarks/results/planner_families_cpu
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _results import device_name, header_lines, run_header, write_results
from transformers import (
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForSeq2SeqLM,
    BertConfig,
    GPT2Config,
    LlamaConfig,
    T5Config,
)

from lightning_tune.plan import estimate_memory, from_hf_config, measure_memory

BATCHES = (1, 8)


def _family_cases(hidden: int, layers: int) -> dict[str, tuple[Any, Callable[..., Any], Callable[[Any, Any], Any]]]:
    """Per family: its config, the ``transformers`` class that builds the model, and the step's loss."""
    heads, inner, vocab = hidden // 32, 2 * hidden, 1000

    def lm_loss(model: Any, batch: Any) -> Any:
        return model(input_ids=batch[0], labels=batch[1]).loss

    def pooled(model: Any, batch: Any) -> Any:  # the body a task head sits on, as the planner plans an encoder
        return model(input_ids=batch[0]).pooler_output.sum()

    ids = {"bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}
    gpt2 = GPT2Config(n_embd=hidden, n_layer=layers, n_head=heads, vocab_size=vocab, **ids)
    llama = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inner,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads // 2,
        **ids,
    )
    bert = BertConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=inner,
        pad_token_id=0,
    )
    t5 = T5Config(
        vocab_size=vocab,
        d_model=hidden,
        d_kv=32,
        d_ff=inner,
        num_layers=layers,
        num_heads=heads,
        decoder_start_token_id=0,
        **ids,
    )
    return {
        "gpt2": (gpt2, AutoModelForCausalLM.from_config, lm_loss),
        "llama": (llama, AutoModelForCausalLM.from_config, lm_loss),
        "bert": (bert, AutoModel.from_config, pooled),
        "t5": (t5, AutoModelForSeq2SeqLM.from_config, lm_loss),
    }


def compare(hidden: int, layers: int, sequence: int) -> list[dict[str, Any]]:
    rows = []
    for family, (config, build, loss) in _family_cases(hidden, layers).items():
        torch.manual_seed(0)
        model = build(config, attn_implementation="eager")
        analytic = estimate_memory(
            from_hf_config(config.to_dict()), sequence_length=sequence, precision="32-true", attention="eager"
        )
        batch = (torch.zeros(1, sequence, dtype=torch.long),) * 2
        for device in ("cpu", "cuda"):
            measured = measure_memory(model, batch, loss_fn=loss, for_device=device, precision="32-true")
            row: dict[str, Any] = {
                "family": family,
                "hidden": hidden,
                "layers": layers,
                "sequence_length": sequence,
                "optimizer_path": "single-tensor" if device == "cpu" else "multi-tensor",
                "parameters_equal": analytic.parameters == measured.parameters,
                "optimizer_bytes_equal": analytic.optimizer_bytes == measured.optimizer_bytes,
                "fixed_ratio": analytic.fixed_bytes / measured.fixed_bytes,
                "per_sample_ratio": analytic.bytes_per_sample / measured.bytes_per_sample,
            }
            for size in BATCHES:
                row[f"peak_ratio_batch_{size}"] = analytic.total_bytes(size) / measured.total_bytes(size)
            rows.append(row)
            print(row, flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="write <out>.json and <out>.md")
    args = parser.parse_args()
    rows = [
        row for hidden, layers, sequence in ((128, 2, 64), (256, 4, 256)) for row in compare(hidden, layers, sequence)
    ]
    record = {**run_header("planner_families_cpu", device_name()), "rows": rows}
    peaks = [row[f"peak_ratio_batch_{size}"] for row in rows for size in BATCHES]
    lines = [f"# Analytic / measured memory, four families — {record['device']}", "", *header_lines(record)]
    lines += [
        "Hugging Face models from configs (vocabulary 1000, heads of 32, MLP 2x the width), fp32, eager attention, "
        "AdamW. Ratios are estimate_memory / measure_memory; below 1 the analytic estimate is the smaller.",
        "",
        "| Family | Width x layers, sequence | Optimizer path | Fixed | Per sample | Peak, batch 1 | Peak, batch 8 "
        "| Parameters, optimizer state equal |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        exact = "yes" if r["parameters_equal"] and r["optimizer_bytes_equal"] else "no"
        lines.append(
            f"| {r['family']} | {r['hidden']} x {r['layers']}, {r['sequence_length']} | {r['optimizer_path']} "
            f"| {r['fixed_ratio']:.3f} | {r['per_sample_ratio']:.3f} | {r['peak_ratio_batch_1']:.3f} "
            f"| {r['peak_ratio_batch_8']:.3f} | {exact} |"
        )
    lines += ["", f"Peak ratio from {min(peaks):.3f} to {max(peaks):.3f}.", ""]
    write_results(args.out, record, "\n".join(lines))


if __name__ == "__main__":
    main()
