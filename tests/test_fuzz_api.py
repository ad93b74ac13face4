"""Fuzz every public callable with bad argument values: each must be refused with a clear error naming the argument.

Cases are generated from the signatures: each parameter of each callable gets the bad values that fit its annotation
(wrong types, ``None`` where not allowed, negative, zero, NaN, inf, ``10**30``, empty, unknown names and keys,
non-string keys), substituted one at a time into a known-valid call. A case is

- *clear* when it raises ``TypeError`` or ``ValueError`` (``ModuleNotFoundError`` for a missing extra,
  ``FileNotFoundError`` for a missing file) naming the argument, or the call returns normally and the value is one
  the callable legitimately accepts;
- *unclear* when it raises anything else (``AttributeError``, ``KeyError``, torch's own errors) or a message that does
  not name the argument;
- *silent* when an invalid value is accepted, or a call returns a number that is not finite;
- a *hang* when it runs past the per-case time limit.
"""

from __future__ import annotations

import inspect
import math
import re
import signal
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any, get_args

import pytest
import torch
from torch import nn

import lightning_tune as lt
from lightning_tune import batch, callbacks, config, lr, perf, plan, plugins
from lightning_tune.batch.step import DynamicBatchSettings
from lightning_tune.perf import counting, devices, flops

PACKAGES = (lt, callbacks, plugins, batch, lr, perf, plan, config)
#: Engine names the docs tell users to import from their own module (docs/peak_flops.md, docs/bench.md).
ENGINE = {
    counting: counting.__all__,
    flops: ("canonical_device", "mfu", "peak_flops"),
    devices: ("NvmlSampler", "cuda_memory_metrics", "describe_device"),
}
CASE_SECONDS = 2.0
BIG = 10**30
NAN = float("nan")
INF = float("inf")


class _Hang(Exception):
    pass


def _sgd() -> torch.optim.Optimizer:
    return torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=0.1, momentum=0.9)


def _estimate() -> lt.MemoryEstimate:
    return lt.MemoryEstimate(parameters=10, weight_bytes=40, bytes_per_sample=100, fixed_bytes=1000)


