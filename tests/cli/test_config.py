"""from_config: the tuning guides' `training:` YAML to Trainer arguments, and one message per bad configuration."""

from __future__ import annotations

import importlib
import math
import re
import sys
import types
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from lightning.pytorch.strategies import DDPStrategy, deepspeed as lightning_deepspeed

import lightning_tune as lt
from lightning_tune.callbacks import ActivationCheckpointing, TorchCompile
from lightning_tune.callbacks.dynamic_batch import DynamicBatchSize
from lightning_tune.config import InitialLR, TrainingConfig, from_config
from lightning_tune.config.loader import KEYS
from lightning_tune.config.precision import lightning_precision
from tests.helpers import LRRecorder, Regressor, make_trainer


def kinds(config: TrainingConfig) -> list[str]:
    return [type(c).__name__ for c in config.callbacks()]


@pytest.mark.parametrize("name", ["lightning_tune.config", "lightning_tune.swaps"])
def test_all_is_sorted_and_importable(name: str) -> None:
    module = importlib.import_module(name)
    assert module.__all__ == sorted(module.__all__)
    for symbol in module.__all__:
        assert hasattr(module, symbol), symbol
    public = {
        k for k, v in vars(module).items() if not k.startswith("_") and getattr(v, "__module__", "").startswith(name)
    }
    assert public <= set(module.__all__)


# ------------------------------------------------------------------------------------- the guides' configurations

SEED_YAML = """
training:
  precision: bf16
  micro_batch_size: 4
  gradient_accumulation_steps: 8
  gradient_checkpointing:
    enabled: true
  optimizer: adamw_8bit
  attention:
    implementation: flash_attention_2
  learning_rate:
    initial: 3e-4
    schedule: cosine_with_warmup
    warmup_steps: 2000
    min_lr: 3e-5
    total_steps: 100000
    adaptive:
      enabled: true
      monitor: validation_loss
      factor: 0.5
      patience: 5
      min_lr: 1e-6
  dataloader:
    num_workers: 8
    prefetch_factor: 4
    pin_memory: true
    persistent_workers: true
  compilation: torch_compile
"""


def test_yaml_file_maps_to_trainer_arguments(tmp_path: Path) -> None:
    path = tmp_path / "train.yaml"
    path.write_text(SEED_YAML)
    with pytest.warns(UserWarning, match=r"`training\.attention\.implementation` 'flash' needs a CUDA GPU"):
        config = from_config(path)
    assert (config.precision, config.micro_batch_size, config.accumulate_grad_batches) == ("bf16-mixed", 4, 8)
    assert config.dataloader_kwargs == {
        "num_workers": 8,
        "prefetch_factor": 4,
        "pin_memory": True,
        "persistent_workers": True,
    }
    callbacks = config.callbacks()
    assert kinds(config) == [
        "InitialLR",
        "WarmupCosine",
        "AdaptiveLROnPlateau",
        "ActivationCheckpointing",
        "TorchCompile",
    ]
    initial, cosine, plateau = callbacks[:3]
    assert isinstance(initial, InitialLR) and initial.lr == 3e-4  # YAML 1.1 reads `3e-4` as text: taken as a number
    assert isinstance(cosine, lt.WarmupCosine)
    assert (cosine.warmup_steps, cosine.min_lr, cosine.total_steps) == (2000, 3e-5, 100000)
    assert isinstance(plateau, lt.AdaptiveLROnPlateau)
    assert (plateau.monitor, plateau.factor, plateau.detector.patience, plateau.min_lr) == (
        "validation_loss",
        0.5,
        5,
        1e-6,
    )
    kwargs = config.trainer_kwargs()
    assert set(kwargs) == {"callbacks", "plugins", "accumulate_grad_batches"}  # no `precision`: it is the plugin's
    (plugin,) = kwargs["plugins"]
    assert isinstance(plugin, lt.TunePlugin)
    assert (plugin.precision, plugin.optimizer, plugin.attention) == ("bf16-mixed", "adamw8bit", "flash")
    assert config.trainer_kwargs()["callbacks"][0] is not callbacks[0]  # fresh callbacks on every call


@pytest.mark.parametrize(
    ("training", "expected"),
    [
        pytest.param({"precision": "fp16"}, "16-mixed", id="fp16"),
        pytest.param({"precision": "fp16", "mixed_precision": {"enabled": False}}, "16-true", id="fp16-pure"),
        pytest.param({"precision": "bf16", "mixed_precision": {"enabled": True}}, "bf16-mixed", id="bf16"),
        pytest.param({"precision": "fp32"}, "32-true", id="fp32"),
        pytest.param({"precision": "auto", "amp": {"enabled": True}}, "auto", id="auto-amp"),
        pytest.param({"mixed_precision": {"enabled": True}}, "auto", id="mixed-only"),
        pytest.param({"precision": "bf16-true"}, "bf16-true", id="lightning-name"),
        pytest.param({"precision": "bf16", "amp": {"keep_batchnorm_fp32": True}}, "bf16-mixed", id="keep-bn"),
        pytest.param({}, None, id="none"),
    ],
)
@pytest.mark.filterwarnings("ignore:this machine .* lacks what the configuration needs")
def test_precision_names(training: dict[str, Any], expected: str | None) -> None:
    assert from_config(training).precision == expected


