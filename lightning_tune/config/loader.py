"""``from_config``: a training configuration file (YAML or a dict) to Trainer arguments, callbacks and plugins.

Every key is either mapped (docs/config.md has the table) or refused with the reason; unknown keys are errors that
list what is allowed. Messages name keys by their dotted path (``training.learning_rate.schedule``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

from lightning_tune import _imports
from lightning_tune._validation import check_int
from lightning_tune.config._section import Section, reject
from lightning_tune.config.precision import lightning_precision
from lightning_tune.config.training import SCHEDULES, TrainingConfig
from lightning_tune.presets.deepspeed import DeepSpeedSettings

__all__ = ["from_config", "load_config"]

ROOT: Final = "training"

_TRAINING_KEYS: Final = frozenset(
    {
        "amp",
        "attention",
        "batch_size",
        "checkpoint",
        "compilation",
        "cpu_offload",
        "dataloader",
        "dynamic_batch_size",
        "gradient_accumulation_steps",
        "gradient_checkpointing",
        "learning_rate",
        "micro_batch_size",
        "mixed_precision",
        "model_parallel",
        "multi_gpu",
        "optimizer",
        "precision",
        "sequence_length",
    }
)
_INFERENCE = (
    "lightning_tune configures training runs; serving settings (continuous batching, KV cache, speculative "
    "decoding) belong to an inference server. Keep only the `training:` section"
)
_SCHEDULES: Final = SCHEDULES
#: Keys of `learning_rate` that belong to one schedule -> the schedules they apply to.
_SCHEDULE_KEYS: Final[dict[str, tuple[str, ...]]] = {
    "warmup_steps": ("cosine_with_warmup", "linear_warmup"),
    "warmup_ratio": ("cosine_with_warmup",),
    "min_lr": ("cosine_with_warmup",),
    "total_steps": ("cosine_with_warmup", "onecycle"),
    "constant_after_warmup": ("linear_warmup",),
    "max_lr": ("onecycle",),
    "pct_start": ("onecycle",),
    "div_factor": ("onecycle",),
    "final_div_factor": ("onecycle",),
    "anneal_strategy": ("onecycle",),
}
#: Optimizer names -> OptimizerSwap name (None: keep the module's own optimizer).
_OPTIMIZERS: Final[dict[str, str | None]] = {
    "adamw": None,
    "adamw_8bit": "adamw8bit",
    "adam_8bit": "adam8bit",
    "lion_8bit": "lion8bit",
    "sgd_8bit": "sgd8bit",
    "paged_adamw_8bit": "paged_adamw8bit",
    "adamw_fused": "adamw_fused",
}
#: Attention implementations (Hugging Face's names) -> AttentionSwap backend.
_ATTENTION: Final[dict[str, str]] = {"flash_attention_2": "flash", "sdpa": "sdpa", "eager": "eager", "auto": "auto"}


def load_config(source: str | os.PathLike[str] | Mapping[str, Any]) -> dict[str, Any]:
    """Read a configuration: a YAML file, or a mapping as it is.

    Args:
        source: Path of a YAML file, or a mapping.

    Returns:
        The configuration as a dict.

    Raises:
        TypeError: If ``source`` is neither a path nor a mapping, or the file does not hold a mapping.
        FileNotFoundError: If the file does not exist.
        ValueError: If the path is empty or a directory, or the file is not UTF-8 text or not valid YAML.
    """
    if isinstance(source, Mapping):
        return dict(source)
    if not isinstance(source, (str, os.PathLike)):
        raise TypeError(
            f"`path_or_dict` must be a path to a YAML file or a mapping, got {source!r} ({type(source).__name__})"
        )
    import yaml

    if not os.fspath(source).strip():  # Path("") would be the current directory
        raise ValueError(f"`path_or_dict` must be the path of a YAML file, got the empty path {os.fspath(source)!r}")
    path = Path(source)
    if path.is_dir():
        raise ValueError(f"configuration file {str(path)!r} is a directory; give the path of a YAML file")
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FileNotFoundError(f"configuration file {str(path)!r} does not exist") from None
    except UnicodeDecodeError as err:
        raise ValueError(
            f"configuration file {str(path)!r} is not a YAML text file (byte {err.start} is not UTF-8 text)"
        ) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ValueError(f"configuration file {str(path)!r} is not valid YAML: {err}") from err
    if not isinstance(data, Mapping):
        raise TypeError(f"configuration file {str(path)!r} must hold a mapping (`training:` ...), got {data!r}")
    return dict(data)


def from_config(path_or_dict: str | os.PathLike[str] | Mapping[str, Any]) -> TrainingConfig:
    """Turn a training configuration into Trainer arguments, callbacks and plugins.

    The configuration is a YAML file or a dict, with or without the top-level ``training:`` key. Everything is
    checked here and the callbacks are built once; the plugin and strategy, which depend on the machine (fp16 and
    DeepSpeed need CUDA), are built by :meth:`~TrainingConfig.trainer_kwargs`, so a GPU configuration can be loaded
    and inspected anywhere.

    Args:
        path_or_dict: Path of a YAML file, or a mapping.

    Returns:
        The checked configuration; ``Trainer(**config.trainer_kwargs())``.

    Raises:
        TypeError: If a value has the wrong type (the message names its dotted key).
        ValueError: If a key is unknown or cannot be honoured, or a value is not allowed (the message says what is).
        ModuleNotFoundError: If a configured feature needs an optional package that is missing (names the extra).

    Example:
        >>> config = from_config({"training": {"precision": "bf16", "micro_batch_size": 8,
        ...                                    "gradient_accumulation_steps": 4}})
        >>> config.precision, config.micro_batch_size, config.accumulate_grad_batches
        ('bf16-mixed', 8, 4)
        >>> sorted(config.trainer_kwargs())
        ['accumulate_grad_batches', 'plugins']
    """
    data = load_config(path_or_dict)
    if ROOT in data:
        root = Section(data, "", {ROOT, "multi_gpu"}, {"inference": _INFERENCE})
        if data[ROOT] is not None and not isinstance(data[ROOT], Mapping):
            raise TypeError(f"`{ROOT}` must be a mapping of keys to values, got {data[ROOT]!r}")
        training = dict(data[ROOT] or {})
        if "multi_gpu" in root:  # the guides put `multi_gpu:` beside `training:` as often as inside it
            if "multi_gpu" in training:
                raise ValueError("`multi_gpu` is given both beside and inside `training`; keep one")
            training["multi_gpu"] = data["multi_gpu"]
    else:
        training = data
    config = _parse(Section(training, ROOT, _TRAINING_KEYS, {"inference": _INFERENCE}), source=data)
    # Build the callbacks once, and check the optional packages, so that a configuration that loads also builds.
    # The plugin and the strategy depend on the machine (fp16 needs CUDA, DeepSpeed too): trainer_kwargs() builds
    # them, so a GPU configuration can still be loaded and inspected on a CPU-only machine.
    config.callbacks()
    if config.optimizer is not None and config.optimizer != "adamw_fused":
        _imports.require("bitsandbytes", feature=f"`{ROOT}.optimizer` {config.optimizer!r}")
    if config.deepspeed is not None:
        _imports.require("deepspeed", feature=f"`{ROOT}.cpu_offload` (DeepSpeed)")
    return config


def _parse(section: Section, source: Mapping[str, Any]) -> TrainingConfig:
    micro, accumulate = _batch(section)
    deepspeed = _cpu_offload(section)
    precision, deepspeed = _precision(section, deepspeed)
    optimizer = _optimizer(section, deepspeed)
    schedule, schedule_kwargs, initial_lr, plateau = _learning_rate(section)
    devices, data_parallel, backend = _multi_gpu(section)
    if deepspeed is not None and backend is not None:
        deepspeed = DeepSpeedSettings(
            stage=deepspeed.stage,
            offload_optimizer=deepspeed.offload_optimizer,
            offload_parameters=deepspeed.offload_parameters,
            pin_memory=deepspeed.pin_memory,
            extra={**deepspeed.extra, "process_group_backend": backend},
        )
    every_n, async_save = _checkpoint(section, deepspeed)
    _model_parallel(section)
    return TrainingConfig(
        precision=precision,
        micro_batch_size=micro,
        sequence_length=section.integer("sequence_length", minimum=1),
        accumulate_grad_batches=accumulate,
        dataloader_kwargs=_dataloader(section),
        initial_lr=initial_lr,
        schedule=schedule,  # type: ignore[arg-type]
        schedule_kwargs=schedule_kwargs,
        plateau_kwargs=plateau,
        dynamic_batch_kwargs=_dynamic_batch(section, micro),
        optimizer=optimizer,
        attention=_attention(section),
        checkpointing_blocks=_gradient_checkpointing(section),
        compile_kwargs=_compilation(section),
        deepspeed=deepspeed,
        devices=devices,
        data_parallel=data_parallel,
        process_group_backend=backend if deepspeed is None else None,
        checkpoint_every_n_steps=every_n,
        async_checkpoint=async_save,
        source=source,
    )


def _enabled(section: Section, default: bool = True) -> bool:
    value = section.boolean("enabled", default)
    return bool(value)


# --------------------------------------------------------------------------------------------------------- batch


def _batch(section: Section) -> tuple[int | None, int | None]:
    batch = section.integer("batch_size", minimum=1)
    micro = section.integer("micro_batch_size", minimum=1)
    accumulate = section.integer("gradient_accumulation_steps", minimum=1)
    if batch is None:
        return micro, accumulate
    names = (section.name("batch_size"), section.name("micro_batch_size"), section.name("gradient_accumulation_steps"))
    if micro is not None and accumulate is not None:
        if micro * accumulate != batch:
            raise ValueError(
                f"`{names[0]}` ({batch}) must equal `{names[1]}` x `{names[2]}` ({micro} x {accumulate} = "
                f"{micro * accumulate}) per device"
            )
        return micro, accumulate
    if micro is not None or accumulate is not None:
        given, other = (micro, names[1]) if micro is not None else (accumulate, names[2])
        assert given is not None
        if batch % given:
            raise ValueError(f"`{names[0]}` ({batch}) must be a multiple of `{other}` ({given})")
        return (micro, batch // given) if micro is not None else (batch // given, accumulate)
    return batch, None


def _dataloader(section: Section) -> dict[str, Any]:
    loader = section.section("dataloader", {"num_workers", "pin_memory", "prefetch_factor", "persistent_workers"})
    kwargs: dict[str, Any] = {}
    workers = loader.integer("num_workers", minimum=0)
    if workers is not None:
        kwargs["num_workers"] = workers
    for key in ("pin_memory", "persistent_workers"):
        if (value := loader.boolean(key)) is not None:
            kwargs[key] = value
    if (prefetch := loader.integer("prefetch_factor", minimum=1)) is not None:
        kwargs["prefetch_factor"] = prefetch
    for key in ("prefetch_factor", "persistent_workers"):
        if kwargs.get(key) and not workers:
            raise ValueError(
                f"`{loader.name(key)}` needs worker processes (torch's DataLoader refuses it without them); set "
                f"`{loader.name('num_workers')}` to 1 or more, got {workers!r}"
            )
    return kwargs


def _dynamic_batch(section: Section, micro: int | None) -> dict[str, Any] | None:
    keys = {
        "enabled",
        "min_batch_size",
        "max_batch_size",
        "target_vram_utilization",
        "adjustment_interval",
        "keep",
        "lr_rule",
        "multiple_of",
    }
    if "dynamic_batch_size" not in section:
        return None
    dyn = section.section("dynamic_batch_size", keys)
    kwargs: dict[str, Any] = {}
    if (target := dyn.number("target_vram_utilization", low=0.0, high=0.98, low_inclusive=False)) is not None:
        kwargs["target_vram"] = target
    lowest = dyn.integer("min_batch_size", minimum=1)
    highest = dyn.integer("max_batch_size", minimum=1)
    if lowest is not None:
        kwargs["min_batch_size"] = lowest
    if highest is not None:
        kwargs["max_batch_size"] = highest
    if lowest is not None and highest is not None and lowest > highest:
        raise ValueError(
            f"`{dyn.name('min_batch_size')}` ({lowest}) must not exceed `{dyn.name('max_batch_size')}` ({highest})"
        )
    if micro is not None and not (lowest or 1) <= micro <= (highest or micro):
        raise ValueError(
            f"`{section.name('micro_batch_size')}` ({micro}) is the starting batch size and must lie in "
            f"[`{dyn.name('min_batch_size')}`, `{dyn.name('max_batch_size')}`] = [{lowest or 1}, {highest}]"
        )
    if (interval := dyn.integer("adjustment_interval", minimum=1)) is not None:
        kwargs["adjust_every"] = interval
    if (keep := dyn.choice("keep", ("effective", "lr", "none"))) is not None:
        kwargs["keep"] = keep
    if (rule := dyn.choice("lr_rule", ("sqrt", "linear"))) is not None:
        kwargs["lr_rule"] = rule
    if (multiple := dyn.integer("multiple_of", minimum=1)) is not None:
        kwargs["multiple_of"] = multiple
    return kwargs if _enabled(dyn) else None


# ------------------------------------------------------------------------------------------------- learning rate


def _learning_rate(
    section: Section,
) -> tuple[str | None, dict[str, Any], float | None, dict[str, Any] | None]:
    lr = section.section("learning_rate", {"initial", "schedule", "adaptive", *_SCHEDULE_KEYS})
    schedule = lr.choice("schedule", _SCHEDULES)
    for key, schedules in _SCHEDULE_KEYS.items():
        if key in lr and schedule not in schedules:
            now = f"is {schedule!r}" if schedule else "is not set"
            raise ValueError(
                f"`{lr.name(key)}` applies to schedule {' or '.join(repr(s) for s in schedules)}, but "
                f"`{lr.name('schedule')}` {now}"
            )
    initial = lr.number("initial", low=0.0, low_inclusive=False)
    if initial is not None and schedule == "onecycle":
        raise ValueError(
            f"`{lr.name('initial')}` does not apply to schedule 'onecycle', which starts at `max_lr` / `div_factor`; "
            f"give the peak as `{lr.name('max_lr')}`"
        )
    kwargs: dict[str, Any] = {}
    if schedule in ("cosine_with_warmup", "linear_warmup"):
        steps = lr.integer("warmup_steps", minimum=0 if schedule == "cosine_with_warmup" else 1)
        ratio = lr.number("warmup_ratio", low=0.0, high=1.0, high_inclusive=False)
        if (steps is None) == (ratio is None) and schedule == "cosine_with_warmup":
            raise ValueError(
                f"schedule 'cosine_with_warmup' needs exactly one of `{lr.name('warmup_steps')}` and "
                f"`{lr.name('warmup_ratio')}` (0 steps for no warm-up), got "
                f"{'both' if steps is not None else 'neither'}"
            )
        if steps is None and schedule == "linear_warmup":
            raise ValueError(f"schedule 'linear_warmup' needs `{lr.name('warmup_steps')}` (an integer >= 1)")
        kwargs["warmup_steps"] = steps
    if schedule == "cosine_with_warmup":
        if ratio is not None:
            kwargs["warmup_ratio"] = ratio
        total = lr.integer("total_steps", minimum=1)
        if total is not None:
            kwargs["total_steps"] = total
            if steps is not None and steps >= total:
                raise ValueError(
                    f"`{lr.name('warmup_steps')}` ({steps}) must be smaller than `{lr.name('total_steps')}` ({total})"
                )
        min_lr = lr.number("min_lr", low=0.0)
        if min_lr is not None:
            kwargs["min_lr"] = min_lr
            if initial is not None and min_lr > initial:
                raise ValueError(
                    f"`{lr.name('min_lr')}` ({min_lr:g}) must not exceed `{lr.name('initial')}` ({initial:g})"
                )
    elif schedule == "linear_warmup":
        if lr.boolean("constant_after_warmup") is False:
            raise reject(
                lr.name("constant_after_warmup"),
                "schedule 'linear_warmup' holds the learning rate after the warm-up; for a decay use "
                "'cosine_with_warmup' (with `min_lr`) or 'onecycle'",
            )
    elif schedule == "onecycle":
        max_lr = lr.number("max_lr", low=0.0, low_inclusive=False)
        if max_lr is None:
            raise ValueError(f"schedule 'onecycle' needs `{lr.name('max_lr')}` (its peak learning rate, > 0)")
        kwargs["max_lr"] = max_lr
        for key, low_inclusive, high in (
            ("pct_start", False, 1.0),
            ("div_factor", False, None),
            ("final_div_factor", False, None),
        ):
            value = lr.number(key, low=0.0, high=high, low_inclusive=low_inclusive, high_inclusive=False)
            if value is not None:
                kwargs[key] = value
        if (total := lr.integer("total_steps", minimum=1)) is not None:
            kwargs["total_steps"] = total
        if (anneal := lr.choice("anneal_strategy", ("cos", "linear"))) is not None:
            kwargs["anneal_strategy"] = anneal
    return schedule, kwargs, initial, _adaptive(lr)


def _adaptive(lr: Section) -> dict[str, Any] | None:
    keys = {"enabled", "monitor", "mode", "factor", "patience", "min_lr", "threshold", "cooldown"}
    if "adaptive" not in lr:
        return None
    adaptive = lr.section("adaptive", keys)
    kwargs: dict[str, Any] = {}
    if (monitor := adaptive.text("monitor")) is not None:
        kwargs["monitor"] = monitor
    if (mode := adaptive.choice("mode", ("min", "max"))) is not None:
        kwargs["mode"] = mode
    if (factor := adaptive.number("factor", low=0.0, high=1.0, low_inclusive=False, high_inclusive=False)) is not None:
        kwargs["factor"] = factor
    for key in ("patience", "cooldown"):
        if (count := adaptive.integer(key, minimum=0)) is not None:
            kwargs[key] = count
    for key in ("min_lr", "threshold"):
        if (value := adaptive.number(key, low=0.0)) is not None:
            kwargs[key] = value
    return kwargs if _enabled(adaptive) else None


# ------------------------------------------------------------------------------------------- precision and memory


def _precision(section: Section, deepspeed: DeepSpeedSettings | None) -> tuple[str | None, DeepSpeedSettings | None]:
    mixed_keys = {"enabled", "loss_scale", "loss_scale_window", "hysteresis"}
    mixed = section.section("mixed_precision", mixed_keys)
    amp = section.section(
        "amp",
        {"enabled", "keep_batchnorm_fp32"},
        {
            "opt_level": "apex AMP opt levels are not available in Lightning 2.x, which dropped apex; choose the "
            "precision with `training.precision` (fp16, bf16, fp32) and `training.mixed_precision.enabled`",
        },
    )
    enabled = mixed.boolean("enabled")
    amp_enabled = amp.boolean("enabled")
    if enabled is not None and amp_enabled is not None and enabled != amp_enabled:
        raise ValueError(f"`{mixed.name('enabled')}` ({enabled}) and `{amp.name('enabled')}` ({amp_enabled}) disagree")
    enabled = enabled if enabled is not None else amp_enabled
    name = section.raw("precision")
    precision = lightning_precision(name, enabled, key=section.name("precision"), mixed_key=mixed.name("enabled"))
    keep_bn = amp.boolean("keep_batchnorm_fp32")
    if keep_bn is False:
        raise reject(
            amp.name("keep_batchnorm_fp32"), "torch.autocast always runs batch norm in float32; it cannot be turned off"
        )
    if keep_bn and precision is not None and precision.endswith("-true") and precision != "32-true":
        raise reject(
            amp.name("keep_batchnorm_fp32"),
            f"precision {precision!r} stores every weight, batch norm included, in half precision; use mixed "
            "precision, where autocast keeps batch norm in float32",
        )
    scale_keys = [key for key in ("loss_scale", "loss_scale_window", "hysteresis") if key in mixed]
    if not scale_keys:
        return precision, deepspeed
    if precision is None or not precision.startswith("16-"):
        raise reject(
            mixed.name(scale_keys[0]),
            f"loss scaling applies to fp16 only, and the precision is {precision or 'fp32'!r} (bf16 needs none)",
        )
    extra: dict[str, Any] = {}
    raw_scale = mixed.raw("loss_scale")
    if isinstance(raw_scale, str) and raw_scale != "dynamic" and not raw_scale[:1].isdigit():
        raise ValueError(
            f"`{mixed.name('loss_scale')}` must be 'dynamic' or a number > 0 (a static scale), got {raw_scale!r}"
        )
    if raw_scale is not None and raw_scale != "dynamic":
        extra["loss_scale"] = mixed.number("loss_scale", low=0.0, low_inclusive=False)
    if (window := mixed.integer("loss_scale_window", minimum=1)) is not None:
        extra["loss_scale_window"] = window
    if (hysteresis := mixed.integer("hysteresis", minimum=1)) is not None:
        extra["hysteresis"] = hysteresis
    if deepspeed is None:
        if extra:
            key = next(iter(extra))
            raise reject(
                mixed.name(key),
                "outside DeepSpeed, Lightning's 16-mixed scales the loss with torch.amp.GradScaler's dynamic scale, "
                "which has no static scale or hysteresis and is not configurable through the pack; use "
                "`training.cpu_offload` (DeepSpeed), or remove the key (`loss_scale: dynamic` is what GradScaler does)",
            )
        return precision, deepspeed
    return precision, DeepSpeedSettings(
        stage=deepspeed.stage,
        offload_optimizer=deepspeed.offload_optimizer,
        offload_parameters=deepspeed.offload_parameters,
        pin_memory=deepspeed.pin_memory,
        extra={**deepspeed.extra, **extra},
    )


def _cpu_offload(section: Section) -> DeepSpeedSettings | None:
    keys = {"enabled", "offload_optimizer", "offload_gradients", "offload_parameters", "stage", "pin_memory"}
    if "cpu_offload" not in section:
        return None
    offload = section.section("cpu_offload", keys)
    optimizer = offload.boolean("offload_optimizer", True)
    parameters = offload.boolean("offload_parameters", False)
    gradients = offload.boolean("offload_gradients")
    stage = offload.integer("stage", 3 if parameters else 2)
    pin = offload.boolean("pin_memory", False)
    if stage not in (1, 2, 3):
        raise ValueError(f"`{offload.name('stage')}` must be one of 1, 2, 3 (ZeRO stages that offload), got {stage!r}")
    if gradients is not None and gradients != optimizer:
        raise reject(
            offload.name("offload_gradients"),
            "DeepSpeed's optimizer offload moves each gradient partition to the CPU for the optimizer step and "
            "has no separate gradient switch; remove the key (gradients follow "
            f"`{offload.name('offload_optimizer')}`)",
        )
    if parameters and stage != 3:
        raise ValueError(
            f"`{offload.name('offload_parameters')}` needs ZeRO stage 3, but `{offload.name('stage')}` is {stage}"
        )
    if not _enabled(offload):
        return None
    if not optimizer and not parameters:
        raise ValueError(
            f"`{offload.name('enabled')}` is true but nothing is offloaded: set `{offload.name('offload_optimizer')}` "
            f"or `{offload.name('offload_parameters')}` to true"
        )
    return DeepSpeedSettings(
        stage=stage, offload_optimizer=bool(optimizer), offload_parameters=bool(parameters), pin_memory=bool(pin)
    )


def _optimizer(section: Section, deepspeed: DeepSpeedSettings | None) -> str | None:
    name = section.choice("optimizer", tuple(_OPTIMIZERS))
    if name is None:
        return None
    swap = _OPTIMIZERS[name]
    if swap is not None and deepspeed is not None:
        raise reject(
            section.name("optimizer"),
            f"{name!r} swaps the module's optimizer, which DeepSpeed replaces with its own when "
            "`training.cpu_offload` is on; use 'adamw' (DeepSpeed offloads it to CPU Adam) or turn CPU offload off",
        )
    return swap


def _attention(section: Section) -> str | None:
    value = section.raw("attention")
    if value is None:
        return None
    if isinstance(value, str):  # shorthand `attention: flash_attention_2`
        implementation = section.choice("attention", tuple(_ATTENTION))
    else:
        implementation = section.section("attention", {"implementation"}).choice("implementation", tuple(_ATTENTION))
        if implementation is None:
            raise ValueError(f"`{section.name('attention.implementation')}` is required under `attention`")
    assert implementation is not None
    return _ATTENTION[implementation]


def _gradient_checkpointing(section: Section) -> Any:
    value = section.raw("gradient_checkpointing")
    if value is None or isinstance(value, bool):
        if value is None:
            return None
        return "auto" if value else None
    ckpt = section.section(
        "gradient_checkpointing",
        {"enabled", "block_types"},
        {
            "checkpoint_segments": "lightning_tune checkpoints each transformer block separately (as Hugging Face's "
            "gradient_checkpointing_enable does); segment counts need one nn.Sequential to cut "
            "(torch.utils.checkpoint.checkpoint_sequential). Remove the key, or name the blocks with `block_types`",
        },
    )
    blocks = ckpt.raw("block_types")
    if blocks is not None:
        if isinstance(blocks, str):
            blocks = [blocks]
        if not isinstance(blocks, list) or not blocks or not all(isinstance(b, str) and b for b in blocks):
            raise TypeError(
                f"`{ckpt.name('block_types')}` must be a class name or a list of class names (e.g. 'Block' or "
                f"'torch.nn.TransformerEncoderLayer'), got {blocks!r}"
            )
    if not _enabled(ckpt):
        return None
    return tuple(blocks) if blocks else "auto"


def _compilation(section: Section) -> dict[str, Any] | None:
    value = section.raw("compilation")
    if value is None:
        return None
    if isinstance(value, str):
        return {} if section.choice("compilation", ("torch_compile", "none")) == "torch_compile" else None
    if isinstance(value, bool):
        return {} if value else None
    if not isinstance(value, dict):
        raise TypeError(
            f"`{section.name('compilation')}` must be 'torch_compile', 'none', true, false or a mapping with keys "
            f"enabled, mode, fullgraph, dynamic, backend; got {value!r} ({type(value).__name__})"
        )
    comp = section.section("compilation", {"enabled", "mode", "fullgraph", "dynamic", "backend"})
    from lightning_tune.presets.compile import COMPILE_MODES

    kwargs: dict[str, Any] = {}
    if (mode := comp.choice("mode", COMPILE_MODES)) is not None:
        kwargs["mode"] = mode
    if (fullgraph := comp.boolean("fullgraph")) is not None:
        kwargs["fullgraph"] = fullgraph
    if "dynamic" in comp and comp.raw("dynamic") is not None:
        kwargs["dynamic"] = comp.boolean("dynamic")
    if (backend := comp.text("backend")) is not None:
        import torch

        comp.choice("backend", torch.compiler.list_backends(exclude_tags=()))
        kwargs["backend"] = backend
    return kwargs if _enabled(comp) else None


# ------------------------------------------------------------------------------------------ devices and checkpoints


def _multi_gpu(section: Section) -> tuple[int | tuple[int, ...] | None, bool, str | None]:
    unsupported = "lightning_tune trains data-parallel only (DDP, or DeepSpeed with `training.cpu_offload`)"
    multi = section.section(
        "multi_gpu",
        {"strategy", "devices", "backend"},
        {
            "tensor_parallel_size": unsupported,
            "pipeline_parallel_size": unsupported,
            "micro_batches": f"pipeline micro-batches need pipeline parallelism; {unsupported}",
            "tensor_split": "uneven splits across GPU types need tensor parallelism; " + unsupported,
            "auto_balance": "balancing across GPU types is not provided; " + unsupported,
            "balance_metric": "balancing across GPU types is not provided; " + unsupported,
        },
    )
    strategy = multi.raw("strategy")
    if strategy in ("tensor_parallel", "pipeline_parallel"):
        raise reject(multi.name("strategy"), f"{strategy!r}: {unsupported}")
    data_parallel = multi.choice("strategy", ("data_parallel",)) == "data_parallel"
    devices: int | tuple[int, ...] | None = None
    raw = multi.raw("devices")
    if raw is not None:
        if isinstance(raw, list):
            for index, device in enumerate(raw):
                check_int(f"{multi.name('devices')}[{index}]", device, minimum=0)
            if not raw or len(set(raw)) != len(raw):
                raise ValueError(f"`{multi.name('devices')}` must list distinct GPU indices, got {raw!r}")
            devices = tuple(raw)
        else:
            devices = multi.integer("devices", minimum=1)
    backend = multi.choice("backend", ("nccl", "gloo"))
    if backend is not None and not data_parallel:
        raise ValueError(
            f"`{multi.name('backend')}` ({backend!r}) sets the process-group backend of data parallelism: it needs "
            f"`{multi.name('strategy')}: data_parallel`"
        )
    return devices, data_parallel, backend


def _model_parallel(section: Section) -> None:
    parallel = section.section("model_parallel", {"enabled", "tensor_parallel_size", "pipeline_parallel_size"})
    sizes = {key: parallel.integer(key, minimum=1) for key in ("tensor_parallel_size", "pipeline_parallel_size")}
    reason = (
        "tensor and pipeline parallelism need a model written for them (Lightning's ModelParallelStrategy); "
        "lightning_tune trains data-parallel only"
    )
    if _enabled(parallel, default=False):
        raise reject(parallel.name("enabled"), reason)
    asked = [key for key, size in sizes.items() if size is not None and size > 1]
    if asked and parallel.raw("enabled") is not False:  # a size above 1 is a request unless `enabled: false` says no
        raise reject(parallel.name(asked[0]), reason)


def _checkpoint(section: Section, deepspeed: DeepSpeedSettings | None) -> tuple[int | None, bool]:
    ckpt = section.section("checkpoint", {"save_interval", "async_save"})
    every_n = ckpt.integer("save_interval", minimum=1)
    async_save = bool(ckpt.boolean("async_save", False))
    if async_save and deepspeed is not None:
        raise reject(
            ckpt.name("async_save"),
            "DeepSpeed writes its sharded checkpoints itself; Lightning's AsyncCheckpointIO does not apply",
        )
    return every_n, async_save