#: Known-valid arguments per callable (a factory, called afresh for each case). Each case replaces one of them.
BASES: dict[str, Callable[[], dict[str, Any]]] = {
    "ActivationCheckpointing": dict,
    "AdaptiveLROnPlateau": dict,
    "AttentionSwap": dict,
    "LossSwap": dict,
    "DynamicBatchSize": lambda: {"loss_weight": "samples"},  # where `label_shift` is refused
    "InitialLR": lambda: {"lr": 0.1},
    "LinearWarmup": lambda: {"warmup_steps": 10},
    "MemoryEstimate": lambda: {"parameters": 10, "weight_bytes": 40, "bytes_per_sample": 100, "fixed_bytes": 1000},
    "OneCycle": lambda: {"max_lr": 0.1},
    "OptimizerSwap": dict,
    "ScheduleLR": lambda: {"optimizer": _sgd(), "factor": partial(lr.linear_warmup, warmup_steps=2)},
    "SimulatedMemory": lambda: {"total_bytes": 10**9, "fixed_bytes": 10**6, "bytes_per_sample": 10**5},
    "TrackedMemory": lambda: {"total_bytes": 10**9},
    "ThroughputLatencyMonitor": dict,
    "TorchCompile": dict,
    "TrainingConfig": dict,
    "TransformerShape": lambda: {
        "family": "llama",
        "vocab_size": 128,
        "hidden_size": 64,
        "num_layers": 2,
        "num_heads": 4,
        "intermediate_size": 128,
    },
    "TunePlugin": dict,
    "WarmupCosine": lambda: {"warmup_steps": 10},
    "WarmupPolynomial": lambda: {"warmup_steps": 10},
    "WarmupStableDecay": lambda: {"warmup_steps": 10, "decay_steps": 10},
    "ZeroPlan": lambda: {
        "stage": 0,
        "offload_optimizer": False,
        "offload_parameters": False,
        "per_gpu_bytes": 1,
        "reason": "fits",
    },
    "estimate_memory": lambda: {"model": "gpt2", "sequence_length": 128},
    "from_config": lambda: {"path_or_dict": {}},
    "measure_memory": lambda: {"model": nn.Linear(4, 2), "batch": torch.randn(2, 4), "for_device": "cpu"},
    "plan_zero": lambda: {"estimate": _estimate(), "gpu_memory_bytes": 80 * 2**30},
    "scale_lr": lambda: {"lr": 0.1, "old_batch_size": 8, "new_batch_size": 16},
    "SurgeryCallback": dict,
    "DeepSpeedSettings": dict,
    "deepspeed_settings": lambda: {"stage": 2},
    "BatchSizeController": lambda: {"target": 0.9, "min_batch_size": 1, "max_batch_size": None, "multiple_of": 8},
    "DynamicBatchSettings": lambda: {"loss_weight": "samples"},
    "DynamicStep": lambda: {"settings": DynamicBatchSettings(loss_weight="samples")},
    "find_batch_size": lambda: {"try_batch": lambda size: size <= 8},
    "linear_cross_entropy": lambda: {
        "hidden": torch.randn(2, 3, 4),
        "weight": torch.randn(5, 4),
        "labels": torch.randint(0, 5, (2, 3)),
    },
    "PlateauDetector": dict,
    "linear_warmup_lr": lambda: {"step": 1, "base_lr": 0.1, "warmup_steps": 2},
    "one_cycle_lr": lambda: {"step": 1, "max_lr": 0.1, "total_steps": 10},
    "one_cycle_momentum": lambda: {"step": 1, "total_steps": 10},
    "warmup_cosine_lr": lambda: {"step": 1, "base_lr": 0.1, "warmup_steps": 2, "total_steps": 10},
    "warmup_polynomial_lr": lambda: {"step": 1, "base_lr": 0.1, "warmup_steps": 2, "total_steps": 10},
    "warmup_stable_decay_lr": lambda: {
        "step": 1,
        "base_lr": 0.1,
        "warmup_steps": 2,
        "decay_steps": 2,
        "total_steps": 10,
    },
    "StepStats": lambda: {"window": 10, "percentiles": (50, 99)},
    "attention_pairs": lambda: {"q_len": 4, "k_len": 4, "causal": True},
    "canonical_device": lambda: {"name": "NVIDIA H100 80GB HBM3"},
    "count_step_flops": lambda: {
        "module": nn.Linear(4, 2),
        "batch": torch.randn(2, 4),
        "step": lambda m, b: m(b).sum(),
        "samples": 2,
    },
    "describe_device": lambda: {"device": torch.device("cpu")},
    "meta_copy": lambda: {"module": nn.Linear(4, 2)},
    "mfu": lambda: {"flops_per_sec": 1e12, "peak": 1e15},
    "peak_flops": lambda: {"device_name": "NVIDIA H100 80GB HBM3", "dtype": torch.bfloat16},
    "timer_for": lambda: {"device": torch.device("cpu")},
    "from_hf_config": lambda: {
        "config": {
            "model_type": "llama",
            "vocab_size": 128,
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "intermediate_size": 128,
        }
    },
    "get_shape": lambda: {"name": "gpt2"},
}

#: Public names that take no bad values of their own, with the reason.
NOT_FUZZED = {
    # Protocols and the records engines return, not built from user input.
    "ScheduleCallback": "abstract base of the schedule callbacks, which are fuzzed",
    "WarmupDecay": "abstract base of WarmupCosine, WarmupPolynomial and WarmupStableDecay, which are fuzzed",
    # Factor functions of the step: unchecked on purpose, as they run every step; the `*_lr` functions are their
    # checked forms, and the callbacks check what they bind.
    **dict.fromkeys(
        ("linear_warmup", "one_cycle", "warmup_cosine", "warmup_polynomial", "warmup_stable_decay"), "factor function"
    ),
    "FlopModel": "record an engine returns",
    # They need what a CPU-only run lacks: CUDA, NVML, an initialised process group, the deepspeed package.
    "CudaMemory": "needs CUDA",
    "NvmlSampler": "needs NVML",
    "cuda_memory_metrics": "needs CUDA",
    "deepspeed_strategy": "needs deepspeed",
    "build_strategy": "needs deepspeed",
    # Their arguments are batches of any structure: every value is legitimate input.
    "count_samples": "any batch",
    "count_tokens": "any batch",
}