@pytest.mark.parametrize(
    ("learning_rate", "callback", "attributes"),
    [
        pytest.param(
            {"initial": 3e-4, "schedule": "linear_warmup", "warmup_steps": 1000, "constant_after_warmup": True},
            lt.LinearWarmup,
            {"warmup_steps": 1000},
            id="linear-warmup",
        ),
        pytest.param(
            {"max_lr": "5e-4", "schedule": "onecycle", "pct_start": 0.3, "div_factor": 25, "final_div_factor": 10000},
            lt.OneCycle,
            {"max_lr": 5e-4, "pct_start": 0.3, "div_factor": 25.0, "final_div_factor": 1e4},
            id="onecycle",
        ),
        pytest.param(
            {"schedule": "cosine_with_warmup", "warmup_ratio": 0.05},
            lt.WarmupCosine,
            {"warmup_ratio": 0.05, "warmup_steps": None, "total_steps": None},
            id="cosine-ratio",
        ),
    ],
)
def test_schedules(learning_rate: dict[str, Any], callback: type, attributes: dict[str, Any]) -> None:
    built = [c for c in from_config({"learning_rate": learning_rate}).callbacks() if isinstance(c, callback)]
    assert len(built) == 1
    assert {name: getattr(built[0], name) for name in attributes} == attributes


def test_dynamic_batch_size_maps_to_the_callback() -> None:
    config = from_config(
        {
            "micro_batch_size": 16,
            "dynamic_batch_size": {
                "enabled": True,
                "min_batch_size": 8,
                "max_batch_size": 64,
                "target_vram_utilization": 0.9,
                "adjustment_interval": 100,
            },
        }
    )
    (callback,) = config.callbacks()
    assert isinstance(callback, DynamicBatchSize)
    assert (callback.target_vram, callback.min_batch_size, callback.max_batch_size, callback.adjust_every) == (
        0.9,
        8,
        64,
        100,
    )
    assert from_config({"dynamic_batch_size": {"enabled": False, "min_batch_size": 8}}).callbacks() == []


# The guides' `training:` blocks as they are written, each either mapped or refused with the reason.
GUIDE_BLOCKS = [
    pytest.param({"batch_size": 32, "micro_batch_size": 8, "sequence_length": 2048}, None, id="batch-sequence"),
    pytest.param(
        {"learning_rate": {"initial": "3e-4", "schedule": "linear_warmup", "warmup_steps": 1000}}, None, id="lr"
    ),
    pytest.param({"precision": "bf16", "mixed_precision": {"enabled": True}}, None, id="bf16"),
    pytest.param(
        {"precision": "fp16", "mixed_precision": {"enabled": True, "loss_scale": "dynamic", "loss_scale_window": 1000}},
        "`training.mixed_precision.loss_scale_window` cannot be honoured",
        id="fp16-loss-scale",
    ),
    pytest.param(
        {"precision": "auto", "amp": {"enabled": True, "opt_level": "O2", "keep_batchnorm_fp32": True}},
        "`training.amp.opt_level` cannot be honoured",
        id="amp",
    ),
    pytest.param(
        {"gradient_checkpointing": {"enabled": True, "checkpoint_segments": 4}},
        "`training.gradient_checkpointing.checkpoint_segments` cannot be honoured",
        id="checkpoint-segments",
    ),
    pytest.param(
        {"cpu_offload": {"enabled": True, "offload_optimizer": True, "offload_gradients": False, "pin_memory": True}},
        "`training.cpu_offload.offload_gradients` cannot be honoured",
        id="cpu-offload",
    ),
    pytest.param({"optimizer": "adamw_8bit"}, None, id="8bit"),
    pytest.param({"attention": {"implementation": "flash_attention_2"}}, None, id="attention"),
    pytest.param({"loss": "chunked"}, None, id="loss"),
    pytest.param(
        {"model_parallel": {"enabled": True, "tensor_parallel_size": 4, "pipeline_parallel_size": 1}},
        "`training.model_parallel.enabled` cannot be honoured",
        id="model-parallel",
    ),
    pytest.param(
        {
            "micro_batch_size": 32,
            "precision": "bf16",
            "attention": "flash_attention_2",
            "compilation": "torch_compile",
            "dataloader": {"num_workers": 8, "prefetch_factor": 4, "pin_memory": True, "persistent_workers": True},
            "checkpoint": {"save_interval": 1000, "async_save": True},
        },
        None,
        id="throughput",
    ),
    pytest.param(
        {
            "precision": "fp16",
            "micro_batch_size": 8,
            "gradient_accumulation_steps": 4,
            "gradient_checkpointing": True,
            "optimizer": "adamw_8bit",
        },
        None,
        id="24gb",
    ),
    pytest.param(
        {
            "precision": "bf16",
            "micro_batch_size": 16,
            "gradient_accumulation_steps": 4,
            "multi_gpu": {"strategy": "data_parallel", "devices": [0, 1, 2, 3]},
            "gradient_checkpointing": False,
            "optimizer": "adamw",
            "attention": "flash_attention_2",
        },
        None,
        id="4xA100",
    ),
    pytest.param(
        {"multi_gpu": {"tensor_split": [0.4, 0.3, 0.2, 0.1], "auto_balance": True, "balance_metric": "memory"}},
        "`training.multi_gpu.tensor_split` cannot be honoured",
        id="tensor-split",
    ),
]


@pytest.mark.filterwarnings("ignore:this machine .* lacks what the configuration needs")
@pytest.mark.parametrize(("block", "refused"), GUIDE_BLOCKS)
def test_every_key_of_the_guides_is_mapped_or_refused(block: dict[str, Any], refused: str | None) -> None:
    if refused is None:
        assert isinstance(from_config({"training": block}), TrainingConfig)
    else:
        with pytest.raises(ValueError, match=re.escape(refused)):
            from_config({"training": block})


def test_batch_sizes_resolve_per_device() -> None:
    assert from_config({"batch_size": 32, "micro_batch_size": 8}).accumulate_grad_batches == 4
    config = from_config({"batch_size": 128, "gradient_accumulation_steps": 8})
    assert (config.micro_batch_size, config.accumulate_grad_batches) == (16, 8)
    assert from_config({"batch_size": 32}).micro_batch_size == 32
    assert from_config({"sequence_length": 2048}).sequence_length == 2048


