"""Every key lightning_tune logs, spelled once: the callbacks log these names and ``report`` and ``bench`` read them.

``perf/...`` keys are measurements, ``tune/...`` keys decisions. ``docs/logged_keys.md`` says who logs each, when, and
what it means; a test checks that table against :data:`ALL`. Templates hold ``{q}`` (a percentile: ``50``, ``99.9``),
``{i}`` (a parameter group), ``{j}`` (an optimizer) or ``{stage}`` (``"val"`` or ``"predict"``).

Example:
    >>> STEP_MS.format(q=95), lr(0, 0), lr(0, 1), lr(1, 0), bool(pattern(BATCH_MS).match("perf/val/batch_ms_p99.9"))
    ('perf/train/step_ms_p95', 'tune/lr', 'tune/lr/pg1', 'tune/lr/opt1/pg0', True)
"""

from __future__ import annotations

import re

PREFIXES = ("perf/", "tune/")
STAGES = ("val", "predict")

# ThroughputLatencyMonitor: training (``perf/train/`` + a figure of :class:`~lightning_tune.perf.stats.StepStats`)
TRAIN = "perf/train/"
SAMPLES_PER_SEC = "perf/train/samples_per_sec"
TOKENS_PER_SEC = "perf/train/tokens_per_sec"
BATCHES_PER_SEC = "perf/train/batches_per_sec"
STEP_MS = "perf/train/step_ms_p{q}"
STEP_MS_MAX = "perf/train/step_ms_max"
DATA_WAIT_FRAC = "perf/train/data_wait_frac"
PADDING_FRAC = "perf/train/padding_frac"
MFU = "perf/train/mfu"
HFU = "perf/train/hfu"
STRAGGLER_RATIO = "perf/train/straggler_ratio"
# ThroughputLatencyMonitor: each validation and predict run
BATCH_MS = "perf/{stage}/batch_ms_p{q}"
SAMPLE_MS = "perf/{stage}/sample_ms_p{q}"
STAGE_SAMPLES_PER_SEC = "perf/{stage}/samples_per_sec"
STAGE_TOKENS_PER_SEC = "perf/{stage}/tokens_per_sec"
STAGE_MFU = "perf/{stage}/mfu"
OVER_BUDGET_FRAC = "perf/{stage}/over_budget_frac"
# ThroughputLatencyMonitor: the device (``perf/`` + a figure of :mod:`lightning_tune.perf.devices`)
DEVICE = "perf/"
VRAM_ALLOCATED_GIB = "perf/vram_allocated_gib"
VRAM_RESERVED_GIB = "perf/vram_reserved_gib"
VRAM_PEAK_GIB = "perf/vram_peak_gib"
VRAM_USED_FRAC = "perf/vram_used_frac"
ALLOC_RETRIES = "perf/alloc_retries"
GPU_UTIL_PCT = "perf/gpu_util_pct"
GPU_MEM_BW_PCT = "perf/gpu_mem_bw_pct"
# the schedules and AdaptiveLROnPlateau
LR = "tune/lr"
LR_GROUP = "tune/lr/pg{i}"
LR_OPTIMIZER_GROUP = "tune/lr/opt{j}/pg{i}"
PLATEAU_REDUCTIONS = "tune/plateau/reductions"
PLATEAU_BAD_EVALS = "tune/plateau/bad_evals"
# OptimizerSwap
OPTIMIZER_STATE_BYTES = "tune/optimizer_state_bytes"
# DynamicBatchSize
BATCH_SIZE = "tune/batch_size"
ACCUMULATE_GRAD_BATCHES = "tune/accumulate_grad_batches"
EFFECTIVE_BATCH_SIZE = "tune/effective_batch_size"
MICRO_BATCH_TOKENS = "tune/micro_batch_tokens"
PREDICTED_VRAM_FRAC = "tune/predicted_vram_frac"
OOM_RECOVERIES = "tune/oom_recoveries"
EVAL_BATCH_SIZE = "tune/eval_batch_size"

#: Every key as ``docs/logged_keys.md`` lists it: templates keep ``{q}``, ``{i}`` and ``{j}``; ``{stage}`` is filled in.
ALL: tuple[str, ...] = tuple(
    key.replace("{stage}", stage)
    for name, key in list(globals().items())
    if name.isupper() and isinstance(key, str) and key.startswith(PREFIXES) and not key.endswith("/")
    for stage in (STAGES if "{stage}" in key else ("",))
)
_PLACEHOLDERS = {"{q}": r"\d+(?:\.\d+)?", "{i}": r"\d+", "{j}": r"[1-9]\d*", "{stage}": "(?:val|predict)"}


def pattern(template: str) -> re.Pattern[str]:
    """A regular expression that matches exactly the keys a key or template stands for."""
    regex = re.escape(template)
    for placeholder, part in _PLACEHOLDERS.items():
        regex = regex.replace(re.escape(placeholder), part)
    return re.compile(regex + "$")


def lr(optimizer_index: int, group_index: int) -> str:
    """The key of one parameter group's learning rate: :data:`LR`, :data:`LR_GROUP` or :data:`LR_OPTIMIZER_GROUP`."""
    if optimizer_index == 0:
        return LR_GROUP.format(i=group_index) if group_index else LR
    return LR_OPTIMIZER_GROUP.format(j=optimizer_index, i=group_index)