def _public() -> dict[str, Callable[..., Any]]:
    found: dict[str, Callable[..., Any]] = {}
    for package, names in [*((p, p.__all__) for p in PACKAGES), *ENGINE.items()]:
        for name in names:
            obj = getattr(package, name)
            if callable(obj) and name != "__version__" and not isinstance(obj, (dict, tuple)):
                found.setdefault(name, obj)
    return found


PUBLIC = _public()


# ---------------------------------------------------------------------------------------------------------- values


class _Unknown:
    """An object of no type any argument takes."""

    def __repr__(self) -> str:
        return "<unknown object>"


@dataclass(frozen=True)
class Bad:
    """One bad value: ``label`` names it in case ids and in the table of values a parameter legitimately accepts.

    ``also`` holds other arguments changed together with it, for a value that is bad only in company.
    """

    label: str
    value: Any
    also: dict[str, Any] = field(default_factory=dict)


def _module_names(fn: Callable[..., Any]) -> dict[str, Any]:
    module = sys.modules[getattr(fn, "__module__", "")]
    return vars(module)


def _literal_choices(token: str, names: dict[str, Any]) -> tuple[Any, ...] | None:
    alias = names.get(token)
    args = get_args(alias) if alias is not None else ()
    return args if args and all(isinstance(a, str) for a in args) else None


def bad_values(fn: Callable[..., Any], param: inspect.Parameter) -> list[Bad]:
    """The bad values that fit ``param``'s annotation (a string, as every module here uses postponed annotations)."""
    note = param.annotation if isinstance(param.annotation, str) else ""
    if note in ("", "Any"):
        return []
    names = _module_names(fn)
    parts = [p.strip() for p in re.split(r"\|(?![^\[]*\])", note)]
    optional = "None" in parts
    values: list[Bad] = [Bad("object", _Unknown())]
    if not optional:
        values.append(Bad("None", None))
    kinds: set[str] = set()
    for part in parts:
        head = part.split("[")[0].split(".")[-1]
        if part.startswith("Literal[") or _literal_choices(head, names):
            kinds.add("choice")
        elif head == "bool":
            kinds.add("bool")
        elif head == "int":
            kinds.add("int")
        elif head == "float":
            kinds.add("float")
        elif head == "str":
            kinds.add("str")
        elif head in ("Mapping", "dict"):
            kinds.add("mapping")
        elif head in ("Sequence", "tuple", "list", "Collection", "Iterable", "BlockTypes"):
            kinds.add("sequence")
        elif head == "Callable":
            kinds.add("callable")
    if "bool" in kinds:
        values += [Bad("int 1", 1), Bad("str", "yes")]
    if "int" in kinds or "float" in kinds:
        values += [Bad("str number", "3"), Bad("bool", True), Bad("-1", -1), Bad("0", 0), Bad("10**30", BIG)]
        if "str" not in kinds and "choice" not in kinds:
            values.append(Bad("empty", ""))
    if "int" in kinds and "float" not in kinds:
        values += [Bad("fraction", 2.5), Bad("nan", NAN)]
    if "float" in kinds:
        values += [Bad("nan", NAN), Bad("inf", INF), Bad("-inf", -INF), Bad("-0.5", -0.5), Bad("1e300", 1e300)]
    if "str" in kinds or "choice" in kinds:
        values += [Bad("empty", ""), Bad("unknown name", "no-such-name"), Bad("number", 7)]
    if "mapping" in kinds:
        values += [Bad("list", [1]), Bad("non-str key", {1: 2}), Bad("unknown key", {"no_such_key": 1})]
    if "sequence" in kinds:
        values += [Bad("empty seq", ()), Bad("item None", (None,)), Bad("item object", (_Unknown(),))]
        if "int" not in kinds and "float" not in kinds:
            values.append(Bad("bare int", 5))
        if "str" not in kinds:
            values.append(Bad("bare str", "abc"))
        if "float" in note or "int" in note:
            values += [Bad("item nan", (NAN,)), Bad("item -1", (-1,)), Bad("item str", ("x",))]
    if "callable" in kinds:
        values += [Bad("number", 7), Bad("str", "abc")]
    if not kinds:  # an object of some class: a name or a number in its place (`lora_parameters("gpt2", 8)`)
        values += [Bad("str", "gpt2"), Bad("number", 7)]
    unique: dict[str, Bad] = {}
    for value in values:
        unique.setdefault(value.label, value)
    return list(unique.values())


