"""Swaps engine: module surgery, by instance and undoable, with no Trainer in it (the callbacks wire the hooks).

Attention kernels, the optimizer, activation checkpointing of the transformer blocks and ``torch.compile`` in place.
"""

from lightning_tune.swaps.attention import AttentionSwapResult, find_attention, resolve_backend, swap_attention
from lightning_tune.swaps.checkpointing import CheckpointEntry, CheckpointResult, checkpoint_blocks
from lightning_tune.swaps.compile import COMPILE_MODES, CompileResult, compile_modules
from lightning_tune.swaps.optimizer import (
    TARGETS,
    OptimizerSwapResult,
    estimate_state_bytes,
    optimizer_state_bytes,
    repoint_schedulers,
    swap_optimizer,
    swap_optimizers,
)

__all__ = [
    "AttentionSwapResult",
    "COMPILE_MODES",
    "CheckpointEntry",
    "CheckpointResult",
    "CompileResult",
    "OptimizerSwapResult",
    "TARGETS",
    "checkpoint_blocks",
    "compile_modules",
    "estimate_state_bytes",
    "find_attention",
    "optimizer_state_bytes",
    "repoint_schedulers",
    "resolve_backend",
    "swap_attention",
    "swap_optimizer",
    "swap_optimizers",
]
