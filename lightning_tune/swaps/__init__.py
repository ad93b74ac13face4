"""Swaps engine: module surgery, by instance and undoable, with no Trainer in it (the callbacks wire the hooks).

Attention kernels, the optimizer, activation checkpointing of the transformer blocks, ``torch.compile`` in place, and
the causal-LM loss computed without logits (:func:`linear_cross_entropy`, :func:`swap_loss`).
"""

from lightning_tune.swaps.attention import AttentionSwapResult, find_attention, resolve_backend, swap_attention
from lightning_tune.swaps.checkpointing import CheckpointEntry, CheckpointResult, checkpoint_blocks
from lightning_tune.swaps.compile import COMPILE_MODES, CompileResult, compile_modules
from lightning_tune.swaps.cross_entropy import linear_cross_entropy
from lightning_tune.swaps.loss import LossSwapResult, swap_loss
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
    "LossSwapResult",
    "OptimizerSwapResult",
    "TARGETS",
    "checkpoint_blocks",
    "compile_modules",
    "estimate_state_bytes",
    "find_attention",
    "linear_cross_entropy",
    "optimizer_state_bytes",
    "repoint_schedulers",
    "resolve_backend",
    "swap_attention",
    "swap_loss",
    "swap_optimizer",
    "swap_optimizers",
]
