"""``from_config``: a training configuration file (YAML or a dict) to Trainer arguments, callbacks and plugins.

:data:`KEYS` sends each key to an argument of a "part" (a callback, the plugin or a setting), whose own class checks it;
its messages are re-worded to name the key by its dotted path. Every problem in a file is reported at once.
"""

from __future__ import annotations

import difflib
import inspect
import os
import re
import reprlib
import warnings
from collections import defaultdict
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import torch

from lightning_tune import _imports
from lightning_tune._validation import check_bool, check_choice, check_int
from lightning_tune.callbacks.dynamic_batch import DynamicBatchSize
from lightning_tune.callbacks.lr_plateau import AdaptiveLROnPlateau
from lightning_tune.callbacks.surgery import ActivationCheckpointing, TorchCompile
from lightning_tune.config.initial_lr import InitialLR
from lightning_tune.config.precision import lightning_precision
from lightning_tune.config.training import SCHEDULE_CALLBACKS, SCHEDULES, Schedule, TrainingConfig
from lightning_tune.plugins.deepspeed import DeepSpeedSettings
from lightning_tune.swaps.optimizer import TARGETS
from lightning_tune.vocab import canonical_attention, canonical_loss, canonical_optimizer

ROOT: Final = "training"
Convert = Callable[[str, Any], Any]
# PyYAML follows YAML 1.1, where `3e-4` (no dot) is a string, not a float; number keys accept such strings.
_FLOAT_TEXT = re.compile(r"[-+]?(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+)?")


def _number(path: str, value: Any) -> Any:
    return float(value) if isinstance(value, str) and _FLOAT_TEXT.fullmatch(value.strip()) else value


def _checked(check: Callable[..., None], *args: Any, **kwargs: Any) -> Convert:
    """A converter that checks a value with ``check(path, value, *args, **kwargs)`` and keeps it."""

    def convert(path: str, value: Any) -> Any:
        check(path, value, *args, **kwargs)
        return value

    return convert


_bool = _checked(check_bool)
_count = _checked(check_int, minimum=0)
_positive = _checked(check_int, minimum=1)


