"""Memory planning on any machine: what a training run holds, what batch fits a GPU, which ZeRO stage it needs.

:func:`estimate_memory` plans from a transformer's shape, :func:`measure_memory` from one step of any module on fake
tensors; both return a :class:`MemoryEstimate`, which :func:`plan_zero` turns into the least-sharding ZeRO setup.
"""

from typing import TYPE_CHECKING

from lightning_tune._lazy import lazy_exports as _lazy_exports
from lightning_tune.plan.estimate import MemoryEstimate, estimate_memory
from lightning_tune.plan.shapes import MODEL_SHAPES, TransformerShape, from_hf_config, get_shape
from lightning_tune.plan.zero import ZeroPlan, plan_zero

if TYPE_CHECKING:
    from lightning_tune.plan.measured import measure_memory

# measure_memory needs torch, which the analytic planner (and `lightning-tune calc`) does without
__getattr__, __dir__ = _lazy_exports(__name__, {"measure_memory": "lightning_tune.plan.measured"})

__all__ = [
    "MODEL_SHAPES",
    "MemoryEstimate",
    "TransformerShape",
    "ZeroPlan",
    "estimate_memory",
    "from_hf_config",
    "get_shape",
    "measure_memory",
    "plan_zero",
]
