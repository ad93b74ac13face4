"""Fine-tune a Hugging Face causal LM on variable-length text, with and without DynamicBatchSize.

The model is a GPT-2 built from a config (no download) and the data long-tailed token sequences padded by Hugging
Face's ``DataCollatorForLanguageModeling``, with a DataLoader batch of 8 and ``accumulate_grad_batches=8``. The
module is the plain one a user writes; the only change between the two runs is the callbacks list. Without a GPU the
callback is given a ``SimulatedMemory`` device that charges memory per padded token.

Each run prints the tokens its ``training_step`` processed, the padding share and samples/s::

    python examples/hf_causal_lm_varlen.py --steps 6
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
import transformers
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from torch.utils.data import DataLoader

import lightning_tune as lt

VOCAB = 256


def make_collator() -> transformers.DataCollatorForLanguageModeling:
    vocab = {"[PAD]": 0, "[UNK]": 1, **{f"w{i}": i for i in range(2, VOCAB)}}
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="[UNK]")), pad_token="[PAD]", unk_token="[UNK]"
    )
    return transformers.DataCollatorForLanguageModeling(tokenizer, mlm=False, return_tensors="pt")


def make_samples(n: int, median: int = 64, max_len: int = 1024) -> list[dict[str, list[int]]]:
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(np.log(median), 1.0, n), 2, max_len).astype(int)
    return [{"input_ids": rng.integers(2, VOCAB, length).tolist()} for length in lengths]


# --- the user's module, unchanged by the callback ----------------------------------------------------------------
class CausalLMFineTune(pl.LightningModule):
    def __init__(self, samples: list[dict[str, list[int]]]) -> None:
        super().__init__()
        torch.manual_seed(0)
        config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=1024, n_embd=64, n_layer=2, n_head=4)
        self.model = transformers.GPT2LMHeadModel(config)
        self.samples = samples
        self.tokens = self.real_tokens = 0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.tokens += batch["input_ids"].numel()
        self.real_tokens += int(batch["attention_mask"].sum())
        return self.model(**batch).loss  # Hugging Face's token-mean loss over the labels (-100 ignored)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.samples, batch_size=8, collate_fn=make_collator())


def train(steps: int, dynamic: bool) -> None:
    module = CausalLMFineTune(make_samples(steps * 64))
    callbacks: list[pl.Callback] = []
    if dynamic:
        device = lt.SimulatedMemory(
            total_bytes=40_000_000, fixed_bytes=4_000_000, bytes_per_sample=1, bytes_per_token=4_000
        )
        # loss_weight="tokens": the step's loss is one token mean over all its micro-batches, as one big batch's
        callbacks.append(lt.DynamicBatchSize(target_vram=0.9, adjust_every=2, probe=device, loss_weight="tokens"))
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=steps,
        accumulate_grad_batches=8,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    start = time.perf_counter()
    trainer.fit(module)
    seconds = time.perf_counter() - start
    name = "DynamicBatchSize" if dynamic else "fixed 8 x 8"
    print(
        f"{name:>16}: {module.tokens:,} tokens processed, padding {1 - module.real_tokens / module.tokens:.0%}, "
        f"{steps * 64 / seconds:.1f} samples/s"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps per run")
    args = parser.parse_args()
    transformers.logging.set_verbosity_error()
    train(args.steps, dynamic=False)
    train(args.steps, dynamic=True)
