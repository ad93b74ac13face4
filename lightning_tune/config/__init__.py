"""Training configuration files (YAML or dicts) to Trainer arguments, callbacks and plugins.

``from_config("train.yaml")`` reads the ``training:`` section of tuning guides and returns a :class:`TrainingConfig`;
``Trainer(**config.trainer_kwargs())`` applies it.
"""

from lightning_tune.config.initial_lr import InitialLR
from lightning_tune.config.loader import from_config
from lightning_tune.config.training import TrainingConfig

__all__ = ["InitialLR", "TrainingConfig", "from_config"]
