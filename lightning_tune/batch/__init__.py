"""The engine behind :class:`~lightning_tune.DynamicBatchSize`.

Memory probes, the memory model, the control law, the resizable batch sampler, batch splitting, the micro-batch runner
and the step policy (:class:`DynamicStep`), each importable from its own module; none of it knows about the Trainer.
"""

from lightning_tune.batch.control import BatchSizeController
from lightning_tune.batch.probes import CudaMemory, SimulatedMemory, TrackedMemory
from lightning_tune.batch.runner import ALLOCATION_FAILURE_MESSAGES
from lightning_tune.batch.search import find_batch_size
from lightning_tune.batch.step import DynamicBatchSettings, DynamicStep

__all__ = [
    "ALLOCATION_FAILURE_MESSAGES",
    "BatchSizeController",
    "CudaMemory",
    "DynamicBatchSettings",
    "DynamicStep",
    "SimulatedMemory",
    "TrackedMemory",
    "find_batch_size",
]
