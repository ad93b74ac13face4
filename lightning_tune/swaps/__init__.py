"""Swaps engine: module surgery, by instance and undoable, with no Trainer in it (the callbacks wire the hooks).

The attention and optimizer swaps are imported from their modules, ``swaps.attention`` and ``swaps.optimizer``.
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
