"""Training configuration files (YAML or dicts) to Trainer arguments, callbacks and plugins.

``from_config("train.yaml")`` reads the ``training:`` section of tuning guides (precision, batch sizes, learning-rate
schedule, 8-bit optimizer, attention kernel, activation checkpointing, ``torch.compile``, DataLoader settings, CPU
offload) and returns a :class:`TrainingConfig`; ``Trainer(**config.trainer_kwargs())`` applies it.
"""

from lightning_tune.config.initial_lr import InitialLR
from lightning_tune.config.loader import KEYS, from_config, load_config
from lightning_tune.config.precision import lightning_precision
from lightning_tune.config.training import TrainingConfig

__all__ = ["InitialLR", "KEYS", "TrainingConfig", "from_config", "lightning_precision", "load_config"]