def test_devices_checkpoints_and_dataloader() -> None:
    config = from_config(
        {
            "multi_gpu": {"strategy": "data_parallel", "devices": [0, 1, 2, 3], "backend": "gloo"},
            "checkpoint": {"save_interval": 1000, "async_save": True},
            "micro_batch_size": 3,
        }
    )
    kwargs = config.trainer_kwargs()
    assert kwargs["devices"] == [0, 1, 2, 3]
    assert isinstance(kwargs["strategy"], DDPStrategy) and kwargs["strategy"].process_group_backend == "gloo"
    (checkpoint,) = kwargs["callbacks"]
    assert isinstance(checkpoint, ModelCheckpoint) and checkpoint._every_n_train_steps == 1000
    assert any(isinstance(p, AsyncCheckpointIO) for p in kwargs["plugins"])
    loader = config.dataloader(torch.arange(10).float())
    assert loader.batch_size == 3 and len(loader) == 4
    # `multi_gpu:` beside `training:`, as one of the guides writes it
    assert from_config({"training": {}, "multi_gpu": {"strategy": "data_parallel"}}).trainer_kwargs() == {
        "strategy": "ddp"
    }


def test_compilation_and_checkpointing_options() -> None:
    config = from_config(
        {
            "compilation": {"mode": "max-autotune", "fullgraph": True, "backend": "inductor"},
            "gradient_checkpointing": {"block_types": ["Block"]},
        }
    )
    checkpointing, compiled = config.callbacks()
    assert isinstance(checkpointing, ActivationCheckpointing) and checkpointing.block_types == ("Block",)
    assert isinstance(compiled, TorchCompile) and (compiled.mode, compiled.fullgraph) == ("max-autotune", True)
    assert from_config({"compilation": "none", "gradient_checkpointing": False}).callbacks() == []


def test_configured_run_trains_with_the_configured_peak_lr(tmp_path: Path) -> None:
    config = from_config(
        {
            "training": {
                "precision": "bf16",
                "micro_batch_size": 4,
                "gradient_accumulation_steps": 2,
                "learning_rate": {"initial": 0.2, "schedule": "linear_warmup", "warmup_steps": 2},
            }
        }
    )
    recorder = LRRecorder()
    kwargs = config.trainer_kwargs()
    model = Regressor(lr=0.05, group_lrs=[0.1, 0.01], batch_size=config.micro_batch_size)  # the module says 0.1 / 0.01
    trainer = make_trainer(tmp_path, [*kwargs.pop("callbacks"), recorder], max_steps=4, **kwargs)
    trainer.fit(model)
    assert trainer.precision == "bf16-mixed"
    assert recorder.batches == 8  # 4 optimizer steps of 2 micro-batches
    expected = [[0.2 * s / 2, 0.02 * s / 2] for s in (0, 1)] + [[0.2, 0.02]] * 2  # peak 0.2, ratio 10:1 kept
    for got, want in zip(recorder.lrs, expected, strict=True):
        assert got == pytest.approx(want)


# ------------------------------------------------------------------------------------------------------ DeepSpeed


@pytest.fixture
def deepspeed_stub(monkeypatch: pytest.MonkeyPatch) -> None:
    """Lightning's real DeepSpeedStrategy, built without deepspeed installed (its constructor only sets a log level)."""
    stub = types.ModuleType("deepspeed")
    logger = types.SimpleNamespace(setLevel=lambda level: None)
    stub.utils = types.SimpleNamespace(logging=types.SimpleNamespace(logger=logger))  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "deepspeed", stub)
    monkeypatch.setattr(lightning_deepspeed, "_DEEPSPEED_AVAILABLE", True)
    monkeypatch.setattr(lightning_deepspeed, "_DEEPSPEED_GREATER_EQUAL_0_16", True)


def test_loss_key_goes_to_the_plugin_and_liger_says_what_this_machine_lacks() -> None:
    (plugin,) = from_config({"loss": "Chunked"}).trainer_kwargs()["plugins"]
    assert isinstance(plugin, lt.TunePlugin) and (plugin.precision, plugin.loss) == ("32-true", "chunked")
    with pytest.warns(UserWarning, match=r"`training\.loss` 'liger' needs a CUDA GPU"):
        assert from_config({"loss": "liger"}).loss == "liger"


def test_cpu_offload_builds_lightnings_deepspeed_config(deepspeed_stub: None) -> None:
    config = from_config(
        {
            "precision": "fp16",
            "mixed_precision": {"loss_scale": "dynamic", "loss_scale_window": 1000, "hysteresis": 2},
            "cpu_offload": {"enabled": True, "offload_optimizer": True, "pin_memory": True},
            "attention": "sdpa",
            "optimizer": "adamw",
        }
    )
    assert config.deepspeed is not None and config.deepspeed.describe() == (
        "DeepSpeed ZeRO stage 2, optimizer state offloaded to CPU"
    )
    kwargs = config.trainer_kwargs()
    assert "precision" not in kwargs and "callbacks" not in kwargs  # the plugin carries precision and attention
    (plugin,) = kwargs["plugins"]  # Lightning uses a given precision plugin under DeepSpeed as under any strategy
    assert (plugin.precision, plugin.attention, plugin.optimizer) == ("16-mixed", "sdpa", None)
    strategy = kwargs["strategy"]
    assert isinstance(strategy, lightning_deepspeed.DeepSpeedStrategy)
    zero = strategy.config["zero_optimization"]
    assert zero["stage"] == 2 and zero["offload_optimizer"]["device"] == "cpu"
    assert zero["offload_optimizer"]["pin_memory"] is True and "offload_param" not in zero
    assert (strategy.loss_scale, strategy.loss_scale_window, strategy.hysteresis) == (0, 1000, 2)


def test_cpu_offload_without_deepspeed_warns_then_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("lightning_tune._imports.is_available", lambda module: module != "deepspeed")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setitem(sys.modules, "deepspeed", None)
    with pytest.warns(UserWarning) as record:
        config = from_config({"cpu_offload": {"enabled": True}})
    assert [str(w.message) for w in record] == [
        "this machine (0 CUDA GPUs) lacks what the configuration needs, so training here will fail: "
        "`training.cpu_offload` (DeepSpeed) needs a CUDA GPU, and deepspeed (pip install 'lightning-tune[deepspeed]')"
    ]
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'lightning-tune\[deepspeed\]'"):
        config.trainer_kwargs()


