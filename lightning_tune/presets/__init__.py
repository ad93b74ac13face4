"""Presets that trade compute for memory or compile time for speed, on an unmodified model.

Activation checkpointing of transformer blocks, ``torch.compile`` of the network in place, and a DeepSpeed ZeRO
strategy chosen from a memory plan. Each is a plain function returning what it changed (or the strategy), with a
thin callback where a Trainer run applies it.
"""

from lightning_tune.presets.checkpointing import (
    ActivationCheckpointing,
    CheckpointEntry,
    CheckpointResult,
    checkpoint_blocks,
)
from lightning_tune.presets.compile import COMPILE_MODES, CompileResult, TorchCompile, compile_modules
from lightning_tune.presets.deepspeed import (
    ZERO_STAGES,
    DeepSpeedSettings,
    build_strategy,
    deepspeed_settings,
    deepspeed_strategy,
)

__all__ = [
    "ActivationCheckpointing",
    "COMPILE_MODES",
    "CheckpointEntry",
    "CheckpointResult",
    "CompileResult",
    "DeepSpeedSettings",
    "TorchCompile",
    "ZERO_STAGES",
    "build_strategy",
    "checkpoint_blocks",
    "compile_modules",
    "deepspeed_settings",
    "deepspeed_strategy",
]
