"""The engine behind :class:`~lightning_tune.DynamicBatchSize`.

Memory probes, the memory model, the control law, the resizable batch sampler and batch splitting; none of it knows
about the Trainer.
"""

from lightning_tune.batch.control import BatchSizeController, Decision
from lightning_tune.batch.memory import MemoryModel
from lightning_tune.batch.probes import CudaMemory, MemoryProbe, SimulatedMemory
from lightning_tune.batch.sampler import ResizableBatchSampler
from lightning_tune.batch.split import split_batch, split_sizes

__all__ = [
    "BatchSizeController",
    "CudaMemory",
    "Decision",
    "MemoryModel",
    "MemoryProbe",
    "ResizableBatchSampler",
    "SimulatedMemory",
    "split_batch",
    "split_sizes",
]