# ---------------------------------------------------------------------------------------------------- bad configs

T = "training"
BAD = [
    # unknown keys and the root
    pytest.param(
        {"learning_rate": {"schedual": "onecycle"}},
        ValueError,
        "unknown key `training.learning_rate.schedual` (did you mean `schedule`?); allowed keys here: `adaptive`, "
        "`anneal_strategy`, `constant_after_warmup`, `div_factor`, `final_div_factor`, `initial`, `max_lr`, "
        "`min_lr`, `pct_start`, `schedule`, `total_steps`, `warmup_ratio`, `warmup_steps`",
        id="unknown-key",
    ),
    pytest.param(
        {T: {}, "inference": {"batch_size": 1}},
        ValueError,
        "`inference` cannot be honoured: lightning_tune configures training runs; serving settings (continuous "
        "batching, KV cache, speculative decoding) belong to an inference server. Keep only the `training:` section",
        id="inference",
    ),
    pytest.param({T: [1]}, TypeError, "`training` must be a mapping of keys to values, got [1]", id="root-not-map"),
    pytest.param(
        {"dataloader": 4},
        TypeError,
        "`training.dataloader` must be a mapping of keys to values, got 4 (int)",
        id="section-not-map",
    ),
    # batch sizes
    pytest.param(
        {"batch_size": 128, "micro_batch_size": 16, "gradient_accumulation_steps": 4},
        ValueError,
        "`training.batch_size` (128) must equal `training.micro_batch_size` x `training.gradient_accumulation_steps` "
        "(16 x 4 = 64) per device",
        id="batch-product",
    ),
    pytest.param(
        {"batch_size": 30, "micro_batch_size": 8},
        ValueError,
        "`training.batch_size` (30) must be a multiple of `training.micro_batch_size` (8)",
        id="batch-multiple",
    ),
    pytest.param(
        {"micro_batch_size": 0}, ValueError, "`training.micro_batch_size` must be an integer >= 1, got 0", id="micro-0"
    ),
    pytest.param(
        {"gradient_accumulation_steps": 2.5},
        TypeError,
        "`training.gradient_accumulation_steps` must be an integer, got 2.5 (float)",
        id="accumulation-float",
    ),
    # precision
    pytest.param(
        {"precision": "fp8"},
        ValueError,
        "`training.precision` must be one of 'auto', '32-true', '16-mixed', 'bf16-mixed', '16-true', 'bf16-true', "
        "'64-true', 'transformer-engine', 'transformer-engine-float16' (or an alias: '16', '32', '64', 'bf16', "
        "'bfloat16', 'float16', 'float32', 'fp16', 'fp32', 'fp64'), got 'fp8'",
        id="precision-unknown",
    ),
    pytest.param(
        {"precision": "int8"},
        ValueError,
        "`training.precision` cannot be 'int8': int8 is an inference quantisation, not a training precision",
        id="precision-int8",
    ),
    pytest.param(
        {"precision": "fp32", "mixed_precision": {"enabled": True}},
        ValueError,
        "`training.precision` 'fp32' is not a mixed precision, but `training.mixed_precision.enabled` is true",
        id="fp32-mixed",
    ),
    pytest.param(
        {"precision": "auto", "amp": {"enabled": True, "opt_level": "O2", "keep_batchnorm_fp32": True}},
        ValueError,
        "`training.amp.opt_level` cannot be honoured: apex AMP opt levels are not available in Lightning 2.x, which "
        "dropped apex; choose the precision with `training.precision` (fp16, bf16, fp32) and "
        "`training.mixed_precision.enabled`",
        id="amp-opt-level",
    ),
    pytest.param(
        {"precision": "fp16", "amp": {"keep_batchnorm_fp32": False}},
        ValueError,
        "`training.amp.keep_batchnorm_fp32` cannot be honoured: torch.autocast always runs batch norm in float32; "
        "it cannot be turned off",
        id="amp-bn-false",
    ),
    pytest.param(
        {"precision": "fp16", "mixed_precision": {"enabled": True, "loss_scale": "dynamic", "loss_scale_window": 1000}},
        ValueError,
        "`training.mixed_precision.loss_scale_window` cannot be honoured: outside DeepSpeed, Lightning's 16-mixed "
        "scales the loss with torch.amp.GradScaler's dynamic scale, which has no static scale or hysteresis and is not "
        "configurable through the pack; use `training.cpu_offload` (DeepSpeed), or remove the key (`loss_scale: "
        "dynamic` is what GradScaler does)",
        id="loss-scale-window",
    ),
    pytest.param(
        {"precision": "bf16", "mixed_precision": {"loss_scale": "dynamic"}},
        ValueError,
        "`training.mixed_precision.loss_scale` cannot be honoured: loss scaling applies to fp16 only, and the "
        "precision is 'bf16-mixed' (bf16 needs none)",
        id="loss-scale-bf16",
    ),
    pytest.param(
        {"precision": "fp16", "mixed_precision": {"loss_scale": "static"}},
        ValueError,
        "`training.mixed_precision.loss_scale` must be 'dynamic' or a number > 0 (a static scale), got 'static'",
        id="loss-scale-word",
    ),
    # learning rate
    pytest.param(
        {"learning_rate": {"schedule": "cosine"}},
        ValueError,
        "`training.learning_rate.schedule` must be one of 'cosine_with_warmup', 'linear_warmup', 'onecycle', got "
        "'cosine'",
        id="schedule-unknown",
    ),
    pytest.param(
        {"learning_rate": {"schedule": "cosine_with_warmup", "warmup_steps": 10, "pct_start": 0.3}},
        ValueError,
        "`training.learning_rate.pct_start` applies to schedule 'onecycle', but `training.learning_rate.schedule` is "
        "'cosine_with_warmup'",
        id="key-of-other-schedule",
    ),
    pytest.param(
        {"learning_rate": {"initial": 3e-4, "warmup_steps": 100}},
        ValueError,
        "`training.learning_rate.warmup_steps` applies to schedule 'cosine_with_warmup' or 'linear_warmup', but "
        "`training.learning_rate.schedule` is not set",
        id="no-schedule",
    ),
    pytest.param(
        {"learning_rate": {"schedule": "onecycle", "max_lr": 5e-4, "initial": 3e-4}},
        ValueError,
        "`training.learning_rate.initial` does not apply to schedule 'onecycle', which starts at `max_lr` / "
        "`div_factor`; give the peak as `training.learning_rate.max_lr`",
        id="onecycle-initial",
    ),
    pytest.param(
        {"learning_rate": {"schedule": "onecycle"}},
        ValueError,
        "OneCycle needs `training.learning_rate.max_lr`",
        id="onecycle-no-max-lr",
    ),
    pytest.param(
        {"learning_rate": {"schedule": "cosine_with_warmup", "warmup_steps": 10, "warmup_ratio": 0.1}},
        ValueError,
        "give at most one of `training.learning_rate.warmup_steps` and `training.learning_rate.warmup_ratio` "
        "(neither: a warm-up of 2% of the run), got warmup_steps=10 and warmup_ratio=0.1",
        id="cosine-two-warmups",
    ),
    pytest.param(
        {"learning_rate": {"schedule": "cosine_with_warmup", "warmup_steps": 2000, "total_steps": 1000}},
        ValueError,
        "`training.learning_rate.warmup_steps` must be smaller than `training.learning_rate.total_steps` (1000), got "
        "2000",
        id="cosine-warmup-too-long",
    ),
    pytest.param(
        {"learning_rate": {"initial": 1e-5, "schedule": "cosine_with_warmup", "warmup_steps": 1, "min_lr": 3e-5}},
        ValueError,
        "`training.learning_rate.min_lr` (3e-05) must not exceed `training.learning_rate.initial` (1e-05)",
        id="min-lr-above-initial",
    ),
    pytest.param(
        {"learning_rate": {"schedule": "linear_warmup", "warmup_steps": 10, "constant_after_warmup": False}},
        ValueError,
        "`training.learning_rate.constant_after_warmup` cannot be honoured: schedule 'linear_warmup' holds the "
        "learning rate after the warm-up; for a decay use 'cosine_with_warmup' (with `min_lr`) or 'onecycle'",
        id="linear-not-constant",
    ),
    pytest.param(
        {"learning_rate": {"initial": "fast"}},
        TypeError,
        "`training.learning_rate.initial` must be a number, got 'fast' (str)",
        id="initial-text",
    ),
    pytest.param(
        {"learning_rate": {"initial": 0}},
        ValueError,
        "`training.learning_rate.initial` must be in (0, inf], got 0",
        id="initial-zero",
    ),
    pytest.param(
        {"learning_rate": {"adaptive": {"factor": 1.5}}},
        ValueError,
        "`training.learning_rate.adaptive.factor` must be in (0, 1), got 1.5",
        id="adaptive-factor",
    ),
    pytest.param(
        {"learning_rate": {"adaptive": {"patience": -1}}},
        ValueError,
        "`training.learning_rate.adaptive.patience` must be an integer >= 0, got -1",
        id="adaptive-patience",
    ),
    # dynamic batch size
    pytest.param(
        {"dynamic_batch_size": {"target_vram_utilization": 90}},
        ValueError,
        "`training.dynamic_batch_size.target_vram_utilization` must be in (0, 0.98], got 90",
        id="dyn-target-percent",
    ),
    pytest.param(
        {"dynamic_batch_size": {"min_batch_size": 64, "max_batch_size": 8}},
        ValueError,
        "`training.dynamic_batch_size.min_batch_size` (64) must not exceed "
        "`training.dynamic_batch_size.max_batch_size` (8)",
        id="dyn-min-above-max",
    ),
    pytest.param(
        {"micro_batch_size": 4, "dynamic_batch_size": {"min_batch_size": 8, "max_batch_size": 64}},
        ValueError,
        "`training.micro_batch_size` (4) is the starting batch size and must lie in "
        "[`training.dynamic_batch_size.min_batch_size`, `training.dynamic_batch_size.max_batch_size`] = [8, 64]",
        id="dyn-start-outside",
    ),
    pytest.param(
        {"dynamic_batch_size": {"keep": "samples"}},
        ValueError,
        "`training.dynamic_batch_size.keep` must be one of 'effective', 'lr', 'none', got 'samples'",
        id="dyn-keep",
    ),
    # optimizer, attention, checkpointing, compilation
    pytest.param(
        {"optimizer": "adafactor"},
        ValueError,
        "`training.optimizer` must be one of 'adamw', 'adamw_fused', 'adam8bit', 'adamw8bit', 'lion8bit', 'sgd8bit', "
        "'paged_adam8bit', 'paged_adamw8bit', 'paged_lion8bit' (or an alias: 'adam_8bit', 'adamw_8bit', "
        "'adamw_bnb_8bit', 'adamw_torch', 'adamw_torch_fused', 'lion_8bit', 'paged_adam_8bit', 'paged_adamw_8bit', "
        "'paged_lion_8bit', 'sgd_8bit'), got 'adafactor'",
        id="optimizer-unknown",
    ),
    pytest.param(
        {"attention": {"implementation": "xformers"}},
        ValueError,
        "`training.attention.implementation` must be one of 'auto', 'flash', 'sdpa', 'eager' (or an alias: "
        "'flash-attn', 'flash_attention_2', 'flash_attention_3', 'scaled_dot_product_attention'), got 'xformers'",
        id="attention-unknown",
    ),
    pytest.param(
        {"attention": {"backend": "flash"}},
        ValueError,
        "unknown key `training.attention.backend`; allowed keys here: `implementation`",
        id="attention-key",
    ),
    pytest.param(
        {"loss": "fused"},
        ValueError,
        "`training.loss` must be one of 'auto', 'chunked', 'liger', got 'fused'",
        id="loss-unknown",
    ),
    pytest.param(
        {"gradient_checkpointing": {"enabled": True, "checkpoint_segments": 4}},
        ValueError,
        "`training.gradient_checkpointing.checkpoint_segments` cannot be honoured: lightning_tune checkpoints each "
        "transformer block separately (as Hugging Face's gradient_checkpointing_enable does); segment counts need one "
        "nn.Sequential to cut (torch.utils.checkpoint.checkpoint_sequential). Remove the key, or name the blocks with "
        "`block_types`",
        id="checkpoint-segments",
    ),
    pytest.param(
        {"gradient_checkpointing": "yes"},
        TypeError,
        "`training.gradient_checkpointing` must be True or False, got 'yes' (str)",
        id="checkpointing-text",
    ),
    pytest.param(
        {"compilation": "xla"},
        ValueError,
        "`training.compilation` must be one of 'torch_compile', 'none', got 'xla'",
        id="compilation-unknown",
    ),
    pytest.param(
        {"compilation": {"mode": "fastest"}},
        ValueError,
        "`training.compilation.mode` must be one of 'default', 'reduce-overhead', 'max-autotune', "
        "'max-autotune-no-cudagraphs', got 'fastest'",
        id="compilation-mode",
    ),
    # dataloader
    pytest.param(
        {"dataloader": {"prefetch_factor": 4}},
        ValueError,
        "`training.dataloader.prefetch_factor` needs worker processes (torch's DataLoader refuses it without them); "
        "set `training.dataloader.num_workers` to 1 or more, got None",
        id="prefetch-no-workers",
    ),
    pytest.param(
        {"dataloader": {"num_workers": -1}},
        ValueError,
        "`training.dataloader.num_workers` must be an integer >= 0, got -1",
        id="workers-negative",
    ),
    pytest.param(
        {"dataloader": {"pin_memory": "true"}},
        TypeError,
        "`training.dataloader.pin_memory` must be True or False, got 'true' (str)",
        id="pin-memory-text",
    ),
    # CPU offload and parallelism
    pytest.param(
        {"cpu_offload": {"enabled": True, "offload_optimizer": True, "offload_gradients": False}},
        ValueError,
        "`training.cpu_offload.offload_gradients` cannot be honoured: DeepSpeed's optimizer offload moves each "
        "gradient partition to the CPU for the optimizer step and has no separate gradient switch; remove the key "
        "(gradients follow `training.cpu_offload.offload_optimizer`)",
        id="offload-gradients",
    ),
    pytest.param(
        {"cpu_offload": {"offload_parameters": True, "stage": 2}},
        ValueError,
        "`training.cpu_offload.offload_parameters` needs ZeRO stage 3 (only stage 3 shards parameters), got stage 2",
        id="offload-params-stage2",
    ),
    pytest.param(
        {"cpu_offload": {"enabled": True, "offload_optimizer": False}},
        ValueError,
        "`training.cpu_offload.enabled` is true but nothing is offloaded: set `training.cpu_offload.offload_optimizer` "
        "or `training.cpu_offload.offload_parameters` to true",
        id="offload-nothing",
    ),
    pytest.param(
        {"cpu_offload": {"enabled": True}, "optimizer": "adamw_8bit"},
        ValueError,
        "`training.optimizer` cannot be honoured: 'adamw8bit' swaps the module's optimizer, which DeepSpeed replaces "
        "with its own when `training.cpu_offload` is on; use 'adamw' (DeepSpeed offloads it to CPU Adam) or turn CPU "
        "offload off",
        id="offload-8bit",
    ),
    pytest.param(
        {"model_parallel": {"enabled": True, "tensor_parallel_size": 4}},
        ValueError,
        "`training.model_parallel.enabled` cannot be honoured: tensor and pipeline parallelism need a model written "
        "for them (Lightning's ModelParallelStrategy); lightning_tune trains data-parallel only",
        id="model-parallel",
    ),
    pytest.param(
        {"multi_gpu": {"tensor_parallel_size": 4}},
        ValueError,
        "`training.multi_gpu.tensor_parallel_size` cannot be honoured: lightning_tune trains data-parallel only "
        "(DDP, or DeepSpeed with `training.cpu_offload`)",
        id="tensor-parallel",
    ),
    pytest.param(
        {"multi_gpu": {"strategy": "data_parallel", "devices": [0, 0]}},
        ValueError,
        "`training.multi_gpu.devices` must list distinct GPU indices, got [0, 0]",
        id="devices-repeated",
    ),
    pytest.param(
        {"multi_gpu": {"backend": "mpi"}},
        ValueError,
        "`training.multi_gpu.backend` must be one of 'nccl', 'gloo', got 'mpi'",
        id="backend",
    ),
    pytest.param(
        {"checkpoint": {"save_interval": 0}},
        ValueError,
        "`training.checkpoint.save_interval` must be an integer >= 1, got 0",
        id="save-interval",
    ),
    pytest.param(
        {"multi_gpu": {"backend": "gloo", "devices": [0, 1]}},
        ValueError,
        "`training.multi_gpu.backend` ('gloo') sets the process-group backend of data parallelism: it needs "
        "`training.multi_gpu.strategy: data_parallel`",
        id="backend-without-strategy",
    ),
    pytest.param(
        {"cpu_offload": {"enabled": False, "stage": 7}},
        ValueError,
        "`training.cpu_offload.stage` must be one of 0, 1, 2, 3, got 7",  # DeepSpeedSettings' check, also when off
        id="offload-off-still-checked",
    ),
    pytest.param(
        {"learning_rate": {"schedule": "cosine", "warmup_steps": 10, "min_lr": 0.0}},
        ValueError,
        "`training.learning_rate.schedule` must be one of 'cosine_with_warmup', 'linear_warmup', 'onecycle', got "
        "'cosine'",  # one problem: the schedule's own keys are not also reported as keys without a schedule
        id="bad-schedule-is-one-problem",
    ),
    pytest.param(
        {T: {"multi_gpu": {"strategy": "data_parallel"}}, "multi_gpu": {"devices": 2}},
        ValueError,
        "`multi_gpu` is given both beside and inside `training`; keep one",
        id="multi-gpu-twice",
    ),
    pytest.param(
        {"model_parallel": {"tensor_parallel_size": 4}},
        ValueError,
        None,
        id="tensor-parallel-size-without-enabled",
    ),
    pytest.param(
        {"compilation": 5},
        TypeError,
        "`training.compilation` must be 'torch_compile', 'none', true, false or a mapping, got 5",
        id="compilation-type",
    ),
]