def _compilation(path: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if not isinstance(value, str):
        raise TypeError(f"`{path}` must be 'torch_compile', 'none', true, false or a mapping, got {value!r}")
    check_choice(path, value, ("torch_compile", "none"))
    return value == "torch_compile"


def _loss_scale(path: str, value: Any) -> float:
    value = _number(path, value)
    if value == "dynamic" or (isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0):
        return 0.0 if value == "dynamic" else float(value)  # DeepSpeed's loss_scale 0 is its dynamic scale
    raise ValueError(f"`{path}` must be 'dynamic' or a number > 0 (a static scale), got {value!r}")


def _strategy(path: str, value: Any) -> bool:
    if value in ("tensor_parallel", "pipeline_parallel"):
        raise _refused(path, f"{value!r}: {_DATA_PARALLEL_ONLY}")
    check_choice(path, value, ("data_parallel",))
    return True


def _devices(path: str, value: Any) -> int | tuple[int, ...]:
    if not isinstance(value, list):
        return _positive(path, value)
    for index, device in enumerate(value):
        check_int(f"{path}[{index}]", device, minimum=0)
    if not value or len(set(value)) != len(value):
        raise ValueError(f"`{path}` must list distinct GPU indices, got {value!r}")
    return tuple(value)


#: Key under ``training:`` -> (part, argument, converter or None). The parts are built in :func:`from_config`.
KEYS: Final[dict[str, tuple[str, str, Convert | None]]] = {
    "precision": ("precision", "name", None),
    "mixed_precision.enabled": ("precision", "mixed", None),
    "amp.enabled": ("precision", "amp", None),
    "amp.keep_batchnorm_fp32": ("precision", "keep_batchnorm_fp32", _bool),
    "mixed_precision.loss_scale": ("loss_scaling", "loss_scale", _loss_scale),
    **{f"mixed_precision.{arg}": ("loss_scaling", arg, _positive) for arg in ("loss_scale_window", "hysteresis")},
    "optimizer": ("plugin", "optimizer", lambda p, v: canonical_optimizer(v, arg=p, allowed=("adamw", *TARGETS))),
    "attention": ("plugin", "attention", lambda p, v: canonical_attention(v, arg=p)),
    "attention.implementation": ("plugin", "attention", lambda p, v: canonical_attention(v, arg=p)),
    "loss": ("plugin", "loss", lambda p, v: canonical_loss(v, arg=p)),
    **{key: ("batch", key, _positive) for key in ("batch_size", "micro_batch_size", "sequence_length")},
    "gradient_accumulation_steps": ("batch", "accumulate_grad_batches", _positive),
    "dynamic_batch_size.enabled": ("dynamic_batch", "enabled", _bool),
    "dynamic_batch_size.target_vram_utilization": ("dynamic_batch", "target_vram", _number),
    "dynamic_batch_size.adjustment_interval": ("dynamic_batch", "adjust_every", None),
    **{
        f"dynamic_batch_size.{arg}": ("dynamic_batch", arg, None)
        for arg in ("min_batch_size", "max_batch_size", "keep", "lr_rule", "multiple_of")
    },
    "learning_rate.initial": ("initial_lr", "lr", _number),
    "learning_rate.schedule": ("schedule", "schedule", _checked(check_choice, SCHEDULES)),
    "learning_rate.constant_after_warmup": ("schedule", "constant_after_warmup", _bool),
    **{
        f"learning_rate.{arg}": ("schedule", arg, _number)
        for arg in ("warmup_steps", "warmup_ratio", "min_lr", "total_steps", "max_lr", "pct_start", "div_factor")
    },
    "learning_rate.final_div_factor": ("schedule", "final_div_factor", _number),
    "learning_rate.anneal_strategy": ("schedule", "anneal_strategy", None),
    **{
        f"learning_rate.adaptive.{arg}": ("plateau", arg, _bool if arg == "enabled" else _number)
        for arg in ("enabled", "monitor", "mode", "factor", "patience", "min_lr", "threshold", "cooldown")
    },
    **dict.fromkeys(("gradient_checkpointing", "gradient_checkpointing.enabled"), ("checkpointing", "enabled", _bool)),
    "gradient_checkpointing.block_types": ("checkpointing", "block_types", None),
    "compilation": ("compile", "enabled", _compilation),
    "compilation.enabled": ("compile", "enabled", _bool),
    **{f"compilation.{arg}": ("compile", arg, None) for arg in ("mode", "fullgraph", "dynamic", "backend")},
    "dataloader.num_workers": ("dataloader", "num_workers", _count),
    "dataloader.prefetch_factor": ("dataloader", "prefetch_factor", _positive),
    **{f"dataloader.{arg}": ("dataloader", arg, _bool) for arg in ("pin_memory", "persistent_workers")},
    **{f"cpu_offload.{a}": ("deepspeed", a, _bool) for a in ("enabled", "offload_gradients")},
    **{f"cpu_offload.{a}": ("deepspeed", a, None) for a in ("stage", "offload_optimizer", "offload_parameters")},
    "cpu_offload.pin_memory": ("deepspeed", "pin_memory", None),
    "multi_gpu.strategy": ("devices", "data_parallel", _strategy),
    "multi_gpu.devices": ("devices", "devices", _devices),
    "multi_gpu.backend": ("devices", "process_group_backend", _checked(check_choice, ("nccl", "gloo"))),
    "model_parallel.enabled": ("model_parallel", "enabled", _bool),
    "model_parallel.tensor_parallel_size": ("model_parallel", "tensor_parallel_size", _positive),
    "model_parallel.pipeline_parallel_size": ("model_parallel", "pipeline_parallel_size", _positive),
    "checkpoint.save_interval": ("checkpoint", "checkpoint_every_n_steps", _positive),
    "checkpoint.async_save": ("checkpoint", "async_checkpoint", _bool),
}
_DATA_PARALLEL_ONLY = "lightning_tune trains data-parallel only (DDP, or DeepSpeed with `training.cpu_offload`)"
#: Keys of tuning guides that cannot be honoured -> why.
REFUSED: Final[dict[str, str]] = {
    "inference": "lightning_tune configures training runs; serving settings (continuous batching, KV cache, "
    "speculative decoding) belong to an inference server. Keep only the `training:` section",
    "amp.opt_level": "apex AMP opt levels are not available in Lightning 2.x, which dropped apex; choose the "
    "precision with `training.precision` (fp16, bf16, fp32) and `training.mixed_precision.enabled`",
    "gradient_checkpointing.checkpoint_segments": "lightning_tune checkpoints each transformer block separately (as "
    "Hugging Face's gradient_checkpointing_enable does); segment counts need one nn.Sequential to cut "
    "(torch.utils.checkpoint.checkpoint_sequential). Remove the key, or name the blocks with `block_types`",
    "multi_gpu.tensor_parallel_size": _DATA_PARALLEL_ONLY,
    "multi_gpu.pipeline_parallel_size": _DATA_PARALLEL_ONLY,
    "multi_gpu.micro_batches": f"pipeline micro-batches need pipeline parallelism; {_DATA_PARALLEL_ONLY}",
    **{
        f"multi_gpu.{key}": f"balancing across GPU types needs tensor parallelism; {_DATA_PARALLEL_ONLY}"
        for key in ("tensor_split", "auto_balance", "balance_metric")
    },
}
#: The largest value of each number key: far above any real run, so that a slip (``1e32``, digits run together) is
#: refused here and not in the DataLoader or hours into training. The callbacks check the lower ends.
LIMITS: Final[dict[str, int | float]] = {
    **dict.fromkeys(  # samples of a batch, tokens of a sequence
        ("batch_size", "micro_batch_size", "sequence_length")
        + tuple(f"dynamic_batch_size.{k}" for k in ("min_batch_size", "max_batch_size", "multiple_of")),
        2**24,
    ),
    **dict.fromkeys(  # optimizer steps, evaluations
        ("gradient_accumulation_steps", "dynamic_batch_size.adjustment_interval", "checkpoint.save_interval")
        + ("learning_rate.warmup_steps", "learning_rate.total_steps", "mixed_precision.loss_scale_window")
        + ("mixed_precision.hysteresis", "learning_rate.adaptive.patience", "learning_rate.adaptive.cooldown"),
        10**9,
    ),
    **dict.fromkeys(  # processes and devices
        ("dataloader.num_workers", "dataloader.prefetch_factor", "multi_gpu.devices")
        + ("model_parallel.tensor_parallel_size", "model_parallel.pipeline_parallel_size"),
        1024,
    ),
    **dict.fromkeys(  # learning rates
        ("learning_rate.initial", "learning_rate.max_lr", "learning_rate.min_lr", "learning_rate.adaptive.min_lr"),
        100.0,
    ),
    "learning_rate.div_factor": 1e9,
    "learning_rate.final_div_factor": 1e9,
    "learning_rate.adaptive.threshold": 1.0,  # relative: 0.01 is 1 %
    "mixed_precision.loss_scale": 2.0**32,
}
_SECTIONS: Final = frozenset(path.rsplit(".", 1)[0] for path in [*KEYS, *REFUSED] if "." in path)
_MODEL_PARALLEL = (
    "tensor and pipeline parallelism need a model written for them (Lightning's ModelParallelStrategy); "
    "lightning_tune trains data-parallel only"
)


#: An error message holds at most this many characters: a problem in full, then as many more as fit.
MAX_MESSAGE: Final = 1500
_MAX_PROBLEM: Final = 500  # characters of one problem
_MAX_NAMED: Final = 5  # unknown keys named in one problem
_REPR = reprlib.Repr()
_REPR.maxstring, _REPR.maxother, _REPR.maxlevel = 160, 80, 3
_shown = _REPR.repr  # a value in a message is a few dozen characters, however large it is


def _capped(message: str, limit: int = _MAX_PROBLEM) -> str:
    return message if len(message) <= limit else f"{message[: limit - 40]}... ({len(message):,} characters, cut)"


def _raise(problems: list[Exception], source: str | None) -> None:
    """Raise the problems found as one error of at most :data:`MAX_MESSAGE` characters, naming the file if any."""
    if len(problems) == 1:
        message = _capped(f"{source}: {problems[0]}" if source else str(problems[0]))
        if message == str(problems[0]):
            raise problems[0]
        raise (TypeError if isinstance(problems[0], TypeError) else ValueError)(message) from None
    lines = [f"{len(problems):,} problems in {source or 'the configuration'}:"]
    for index, problem in enumerate(problems):
        line = f"- {_capped(str(problem))}"
        if sum(map(len, lines)) + len(line) > MAX_MESSAGE - 40:
            lines.append(f"- and {len(problems) - index:,} more")
            break
        lines.append(line)
    raise (TypeError if all(isinstance(p, TypeError) for p in problems) else ValueError)("\n".join(lines))


def _line(mark: Any) -> str:
    return "an unknown line" if mark is None else f"line {mark.line + 1}, column {mark.column + 1}"


def _within(path: str, value: Any, limit: float | None) -> None:
    """Refuse a number (or a list's number) above the key's limit."""
    for number in value if isinstance(value, (list, tuple)) else (value,):
        if limit is not None and isinstance(number, (int, float)) and not isinstance(number, bool) and number > limit:
            shown = f"{limit:,}" if isinstance(limit, int) else f"{limit:g}"
            raise ValueError(f"`{path}` must be at most {shown}, got {_shown(number)}")


def load_config(path_or_dict: str | os.PathLike[str] | Mapping[str, Any]) -> dict[str, Any]:
    """Read a configuration: a YAML file (safely, within the limits of ``docs/config.md``), or a mapping as it is.

    Raises:
        TypeError: If ``path_or_dict`` is neither a path nor a mapping, or the file does not hold a mapping.
        FileNotFoundError: If the file does not exist.
        ValueError: If the path is empty, a directory or not a regular file, or the file is not UTF-8 text, not valid
            YAML or passes a limit above (the message names the file, the line and the key).
    """
    source = path_or_dict
    if isinstance(source, Mapping):
        return dict(source)
    if not isinstance(source, (str, os.PathLike)):
        raise TypeError(
            f"`path_or_dict` must be a path to a YAML file or a mapping, got {_shown(source)} ({type(source).__name__})"
        )
    import yaml

    from lightning_tune.config._yaml import LimitError, read_yaml

    if not os.fspath(source).strip():  # Path("") would be the current directory
        raise ValueError(f"`path_or_dict` must be the path of a YAML file, got the empty path {os.fspath(source)!r}")
    path = Path(source)
    name = f"configuration file {_shown(str(path))}"
    if path.is_dir():
        raise ValueError(f"{name} is a directory; give the path of a YAML file")
    if path.exists() and not path.is_file():  # a FIFO or a device would block the read, or never end
        raise ValueError(f"{name} is not a regular file; give the path of a YAML file")
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FileNotFoundError(f"`path_or_dict`: {name} does not exist") from None
    except UnicodeDecodeError as err:
        raise ValueError(f"{name} is not a YAML text file (byte {err.start} is not UTF-8 text)") from None
    try:
        data = read_yaml(text)
    except yaml.MarkedYAMLError as err:
        at = _line(err.problem_mark or err.context_mark)
        if isinstance(err, LimitError):
            raise ValueError(_capped(f"{name}, {at}: {err.problem}")) from None
        context = f" ({err.context} from {_line(err.context_mark)})" if err.context and err.context_mark else ""
        raise ValueError(_capped(f"{name} is not valid YAML at {at}: {err.problem or err.context}{context}")) from None
    except (yaml.YAMLError, ValueError) as err:  # ValueError: an integer of over 4,300 digits (Python's limit)
        raise ValueError(_capped(f"{name} cannot be read: {' '.join(str(err).split())}")) from None
    if not isinstance(data, Mapping):
        raise TypeError(f"{name} must hold a mapping (`training:` ...), got {_shown(data)}")
    return dict(data)


def from_config(path_or_dict: str | os.PathLike[str] | Mapping[str, Any]) -> TrainingConfig:
    """Turn a training configuration into Trainer arguments, callbacks and plugins.

    The configuration is a YAML file or a dict, with or without the top-level ``training:`` key. What needs hardware
    or packages this machine lacks draws one warning (``docs/config.md``).

    Args:
        path_or_dict: Path of a YAML file, or a mapping.

    Raises:
        TypeError: If a value has the wrong type (the message names its dotted key), or every problem found is one.
        ValueError: If a key is unknown or cannot be honoured, a value is not allowed or above its :data:`LIMITS`, or
            the file cannot be read; several problems are listed in one error (``docs/config.md``).

    Example:
        >>> config = from_config({"training": {"precision": "bf16", "micro_batch_size": 8,
        ...                                    "gradient_accumulation_steps": 4}})
        >>> config.precision, config.micro_batch_size, config.accumulate_grad_batches
        ('bf16-mixed', 8, 4)
        >>> sorted(config.trainer_kwargs())
        ['accumulate_grad_batches', 'plugins']
    """
    data = load_config(path_or_dict)
    source = None if isinstance(path_or_dict, Mapping) else f"configuration file {_shown(os.fspath(path_or_dict))}"
    problems: list[Exception] = []
    if ROOT in data:
        training = data[ROOT] if data[ROOT] is not None else {}
        if not isinstance(training, Mapping):
            _raise([TypeError(f"`{ROOT}` must be a mapping of keys to values, got {_shown(training)}")], source)
        beside = {k: v for k, v in data.items() if k != ROOT}
        if "multi_gpu" in beside and "multi_gpu" in training:  # the guides put it beside `training:` as often as in it
            problems.append(ValueError("`multi_gpu` is given both beside and inside `training`; keep one"))
        problems += [ValueError(f"`{key}` cannot be honoured: {REFUSED[key]}") for key in beside if key in REFUSED]
        if unknown := [str(key) for key in beside if key not in REFUSED and key != "multi_gpu"]:
            problems.append(ValueError(_unknown(unknown, (ROOT, "multi_gpu"))))
        training = {**training, **({"multi_gpu": beside["multi_gpu"]} if "multi_gpu" in beside else {})}
    else:
        training = data
    given: dict[str, dict[str, Any]] = defaultdict(dict)
    paths: dict[str, dict[str, str]] = defaultdict(dict)
    failed: set[tuple[str, str]] = set()
    for path, (part, arg, _) in KEYS.items():
        paths[part].setdefault(arg, f"{ROOT}.{path}")
    for key, value in _walk(training, "", problems):
        part, arg, convert = KEYS[key]
        path = paths[part][arg] = f"{ROOT}.{key}"
        try:
            value = convert(path, value) if convert is not None else value
            _within(path, value, LIMITS.get(key))
            given[part][arg] = value
        except (TypeError, ValueError) as err:
            problems.append(err)
            failed.add((part, arg))
    config = _assemble(_Rules(given, paths, failed, problems), source=data)
    if problems:
        _raise(problems, source)
    assert config is not None
    if lacking := _lacking(config, paths):
        warnings.warn(
            f"this machine ({torch.cuda.device_count()} CUDA GPUs) lacks what the configuration needs, so training "
            "here will fail: " + "; ".join(lacking),
            UserWarning,
            stacklevel=2,
        )
    return config


def _walk(mapping: Mapping[Any, Any], prefix: str, problems: list[Exception]) -> Iterator[tuple[str, Any]]:
    """The keys of :data:`KEYS` under ``mapping`` with their values; unknown and refused keys go to ``problems``."""
    unknown = []
    for key, value in mapping.items():
        path = f"{prefix}{key}"
        if not isinstance(key, str):
            where = f"{ROOT}{'.' + prefix[:-1] if prefix else ''}"
            problems.append(TypeError(f"keys of `{where}` must be strings, got {_shown(key)}"))
        elif path in REFUSED:
            problems.append(_refused(f"{ROOT}.{path}", REFUSED[path]))
        elif path in _SECTIONS and (isinstance(value, Mapping) or path not in KEYS):
            if isinstance(value, Mapping):
                yield from _walk(value, f"{path}.", problems)
            else:
                what = f"a mapping of keys to values, got {_shown(value)} ({type(value).__name__})"
                problems.append(TypeError(f"`{ROOT}.{path}` must be {what}"))
        elif path in KEYS:
            yield path, value
        else:
            unknown.append(f"{ROOT}.{path}")
    if unknown:  # one problem for the mapping, however many keys
        problems.append(
            ValueError(_unknown(unknown, {p[len(prefix) :].split(".")[0] for p in KEYS if p.startswith(prefix)}))
        )


def _unknown(paths: list[str], allowed: Collection[str]) -> str:
    named = []
    for path in paths[:_MAX_NAMED]:
        close = difflib.get_close_matches(path.rsplit(".", 1)[-1], list(allowed), n=1)
        named.append(f"`{_capped(path, 80)}`" + (f" (did you mean `{close[0]}`?)" if close else ""))
    more = f" and {len(paths) - _MAX_NAMED:,} more" if len(paths) > _MAX_NAMED else ""
    keys = f"key{'s' if len(paths) > 1 else ''} {', '.join(named)}{more}"
    return f"unknown {keys}; allowed keys here: {', '.join(f'`{k}`' for k in sorted(allowed))}"


def _refused(path: str, reason: str) -> ValueError:
    return ValueError(f"`{path}` cannot be honoured: {reason}")


def _assemble(rules: _Rules, source: Any) -> TrainingConfig | None:
    """Check what only the file knows (keys that must agree), build each part, and the :class:`TrainingConfig`."""
    precision = rules.precision()
    micro, accumulate = rules.batch_sizes()
    initial, schedule = rules.learning_rate()
    on = rules.callbacks(micro)
    deepspeed, backend = rules.cpu_offload(precision, offload=on["deepspeed"])
    optimizer = rules.plugin_and_dataloader(offload=on["deepspeed"])
    if rules.problems:
        return None
    given = rules.given
    blocks = given["checkpointing"].get("block_types")
    blocks = (tuple(blocks) if isinstance(blocks, list) else blocks) or "auto"
    return TrainingConfig(
        precision=precision,
        micro_batch_size=micro,
        sequence_length=given["batch"].get("sequence_length"),
        accumulate_grad_batches=accumulate,
        dataloader_kwargs=given["dataloader"],
        initial_lr=initial.lr if initial is not None else None,
        schedule=schedule,
        schedule_kwargs=given["schedule"],
        plateau_kwargs=given["plateau"] if on["plateau"] else None,
        dynamic_batch_kwargs=given["dynamic_batch"] if on["dynamic_batch"] else None,
        optimizer=optimizer,
        attention=given["plugin"].get("attention"),
        loss=given["plugin"].get("loss"),
        checkpointing_blocks=blocks if on["checkpointing"] else None,
        compile_kwargs=given["compile"] if on["compile"] else None,
        deepspeed=deepspeed,
        devices=given["devices"].get("devices"),
        data_parallel=bool(given["devices"].get("data_parallel")),
        process_group_backend=backend if deepspeed is None else None,
        source=source,
        **given["checkpoint"],
    )


@dataclass
class _Rules:
    """The rules between keys, one method a block; each problem, naming its keys by dotted path, joins ``problems``."""

    given: dict[str, dict[str, Any]]  # part -> argument -> value, converted; a rule pops what it settles
    paths: dict[str, dict[str, str]]  # part -> argument -> dotted key
    failed: set[tuple[str, str]]  # (part, argument) whose value was refused already
    problems: list[Exception]

    def key(self, part: str, arg: str) -> str:
        return f"`{self.paths[part][arg]}`"

    def bad(self, part: str, arg: str, rest: str) -> None:
        self.problems.append(ValueError(f"{self.key(part, arg)} {rest}"))

    def refuse(self, part: str, arg: str, why: str) -> None:
        self.bad(part, arg, f"cannot be honoured: {why}")

    def build(self, factory: Callable[..., Any], part: str, kwargs: dict[str, Any] | None = None) -> Any:
        """``factory(**kwargs)`` (the part's arguments by default), or ``None`` and its error (naming keys) noted."""
        kwargs, paths = self.given[part] if kwargs is None else kwargs, self.paths[part]
        missing = [
            arg
            for arg, p in inspect.signature(factory).parameters.items()
            if p.default is p.empty and p.kind is not p.VAR_KEYWORD and arg not in kwargs
        ]
        if missing:
            self.problems.append(ValueError(f"{factory.__name__} needs `{paths[missing[0]]}`"))
            return None
        try:
            return factory(**kwargs)
        except (TypeError, ValueError) as err:
            message = str(err)
            for arg, path in paths.items():
                message = message.replace(f"`{arg}`", f"`{path}`")
            self.problems.append(type(err)(message))
            return None

    def precision(self) -> str | None:
        """Lightning's precision (config/precision.py's rule); keep_batchnorm_fp32 and loss scaling must suit it."""
        prec, precision, known = self.given["precision"], None, True  # known: given well, or not at all
        mixed, amp = prec.get("mixed"), prec.get("amp")
        if mixed is not None and amp is not None and mixed != amp:
            self.bad("precision", "mixed", f"({mixed}) and {self.key('precision', 'amp')} ({amp}) disagree")
        try:
            keys, which = self.paths["precision"], "mixed" if mixed is not None else "amp"
            precision = lightning_precision(prec.get("name"), prec.get(which), key=keys["name"], mixed_key=keys[which])
        except (TypeError, ValueError) as err:
            self.problems.append(err)
            known = False
        if prec.get("keep_batchnorm_fp32") is False:
            why = "torch.autocast always runs batch norm in float32; it cannot be turned off"
            self.refuse("precision", "keep_batchnorm_fp32", why)
        elif prec.get("keep_batchnorm_fp32") and precision in ("16-true", "bf16-true"):
            why = f"{precision!r} stores every weight, batch norm included, in half precision; use mixed precision"
            self.refuse("precision", "keep_batchnorm_fp32", f"{why} (autocast keeps fp32)")
        if (scaling := self.given["loss_scaling"]) and known and not (precision or "").startswith("16-"):
            why = f"loss scaling applies to fp16 only, and the precision is {precision or '32-true'!r}"
            self.refuse("loss_scaling", next(iter(scaling)), f"{why} (bf16 needs none)")
        return precision

    def batch_sizes(self) -> tuple[int | None, int | None]:
        """Micro-batch size and accumulation, per device: `batch_size` is their product, or gives the one missing."""
        batch = self.given["batch"]
        total, micro, accumulate = (batch.get(k) for k in ("batch_size", "micro_batch_size", "accumulate_grad_batches"))
        micro_key, accumulate_key = self.key("batch", "micro_batch_size"), self.key("batch", "accumulate_grad_batches")
        if total is not None and micro is not None and accumulate is not None and micro * accumulate != total:
            product = f"({micro} x {accumulate} = {micro * accumulate})"
            self.bad("batch", "batch_size", f"({total}) must equal {micro_key} x {accumulate_key} {product} per device")
        elif total is not None and (micro is None or accumulate is None) and (one := micro or accumulate):
            if total % one:
                which = micro_key if micro else accumulate_key
                self.bad("batch", "batch_size", f"({total}) must be a multiple of {which} ({one})")
            micro, accumulate = (micro, total // one) if micro else (total // one, accumulate)
        elif total is not None and micro is None and accumulate is None:
            micro = total
        return micro, accumulate

    def learning_rate(self) -> tuple[InitialLR | None, Schedule | None]:
        """InitialLR and the schedule callback; a key the chosen schedule's callback does not take is an error."""
        lr, schedule = self.given["schedule"], self.given["schedule"].pop("schedule", None)
        initial = self.build(InitialLR, "initial_lr") if self.given["initial_lr"] else None
        takes = {name: set(inspect.signature(cls).parameters) for name, cls in SCHEDULE_CALLBACKS.items()}
        takes["linear_warmup"].add("constant_after_warmup")
        for arg in list(lr) if ("schedule", "schedule") not in self.failed else []:  # a bad name is one problem
            if schedule not in (schedules := [name for name, args in takes.items() if arg in args]):
                now = f"{self.key('schedule', 'schedule')} " + (f"is {schedule!r}" if schedule else "is not set")
                self.bad("schedule", arg, f"applies to schedule {' or '.join(map(repr, schedules))}, but {now}")
                lr.pop(arg)
        if lr.pop("constant_after_warmup", True) is False:
            why = "schedule 'linear_warmup' holds the learning rate after the warm-up; for a decay use "
            self.refuse("schedule", "constant_after_warmup", f"{why}'cosine_with_warmup' (with `min_lr`) or 'onecycle'")
        if schedule == "onecycle" and initial is not None:
            why = f"which starts at `max_lr` / `div_factor`; give the peak as {self.key('schedule', 'max_lr')}"
            self.bad("initial_lr", "lr", f"does not apply to schedule 'onecycle', {why}")
        if initial is not None and isinstance(lr.get("min_lr"), float) and lr["min_lr"] > initial.lr:
            limit = f"{self.key('initial_lr', 'lr')} ({initial.lr:g})"
            self.bad("schedule", "min_lr", f"({lr['min_lr']:g}) must not exceed {limit}")
        if schedule is not None:
            self.build(SCHEDULE_CALLBACKS[schedule], "schedule")
        return initial, schedule

    def callbacks(self, micro: int | None) -> dict[str, bool]:
        """Which sections are on; each callback is built (and so checked) when its section is given, on or off."""
        present = {part for part, kwargs in self.given.items() if kwargs}
        on = {  # a section given is on unless `enabled: false`
            part: part in present and self.given[part].pop("enabled", True) is not False
            for part in ("plateau", "dynamic_batch", "checkpointing", "compile", "deepspeed")
        }
        factories = {"plateau": AdaptiveLROnPlateau, "dynamic_batch": DynamicBatchSize}
        factories.update(checkpointing=ActivationCheckpointing, compile=TorchCompile)
        built = {part: self.build(cls, part) for part, cls in factories.items() if part in present}
        if (dynamic := built.get("dynamic_batch")) is not None and micro is not None:
            low, high = dynamic.min_batch_size, dynamic.max_batch_size
            if not low <= micro <= (high or micro):
                where = ", ".join(self.key("dynamic_batch", f"{end}_batch_size") for end in ("min", "max"))
                rest = f"is the starting batch size and must lie in [{where}] = [{low}, {high}]"
                self.bad("batch", "micro_batch_size", f"({micro}) {rest}")
        return on

    def cpu_offload(self, precision: str | None, *, offload: bool) -> tuple[DeepSpeedSettings | None, str | None]:
        """DeepSpeedSettings, with the loss scaling and the process-group backend; built (so checked) when off too."""
        ds, devices, scaling = self.given["deepspeed"], self.given["devices"], self.given["loss_scaling"]
        ds.setdefault("offload_optimizer", True)
        ds.setdefault("stage", 3 if ds.get("offload_parameters") else 2)
        optimizer_key = self.key("deepspeed", "offload_optimizer")
        if ds.pop("offload_gradients", ds["offload_optimizer"]) != ds["offload_optimizer"]:
            why = "DeepSpeed's optimizer offload moves each gradient partition to the CPU for the optimizer step"
            why += f" and has no separate gradient switch; remove the key (gradients follow {optimizer_key})"
            self.refuse("deepspeed", "offload_gradients", why)
        if offload and not ds["offload_optimizer"] and not ds.get("offload_parameters"):
            what = f"{optimizer_key} or {self.key('deepspeed', 'offload_parameters')}"
            self.bad("deepspeed", "enabled", f"is true but nothing is offloaded: set {what} to true")
        if (backend := devices.get("process_group_backend")) is not None and not devices.get("data_parallel"):
            strategy = self.paths["devices"]["data_parallel"]
            why = f"sets the process-group backend of data parallelism: it needs `{strategy}: data_parallel`"
            self.bad("devices", "process_group_backend", f"({backend!r}) {why}")
        extra = {**scaling, **({"process_group_backend": backend} if backend else {})}
        settings = self.build(DeepSpeedSettings, "deepspeed", {**ds, "extra": extra})
        deepspeed = settings if offload else None  # checked when off too: nothing given is ignored
        static = [arg for arg, value in scaling.items() if arg != "loss_scale" or value]  # `loss_scale: dynamic` is 0
        if deepspeed is None and static and (precision or "").startswith("16-"):
            why = (
                "outside DeepSpeed, Lightning's 16-mixed scales the loss with torch.amp.GradScaler's dynamic scale, "
                "which has no static scale or hysteresis and is not configurable through the pack; use "
                "`training.cpu_offload` (DeepSpeed), or remove the key (`loss_scale: dynamic` is what GradScaler does)"
            )
            self.refuse("loss_scaling", static[0], why)
        return deepspeed, backend

    def plugin_and_dataloader(self, *, offload: bool) -> str | None:
        """The plugin's optimizer ('adamw' is the module's own: None), no model parallelism, checkpoints, DataLoader."""
        optimizer = None if self.given["plugin"].get("optimizer") == "adamw" else self.given["plugin"].get("optimizer")
        if optimizer is not None and offload:
            why = (
                f"{optimizer!r} swaps the module's optimizer, which DeepSpeed replaces with its own when "
                "`training.cpu_offload` is on; use 'adamw' (DeepSpeed offloads it to CPU Adam) or turn CPU offload off"
            )
            self.refuse("plugin", "optimizer", why)
        parallel = self.given["model_parallel"]
        sizes = [arg for arg, size in parallel.items() if arg != "enabled" and size > 1]
        if parallel.get("enabled") or (parallel.get("enabled") is None and sizes):
            self.refuse("model_parallel", "enabled" if parallel.get("enabled") else sizes[0], _MODEL_PARALLEL)
        if self.given["checkpoint"].get("async_checkpoint") and offload:
            why = "DeepSpeed writes its sharded checkpoints itself; Lightning's AsyncCheckpointIO does not apply"
            self.refuse("checkpoint", "async_checkpoint", why)
        loader, workers = self.given["dataloader"], self.given["dataloader"].get("num_workers")
        for arg in [arg for arg in ("prefetch_factor", "persistent_workers") if loader.get(arg) and not workers]:
            why = f"set {self.key('dataloader', 'num_workers')} to 1 or more, got {workers!r}"
            self.bad("dataloader", arg, f"needs worker processes (torch's DataLoader refuses it without them); {why}")
        return optimizer


def _lacking(config: TrainingConfig, paths: dict[str, dict[str, str]]) -> list[str]:
    """What the configuration needs that this machine lacks, one line each, without initialising CUDA."""
    gpus = torch.cuda.device_count()  # asks NVML where it can; does not initialise CUDA
    cuda = "a CUDA GPU"
    needs = []
    if config.precision in ("16-mixed", "transformer-engine", "transformer-engine-float16") and not gpus:
        needs.append(f"`{paths['precision']['name']}` {config.precision!r} needs {cuda}")
    flash = _imports.is_available("flash_attn") or _imports.is_available("flash_attn.cute")
    if config.attention == "flash" and not (gpus and flash):
        hint = "" if flash else ", and flash-attn (pip install 'lightning-tune[flash2]' or '[flash4]')"
        needs.append(f"`{paths['plugin']['attention']}` 'flash' needs {cuda} of compute capability 8.0 or newer{hint}")
    liger = "" if _imports.is_available("liger_kernel") else ", and liger-kernel (pip install 'lightning-tune[liger]')"
    if config.loss == "liger" and (liger or not gpus):
        needs.append(f"`{paths['plugin']['loss']}` 'liger' needs {cuda}{liger}")
    if config.optimizer not in (None, "adamw_fused") and not _imports.is_available("bitsandbytes"):
        needs.append(
            f"`{paths['plugin']['optimizer']}` {config.optimizer!r} needs bitsandbytes "
            "(pip install 'lightning-tune[bnb]')"
        )
    ds = "" if _imports.is_available("deepspeed") else ", and deepspeed (pip install 'lightning-tune[deepspeed]')"
    if config.deepspeed is not None and (ds or not gpus):
        needs.append(f"`{paths['deepspeed']['enabled'].rsplit('.', 1)[0]}` (DeepSpeed) needs {cuda}{ds}")
    if isinstance(config.devices, tuple) and max(config.devices) >= gpus:
        needs.append(f"`{paths['devices']['devices']}` {list(config.devices)} names GPUs; this machine has {gpus}")
    if config.process_group_backend == "nccl" and not gpus:
        needs.append(f"`{paths['devices']['process_group_backend']}` 'nccl' needs {cuda}")
    return needs
