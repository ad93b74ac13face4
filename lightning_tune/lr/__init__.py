"""Learning-rate engine: pure schedules, plateau detection, batch-size scaling and the torch scheduler adapter."""

from lightning_tune.lr.plateau import PlateauDetector
from lightning_tune.lr.scaling import scale_lr
from lightning_tune.lr.scheduler import ScheduleLR
from lightning_tune.lr.schedules import (
    LinearWarmupSchedule,
    OneCycleSchedule,
    Schedule,
    WarmupCosineSchedule,
    WarmupPolynomialSchedule,
    WarmupStableDecaySchedule,
    linear_warmup_lr,
    one_cycle_lr,
    one_cycle_momentum,
    warmup_cosine_lr,
    warmup_polynomial_lr,
    warmup_stable_decay_lr,
)

__all__ = [
    "LinearWarmupSchedule",
    "OneCycleSchedule",
    "PlateauDetector",
    "Schedule",
    "ScheduleLR",
    "WarmupCosineSchedule",
    "WarmupPolynomialSchedule",
    "WarmupStableDecaySchedule",
    "linear_warmup_lr",
    "one_cycle_lr",
    "one_cycle_momentum",
    "scale_lr",
    "warmup_cosine_lr",
    "warmup_polynomial_lr",
    "warmup_stable_decay_lr",
]
