"""Choose a DeepSpeed ZeRO configuration from a memory plan: the least sharding that fits.

Per-GPU bytes follow the ZeRO paper (Rajbhandari et al. 2020) and DeepSpeed's own estimators; ``docs/planner.md`` has
the table of configurations, tried in order (sharding before offloading), the first that fits after the margin chosen.

Example:
    >>> from lightning_tune.plan.estimate import estimate_memory
    >>> estimate = estimate_memory("llama-2-7b", sequence_length=2048, gradient_checkpointing=True)  # bf16-mixed
    >>> plan = plan_zero(estimate, gpu_memory_bytes=80 * 2**30, num_gpus=8, batch_size=4)
    >>> plan.stage, plan.offload_optimizer, plan.offload_parameters
    (1, False, False)
    >>> one_gpu = plan_zero(estimate, gpu_memory_bytes=80 * 2**30, num_gpus=1, batch_size=4)
    >>> one_gpu.stage, one_gpu.offload_optimizer, format_bytes(one_gpu.per_gpu_bytes)
    (2, True, '18.29 GiB')
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from lightning_tune._validation import check_bool, check_instance, check_int, check_str
from lightning_tune.plan.estimate import Margin, MemoryEstimate, format_bytes


@dataclass(frozen=True)
class ZeroPlan:
    """A DeepSpeed ZeRO configuration and what it needs per GPU.

    The first three fields are the arguments of Lightning's ``DeepSpeedStrategy`` of the same names.

    Attributes:
        stage: ZeRO stage, 0-3 (0: no sharding, plain data parallel).
        offload_optimizer: Keep optimizer state (and master weights) in CPU memory and step it there.
        offload_parameters: Keep the weights in CPU memory too (stage 3 only).
        per_gpu_bytes: Predicted peak on each GPU at the planned batch size.
        reason: One sentence on why this configuration, with the figures.
        fits: Whether ``per_gpu_bytes`` fits the budget after the margin; ``False`` only when nothing does, and
            then the plan is the most memory-saving configuration.
        num_gpus: GPUs the plan shards over.
        batch_size: Micro-batch per GPU the plan is for.
    """

    stage: int
    offload_optimizer: bool
    offload_parameters: bool
    per_gpu_bytes: int
    reason: str
    fits: bool = True
    num_gpus: int = 1
    batch_size: int = 1

    def __post_init__(self) -> None:
        check_int("stage", self.stage, minimum=0, maximum=3)
        check_bool("offload_optimizer", self.offload_optimizer)
        check_bool("offload_parameters", self.offload_parameters)
        check_int("per_gpu_bytes", self.per_gpu_bytes, minimum=0)
        check_str("reason", self.reason)
        check_bool("fits", self.fits)
        check_int("num_gpus", self.num_gpus, minimum=1)
        check_int("batch_size", self.batch_size, minimum=1)
        if self.offload_optimizer and self.stage == 0:
            raise ValueError("`offload_optimizer=True` needs a ZeRO stage of 1 to 3, got stage=0")
        if self.offload_parameters and (self.stage != 3 or not self.offload_optimizer):
            raise ValueError(
                "`offload_parameters=True` needs stage=3 and offload_optimizer=True, got "
                f"stage={self.stage} and offload_optimizer={self.offload_optimizer}"
            )


#: (stage, offload_optimizer, offload_parameters), in the order tried: every stage, then offloading.
_CONFIGS: Final = [(stage, False, False) for stage in range(4)] + [(2, True, False), (3, True, False), (3, True, True)]


def zero_bytes(
    estimate: MemoryEstimate, stage: int, offload_optimizer: bool, offload_parameters: bool, num_gpus: int, batch: int
) -> int:
    """Per-GPU bytes of one ZeRO configuration (the table in ``docs/planner.md``), ``batch`` samples per GPU."""
    w, g = estimate.weight_bytes, estimate.gradient_bytes
    o = estimate.optimizer_bytes + estimate.master_weight_bytes
    f = estimate.master_weight_bytes  # the float32 gradient partition of a mixed-precision step
    per_param = (w + g) / max(estimate.parameters, 1)
    largest = int(per_param * (estimate.largest_layer_parameters or 0))
    # Whatever else the fixed part holds (buffers, temporaries of a measured step) stays on every GPU.
    other = max(0, estimate.fixed_bytes - estimate.state_bytes)
    activations = estimate.bytes_per_sample * batch + other
    if offload_parameters:
        states = largest
    elif offload_optimizer:
        states = w // num_gpus + largest if stage == 3 else w
    else:
        states = {
            0: w + g + o,
            1: w + g + (f + o) // num_gpus,
            2: w + (g + f + o) // num_gpus,
            3: (w + (f or g) + o) // num_gpus + largest,
        }[stage]
    return states + activations


def plan_zero(
    estimate: MemoryEstimate,
    *,
    gpu_memory_bytes: int,
    num_gpus: int = 1,
    batch_size: int = 1,
    margin: Margin = "optimal",
) -> ZeroPlan:
    """Pick the least-sharding DeepSpeed ZeRO configuration whose per-GPU memory fits.

    Args:
        estimate: The memory plan of one replica (from :func:`~lightning_tune.plan.estimate_memory` or
            :func:`~lightning_tune.plan.measure_memory`).
        gpu_memory_bytes: Memory of one GPU, in bytes.
        num_gpus: GPUs in the data-parallel group, >= 1.
        batch_size: Micro-batch per GPU, >= 1.
        margin: Share of each GPU kept back, as in :meth:`MemoryEstimate.max_batch_size`.

    Returns:
        The plan. When nothing fits, the most memory-saving configuration with ``fits=False`` and a reason saying
        by how much it misses.

    Raises:
        TypeError: If ``estimate`` is not a :class:`MemoryEstimate` or a count is not an integer.
        ValueError: If a count is out of range or ``margin`` is unknown.
    """
    check_instance("estimate", estimate, MemoryEstimate, "a MemoryEstimate")
    check_int("gpu_memory_bytes", gpu_memory_bytes, minimum=1)
    check_int("num_gpus", num_gpus, minimum=1)
    check_int("batch_size", batch_size, minimum=1)
    usable = estimate.usable_bytes(gpu_memory_bytes, margin)  # checks the margin
    gpus = "1 GPU" if num_gpus == 1 else f"{num_gpus} GPUs"
    where = f"{format_bytes(usable)} usable ({margin} margin) at batch {batch_size} on {gpus}"
    needed: list[str] = []
    for stage, offload_optimizer, offload_parameters in _CONFIGS:
        if num_gpus == 1 and stage in (1, 2, 3) and not offload_optimizer:
            continue  # nothing to shard over
        per_gpu = zero_bytes(estimate, stage, offload_optimizer, offload_parameters, num_gpus, batch_size)
        label = "no ZeRO sharding" if stage == 0 else f"ZeRO stage {stage}"
        if offload_parameters:
            label += " with optimizer and weights offloaded to CPU"
        elif offload_optimizer:
            label += " with the optimizer offloaded to CPU"
        if per_gpu <= usable:
            before = f"; {'; '.join(needed)}" if needed else ""
            reason = f"{label} needs {format_bytes(per_gpu)} per GPU of {where}{before}"
            break
        needed.append(f"{label} would need {format_bytes(per_gpu)}")
    else:  # the last configuration, the most memory-saving one
        reason = f"nothing fits: {label} still needs {format_bytes(per_gpu)} per GPU of {where}"
    fits = per_gpu <= usable
    return ZeroPlan(
        stage, offload_optimizer, offload_parameters, per_gpu, reason, fits, num_gpus=num_gpus, batch_size=batch_size
    )