@pytest.mark.parametrize(("config", "error", "message"), BAD)
def test_bad_configs(config: dict[str, Any], error: type[Exception], message: str) -> None:
    with pytest.raises(error) as info:
        from_config(config)
    if message is None:  # the start of the message is another case's
        assert str(info.value).startswith("`training.model_parallel.tensor_parallel_size`"), str(info.value)
    else:
        assert str(info.value) == message


def test_every_mistake_in_a_file_is_reported_at_once() -> None:
    config = {
        "training": {
            "precision": "fp8",
            "micro_bach_size": 4,
            "learning_rate": {"initial": 3e-4, "schedule": "linear_warmup", "warmup_steps": -100},
        }
    }
    with pytest.raises(ValueError) as info:
        from_config(config)
    assert str(info.value).splitlines() == [
        "3 problems in the configuration:",
        "- unknown key `training.micro_bach_size` (did you mean `micro_batch_size`?); allowed keys here: `amp`, "
        "`attention`, `batch_size`, `checkpoint`, `compilation`, `cpu_offload`, `dataloader`, `dynamic_batch_size`, "
        "`gradient_accumulation_steps`, `gradient_checkpointing`, `learning_rate`, `loss`, `micro_batch_size`, "
        "`mixed_precision`, `model_parallel`, `multi_gpu`, `optimizer`, `precision`, `sequence_length`",
        "- `training.precision` must be one of 'auto', '32-true', '16-mixed', 'bf16-mixed', '16-true', 'bf16-true', "
        "'64-true', 'transformer-engine', 'transformer-engine-float16' (or an alias: '16', '32', '64', 'bf16', "
        "'bfloat16', 'float16', 'float32', 'fp16', 'fp32', 'fp64'), got 'fp8'",
        "- `training.learning_rate.warmup_steps` must be an integer >= 1, got -100",  # LinearWarmup's own check
    ]
    with pytest.raises(TypeError, match="^2 problems in the configuration:\n- `training.dataloader.pin_memory` must"):
        from_config({"dataloader": {"pin_memory": "yes"}, "sequence_length": "2048"})  # wrong types only: TypeError


