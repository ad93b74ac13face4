"""Trainer plugins of lightning_tune, and the DeepSpeed ZeRO strategy built from a memory plan."""

from lightning_tune.plugins.deepspeed import DeepSpeedSettings, build_strategy, deepspeed_settings, deepspeed_strategy
from lightning_tune.plugins.tune import TunePlugin

__all__ = [
    "DeepSpeedSettings",
    "TunePlugin",
    "build_strategy",
    "deepspeed_settings",
    "deepspeed_strategy",
]
