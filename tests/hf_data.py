"""Hugging Face shaped data for tests: a tokenizer built in code, long-tailed lengths, the library's own collators."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

VOCAB = 64


def tokenizer(padding_side: str = "right") -> Any:
    """A word-level tokenizer with `VOCAB` tokens, built in code (no download)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    vocab = {"[PAD]": 0, "[UNK]": 1, **{f"w{i}": i for i in range(2, VOCAB)}}
    tok = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]")
    fast.padding_side = padding_side
    return fast


def long_tailed_lengths(n: int, median: int = 64, sigma: float = 1.0, max_len: int = 1024, seed: int = 0) -> list[int]:
    """Lognormal sequence lengths (median `median`), clipped to [2, max_len]."""
    rng = np.random.default_rng(seed)
    return [int(v) for v in np.clip(rng.lognormal(np.log(median), sigma, n), 2, max_len)]


class TokenDataset(Dataset):
    """Samples of random token ids with the given lengths, as a tokenizer's output (`input_ids` only)."""

    def __init__(self, lengths: list[int], seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.samples = [torch.randint(2, VOCAB, (n,), generator=gen).tolist() for n in lengths]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> dict[str, list[int]]:
        return {"input_ids": self.samples[i]}


def lm_collator(padding_side: str = "right") -> Any:
    """Hugging Face's causal-LM collator: pads to the batch's longest, labels are input ids with -100 at padding."""
    from transformers import DataCollatorForLanguageModeling

    return DataCollatorForLanguageModeling(tokenizer(padding_side), mlm=False, return_tensors="pt")