# The seeds' "Efficient configuration for 24GB GPU, 7B model", as the tuning guide writes it.
GUIDE_24GB_7B = """
training:
  # Efficient configuration for 24GB GPU, 7B model
  precision: fp16
  micro_batch_size: 4
  gradient_accumulation_steps: 8 # Effective batch: 32
  gradient_checkpointing:
    enabled: true
    checkpoint_segments: 4
  optimizer: adamw_8bit
  attention:
    implementation: flash_attention_2
  cpu_offload:
    enabled: true
    offload_optimizer: true
"""


def test_the_guides_24gb_block_gets_every_problem_in_one_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)  # a laptop, the file meant for a GPU node
    path = tmp_path / "train.yaml"
    path.write_text(GUIDE_24GB_7B)
    with pytest.raises(ValueError) as info:
        from_config(path)
    lines = str(info.value).splitlines()
    assert lines[0] == f"2 problems in configuration file {str(path)!r}:"  # a file's errors name it
    assert [line.split(" cannot be honoured: ")[0] for line in lines[1:]] == [
        "- `training.gradient_checkpointing.checkpoint_segments`",
        "- `training.optimizer`",
    ]
    # the two edits the messages ask for, and the block loads (flash-attn and DeepSpeed need a GPU: one warning)
    fixed = GUIDE_24GB_7B.replace("    checkpoint_segments: 4\n", "").replace("adamw_8bit", "adamw")
    path.write_text(fixed)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = from_config(path)
    assert (config.precision, config.optimizer, config.attention) == ("16-mixed", None, "flash")
    assert config.deepspeed is not None and config.checkpointing_blocks == "auto"
    (warning,) = caught
    for need in ("`training.precision` '16-mixed'", "`training.attention.implementation` 'flash'", "(DeepSpeed)"):
        assert need in str(warning.message)