# ------------------------------------------------------------------- values the callables legitimately accept

#: Values a Python int or float legitimately takes: an overflowing *result* is caught separately.
LARGE = {"10**30", "1e300"}

_ZERO_IS_VALID = [
    ("DynamicBatchSettings", "min_change"),
    ("AdaptiveLROnPlateau", "patience"),
    ("AdaptiveLROnPlateau", "threshold"),
    ("AdaptiveLROnPlateau", "eps"),
    ("AdaptiveLROnPlateau", "min_lr"),
    ("PlateauDetector", "patience"),
    ("PlateauDetector", "threshold"),
    ("BatchSizeController", "min_change"),
    ("DynamicBatchSize", "min_change"),
    ("DeepSpeedSettings", "stage"),
    ("deepspeed_settings", "stage"),
    ("ZeroPlan", "stage"),
    ("ZeroPlan", "per_gpu_bytes"),
    ("MemoryEstimate", "parameters"),
    ("MemoryEstimate", "weight_bytes"),
    ("MemoryEstimate", "fixed_bytes"),
    ("MemoryEstimate", "trainable_parameters"),
    ("MemoryEstimate", "largest_layer_parameters"),
    ("SimulatedMemory", "fixed_bytes"),
    ("OneCycle", "base_momentum"),
    ("WarmupCosine", "warmup_steps"),
    ("WarmupPolynomial", "warmup_steps"),
    ("WarmupStableDecay", "warmup_steps"),
    ("WarmupStableDecay", "decay_steps"),
    ("warmup_polynomial_lr", "step"),
    ("warmup_polynomial_lr", "warmup_steps"),
    ("warmup_polynomial_lr", "base_lr"),
    ("warmup_stable_decay_lr", "step"),
    ("warmup_stable_decay_lr", "warmup_steps"),
    ("warmup_stable_decay_lr", "decay_steps"),
    ("warmup_stable_decay_lr", "base_lr"),
    ("attention_pairs", "q_len"),
    ("attention_pairs", "k_len"),
    ("linear_warmup_lr", "step"),
    ("linear_warmup_lr", "warmup_steps"),
    ("linear_warmup_lr", "base_lr"),
    ("warmup_cosine_lr", "step"),
    ("warmup_cosine_lr", "warmup_steps"),
    ("warmup_cosine_lr", "base_lr"),
    ("one_cycle_lr", "step"),
    ("one_cycle_momentum", "step"),
    ("one_cycle_momentum", "base_momentum"),
    ("one_cycle_momentum", "max_momentum"),
    ("one_cycle_lr", "max_lr"),
    ("ScheduleLR", "last_epoch"),
    ("format_bytes", "n"),
    ("mfu", "flops_per_sec"),
    ("count_step_flops", "samples"),
    ("scale_lr", "lr"),
]

#: (callable, parameter) -> labels of generated values that are valid there (and so may be accepted).
VALID: dict[tuple[str, str], set[str]] = {
    **{key: {"0"} for key in _ZERO_IS_VALID},
    # Free-form text: a display name, a metric, a device name looked up in a table, an environment variable.
    ("TransformerShape", "name"): {"empty", "unknown name"},
    ("ZeroPlan", "reason"): {"unknown name"},
    ("AdaptiveLROnPlateau", "monitor"): {"unknown name"},
    ("canonical_device", "name"): {"empty", "unknown name"},
    ("peak_flops", "device_name"): {"empty", "unknown name"},
    ("from_hf_config", "name"): {"unknown name"},
    ("lightning_precision", "key"): {"unknown name"},
    ("lightning_precision", "mixed_key"): {"unknown name"},
    # The raw mapping a configuration was read from, kept for reference: any keys.
    ("TrainingConfig", "source"): {"unknown key"},
    # Module classes named by their class name: any name may be a class of the model it meets.
    ("ActivationCheckpointing", "block_types"): {"unknown name", "bare str"},
    ("TrainingConfig", "checkpointing_blocks"): {"unknown name", "bare str"},
    # A reader: it returns the mapping it was given; from_config checks the keys.
    ("load_config", "path_or_dict"): {"unknown key", "non-str key"},
    # Any int64 label value may mark the ignored tokens.
    ("linear_cross_entropy", "ignore_index"): {"0", "-1"},
}


