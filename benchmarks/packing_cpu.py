"""Padding-free micro-batches on a CPU: positions computed per real token, padded against trimmed against packed.

A Hugging Face Llama built from a config (SDPA attention) is fine-tuned on long-tailed lengths (lognormal, median
``--median``, clipped to ``--max-len``), right-padded by ``DataCollatorForLanguageModeling``, DataLoader
``--batch-size`` × ``accumulate_grad_batches=--accumulate``, without a memory probe (each micro-batch is the configured
one's tokens at the first step's padded length). Three runs from the same seed:

- ``padded``: plain Lightning, each DataLoader batch padded to its longest;
- ``trimmed``: ``DynamicBatchSize(loss_weight="tokens")``: each step's samples grouped by length and trimmed;
- ``packed``: ``DynamicBatchSize(pack=True)``: each micro-batch one row of real tokens with sequence boundaries.

Reported: the positions the model computed (``input_ids.numel()`` over every training forward) per real token, and
real tokens per second of wall time over the steps after the first. On a CPU, SDPA runs a packed row with a dense
block-diagonal mask: its attention computes the row's length squared, so the wall time says nothing of a varlen
kernel on a GPU, which attends each sequence alone.

    python benchmarks/packing_cpu.py > benchmarks/results/packing_cpu.md
"""

from __future__ import annotations

import argparse
import tempfile
import time
import warnings
from typing import Any

import numpy as np
import torch
import transformers
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from torch.utils.data import DataLoader, Dataset

import lightning_tune as lt

VOCAB = 256


class Tokens(Dataset):
    def __init__(self, lengths: list[int]) -> None:
        gen = torch.Generator().manual_seed(0)
        self.samples = [torch.randint(2, VOCAB, (n,), generator=gen).tolist() for n in lengths]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> dict[str, list[int]]:
        return {"input_ids": self.samples[i]}


def collator() -> Any:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    vocab = {"[PAD]": 0, "[UNK]": 1, **{f"w{i}": i for i in range(2, VOCAB)}}
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="[UNK]")), pad_token="[PAD]", unk_token="[UNK]"
    )
    return transformers.DataCollatorForLanguageModeling(tok, mlm=False, return_tensors="pt")


class FineTune(LightningModule):
    def __init__(self, dataset: Dataset, batch_size: int) -> None:
        super().__init__()
        seed_everything(0, verbose=False)
        config = transformers.LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            max_position_embeddings=4096,
            pad_token_id=0,
        )
        self.model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
        self.dataset, self.batch_size, self.collate = dataset, batch_size, collator()
        self.computed = self.real = 0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if torch.is_grad_enabled():  # not the packing guard's forwards
            self.computed += batch["input_ids"].numel()
            mask = batch.get("attention_mask")  # a packed row has none: every position is real
            self.real += int(mask.sum()) if mask is not None else batch["input_ids"].numel()
        return self.model(**batch).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.dataset, batch_size=self.batch_size, shuffle=True, collate_fn=self.collate)


class Clock(Callback):
    def __init__(self) -> None:
        self.ticks: list[tuple[float, int]] = []  # (time, real tokens trained so far) at each batch's end

    def on_train_batch_end(self, trainer: Trainer, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.ticks.append((time.perf_counter(), module.real))


def run(mode: str, args: argparse.Namespace, lengths: list[int]) -> dict[str, float]:
    module = FineTune(Tokens(lengths), args.batch_size)
    clock = Clock()
    callbacks: list[Callback] = [clock]
    if mode == "trimmed":
        callbacks.append(lt.DynamicBatchSize(loss_weight="tokens"))
    elif mode == "packed":
        callbacks.append(lt.DynamicBatchSize(pack=True))
    with tempfile.TemporaryDirectory() as root, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        Trainer(
            default_root_dir=root,
            callbacks=callbacks,
            max_epochs=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            accelerator="cpu",
            devices=1,
            accumulate_grad_batches=args.accumulate,
        ).fit(module)
    # optimizer steps end every `accumulate` batches (with DynamicBatchSize every batch is a step)
    ends = clock.ticks if mode != "padded" else clock.ticks[args.accumulate - 1 :: args.accumulate]
    (start, before), (end, after) = ends[0], ends[-1]
    return {"computed_per_real": module.computed / module.real, "tokens_per_sec": (after - before) / (end - start)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--median", type=int, default=32)
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--accumulate", type=int, default=8)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    lengths = [int(v) for v in np.clip(rng.lognormal(np.log(args.median), 1.0, args.samples), 2, args.max_len)]
    torch.set_num_threads(2)
    print(f"| Run | Positions computed per real token | Real tokens/s (CPU, {torch.get_num_threads()} threads) |")
    print("| --- | --- | --- |")
    for mode in ("padded", "trimmed", "packed"):
        result = run(mode, args, lengths)
        print(f"| {mode} | {result['computed_per_real']:.3f} | {result['tokens_per_sec']:,.0f} |")


if __name__ == "__main__":
    main()