def test_hardware_this_machine_lacks_draws_one_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr("lightning_tune._imports.is_available", lambda module: False)
    training = {
        "precision": "fp16",
        "optimizer": "adamw_8bit",
        "attention": "flash_attention_2",
        "multi_gpu": {"strategy": "data_parallel", "devices": [0, 1], "backend": "nccl"},
    }
    with pytest.warns(UserWarning) as record:
        config = from_config(training)
    assert [str(w.message) for w in record] == [
        "this machine (0 CUDA GPUs) lacks what the configuration needs, so training here will fail: "
        "`training.precision` '16-mixed' needs a CUDA GPU; `training.attention` 'flash' needs a CUDA GPU of compute "
        "capability 8.0 or newer, and flash-attn (pip install 'lightning-tune[flash2]' or '[flash4]'); "
        "`training.optimizer` 'adamw8bit' needs bitsandbytes (pip install 'lightning-tune[bnb]'); "
        "`training.multi_gpu.devices` [0, 1] names GPUs; this machine has 0; `training.multi_gpu.backend` 'nccl' "
        "needs a CUDA GPU"
    ]
    assert config.optimizer == "adamw8bit"  # still loaded: the file may be meant for another machine


@pytest.mark.parametrize(
    ("training", "error", "message"),
    [
        pytest.param(
            {"precision": "fp16"}, ValueError, "`precision` '16-mixed' needs a CUDA GPU", id="fp16-needs-cuda"
        ),
        pytest.param(
            {"precision": "bf16", "attention": "flash_attention_2"},
            ModuleNotFoundError,
            "backend='flash' needs FlashAttention, which is not installed. Install it with: pip install "
            "'lightning-tune[flash4]' on Hopper or newer, 'lightning-tune[flash2]' on Ampere. It also needs a CUDA "
            "GPU, got device 'cpu'",
            id="flash-needs-flash-attn-and-cuda",
        ),
    ],
)
def test_at_fit_what_the_machine_lacks_fails_with_the_whole_reason(
    tmp_path: Path, training: dict[str, Any], error: type[Exception], message: str
) -> None:
    from lightning_tune.demos import DemoGPT, GPTConfig, SyntheticTokenDataModule

    if error is ModuleNotFoundError and lt._imports.is_available("flash_attn"):
        pytest.skip("flash-attn is installed here")
    with pytest.warns(UserWarning, match="lacks what the configuration needs"):
        config = from_config(training)
    gpt = GPTConfig(d_model=16, n_heads=2, n_layers=1, seq_len=8, vocab_size=32)
    trainer = make_trainer(tmp_path, [], max_steps=1, **config.trainer_kwargs())
    with pytest.raises(error) as info:
        trainer.fit(DemoGPT(gpt), datamodule=SyntheticTokenDataModule(2, seq_len=8, vocab_size=32, seed=0))
    assert message in str(info.value)