def valid_labels(fn: str, param: inspect.Parameter) -> set[str]:
    """Labels that are legitimately valid for ``param``: large numbers, its own default, and the table above."""
    labels = LARGE | VALID.get((fn, param.name), set())
    default = param.default
    if default is not inspect.Parameter.empty:
        if isinstance(default, (int, float)) and not isinstance(default, bool):
            labels |= {"0"} if default == 0 else set()
            labels |= {"-1"} if default == -1 else set()
        if isinstance(default, (tuple, list)) and not default:
            labels.add("empty seq")
    return labels


# ------------------------------------------------------------------------------------------------------- running


@dataclass
class Outcome:
    case: str
    verdict: str  # clear | unclear | silent | hang
    detail: str


def _alarm(signum: int, frame: Any) -> None:
    raise _Hang


def run_case(fn: Callable[..., Any], kwargs: dict[str, Any]) -> tuple[str, Any]:
    """Call ``fn(**kwargs)`` under the time limit: ("ok", result), ("raised", exception) or ("hang", None)."""
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, CASE_SECONDS)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return "ok", fn(**kwargs)
    except _Hang:
        return "hang", None
    except BaseException as err:  # noqa: BLE001 - every error is classified
        return "raised", err
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


#: Names a message may use for an argument besides its own: a configuration names the key of the file.
ALIASES: dict[tuple[str, str], tuple[str, ...]] = {
    ("from_config", "path_or_dict"): ("`training",),
    ("lightning_precision", "name"): ("training.precision",),
    ("lightning_precision", "mixed"): ("training.mixed_precision.enabled",),
}


def _names(err: BaseException, fn: str, param: str, value: Any) -> bool:
    """Whether the message names the argument, outside the repeated value (``'no-such-name'`` holds ``name``)."""
    text = str(err).replace(repr(value), "")
    if any(alias in text for alias in ALIASES.get((fn, param), ())):
        return True
    return re.search(rf"(?<![\w-]){re.escape(param)}(?![\w-])", text) is not None


def _finite(result: Any) -> bool:
    if isinstance(result, float):
        return math.isfinite(result)
    if isinstance(result, str):
        return not re.search(r"\b(nan|inf)\b|^-\d", result)  # 'nan B', 'p-inf', '-1 B'
    return True


def classify(name: str, param: inspect.Parameter, bad: Bad) -> Outcome:
    fn = PUBLIC[name]
    kwargs = BASES[name]()
    kwargs.update(bad.also)
    kwargs[param.name] = bad.value
    case = f"{name}({param.name}={bad.label})"
    how, got = run_case(fn, kwargs)
    if how == "hang":
        return Outcome(case, "hang", f"ran past {CASE_SECONDS} s")
    if how == "raised":
        clear_kind = isinstance(got, (TypeError, ValueError, ModuleNotFoundError, FileNotFoundError))
        if clear_kind and _names(got, name, param.name, bad.value):
            return Outcome(case, "clear", "")
        return Outcome(case, "unclear", f"{type(got).__name__}: {str(got)[:160]}")
    if not _finite(got):
        return Outcome(case, "silent", f"returned {got!r}")
    if bad.label in valid_labels(name, param):
        return Outcome(case, "clear", "")
    return Outcome(case, "silent", "accepted")


def parameters(name: str) -> Iterator[inspect.Parameter]:
    for param in inspect.signature(PUBLIC[name]).parameters.values():
        if param.kind not in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            yield param


