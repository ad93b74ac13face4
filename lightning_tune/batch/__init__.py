"""The engine behind :class:`~lightning_tune.DynamicBatchSize`.

Memory probes, the memory model, the control law, the resizable batch sampler, batch splitting, the micro-batch
runner and the step policy (:class:`DynamicStep`); none of it knows about the Trainer.
"""

from lightning_tune.batch.control import BatchSizeController, Decision
from lightning_tune.batch.logs import StepLogs
from lightning_tune.batch.memory import MemoryModel
from lightning_tune.batch.probes import (
    FAILURE_KINDS,
    CudaMemory,
    MemoryProbe,
    SimulatedMemory,
    TrackedMemory,
    expandable_segments,
)
from lightning_tune.batch.runner import (
    ALLOCATION_FAILURE_MESSAGES,
    MicroBatch,
    MicroBatchRunner,
    StepOutcome,
    all_reduce_max,
    cut_step,
    is_allocation_failure,
    step_with_retry,
)
from lightning_tune.batch.sampler import ResizableBatchSampler
from lightning_tune.batch.search import SEARCH_MODES, BatchSizeSearch, find_batch_size
from lightning_tune.batch.split import split_batch, split_sizes
from lightning_tune.batch.step import DynamicStep, IntervalFigures, SizePolicy
from lightning_tune.batch.tokens import TokenBudget

__all__ = [
    "ALLOCATION_FAILURE_MESSAGES",
    "BatchSizeController",
    "BatchSizeSearch",
    "CudaMemory",
    "Decision",
    "DynamicStep",
    "FAILURE_KINDS",
    "IntervalFigures",
    "MemoryModel",
    "MemoryProbe",
    "MicroBatch",
    "MicroBatchRunner",
    "ResizableBatchSampler",
    "SEARCH_MODES",
    "SimulatedMemory",
    "SizePolicy",
    "StepLogs",
    "StepOutcome",
    "TokenBudget",
    "TrackedMemory",
    "all_reduce_max",
    "cut_step",
    "expandable_segments",
    "find_batch_size",
    "is_allocation_failure",
    "split_batch",
    "split_sizes",
    "step_with_retry",
]