def test_building_trainer_kwargs_leaves_cuda_uninitialised(
    monkeypatch: pytest.MonkeyPatch, deepspeed_stub: None
) -> None:
    """A launcher on a GPU node builds the Trainer before DDP/DeepSpeed fork: "auto" must not touch CUDA there."""

    def touched(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("CUDA was initialised in the launching process")

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for name in ("_lazy_init", "init", "is_bf16_supported", "get_device_capability", "get_device_properties"):
        monkeypatch.setattr(torch.cuda, name, touched)
    for offload in (None, {"enabled": True}):
        training = {"precision": "auto", "attention": "sdpa", **({"cpu_offload": offload} if offload else {})}
        kwargs = from_config(training).trainer_kwargs()
        assert "precision" not in kwargs  # Lightning refuses it beside a precision plugin, under DeepSpeed too
        (plugin,) = kwargs["plugins"]
        assert plugin.requested_precision == "auto"
    assert not torch.cuda.is_initialized()


def test_docs_table_names_every_key() -> None:
    from lightning_tune.config.loader import REFUSED

    docs = (Path(__file__).resolve().parents[2] / "docs" / "config.md").read_text()
    table = "\n".join(line for line in docs.splitlines() if line.startswith("| `"))
    assert [path for path in [*KEYS, *REFUSED] if f"`{path}`" not in table] == []


def test_compilation_true_and_false() -> None:
    from lightning_tune.callbacks import TorchCompile

    assert any(isinstance(cb, TorchCompile) for cb in from_config({"compilation": True}).callbacks())
    assert not any(isinstance(cb, TorchCompile) for cb in from_config({"compilation": False}).callbacks())


def test_file_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="configuration file '.*missing.yaml' does not exist"):
        from_config(tmp_path / "missing.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("training:\n  precision: [bf16\n")
    message = (
        r"configuration file '.*broken.yaml' is not valid YAML at line 3, column 1: expected ',' or '\]', but got "
        r"'<stream end>' \(while parsing a flow sequence from line 2, column 14\)$"
    )
    with pytest.raises(ValueError, match=message):
        from_config(broken)
    listed = tmp_path / "list.yaml"
    listed.write_text("- precision: bf16\n")
    with pytest.raises(TypeError, match=r"must hold a mapping \(`training:` ...\), got \[\{'precision': 'bf16'\}\]"):
        from_config(listed)
    with pytest.raises(TypeError, match="`path_or_dict` must be a path to a YAML file or a mapping, got 3 "):
        from_config(3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"configuration file '.*' is a directory; give the path of a YAML file"):
        from_config(tmp_path)
    with pytest.raises(ValueError, match=r"`path_or_dict` must be the path of a YAML file, got the empty path ''$"):
        from_config("")
    binary = tmp_path / "weights.yaml"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff\xfe")
    with pytest.raises(ValueError, match=r"'.*weights.yaml' is not a YAML text file \(byte 0 is not UTF-8 text\)$"):
        from_config(binary)


def test_initial_lr_must_come_before_the_schedule(tmp_path: Path) -> None:
    from lightning.pytorch.utilities.exceptions import MisconfigurationException

    trainer = make_trainer(tmp_path, [lt.LinearWarmup(2), InitialLR(0.1)], max_steps=1)
    with pytest.raises(MisconfigurationException, match="InitialLR must come before LinearWarmup"):
        trainer.fit(Regressor())


def test_precision_mapping_is_lightnings() -> None:
    from lightning.pytorch.plugins.precision import MixedPrecision

    for name, mixed in (("bf16", None), ("bf16", False), ("fp32", None)):
        precision = lightning_precision(name, mixed)
        assert precision is not None
        plugin = lt.TunePlugin(precision, device="cpu")
        assert plugin.precision == precision
        assert isinstance(plugin.inner, MixedPrecision) == precision.endswith("-mixed")
    assert math.isclose(from_config({"learning_rate": {"initial": "1.5e-4"}}).initial_lr or 0, 1.5e-4)