#: Bad values the annotations do not suggest: values inside mappings, and values bad only together with others.
EXTRA: dict[str, list[tuple[str, Bad]]] = {
    "DynamicBatchSettings": [("label_shift", Bad("shift for samples", 3))],
    "TrainingConfig": [
        ("dataloader_kwargs", Bad("negative workers", {"num_workers": -1})),
        ("dataloader_kwargs", Bad("str pin_memory", {"pin_memory": "yes"})),
        ("dataloader_kwargs", Bad("zero prefetch", {"num_workers": 2, "prefetch_factor": 0})),
        ("plateau_kwargs", Bad("misspelt key", {"patiense": 3})),
        ("dynamic_batch_kwargs", Bad("misspelt key", {"target_vrma": 0.5})),
        ("compile_kwargs", Bad("misspelt key", {"mdoe": "default"})),
        ("schedule_kwargs", Bad("misspelt key", {"warmup_step": 10}, also={"schedule": "linear_warmup"})),
    ],
    "DynamicBatchSize": [("label_shift", Bad("shift for samples", 3))],
    "TorchCompile": [("options", Bad("misspelt inductor option", {"max_autotun": True}))],
    "scale_lr": [
        ("lr", Bad("overflowing", 1e300, also={"old_batch_size": 1, "new_batch_size": BIG, "rule": "linear"}))
    ],
    "estimate_memory": [("model", Bad("missing config.json", "/nonexistent/config.json"))],
    "from_hf_config": [("config", Bad("missing config.json", "/nonexistent/config.json"))],
}


def cases(name: str) -> Iterator[tuple[inspect.Parameter, Bad]]:
    params = {param.name: param for param in parameters(name)}
    for param in params.values():
        for bad in bad_values(PUBLIC[name], param):
            yield param, bad
    for param_name, bad in EXTRA.get(name, []):
        yield params[param_name], bad


_RESULTS: dict[str, list[Outcome]] = {}
_SECONDS: dict[str, float] = {}


def results(name: str) -> list[Outcome]:
    """The outcomes of every case of ``name``, run once per session."""
    if name not in _RESULTS:
        start = time.perf_counter()
        _RESULTS[name] = [classify(name, param, bad) for param, bad in cases(name)]
        _SECONDS[name] = time.perf_counter() - start
    return _RESULTS[name]


# --------------------------------------------------------------------------------------------------------- tests


def test_every_public_callable_is_fuzzed_or_excused() -> None:
    assert sorted(set(PUBLIC) - set(BASES) - set(NOT_FUZZED)) == []
    assert sorted((set(BASES) | set(NOT_FUZZED)) - set(PUBLIC)) == []


@pytest.mark.parametrize("name", sorted(BASES))
def test_base_arguments_are_valid(name: str) -> None:
    how, got = run_case(PUBLIC[name], BASES[name]())
    assert how == "ok", got


@pytest.mark.parametrize("name", sorted(BASES))
def test_bad_values_get_a_clear_error(name: str) -> None:
    wrong = [f"{o.case}: {o.verdict}: {o.detail}" for o in results(name) if o.verdict != "clear"]
    assert wrong == []


GIB = 2**30

