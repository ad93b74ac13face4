"""Memory planning on any machine: what a training run holds, what batch fits a GPU, which ZeRO stage it needs.

Two ways to get a :class:`MemoryEstimate`:

- :func:`estimate_memory`, analytic, from a transformer's shape (a name in :data:`MODEL_SHAPES`, a Hugging Face
  ``config.json`` or a :class:`TransformerShape`): no model is built;
- :func:`measure_memory`, measured, from one training step of any ``nn.Module`` or LightningModule on fake tensors:
  no memory of the model's size is used, so a CPU-only machine can plan a GPU run.

:func:`plan_zero` turns an estimate into the least-sharding DeepSpeed ZeRO configuration that fits.
"""

from typing import TYPE_CHECKING

from lightning_tune._lazy import lazy_exports as _lazy_exports
from lightning_tune.plan.analytic import estimate_memory, lora_parameters, resolve_model
from lightning_tune.plan.estimate import (
    MARGIN_RESERVE,
    MARGINS,
    PLAN_MODES,
    PLAN_PRECISIONS,
    Margin,
    MemoryEstimate,
    PlanMode,
    format_bytes,
)
from lightning_tune.plan.shapes import (
    FAMILIES,
    HF_MODEL_TYPES,
    MODEL_SHAPES,
    TransformerShape,
    from_hf_config,
    get_shape,
)
from lightning_tune.plan.zero import ZeroPlan, plan_zero

if TYPE_CHECKING:
    from lightning_tune.plan.measured import measure_memory

# measure_memory needs torch, which the analytic planner (and `lightning-tune calc`) does without
__getattr__, __dir__ = _lazy_exports(__name__, {"measure_memory": "lightning_tune.plan.measured"})

__all__ = [
    "FAMILIES",
    "HF_MODEL_TYPES",
    "MARGINS",
    "MARGIN_RESERVE",
    "MODEL_SHAPES",
    "Margin",
    "MemoryEstimate",
    "PLAN_MODES",
    "PLAN_PRECISIONS",
    "PlanMode",
    "TransformerShape",
    "ZeroPlan",
    "estimate_memory",
    "format_bytes",
    "from_hf_config",
    "get_shape",
    "lora_parameters",
    "measure_memory",
    "plan_zero",
    "resolve_model",
]
