"""Token data for the benchmarks whose vocabulary or sequence length the Markov-chain demo data cannot serve cheaply:
uniform random tokens, made on demand from the index (nothing held in memory), with a sequence length that can change
while training runs."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset, Sampler


class RandomTokens(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Item ``i`` is ``(input_ids, targets)`` of ``seq_len`` uniform tokens, the same for the same ``(i, seq_len)``.

    ``seq_len`` may be changed between batches (the sequence-doubling scenario).
    """

    def __init__(self, num_sequences: int, seq_len: int, vocab_size: int) -> None:
        self.num_sequences = num_sequences
        self.seq_len = seq_len
        self.vocab_size = vocab_size

    def __len__(self) -> int:
        return self.num_sequences

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(index * 1_000_003 + self.seq_len)
        walk = torch.randint(0, self.vocab_size, (self.seq_len + 1,), generator=gen)
        return walk[:-1], walk[1:]


def window_sizes(effective: int, micro: int) -> list[int]:
    """The micro-batches of one optimizer step of exactly ``effective`` samples: full ones of ``micro``, then the
    rest."""
    return [micro] * (effective // micro) + ([effective % micro] if effective % micro else [])


class WindowBatchSampler(Sampler[list[int]]):
    """Shuffled batches whose sizes cycle through ``sizes``: with ``accumulate_grad_batches=len(sizes)`` every
    optimizer step sees exactly ``sum(sizes)`` samples, whatever the micro-batch. Only whole windows are yielded."""

    def __init__(self, num_samples: int, sizes: list[int]) -> None:
        self.num_samples = num_samples
        self.sizes = sizes

    def __len__(self) -> int:
        return (self.num_samples // sum(self.sizes)) * len(self.sizes)

    def __iter__(self) -> Iterator[list[int]]:
        order = torch.randperm(self.num_samples).tolist()
        start = 0
        for _ in range(self.num_samples // sum(self.sizes)):
            for size in self.sizes:
                yield order[start : start + size]
                start += size


class RandomTokenDataModule(pl.LightningDataModule):
    """A shuffled training loader over :class:`RandomTokens`.

    With ``sizes``, batches cycle through those sizes (see :class:`WindowBatchSampler`); without, every batch has
    ``batch_size`` samples, read each time the loader is built (as ``BatchSizeFinder`` needs).
    """

    def __init__(
        self,
        batch_size: int,
        *,
        seq_len: int,
        vocab_size: int,
        num_sequences: int = 65_536,
        sizes: list[int] | None = None,
    ) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.sizes = sizes
        self.dataset = RandomTokens(num_sequences, seq_len, vocab_size)

    def train_dataloader(self) -> DataLoader[Any]:
        if self.sizes is not None:
            return DataLoader(self.dataset, batch_sampler=WindowBatchSampler(len(self.dataset), self.sizes))
        return DataLoader(self.dataset, batch_size=self.batch_size, shuffle=True, drop_last=True)

    def val_dataloader(self) -> DataLoader[Any]:
        # never run (the benchmarks set limit_val_batches=0), but BatchSizeFinder builds every loader the module has
        return DataLoader(RandomTokens(8, self.dataset.seq_len, self.dataset.vocab_size), batch_size=8)
