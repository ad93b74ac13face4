"""A synthetic, learnable token corpus generated at run time: nothing is downloaded.

Sequences are walks of a fixed random sparse Markov chain over the vocabulary. The best any model can do on them is
the chain's entropy rate, ``entropy_floor`` in nats per token, far below ``ln(vocab_size)`` (a uniform guess): a small
GPT's loss falls visibly within a couple of hundred steps, and the demo can say how close it got to the best.
"""

from __future__ import annotations

import operator
from functools import cached_property
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from lightning_tune._validation import check_float, check_int

# Sequences are generated in fixed-size chunks, each from its own generator, so that item ``i`` depends only on
# (chain, seed, i) and not on how many sequences the dataset holds.
_CHUNK = 256
_GOLDEN = 0x9E3779B97F4A7C15  # odd 64-bit constant used to spread (seed, chunk) pairs over generator seeds


def markov_chain(vocab_size: int, *, successors: int = 4, smoothing: float = 0.05, seed: int = 0) -> Tensor:
    """The transition matrix ``P[a, b]`` (``float64``, rows summing to 1) of a random sparse chain over the tokens.

    Each token gets ``successors`` (1 to ``vocab_size``) likely next tokens with random weights; a share
    ``smoothing`` (in [0, 1)) of the probability is spread over all tokens, which keeps the chain ergodic. The same
    ``seed`` gives the same chain.
    """
    check_int("vocab_size", vocab_size, minimum=2)
    check_int("successors", successors, minimum=1)
    if successors > vocab_size:
        raise ValueError(f"`successors` must be an integer <= vocab_size={vocab_size}, got {successors!r}")
    check_float("smoothing", smoothing, low=0.0, high=1.0, high_inclusive=False)
    check_int("seed", seed, minimum=0)
    gen = torch.Generator().manual_seed(seed)
    sparse = torch.zeros(vocab_size, vocab_size, dtype=torch.float64)
    for token in range(vocab_size):
        nxt = torch.randperm(vocab_size, generator=gen)[:successors]
        # Skewed weights (one dominant successor, a few rarer ones) keep the entropy rate well below ln(successors).
        weights = torch.rand(successors, generator=gen, dtype=torch.float64).pow(2) + 0.05
        sparse[token, nxt] = weights / weights.sum()
    return (1.0 - smoothing) * sparse + smoothing / vocab_size


def _stationary(transition: Tensor) -> Tensor:
    pi = torch.full((transition.shape[0],), 1.0 / transition.shape[0], dtype=torch.float64)
    for _ in range(10_000):
        nxt = pi @ transition
        if torch.allclose(nxt, pi, rtol=0.0, atol=1e-13):
            return nxt
        pi = nxt
    return pi


def _entropy_rate(transition: Tensor) -> float:
    pi = _stationary(transition)
    logp = torch.where(transition > 0, transition.log(), torch.zeros_like(transition))
    row_entropy = -(transition * logp).sum(dim=1)
    return float(pi @ row_entropy)


