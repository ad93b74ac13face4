"""Lightning callbacks of lightning_tune."""

from lightning_tune.callbacks.dynamic_batch import DynamicBatchSize
from lightning_tune.callbacks.lr_plateau import AdaptiveLROnPlateau
from lightning_tune.callbacks.lr_schedule import (
    LinearWarmup,
    OneCycle,
    ScheduleCallback,
    WarmupCosine,
    WarmupDecay,
    WarmupPolynomial,
    WarmupStableDecay,
)
from lightning_tune.callbacks.optimizer_swap import OptimizerSwap
from lightning_tune.callbacks.surgery import (
    ActivationCheckpointing,
    AttentionSwap,
    LossSwap,
    SurgeryCallback,
    TorchCompile,
)
from lightning_tune.callbacks.throughput import ThroughputLatencyMonitor

__all__ = [
    "ActivationCheckpointing",
    "AdaptiveLROnPlateau",
    "AttentionSwap",
    "DynamicBatchSize",
    "LinearWarmup",
    "LossSwap",
    "OneCycle",
    "OptimizerSwap",
    "ScheduleCallback",
    "SurgeryCallback",
    "ThroughputLatencyMonitor",
    "TorchCompile",
    "WarmupCosine",
    "WarmupDecay",
    "WarmupPolynomial",
    "WarmupStableDecay",
]
