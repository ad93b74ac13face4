"""Learning-rate engine: schedules as factor functions of the step, their scheduler, plateau detection, scaling."""

from lightning_tune.lr.plateau import PlateauDetector
from lightning_tune.lr.scaling import scale_lr
from lightning_tune.lr.scheduler import ScheduleLR
from lightning_tune.lr.schedules import (
    linear_warmup,
    linear_warmup_lr,
    one_cycle,
    one_cycle_lr,
    one_cycle_momentum,
    warmup_cosine,
    warmup_cosine_lr,
    warmup_polynomial,
    warmup_polynomial_lr,
    warmup_stable_decay,
    warmup_stable_decay_lr,
)

__all__ = [
    "PlateauDetector",
    "ScheduleLR",
    "linear_warmup",
    "linear_warmup_lr",
    "one_cycle",
    "one_cycle_lr",
    "one_cycle_momentum",
    "scale_lr",
    "warmup_cosine",
    "warmup_cosine_lr",
    "warmup_polynomial",
    "warmup_polynomial_lr",
    "warmup_stable_decay",
    "warmup_stable_decay_lr",
]