class SyntheticTokenDataset(Dataset[tuple[Tensor, Tensor]]):
    """Map-style dataset of ``num_sequences`` Markov-chain walks for next-token prediction.

    Item ``i`` is ``(input_ids, targets)``, two ``int64`` tensors of ``seq_len`` tokens, ``targets`` shifted left by
    one, generated once, in memory, from the chain (see :func:`markov_chain`), the walks' ``seed`` and ``i`` alone.
    """

    def __init__(
        self,
        num_sequences: int,
        seq_len: int,
        vocab_size: int,
        *,
        seed: int = 0,
        chain_seed: int = 0,
        successors: int = 4,
        smoothing: float = 0.05,
    ) -> None:
        self.num_sequences = num_sequences
        self.seq_len = seq_len
        self.vocab_size = vocab_size
        self.seed = seed
        self.transition = markov_chain(vocab_size, successors=successors, smoothing=smoothing, seed=chain_seed)
        #: Entropy rate of the chain in nats per token: the lowest mean cross-entropy any model can reach.
        self.entropy_floor = _entropy_rate(self.transition)
        self._tokens = self._generate()

    def _generate(self) -> Tensor:
        cdf = self.transition.cumsum(dim=1)
        start_cdf = _stationary(self.transition).cumsum(dim=0)
        chunks = []
        for chunk in range(-(-self.num_sequences // _CHUNK)):
            gen = torch.Generator().manual_seed((self.seed * _GOLDEN + chunk) % 2**63)
            u = torch.rand(self.seq_len + 1, _CHUNK, 1, generator=gen, dtype=torch.float64)
            tokens = torch.empty(_CHUNK, self.seq_len + 1, dtype=torch.int64)
            tokens[:, 0] = torch.searchsorted(start_cdf, u[0]).squeeze(1)
            for t in range(1, self.seq_len + 1):
                row = cdf[tokens[:, t - 1].clamp_(max=self.vocab_size - 1)]
                tokens[:, t] = torch.searchsorted(row, u[t]).squeeze(1)
            chunks.append(tokens.clamp_(max=self.vocab_size - 1))
        return torch.cat(chunks)[: self.num_sequences]

    def __len__(self) -> int:
        return self.num_sequences

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        i = operator.index(index)
        if not -self.num_sequences <= i < self.num_sequences:
            raise IndexError(f"index {index} is out of range for a dataset of {self.num_sequences} sequences")
        walk = self._tokens[i]
        return walk[:-1].clone(), walk[1:].clone()


class SyntheticTokenDataModule(pl.LightningDataModule):
    """Train, validation and predict splits of :class:`SyntheticTokenDataset` over one shared Markov chain.

    The dataloaders read :attr:`batch_size` each time they are built, so a callback that changes it (for example a
    dynamic batch-size callback) takes effect when the loaders are next requested.

    Args:
        batch_size: Sequences per batch, >= 1.
        seq_len: Tokens per sequence, >= 1.
        vocab_size: Number of token ids, >= 2.
        train_sequences: Size of the training split, >= 1. Training runs longer than one epoch simply reshuffle it.
        val_sequences: Size of the validation split, >= 1.
        predict_sequences: Size of the predict split, >= 1.
        seed: Seed of the chain and of the splits (each split samples its own walks), >= 0.
        num_workers: DataLoader worker processes, >= 0. The data lives in memory, so 0 is usually fastest.

    Raises:
        TypeError: If an argument has the wrong type.
        ValueError: If an argument is out of range.
    """

    def __init__(
        self,
        batch_size: int = 32,
        *,
        seq_len: int = 64,
        vocab_size: int = 64,
        train_sequences: int = 4096,
        val_sequences: int = 256,
        predict_sequences: int = 64,
        seed: int = 0,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        check_int("batch_size", batch_size, minimum=1)
        check_int("seq_len", seq_len, minimum=1)
        check_int("vocab_size", vocab_size, minimum=2)
        check_int("train_sequences", train_sequences, minimum=1)
        check_int("val_sequences", val_sequences, minimum=1)
        check_int("predict_sequences", predict_sequences, minimum=1)
        check_int("seed", seed, minimum=0)
        check_int("num_workers", num_workers, minimum=0)
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.vocab_size = vocab_size
        self.train_sequences = train_sequences
        self.val_sequences = val_sequences
        self.predict_sequences = predict_sequences
        self.seed = seed
        self.num_workers = num_workers
        self.train_set: SyntheticTokenDataset | None = None
        self.val_set: SyntheticTokenDataset | None = None
        self.predict_set: SyntheticTokenDataset | None = None

    @cached_property
    def entropy_floor(self) -> float:
        """Entropy rate of the shared chain in nats per token: the lowest mean cross-entropy any model can reach."""
        return _entropy_rate(markov_chain(self.vocab_size, seed=self.seed))

    def _dataset(self, num_sequences: int, split: int) -> SyntheticTokenDataset:
        # Splits draw walks from disjoint seed streams (3 * seed + split) over the same chain.
        return SyntheticTokenDataset(
            num_sequences, self.seq_len, self.vocab_size, seed=3 * self.seed + split, chain_seed=self.seed
        )

    def setup(self, stage: str) -> None:
        """Generate the splits ``stage`` needs (each only once)."""
        if stage in ("fit", "validate") and self.val_set is None:
            self.val_set = self._dataset(self.val_sequences, 1)
        if stage == "fit" and self.train_set is None:
            self.train_set = self._dataset(self.train_sequences, 0)
        if stage == "predict" and self.predict_set is None:
            self.predict_set = self._dataset(self.predict_sequences, 2)

    def _loader(self, stage: str, *, shuffle: bool) -> DataLoader[Any]:
        """The loader of ``stage``'s split (generated first if needed)."""
        self.setup(stage)
        dataset = {"fit": self.train_set, "validate": self.val_set, "predict": self.predict_set}[stage]
        assert dataset is not None
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            shuffle=shuffle,
            drop_last=shuffle and len(dataset) >= self.batch_size,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )

    def train_dataloader(self) -> DataLoader[Any]:
        """The shuffled loader of ``(input_ids, targets)`` training batches; an incomplete last batch is dropped."""
        return self._loader("fit", shuffle=True)

    def val_dataloader(self) -> DataLoader[Any]:
        """The loader of ``(input_ids, targets)`` validation batches, in a fixed order."""
        return self._loader("validate", shuffle=False)

    def predict_dataloader(self) -> DataLoader[Any]:
        """The loader of ``(input_ids, targets)`` predict batches, in a fixed order."""
        return self._loader("predict", shuffle=False)
