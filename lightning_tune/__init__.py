"""lightning_tune: callbacks and a Trainer plugin that make an existing LightningModule train faster and fit larger.

Add them to a ``Trainer``; the module itself is not edited::

    import lightning_tune as lt
    trainer = Trainer(callbacks=[lt.WarmupCosine(warmup_ratio=0.05), lt.AdaptiveLROnPlateau(monitor="val_loss")])

The names are imported on first use, so ``import lightning_tune`` (and ``lightning-tune --version`` or ``calc``)
loads neither torch nor Lightning until something needs them.
"""

from typing import TYPE_CHECKING

from lightning_tune._lazy import lazy_exports as _lazy_exports

if TYPE_CHECKING:  # the same names, for type checkers: `X as X` marks each as re-exported
    from lightning_tune.batch import (
        SimulatedMemory as SimulatedMemory,
        TrackedMemory as TrackedMemory,
        find_batch_size as find_batch_size,
    )
    from lightning_tune.callbacks import (
        ActivationCheckpointing as ActivationCheckpointing,
        AdaptiveLROnPlateau as AdaptiveLROnPlateau,
        AttentionSwap as AttentionSwap,
        DynamicBatchSize as DynamicBatchSize,
        LinearWarmup as LinearWarmup,
        LossSwap as LossSwap,
        OneCycle as OneCycle,
        OptimizerSwap as OptimizerSwap,
        ThroughputLatencyMonitor as ThroughputLatencyMonitor,
        TorchCompile as TorchCompile,
        WarmupCosine as WarmupCosine,
        WarmupPolynomial as WarmupPolynomial,
        WarmupStableDecay as WarmupStableDecay,
    )
    from lightning_tune.config import (
        InitialLR as InitialLR,
        TrainingConfig as TrainingConfig,
        from_config as from_config,
    )
    from lightning_tune.lr import ScheduleLR as ScheduleLR, scale_lr as scale_lr
    from lightning_tune.plan import (
        MODEL_SHAPES as MODEL_SHAPES,
        MemoryEstimate as MemoryEstimate,
        TransformerShape as TransformerShape,
        ZeroPlan as ZeroPlan,
        estimate_memory as estimate_memory,
        measure_memory as measure_memory,
        plan_zero as plan_zero,
    )
    from lightning_tune.plugins import TunePlugin as TunePlugin, deepspeed_strategy as deepspeed_strategy
    from lightning_tune.swaps import linear_cross_entropy as linear_cross_entropy

#: Where each public name is defined, imported from there on first use.
_ORIGINS = {
    "ActivationCheckpointing": "lightning_tune.callbacks",
    "AdaptiveLROnPlateau": "lightning_tune.callbacks",
    "AttentionSwap": "lightning_tune.callbacks",
    "DynamicBatchSize": "lightning_tune.callbacks",
    "InitialLR": "lightning_tune.config",
    "LinearWarmup": "lightning_tune.callbacks",
    "LossSwap": "lightning_tune.callbacks",
    "MODEL_SHAPES": "lightning_tune.plan",
    "MemoryEstimate": "lightning_tune.plan",
    "OneCycle": "lightning_tune.callbacks",
    "OptimizerSwap": "lightning_tune.callbacks",
    "ScheduleLR": "lightning_tune.lr",
    "SimulatedMemory": "lightning_tune.batch",
    "ThroughputLatencyMonitor": "lightning_tune.callbacks",
    "TorchCompile": "lightning_tune.callbacks",
    "TrackedMemory": "lightning_tune.batch",
    "TrainingConfig": "lightning_tune.config",
    "TransformerShape": "lightning_tune.plan",
    "TunePlugin": "lightning_tune.plugins",
    "WarmupCosine": "lightning_tune.callbacks",
    "WarmupPolynomial": "lightning_tune.callbacks",
    "WarmupStableDecay": "lightning_tune.callbacks",
    "ZeroPlan": "lightning_tune.plan",
    "deepspeed_strategy": "lightning_tune.plugins",
    "estimate_memory": "lightning_tune.plan",
    "find_batch_size": "lightning_tune.batch",
    "from_config": "lightning_tune.config",
    "linear_cross_entropy": "lightning_tune.swaps",
    "measure_memory": "lightning_tune.plan",
    "plan_zero": "lightning_tune.plan",
    "scale_lr": "lightning_tune.lr",
}
if not TYPE_CHECKING:  # type checkers read the imports above, so a misspelt name is an error there
    __getattr__, __dir__ = _lazy_exports(__name__, _ORIGINS)

try:
    from importlib.metadata import PackageNotFoundError, version

    __version__ = version("lightning-tune")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0.0.0+unknown"

__all__ = sorted([*_ORIGINS, "__version__"])
