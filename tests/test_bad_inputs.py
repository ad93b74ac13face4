"""Every bad constructor argument fails at construction with a message naming the argument, the value and the rule."""

from __future__ import annotations

import re
from collections.abc import Callable
from functools import partial
from typing import Any

import pytest
import torch

import lightning_tune as lt
from lightning_tune._compat import check_lightning_version
from lightning_tune.batch import BatchSizeController
from lightning_tune.bench import LatencyBudget
from lightning_tune.callbacks import TorchCompile
from lightning_tune.config.precision import lightning_precision
from lightning_tune.demos import SyntheticTokenDataModule
from lightning_tune.lr import PlateauDetector, linear_warmup, one_cycle_lr, warmup_cosine_lr
from lightning_tune.lr.scheduler import ScheduleLR
from lightning_tune.plan import MemoryEstimate, TransformerShape, ZeroPlan, estimate_memory, measure_memory
from lightning_tune.swaps.compile import compile_modules
from lightning_tune.swaps.optimizer import swap_optimizers

_MAP = "a mapping of argument names to values"
_ZERO: dict[str, Any] = {
    "stage": 0,
    "offload_optimizer": False,
    "offload_parameters": False,
    "per_gpu_bytes": 1,
    "reason": "fits",
}
_WARMUP = partial(linear_warmup, warmup_steps=2)

