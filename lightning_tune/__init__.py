"""lightning_tune: callbacks and a Trainer plugin that make an existing LightningModule train faster and fit larger.

Add them to a ``Trainer``; the module itself is not edited::

    import lightning_tune as lt
    trainer = Trainer(callbacks=[lt.WarmupCosine(warmup_ratio=0.05), lt.AdaptiveLROnPlateau(monitor="val_loss")])
"""

from lightning_tune.batch import SimulatedMemory
from lightning_tune.callbacks import (
    ActivationCheckpointing,
    AdaptiveLROnPlateau,
    AttentionSwap,
    DynamicBatchSize,
    LinearWarmup,
    OneCycle,
    OptimizerSwap,
    ThroughputLatencyMonitor,
    TorchCompile,
    WarmupCosine,
)
from lightning_tune.config import InitialLR, TrainingConfig, from_config
from lightning_tune.lr import ScheduleLR, scale_lr
from lightning_tune.plan import (
    MODEL_SHAPES,
    MemoryEstimate,
    TransformerShape,
    ZeroPlan,
    estimate_memory,
    measure_memory,
    plan_zero,
)
from lightning_tune.plugins import TunePlugin, deepspeed_strategy

try:
    from importlib.metadata import PackageNotFoundError, version

    __version__ = version("lightning-tune")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0.0.0+unknown"

__all__ = [
    "ActivationCheckpointing",
    "AdaptiveLROnPlateau",
    "AttentionSwap",
    "DynamicBatchSize",
    "InitialLR",
    "LinearWarmup",
    "MODEL_SHAPES",
    "MemoryEstimate",
    "OneCycle",
    "OptimizerSwap",
    "ScheduleLR",
    "SimulatedMemory",
    "ThroughputLatencyMonitor",
    "TorchCompile",
    "TrainingConfig",
    "TransformerShape",
    "TunePlugin",
    "WarmupCosine",
    "ZeroPlan",
    "__version__",
    "deepspeed_strategy",
    "estimate_memory",
    "from_config",
    "measure_memory",
    "plan_zero",
    "scale_lr",
]