#: The cases the reliability run reported, with the message each must now produce.
REPORTED = [
    pytest.param(
        lambda: lt.ScheduleLR(None, partial(lr.linear_warmup, warmup_steps=2)),
        TypeError,
        "`optimizer` must be a torch.optim.Optimizer, got None (NoneType)",
        id="schedule-lr-no-optimizer",
    ),
    pytest.param(
        lambda: lt.ScheduleLR(_sgd(), "cosine"),  # type: ignore[arg-type]
        TypeError,
        "`factor` must be a callable, got 'cosine' (str)",
        id="schedule-lr-factor-name",
    ),
    pytest.param(
        lambda: plan.estimate.lora_parameters("gpt2", 8),  # type: ignore[arg-type]
        TypeError,
        "`shape` must be a TransformerShape (get_shape, from_hf_config), got 'gpt2' (str)",
        id="lora-model-name",
    ),
    pytest.param(
        lambda: lt.DynamicBatchSize(trim_keys=None),  # type: ignore[arg-type]
        TypeError,
        "`trim_keys` must be a sequence of key names (strings), got None (NoneType)",
        id="trim-keys-none",
    ),
    pytest.param(
        lambda: lt.TrainingConfig(plateau_kwargs={"patiense": 3}),
        ValueError,
        "`plateau_kwargs` has unknown key(s) 'patiense'; allowed: check_on_train_epoch_end, cooldown,",
        id="plateau-kwargs-misspelt",
    ),
    pytest.param(
        lambda: lt.estimate_memory("/nonexistent/config.json", sequence_length=128),
        FileNotFoundError,
        "`model`: no Hugging Face config.json at '/nonexistent/config.json'",
        id="estimate-missing-config",
    ),
    pytest.param(
        lambda: lt.TrainingConfig(dataloader_kwargs={"num_workers": -1}),
        ValueError,
        "`dataloader_kwargs['num_workers']` must be an integer >= 0, got -1",
        id="negative-workers",
    ),
    pytest.param(
        lambda: lt.TorchCompile(options={1: 2}),  # type: ignore[dict-item]
        TypeError,
        "`options` must be a mapping of argument names to values or None, got {1: 2} (dict)",
        id="compile-options-int-key",
    ),
    pytest.param(
        lambda: lt.DynamicBatchSize(loss_weight="samples", label_shift=3),
        ValueError,
        "`label_shift` is read only when losses are weighted by tokens (`loss_weight` 'tokens' or 'auto'), got "
        "loss_weight='samples'",
        id="label-shift-for-samples",
    ),
    pytest.param(
        lambda: lt.scale_lr(1e300, 1, BIG, rule="linear"),
        ValueError,
        "the scaled learning rate is not finite (inf) for `lr`=1e+300, `old_batch_size`=1, `new_batch_size`=10",
        id="scale-lr-overflow",
    ),
    pytest.param(
        lambda: plan.estimate.format_bytes(NAN), TypeError, "`n` must be an integer, got nan (float)", id="bytes-nan"
    ),
    pytest.param(
        lambda: plan.estimate.format_bytes(-1), ValueError, "`n` must be an integer >= 0, got -1", id="bytes-neg"
    ),
    pytest.param(
        lambda: plan.from_hf_config(BASES["from_hf_config"]()["config"], name=-1),  # type: ignore[arg-type]
        TypeError,
        "`name` must be a string or None, got -1 (int)",
        id="hf-config-int-name",
    ),
]


@pytest.mark.parametrize(("make", "error", "message"), REPORTED)
def test_reported_cases_get_their_message(make: Callable[[], Any], error: type[Exception], message: str) -> None:
    with pytest.raises(error) as info:
        make()
    assert str(info.value).startswith(message), str(info.value)


def test_schedule_lr_resumes_from_last_epoch_without_initial_lr() -> None:
    # torch's own schedulers need `initial_lr` in each group to start at last_epoch >= 0 and raise a KeyError
    # without it; ScheduleLR computes every value from the factor, so it starts there as a resumed one would.
    schedule = partial(lr.linear_warmup, warmup_steps=4)
    resumed, fresh = _sgd(), _sgd()
    lt.ScheduleLR(resumed, schedule, last_epoch=1)
    scheduler = lt.ScheduleLR(fresh, schedule)
    for _ in range(2):
        fresh.step()
        scheduler.step()
    assert resumed.param_groups[0]["lr"] == fresh.param_groups[0]["lr"] == 0.05


def test_reserve_larger_than_the_device_is_refused_when_training_starts(tmp_path: Any) -> None:
    from tests.batch.test_dynamic_batch import Net, fit

    memory = lt.SimulatedMemory(16 * GIB, 2 * GIB, GIB // 4)
    with pytest.raises(ValueError, match=r"`reserve_gib` must leave memory to train in: PyTorch can get 16 GiB on"):
        fit(Net(batch_size=8, n=64), [lt.DynamicBatchSize(probe=memory, reserve_gib=20.0)], tmp_path)


def test_summary(capsys: pytest.CaptureFixture[str]) -> None:
    names = [name for name in sorted(set(BASES) & set(PUBLIC)) if run_case(PUBLIC[name], BASES[name]())[0] == "ok"]
    outcomes = [o for name in names for o in results(name)]
    counts = {v: sum(o.verdict == v for o in outcomes) for v in ("unclear", "silent", "hang")}
    with capsys.disabled():
        print(
            f"\n{len(outcomes)} cases over {len(names)} callables: {counts['unclear']} unclear, "
            f"{counts['silent']} silent, {counts['hang']} hangs ({sum(_SECONDS[name] for name in names):.1f} s)"
        )
    assert len(outcomes) > 2000
    assert counts == {"unclear": 0, "silent": 0, "hang": 0}