CASES = [
    # WarmupCosine
    pytest.param(
        lambda: lt.WarmupCosine(-1),
        ValueError,
        "`warmup_steps` must be an integer >= 0, got -1",
        id="wc-negative-warmup",
    ),
    pytest.param(
        lambda: lt.WarmupCosine(2.5),
        TypeError,
        "`warmup_steps` must be an integer or None, got 2.5 (float)",
        id="wc-float-warmup",
    ),
    pytest.param(
        lambda: lt.WarmupCosine(10, total_steps=0),
        ValueError,
        "`total_steps` must be an integer >= 1, got 0",
        id="wc-zero-total",
    ),
    pytest.param(
        lambda: lt.WarmupCosine(10, total_steps=-5),
        ValueError,
        "`total_steps` must be an integer >= 1, got -5",
        id="wc-negative-total",
    ),
    pytest.param(
        lambda: lt.WarmupCosine(100, total_steps=50),
        ValueError,
        "`warmup_steps` must be smaller than `total_steps` (50), got 100",
        id="wc-warmup-longer-than-total",
    ),
    pytest.param(
        lambda: lt.WarmupCosine(50, total_steps=50),
        ValueError,
        "`warmup_steps` must be smaller than `total_steps` (50), got 50",
        id="wc-warmup-equals-total",
    ),
    pytest.param(
        lambda: lt.WarmupCosine(10, warmup_ratio=0.1),
        ValueError,
        "give at most one of `warmup_steps` and `warmup_ratio` (neither: a warm-up of 2% of the run), got "
        "warmup_steps=10 and warmup_ratio=0.1",
        id="wc-both-warmups",
    ),
    pytest.param(
        lambda: lt.WarmupCosine(warmup_ratio=1.0),
        ValueError,
        "`warmup_ratio` must be in [0, 1), got 1.0",
        id="wc-ratio-one",
    ),
    pytest.param(
        lambda: lt.WarmupCosine(warmup_ratio=-0.1),
        ValueError,
        "`warmup_ratio` must be in [0, 1), got -0.1",
        id="wc-ratio-negative",
    ),
    pytest.param(
        lambda: lt.WarmupCosine(1, min_lr=-1e-5),
        ValueError,
        "`min_lr` must be in [0, inf], got -1e-05",
        id="wc-negative-min-lr",
    ),
    pytest.param(
        lambda: lt.WarmupCosine(1, min_lr=float("nan")),
        ValueError,
        "`min_lr` must be a finite number, got nan",
        id="wc-nan-min-lr",
    ),
    pytest.param(
        lambda: lt.WarmupCosine(1, replace="yes"),
        TypeError,
        "`replace` must be True or False, got 'yes' (str)",
        id="wc-replace-type",
    ),
    # LinearWarmup
    pytest.param(lambda: lt.LinearWarmup(0), ValueError, "`warmup_steps` must be an integer >= 1, got 0", id="lw-zero"),
    pytest.param(
        lambda: lt.LinearWarmup(-3), ValueError, "`warmup_steps` must be an integer >= 1, got -3", id="lw-negative"
    ),
    pytest.param(
        lambda: lt.LinearWarmup(True), TypeError, "`warmup_steps` must be an integer, got True (bool)", id="lw-bool"
    ),
    # OneCycle
    pytest.param(lambda: lt.OneCycle(0.0), ValueError, "`max_lr` must be in (0, inf], got 0.0", id="oc-zero-max-lr"),
    pytest.param(
        lambda: lt.OneCycle([0.1, -0.2]),
        ValueError,
        "`max_lr[1]` must be in (0, inf], got -0.2",
        id="oc-negative-group-max-lr",
    ),
    pytest.param(
        lambda: lt.OneCycle("0.1"), TypeError, "`max_lr` must be a number, got '0.1' (str)", id="oc-str-max-lr"
    ),
    pytest.param(
        lambda: lt.OneCycle(0.1, pct_start=0.0), ValueError, "`pct_start` must be in (0, 1), got 0.0", id="oc-pct-zero"
    ),
    pytest.param(
        lambda: lt.OneCycle(0.1, pct_start=1.0), ValueError, "`pct_start` must be in (0, 1), got 1.0", id="oc-pct-one"
    ),
    pytest.param(
        lambda: lt.OneCycle(0.1, pct_start=0.6, three_phase=True),
        ValueError,
        "`pct_start` must be in (0, 0.5) with `three_phase=True`, got 0.6",
        id="oc-pct-three-phase",
    ),
    pytest.param(
        lambda: lt.OneCycle(0.1, anneal_strategy="cosine"),
        ValueError,
        "`anneal_strategy` must be one of 'cos', 'linear', got 'cosine'",
        id="oc-unknown-anneal",
    ),
    pytest.param(
        lambda: lt.OneCycle(0.1, div_factor=0),
        ValueError,
        "`div_factor` must be in (0, inf], got 0",
        id="oc-div-factor",
    ),
    pytest.param(
        lambda: lt.OneCycle(0.1, final_div_factor=-1.0),
        ValueError,
        "`final_div_factor` must be in (0, inf], got -1.0",
        id="oc-final-div-factor",
    ),
    pytest.param(
        lambda: lt.OneCycle(0.1, total_steps=0),
        ValueError,
        "`total_steps` must be an integer >= 1, got 0",
        id="oc-zero-total",
    ),
    pytest.param(
        lambda: lt.OneCycle(0.1, base_momentum=0.96),
        ValueError,
        "`base_momentum` must not exceed `max_momentum` (0.95), got 0.96",
        id="oc-momenta-order",
    ),
    pytest.param(
        lambda: lt.OneCycle(0.1, max_momentum=1.0),
        ValueError,
        "`max_momentum` must be in [0, 1), got 1.0",
        id="oc-momentum-one",
    ),
    # AdaptiveLROnPlateau
    pytest.param(
        lambda: lt.AdaptiveLROnPlateau(factor=1.0),
        ValueError,
        "`factor` must be in (0, 1), got 1.0",
        id="pl-factor-one",
    ),
    pytest.param(
        lambda: lt.AdaptiveLROnPlateau(factor=0.0),
        ValueError,
        "`factor` must be in (0, 1), got 0.0",
        id="pl-factor-zero",
    ),
    pytest.param(
        lambda: lt.AdaptiveLROnPlateau(factor=1.5),
        ValueError,
        "`factor` must be in (0, 1), got 1.5",
        id="pl-factor-above-one",
    ),
    pytest.param(
        lambda: lt.AdaptiveLROnPlateau(mode="minimum"),
        ValueError,
        "`mode` must be one of 'min', 'max', got 'minimum'",
        id="pl-unknown-mode",
    ),
    pytest.param(
        lambda: lt.AdaptiveLROnPlateau(threshold_mode="relative"),
        ValueError,
        "`threshold_mode` must be one of 'rel', 'abs', got 'relative'",
        id="pl-unknown-threshold-mode",
    ),
    pytest.param(
        lambda: lt.AdaptiveLROnPlateau(patience=-1),
        ValueError,
        "`patience` must be an integer >= 0, got -1",
        id="pl-negative-patience",
    ),
    pytest.param(
        lambda: lt.AdaptiveLROnPlateau(cooldown=-2),
        ValueError,
        "`cooldown` must be an integer >= 0, got -2",
        id="pl-negative-cooldown",
    ),
    pytest.param(
        lambda: lt.AdaptiveLROnPlateau(threshold=-0.1),
        ValueError,
        "`threshold` must be in [0, inf], got -0.1",
        id="pl-negative-threshold",
    ),
    pytest.param(
        lambda: lt.AdaptiveLROnPlateau(min_lr=-1.0),
        ValueError,
        "`min_lr` must be in [0, inf], got -1.0",
        id="pl-negative-min-lr",
    ),
    pytest.param(
        lambda: lt.AdaptiveLROnPlateau(min_lr=[1e-6, -1.0]),
        ValueError,
        "`min_lr[1]` must be in [0, inf], got -1.0",
        id="pl-negative-group-min-lr",
    ),
    pytest.param(
        lambda: lt.AdaptiveLROnPlateau(eps=-1e-9),
        ValueError,
        "`eps` must be in [0, inf], got -1e-09",
        id="pl-negative-eps",
    ),
    pytest.param(
        lambda: lt.AdaptiveLROnPlateau(monitor=""),
        TypeError,
        "`monitor` must be a non-empty metric name, got ''",
        id="pl-empty-monitor",
    ),
    pytest.param(
        lambda: lt.AdaptiveLROnPlateau(check_on_train_epoch_end=1),
        TypeError,
        "`check_on_train_epoch_end` must be True or False, got 1 (int)",
        id="pl-check-on-type",
    ),
    # scale_lr
    pytest.param(
        lambda: lt.scale_lr(1e-3, 32, 64, rule="cubic"),
        ValueError,
        "`rule` must be one of 'sqrt', 'linear', got 'cubic'",
        id="scale-unknown-rule",
    ),
    pytest.param(
        lambda: lt.scale_lr(1e-3, 0, 64),
        ValueError,
        "`old_batch_size` must be an integer >= 1, got 0",
        id="scale-zero-old",
    ),
    pytest.param(
        lambda: lt.scale_lr(1e-3, 32, 8.0),
        TypeError,
        "`new_batch_size` must be an integer, got 8.0 (float)",
        id="scale-float-new",
    ),
    pytest.param(
        lambda: lt.scale_lr(-1e-3, 32, 64), ValueError, "`lr` must be in [0, inf], got -0.001", id="scale-negative-lr"
    ),
    # engine classes
    pytest.param(
        lambda: warmup_cosine_lr(0, base_lr=0.1, warmup_steps=5, total_steps=5),
        ValueError,
        "`warmup_steps` must be smaller than `total_steps` (5), got 5",
        id="engine-warmup",
    ),
    pytest.param(
        lambda: one_cycle_lr(0, max_lr=0.1, total_steps=10, anneal_strategy="exp"),  # type: ignore[arg-type]
        ValueError,
        "`anneal_strategy` must be one of 'cos', 'linear', got 'exp'",
        id="engine-anneal",
    ),
    pytest.param(
        lambda: PlateauDetector(mode="low"),
        ValueError,
        "`mode` must be one of 'min', 'max', got 'low'",
        id="engine-mode",
    ),
    # DynamicBatchSize's budget and the simulated device
    pytest.param(
        lambda: lt.DynamicBatchSize(target_vram=0.99),
        ValueError,
        "`target_vram` must be in (0, 0.98], got 0.99",
        id="dbs-target-above-0.98",
    ),
    pytest.param(
        lambda: lt.DynamicBatchSize(reserve_gib="4"),
        TypeError,
        "`reserve_gib` must be a number, got '4' (str)",
        id="dbs-reserve-type",
    ),
    pytest.param(
        lambda: lt.DynamicBatchSize(agree_timeout=float("inf")),
        ValueError,
        "`agree_timeout` must be a finite number, got inf",
        id="dbs-agree-timeout-inf",
    ),
    pytest.param(
        lambda: lt.DynamicBatchSize(loss_weight="token"),
        ValueError,
        "`loss_weight` must be one of 'auto', 'samples', 'tokens', got 'token'",
        id="dbs-loss-weight",
    ),
    pytest.param(
        lambda: lt.DynamicBatchSize(label_shift=-1),
        ValueError,
        "`label_shift` must be an integer >= 0, got -1",
        id="dbs-label-shift",
    ),
    pytest.param(
        lambda: lt.DynamicBatchSize(trim_keys="loss_mask"),
        TypeError,
        "`trim_keys` must be a sequence of key names (strings), got 'loss_mask' (str)",
        id="dbs-trim-keys-str",
    ),
    pytest.param(
        lambda: lt.DynamicBatchSize(pad_to_multiple_of=0),
        ValueError,
        "`pad_to_multiple_of` must be an integer >= 1, got 0",
        id="dbs-pad-multiple",
    ),
    pytest.param(
        lambda: lt.DynamicBatchSize(size_eval="yes"),
        TypeError,
        "`size_eval` must be True or False, got 'yes' (str)",
        id="dbs-size-eval",
    ),
    pytest.param(
        lambda: lt.SimulatedMemory(100, 0, 1, eval_bytes_per_sample=0),
        ValueError,
        "`eval_bytes_per_sample` must be an integer >= 1, got 0",
        id="sim-eval-bytes",
    ),
    pytest.param(
        lambda: lt.SimulatedMemory(100, 0, 1, bytes_per_token=-1),
        ValueError,
        "`bytes_per_token` must be an integer >= 0, got -1",
        id="sim-bytes-per-token",
    ),
    pytest.param(
        lambda: lt.SimulatedMemory(100, 0, 1, fragmentation=1.0),
        ValueError,
        "`fragmentation` must be in [0, 1), got 1.0",
        id="sim-fragmentation",
    ),
    pytest.param(
        lambda: BatchSizeController(target=0.9, min_batch_size=1, max_batch_size=None, multiple_of=8, probe_growth=0.0),
        ValueError,
        "`probe_growth` must be in (0, inf], got 0.0",
        id="controller-probe-growth",
    ),
    pytest.param(
        lambda: lt.SimulatedMemory(100, 50, 1, outside_bytes=50),
        ValueError,
        "`fixed_bytes` + `outside_bytes` must be below `total_bytes` (100) so that a sample fits, got 50 + 50",
        id="sim-no-room",
    ),
    pytest.param(
        lambda: lt.SimulatedMemory(100, 0, 1, activations="graph"),
        ValueError,
        "`activations` must be one of 'micro_batch', 'tensors', got 'graph'",
        id="sim-activations",
    ),
    pytest.param(
        lambda: lt.SimulatedMemory(100, 0, 1, fail_as="nccl"),
        ValueError,
        "`fail_as` must be one of 'oom', 'cublas', 'cudnn', got 'nccl'",
        id="sim-fail-as",
    ),
    pytest.param(
        lambda: lt.SimulatedMemory(100, 0, 1, expandable_segments=1),
        TypeError,
        "`expandable_segments` must be True or False, got 1 (int)",
        id="sim-expandable-type",
    ),
    # the monitor's window and explicit peak
    pytest.param(
        lambda: lt.ThroughputLatencyMonitor(window=10**30),
        ValueError,
        "`window` must be an integer from 2 to 1000000, got 1000000000000000000000000000000",
        id="monitor-window-huge",
    ),
    pytest.param(
        lambda: lt.ThroughputLatencyMonitor(warmup_steps=-1),
        ValueError,
        "`warmup_steps` must be an integer >= 0, got -1",
        id="monitor-warmup-negative",
    ),
    pytest.param(
        lambda: lt.ThroughputLatencyMonitor(peak_flops=-1e12),
        ValueError,
        "`peak_flops` must be in (0, inf], got -1000000000000.0",
        id="monitor-peak-negative",
    ),
    # latency budgets: the monitor's and bench's
    pytest.param(
        lambda: lt.ThroughputLatencyMonitor(latency_budget_ms=0),
        ValueError,
        "`latency_budget_ms` must be in (0, inf], got 0",
        id="monitor-budget-zero",
    ),
    pytest.param(
        lambda: lt.ThroughputLatencyMonitor(latency_budget_ms=float("nan")),
        ValueError,
        "`latency_budget_ms` must be a finite number, got nan",
        id="monitor-budget-nan",
    ),
    pytest.param(
        lambda: LatencyBudget(p95_budget_ms=-1.0),
        ValueError,
        "`p95_budget_ms` must be in (0, inf], got -1.0",
        id="bench-budget-negative",
    ),
    pytest.param(
        lambda: LatencyBudget(p99_budget_ms=float("inf")),
        ValueError,
        "`p99_budget_ms` must be a finite number, got inf",
        id="bench-budget-inf",
    ),
    # issue 15: values built directly that were accepted, or refused only by a raw error deep inside
    *[
        pytest.param(lambda kw=kw: lt.TrainingConfig(**kw), error, message, id=f"config-{name}")
        for name, kw, error, message in [
            (
                "precision",
                {"precision": "fp8"},
                ValueError,
                "`precision` must be one of 'auto', '32-true', '16-mixed', 'bf16-mixed', '16-true', 'bf16-true', "
                "'64-true', 'transformer-engine', 'transformer-engine-float16' (or an alias: '16', '32', '64', 'bf16', "
                "'bfloat16', 'float16', 'float32', 'fp16', 'fp32', 'fp64'), got 'fp8'",
            ),
            ("micro-batch", {"micro_batch_size": 0}, ValueError, "`micro_batch_size` must be an integer >= 1, got 0"),
            (
                "sequence-length",
                {"sequence_length": "128"},
                TypeError,
                "`sequence_length` must be an integer or None, got '128' (str)",
            ),
            (
                "accumulate",
                {"accumulate_grad_batches": 2.0},
                TypeError,
                "`accumulate_grad_batches` must be an integer or None, got 2.0 (float)",
            ),
            ("dataloader", {"dataloader_kwargs": 5}, TypeError, f"`dataloader_kwargs` must be {_MAP}, got 5 (int)"),
            ("initial-lr-type", {"initial_lr": "x"}, TypeError, "`initial_lr` must be a number, got 'x' (str)"),
            ("initial-lr-zero", {"initial_lr": 0.0}, ValueError, "`initial_lr` must be in (0, inf], got 0.0"),
            (
                "schedule",
                {"schedule": "cosine"},
                ValueError,
                "`schedule` must be one of 'cosine_with_warmup', 'linear_warmup', 'onecycle', got 'cosine'",
            ),
            (
                "schedule-kwargs",
                {"schedule_kwargs": [1]},
                TypeError,
                f"`schedule_kwargs` must be {_MAP}, got [1] (list)",
            ),
            (
                "schedule-kwargs-alone",
                {"schedule_kwargs": {"warmup_steps": 5}},
                ValueError,
                "`schedule_kwargs` needs a `schedule`, got {'warmup_steps': 5} without one",
            ),
            ("plateau", {"plateau_kwargs": 1}, TypeError, f"`plateau_kwargs` must be {_MAP} or None, got 1 (int)"),
            (
                "dynamic-batch",
                {"dynamic_batch_kwargs": {1: 2}},
                TypeError,
                f"`dynamic_batch_kwargs` must be {_MAP} or None, got {{1: 2}} (dict)",
            ),
            (
                "optimizer",
                {"optimizer": "adamw"},
                ValueError,
                "got 'adamw'; 'adamw' is an optimizer but not one this accepts",
            ),
            (
                "attention",
                {"attention": "flash2"},
                ValueError,
                "`attention` must be one of 'auto', 'flash', 'sdpa', 'eager' (or an alias: 'flash-attn', "
                "'flash_attention_2', 'flash_attention_3', 'scaled_dot_product_attention'), got 'flash2'",
            ),
            (
                "blocks",
                {"checkpointing_blocks": 5},
                TypeError,
                "`checkpointing_blocks` must be None, 'auto' or block types: `block_types` must be nn.Module "
                "subclasses or class names (e.g. 'Block' or 'torch.nn.TransformerEncoderLayer'), got 5 (int)",
            ),
            (
                "compile",
                {"compile_kwargs": "max"},
                TypeError,
                f"`compile_kwargs` must be {_MAP} or None, got 'max' (str)",
            ),
            (
                "deepspeed",
                {"deepspeed": {"stage": 2}},
                TypeError,
                "`deepspeed` must be a DeepSpeedSettings or None, got {'stage': 2} (dict)",
            ),
            (
                "devices-nan",
                {"devices": float("nan")},
                TypeError,
                "`devices` must be an integer or None, got nan (float)",
            ),
            ("devices-zero", {"devices": 0}, ValueError, "`devices` must be an integer >= 1, got 0"),
            (
                "devices-repeated",
                {"devices": (0, 0)},
                ValueError,
                "`devices` must list distinct device indices, got (0, 0)",
            ),
            ("devices-negative", {"devices": (-1,)}, ValueError, "`devices[0]` must be an integer >= 0, got -1"),
            (
                "data-parallel",
                {"data_parallel": "yes"},
                TypeError,
                "`data_parallel` must be True or False, got 'yes' (str)",
            ),
            (
                "backend",
                {"process_group_backend": "mpi"},
                ValueError,
                "`process_group_backend` must be one of 'nccl', 'gloo', got 'mpi'",
            ),
            (
                "backend-without-ddp",
                {"process_group_backend": "gloo"},
                ValueError,
                "`process_group_backend` ('gloo') sets the backend of data parallelism: it needs `data_parallel=True`",
            ),
            (
                "checkpoint-every",
                {"checkpoint_every_n_steps": 0},
                ValueError,
                "`checkpoint_every_n_steps` must be an integer >= 1, got 0",
            ),
            ("async", {"async_checkpoint": 1}, TypeError, "`async_checkpoint` must be True or False, got 1 (int)"),
            ("source", {"source": None}, TypeError, f"`source` must be {_MAP}, got None (NoneType)"),
            (
                "plateau-unknown-key",
                {"plateau_kwargs": {"patient": 3}},
                ValueError,
                "`plateau_kwargs` has unknown key(s) 'patient'; allowed: check_on_train_epoch_end, cooldown, eps, "
                "factor, min_lr, mode, monitor, patience, threshold, threshold_mode",
            ),
            (
                "schedule-kwargs-value",
                {"schedule": "onecycle", "schedule_kwargs": {"max_lr": -1}},
                ValueError,
                "`max_lr` must be in (0, inf], got -1",
            ),
            (
                "dataloader-unknown-key",
                {"dataloader_kwargs": {"workers": 2}},
                ValueError,
                "`dataloader_kwargs` has keys DataLoader does not take: workers (allowed: batch_sampler, collate_fn, "
                "drop_last, generator, in_order, multiprocessing_context, num_workers, persistent_workers, pin_memory, "
                "pin_memory_device, prefetch_factor, sampler, shuffle, timeout, worker_init_fn; the batch size is "
                "`micro_batch_size`)",
            ),
        ]
    ],
    *[
        pytest.param(lambda kw=kw: ZeroPlan(**{**_ZERO, **kw}), error, message, id=f"zero-plan-{name}")
        for name, kw, error, message in [
            ("stage-negative", {"stage": -1}, ValueError, "`stage` must be an integer from 0 to 3, got -1"),
            ("stage-four", {"stage": 4}, ValueError, "`stage` must be an integer from 0 to 3, got 4"),
            ("stage-float", {"stage": 2.0}, TypeError, "`stage` must be an integer, got 2.0 (float)"),
            (
                "offload-opt",
                {"offload_optimizer": "no"},
                TypeError,
                "`offload_optimizer` must be True or False, got 'no' (str)",
            ),
            (
                "offload-params",
                {"offload_parameters": 1},
                TypeError,
                "`offload_parameters` must be True or False, got 1 (int)",
            ),
            ("bytes", {"per_gpu_bytes": -1}, ValueError, "`per_gpu_bytes` must be an integer >= 0, got -1"),
            ("reason", {"reason": 3}, TypeError, "`reason` must be a string, got 3 (int)"),
            ("fits", {"fits": None}, TypeError, "`fits` must be True or False, got None (NoneType)"),
            ("gpus", {"num_gpus": 0}, ValueError, "`num_gpus` must be an integer >= 1, got 0"),
            ("batch", {"batch_size": 0}, ValueError, "`batch_size` must be an integer >= 1, got 0"),
            (
                "offload-at-stage-0",
                {"offload_optimizer": True},
                ValueError,
                "`offload_optimizer=True` needs a ZeRO stage of 1 to 3, got stage=0",
            ),
            (
                "params-offload-at-stage-2",
                {"stage": 2, "offload_optimizer": True, "offload_parameters": True},
                ValueError,
                "`offload_parameters=True` needs stage=3 and offload_optimizer=True, got stage=2 and "
                "offload_optimizer=True",
            ),
        ]
    ],
    pytest.param(
        lambda: MemoryEstimate(parameters=1, weight_bytes=1, bytes_per_sample=1, fixed_bytes=1, notes="one note"),  # type: ignore[arg-type]
        TypeError,
        "`notes` must be a tuple of strings, got 'one note' (str)",
        id="estimate-notes-str",
    ),
    pytest.param(
        lambda: MemoryEstimate(parameters=1, weight_bytes=1, bytes_per_sample=1, fixed_bytes=1, notes=(1,)),  # type: ignore[arg-type]
        TypeError,
        "`notes` must be a tuple of strings, got (1,) (tuple)",
        id="estimate-notes-int",
    ),
    pytest.param(
        lambda: TorchCompile(modules=5),  # type: ignore[arg-type]
        TypeError,
        "`modules` must be a sequence of submodule names or None, got 5 (int)",
        id="compile-modules-int",
    ),
    pytest.param(
        lambda: compile_modules(torch.nn.Linear(1, 1), modules=5),  # type: ignore[arg-type]
        TypeError,
        "`modules` must be a sequence of submodule names, got 5 (int)",
        id="compile-modules-engine-int",
    ),
    pytest.param(
        lambda: lt.AdaptiveLROnPlateau(min_lr=[]),
        ValueError,
        "`min_lr` must be a number >= 0 or a non-empty sequence of them, got []",
        id="pl-empty-min-lr",
    ),
    pytest.param(
        lambda: estimate_memory("gpt2", sequence_length=128, lora_rank=10**6),
        ValueError,
        "`lora_rank` must be an integer from 1 to 768 for gpt2 (the smallest side of its q/k/v/o projections; a "
        "higher rank trains more than the full weight), got 1000000",
        id="estimate-lora-rank-above-hidden",
    ),
    pytest.param(
        lambda: estimate_memory("gpt2", sequence_length=128, precision="auto"),
        ValueError,
        "`precision` must be one of '32-true', '16-mixed', 'bf16-mixed', '16-true', 'bf16-true', '64-true' (or an "
        "alias: '16', '32', '64', 'bf16', 'bfloat16', 'float16', 'float32', 'fp16', 'fp32', 'fp64'), got 'auto'; "
        "'auto' is a precision but not one this accepts",
        id="estimate-precision-auto",
    ),
    pytest.param(
        lambda: lt.TunePlugin("bf16", optimizer="sgd"),
        ValueError,
        "`optimizer` must be one of 'adamw_fused', 'adam8bit', 'adamw8bit', 'lion8bit', 'sgd8bit', 'paged_adam8bit', "
        "'paged_adamw8bit', 'paged_lion8bit' (or an alias: 'adam_8bit', 'adamw_8bit', 'adamw_bnb_8bit', "
        "'adamw_torch_fused', 'lion_8bit', 'paged_adam_8bit', 'paged_adamw_8bit', 'paged_lion_8bit', 'sgd_8bit'), "
        "got 'sgd'; 'sgd' is an optimizer but not one this accepts",
        id="plugin-optimizer-not-a-swap",
    ),
    pytest.param(
        lambda: estimate_memory("gpt2", sequence_length=128, mode="validation"),  # type: ignore[arg-type]
        ValueError,
        "`mode` must be one of 'train', 'eval', 'predict', got 'validation'",
        id="estimate-mode",
    ),
    pytest.param(
        lambda: measure_memory(torch.nn.Linear(4, 2), torch.zeros(2, 4), mode="test"),  # type: ignore[arg-type]
        ValueError,
        "`mode` must be one of 'train', 'eval', 'predict', got 'test'",
        id="measure-mode",
    ),
    pytest.param(
        lambda: measure_memory(torch.nn.Linear(4, 2), [1, 2, 3]),
        TypeError,
        "`batch` must be a tensor, or a tuple, list or dict holding tensors (first dimension: the batch), or a "
        "function batch_size -> batch; got [1, 2, 3] (list), which holds no tensor",
        id="measure-batch-without-tensors",
    ),
    pytest.param(
        lambda: lt.from_config(""),
        ValueError,
        "`path_or_dict` must be the path of a YAML file, got the empty path ''",
        id="from-config-empty-path",
    ),
    pytest.param(
        lambda: ScheduleLR(torch.optim.SGD([torch.zeros(1, requires_grad=True)]), _WARMUP, on_restore=5),  # type: ignore[arg-type]
        TypeError,
        "`on_restore` must be a callable or None, got 5 (int)",
        id="schedule-lr-on-restore",
    ),
    pytest.param(
        lambda: ScheduleLR(torch.optim.SGD([torch.zeros(1, requires_grad=True)]), _WARMUP, last_epoch="0"),  # type: ignore[arg-type]
        TypeError,
        "`last_epoch` must be an integer, got '0' (str)",
        id="schedule-lr-last-epoch-type",
    ),
    pytest.param(
        lambda: ScheduleLR(torch.optim.SGD([torch.zeros(1, requires_grad=True)]), _WARMUP, last_epoch=-2),
        ValueError,
        "`last_epoch` must be an integer >= -1, got -2",
        id="schedule-lr-last-epoch-value",
    ),
    *[
        pytest.param(make, TypeError, "`log_lr` must be True or False, got 'yes' (str)", id=f"{name}-log-lr")
        for name, make in [
            ("wc", lambda: lt.WarmupCosine(1, log_lr="yes")),
            ("lw", lambda: lt.LinearWarmup(1, log_lr="yes")),
            ("oc", lambda: lt.OneCycle(0.1, log_lr="yes")),
        ]
    ],
    pytest.param(
        lambda: swap_optimizers(5, [], None, optimizer="adamw_fused"),  # type: ignore[arg-type]
        TypeError,
        "`optimizers` must be a sequence (a list of them), got 5 (int)",
        id="swap-optimizers-not-a-sequence",
    ),
    pytest.param(
        lambda: swap_optimizers([], None, None, optimizer="adamw_fused"),  # type: ignore[arg-type]
        TypeError,
        "`lr_scheduler_configs` must be a sequence (a list of them), got None (NoneType)",
        id="swap-optimizers-configs-none",
    ),
    *[
        pytest.param(
            lambda kw=kw: MemoryEstimate(parameters=1, weight_bytes=1, bytes_per_sample=1, fixed_bytes=1, **kw),
            ValueError,
            message,
            id=f"estimate-{name}",
        )
        for name, kw, message in [
            ("trainable", {"trainable_parameters": -1}, "`trainable_parameters` must be an integer >= 0, got -1"),
            ("buffers", {"buffer_bytes": -1}, "`buffer_bytes` must be an integer >= 0, got -1"),
        ]
    ],
    *[
        pytest.param(
            lambda kw=kw: TransformerShape("llama", 8, 8, 1, 2, 16, **kw),
            TypeError,
            f"`{next(iter(kw))}` must be True or False, got 1 (int)",
            id=f"shape-{next(iter(kw))}",
        )
        for kw in ({"qkv_bias": 1}, {"output_bias": 1})
    ],
    pytest.param(
        lambda: TorchCompile(dynamic="yes"),  # type: ignore[arg-type]
        TypeError,
        "`dynamic` must be True or False, got 'yes' (str)",
        id="compile-dynamic",
    ),
    pytest.param(
        lambda: compile_modules(torch.nn.Linear(1, 1), dynamic=1),  # type: ignore[arg-type]
        TypeError,
        "`dynamic` must be True or False, got 1 (int)",
        id="compile-modules-dynamic",
    ),
    pytest.param(
        lambda: lightning_precision("bf16", "yes"),  # type: ignore[arg-type]
        TypeError,
        "`training.mixed_precision.enabled` must be true, false or absent, got 'yes' (str)",
        id="precision-mixed-type",
    ),
    pytest.param(
        lambda: lightning_precision("bf16-mixed", False),
        ValueError,
        "`training.precision` 'bf16-mixed' is a mixed precision, but `training.mixed_precision.enabled` is false",
        id="precision-mixed-contradiction",
    ),
    pytest.param(
        lambda: SyntheticTokenDataModule(predict_sequences=0),
        ValueError,
        "`predict_sequences` must be an integer >= 1, got 0",
        id="demo-data-predict-sequences",
    ),
    pytest.param(
        lambda: check_lightning_version("DynamicBatchSize", tested=("2.7", "2.6")),
        ValueError,
        "`tested` must be two increasing version strings (first, end), got ('2.7', '2.6')",
        id="compat-tested",
    ),
    pytest.param(
        lambda: check_lightning_version("DynamicBatchSize", installed=2.6),  # type: ignore[arg-type]
        TypeError,
        "`installed` must be a version string or None, got 2.6 (float)",
        id="compat-installed",
    ),
]


@pytest.mark.parametrize(("make", "error", "message"), CASES)
def test_bad_input_is_refused_at_construction(make: Callable[[], Any], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=re.escape(message) + "$"):
        make()


def test_scale_lr_rules() -> None:
    assert lt.scale_lr(3e-4, 32, 64) == pytest.approx(3e-4 * 2**0.5)  # the seeds' example: 4.24e-4
    assert lt.scale_lr(0.1, 256, 128, rule="linear") == pytest.approx(0.05)
    assert lt.scale_lr(1e-3, 64, 64) == 1e-3
