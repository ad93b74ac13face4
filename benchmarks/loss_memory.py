"""Training memory per sample of a Llama-shaped causal LM with and without the loss swap, on fake tensors (CPU).

``measure_memory`` runs real training steps of the model on fake tensors (no data, no memory of its size) and
reports the bytes each sample adds to the step's peak. The model is Llama-3.2-1B-shaped (hidden 2048, 16 layers,
32 heads, 8 key/value heads, MLP 8192, tied embeddings), trained at sequence length 2048 under bf16-mixed, with a
vocabulary of 128,256 (Llama 3) and of 32,000 (Llama 2, Mistral). The swap's claim: at 128k the bytes per sample
fall by at least 40 %.

    python benchmarks/loss_memory.py
"""

from __future__ import annotations

import argparse
import time

import torch
import transformers

from lightning_tune.plan import measure_memory
from lightning_tune.swaps import swap_loss

GIB = float(1 << 30)


def llama(vocab: int, *, hidden: int = 2048, layers: int = 16, intermediate: int = 8192) -> torch.nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=32,
        num_key_value_heads=8,
        tie_word_embeddings=True,
    )
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    return model.train()


def per_sample(model: torch.nn.Module, vocab: int, seq: int, precision: str) -> int:
    def batch(size: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, vocab, (size, seq))
        return {"input_ids": ids, "labels": ids}

    return measure_memory(model, batch, precision=precision, for_device="cuda").bytes_per_sample  # type: ignore[arg-type]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--precision", default="bf16-mixed")
    args = parser.parse_args()
    print(f"Llama-shaped, hidden 2048, {args.layers} layers, sequence {args.seq}, {args.precision}, fake tensors")
    print(f"{'vocabulary':>10}  {'no swap GiB/sample':>18}  {'swapped GiB/sample':>18}  {'saving':>7}  seconds")
    for vocab in (128_256, 32_000):
        start = time.perf_counter()
        model = llama(vocab, layers=args.layers)
        before = per_sample(model, vocab, args.seq, args.precision)
        with swap_loss(model, "chunked"):
            after = per_sample(model, vocab, args.seq, args.precision)
        saving = 1 - after / before
        elapsed = time.perf_counter() - start
        print(f"{vocab:>10,}  {before / GIB:>18.3f}  {after / GIB:>18.3f}  {saving:>7.1%}  {elapsed:.0f}")


if __name__ == "__main__":
    main()
