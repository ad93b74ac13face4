"""Swaps engine: module surgery, by instance and undoable, with no Trainer in it (the callbacks wire the hooks).

Attention kernels, the optimizer, activation checkpointing of the transformer blocks, ``torch.compile`` in place, and
the causal-LM loss computed without logits (:func:`linear_cross_entropy`, :func:`swap_loss`). The engines of the
attention and optimizer swaps stay in their modules (:mod:`lightning_tune.swaps.attention`,
:mod:`lightning_tune.swaps.optimizer`).
"""

from lightning_tune.swaps.checkpointing import checkpoint_blocks
from lightning_tune.swaps.compile import compile_modules
from lightning_tune.swaps.cross_entropy import LinearCrossEntropyOutput, linear_cross_entropy
from lightning_tune.swaps.loss import swap_loss

__all__ = [
    "LinearCrossEntropyOutput",
    "checkpoint_blocks",
    "compile_modules",
    "linear_cross_entropy",
    "swap_loss",
]
