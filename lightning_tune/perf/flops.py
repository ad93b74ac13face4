"""Model FLOPs utilisation (MFU): dense peak FLOP/s per device and dtype, and counting a model's FLOPs.

MFU is the model FLOP/s a run achieves divided by the device's *dense* peak FLOP/s for the dtype its matmuls run
in. This module holds the pieces, free of any Trainer:

- :data:`PEAK_FLOPS`, dense peaks from NVIDIA's datasheets and architecture whitepapers (sources and the reasoning
  behind each number: ``docs/peak_flops.md``), with :func:`canonical_device` mapping a CUDA device name to a row
  and :func:`peak_flops` reading one entry;
- :func:`precision_dtype`, the dtype whose peak applies to a Lightning precision setting;
- :func:`measure_flops` and :class:`FlopCounter`, counting FLOPs with ``torch.utils.flop_counter`` (the monitor
  counts a training step on a meta-device copy instead: :mod:`lightning_tune.perf.counting`);
- :func:`mfu`, the ratio.

Example:
    >>> peak = peak_flops("NVIDIA H100 80GB HBM3", precision_dtype("bf16-mixed"))
    >>> round(mfu(400e12, peak), 3)
    0.404
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Final, Literal, cast, get_args

from torch.utils.flop_counter import FlopCounterMode

from lightning_tune._validation import check_choice, check_float

Dtype = Literal["fp64", "fp32", "tf32", "bf16", "fp16", "fp8"]
DTYPES: Final[tuple[Dtype, ...]] = get_args(Dtype)

Precision = Literal[
    "64-true",
    "64",
    "32-true",
    "32",
    "16-mixed",
    "16-true",
    "16",
    "bf16-mixed",
    "bf16-true",
    "bf16",
    "transformer-engine",
    "transformer-engine-float16",
]
PRECISIONS: Final[tuple[Precision, ...]] = get_args(Precision)

MatmulPrecision = Literal["highest", "high", "medium"]
MATMUL_PRECISIONS: Final[tuple[MatmulPrecision, ...]] = get_args(MatmulPrecision)

_PRECISION_DTYPE: Final[Mapping[Precision, Dtype]] = MappingProxyType(
    {
        "64-true": "fp64",
        "64": "fp64",
        "32-true": "fp32",
        "32": "fp32",
        "16-mixed": "fp16",
        "16-true": "fp16",
        "16": "fp16",
        "bf16-mixed": "bf16",
        "bf16-true": "bf16",
        "bf16": "bf16",
        "transformer-engine": "fp8",
        "transformer-engine-float16": "fp8",
    }
)

# Dense (no 2:4 sparsity) peak FLOP/s. Tensor-core figures where the card has them (fp64 too, on the cards whose
# FP64 runs on tensor cores); FP16/BF16/FP8 with FP32 accumulate, the mode mixed-precision training uses.
# Every number and its source document: docs/peak_flops.md.
_H100_SXM: Final[dict[Dtype, float]] = {
    "fp64": 66.9e12,
    "fp32": 66.9e12,
    "tf32": 494.7e12,
    "bf16": 989.4e12,
    "fp16": 989.4e12,
    "fp8": 1978.9e12,
}
_H100_NVL: Final[dict[Dtype, float]] = {
    "fp64": 60e12,
    "fp32": 60e12,
    "tf32": 417.5e12,
    "bf16": 835.5e12,
    "fp16": 835.5e12,
    "fp8": 1670.5e12,
}

_TABLE: Final[dict[str, dict[Dtype, float]]] = {
    "H100 SXM": _H100_SXM,
    "H100 PCIe": {
        "fp64": 51.2e12,
        "fp32": 51.2e12,
        "tf32": 378e12,
        "bf16": 756.5e12,
        "fp16": 756.5e12,
        "fp8": 1513e12,
    },
    "H100 NVL": _H100_NVL,
    "H200 SXM": dict(_H100_SXM),
    "H200 NVL": dict(_H100_NVL),
    "B200": {
        "fp64": 37e12,
        "fp32": 75e12,
        "tf32": 1.1e15,
        "bf16": 2.25e15,
        "fp16": 2.25e15,
        "fp8": 4.5e15,
    },
    "A100": {"fp64": 19.5e12, "fp32": 19.5e12, "tf32": 156e12, "bf16": 312e12, "fp16": 312e12},
    "A10": {"fp32": 31.2e12, "tf32": 62.5e12, "bf16": 125e12, "fp16": 125e12},
    "A10G": {"fp32": 35e12, "tf32": 35e12, "bf16": 70e12, "fp16": 70e12},
    "L40S": {"fp32": 91.6e12, "tf32": 183e12, "bf16": 362.05e12, "fp16": 362.05e12, "fp8": 733e12},
    "L40": {"fp32": 90.5e12, "tf32": 90.5e12, "bf16": 181.05e12, "fp16": 181.05e12, "fp8": 362e12},
    "L4": {"fp32": 30.3e12, "tf32": 60e12, "bf16": 121e12, "fp16": 121e12, "fp8": 242.5e12},
    "RTX 4090": {"fp32": 82.6e12, "tf32": 82.6e12, "bf16": 165.2e12, "fp16": 165.2e12, "fp8": 330.3e12},
    "RTX 5090": {"fp32": 104.8e12, "tf32": 104.8e12, "bf16": 209.5e12, "fp16": 209.5e12, "fp8": 419e12},
    "V100 SXM2": {"fp64": 7.8e12, "fp32": 15.7e12, "fp16": 125e12},
    "V100 PCIe": {"fp64": 7e12, "fp32": 14e12, "fp16": 112e12},
    "V100S PCIe": {"fp64": 8.2e12, "fp32": 16.4e12, "fp16": 130e12},
    "T4": {"fp32": 8.1e12, "fp16": 65e12},
}
PEAK_FLOPS: Final[Mapping[str, Mapping[Dtype, float]]] = MappingProxyType(
    {key: MappingProxyType(row) for key, row in _TABLE.items()}
)
"""Dense peak FLOP/s, by device key (see :func:`canonical_device`) and dtype; a dtype the card lacks is absent."""

DEVICES: Final[tuple[str, ...]] = tuple(PEAK_FLOPS)


@dataclass(frozen=True)
class _Rule:
    """A device name matches when it holds every ``required`` token and nothing beyond them but ``optional`` ones."""

    key: str
    required: frozenset[str]
    optional: frozenset[str]


def _rule(key: str, required: str, optional: str = "") -> _Rule:
    return _Rule(key, frozenset(required.split()), frozenset(optional.split()))


# Most specific first. Matching is on whole tokens, so "l4" never matches "L40S", nor "a10" "A10G" or "A100".
_RULES: Final[tuple[_Rule, ...]] = (
    _rule("H200 NVL", "h200 nvl", "hbm3e"),
    _rule("H200 SXM", "h200", "hbm3e sxm sxm5"),
    _rule("H100 NVL", "h100 nvl", "hbm3"),
    _rule("H100 PCIe", "h100 pcie", "hbm2e"),
    _rule("H100 PCIe", "h100 hbm2e"),
    _rule("H100 SXM", "h100", "hbm3 sxm sxm5"),
    _rule("B200", "b200", "hbm3e sxm sxm6"),
    _rule("A100", "a100", "sxm sxm4 pcie"),
    _rule("A10G", "a10g"),
    _rule("A10", "a10"),
    _rule("L40S", "l40s"),
    _rule("L40", "l40"),
    _rule("L4", "l4"),
    _rule("RTX 5090", "rtx 5090"),
    _rule("RTX 4090", "rtx 4090"),
    _rule("V100S PCIe", "v100s", "pcie"),
    _rule("V100 PCIe", "v100 pcie"),
    _rule("V100 SXM2", "v100 sxm2"),
    _rule("T4", "t4"),
)
_IGNORED_TOKENS: Final[frozenset[str]] = frozenset({"nvidia", "geforce", "tesla", "gpu"})
_CAPACITY = re.compile(r"\d+gb")
_TOKEN = re.compile(r"[a-z0-9]+")


def _check_str(name: str, value: object) -> None:
    if not isinstance(value, str):
        raise TypeError(f"`{name}` must be a string, got {value!r} ({type(value).__name__})")


def canonical_device(name: str) -> str | None:
    """Map a CUDA device name, as ``torch.cuda.get_device_name()`` gives it, to a key of :data:`PEAK_FLOPS`.

    The name is lower-cased and split into alphanumeric tokens; vendor words (``NVIDIA``, ``GeForce``, ``Tesla``,
    ``GPU``) and memory sizes (``80GB``) are dropped. A rule matches when the remaining tokens contain all of its
    required tokens and nothing else but its optional ones (form factor, memory type). Anything unrecognised, a
    variant such as ``RTX 4090 D`` or a MIG slice included, gives ``None`` rather than a wrong peak.

    Args:
        name: The device name.

    Returns:
        The table key, or ``None`` for a device not in the table (and for CPUs).

    Raises:
        TypeError: If ``name`` is not a string.

    Example:
        >>> canonical_device("NVIDIA L40S"), canonical_device("NVIDIA A10G"), canonical_device("NVIDIA H200")
        ('L40S', 'A10G', 'H200 SXM')
        >>> canonical_device("AMD EPYC 7763") is None
        True
    """
    _check_str("name", name)
    tokens = {
        token
        for token in _TOKEN.findall(name.lower())
        if token not in _IGNORED_TOKENS and not _CAPACITY.fullmatch(token)
    }
    for rule in _RULES:
        if rule.required <= tokens and tokens - rule.required <= rule.optional:
            return rule.key
    return None


def peak_flops(device_name: str, dtype: str) -> float | None:
    """Dense peak FLOP/s of a device for one dtype.

    ``"tf32"`` on a card without TF32 tensor cores (V100, T4) gives its FP32 peak: there
    ``torch.set_float32_matmul_precision("high")`` has no effect and float32 matmuls run in plain FP32.

    Args:
        device_name: A CUDA device name (see :func:`canonical_device`) or a key of :data:`PEAK_FLOPS`.
        dtype: One of ``"fp64"``, ``"fp32"``, ``"tf32"``, ``"bf16"``, ``"fp16"``, ``"fp8"``.

    Returns:
        The peak in FLOP/s, or ``None`` when the device is unknown or lacks the dtype.

    Raises:
        TypeError: If ``device_name`` or ``dtype`` is not a string.
        ValueError: If ``dtype`` is not one of the dtypes above.

    Example:
        >>> peak_flops("NVIDIA A100-SXM4-80GB", "bf16")
        312000000000000.0
        >>> peak_flops("NVIDIA L4", "fp64") is None
        True
    """
    _check_str("device_name", device_name)
    _check_str("dtype", dtype)
    check_choice("dtype", dtype, DTYPES)
    key = canonical_device(device_name)
    if key is None:
        return None
    row = PEAK_FLOPS[key]
    if dtype == "tf32" and "tf32" not in row:
        return row.get("fp32")
    return row.get(cast(Dtype, dtype))


def precision_dtype(precision: str, *, float32_matmul_precision: str = "highest") -> Dtype:
    """The dtype whose peak applies to a Lightning precision setting.

    Args:
        precision: The Trainer's precision string (``str(trainer.precision)``), e.g. ``"bf16-mixed"``.
        float32_matmul_precision: ``torch.get_float32_matmul_precision()``. With ``"high"`` or ``"medium"``,
            float32 matmuls run on TF32 tensor cores, so 32-bit precision maps to ``"tf32"``.

    Returns:
        ``"fp64"``, ``"fp32"``, ``"tf32"``, ``"bf16"``, ``"fp16"`` or ``"fp8"`` (Transformer Engine).

    Raises:
        TypeError: If ``precision`` is not a string.
        ValueError: If ``precision`` or ``float32_matmul_precision`` is not one of the allowed values.

    Example:
        >>> precision_dtype("16-mixed"), precision_dtype("32-true", float32_matmul_precision="high")
        ('fp16', 'tf32')
    """
    _check_str("precision", precision)
    check_choice("precision", precision, PRECISIONS)
    check_choice("float32_matmul_precision", float32_matmul_precision, MATMUL_PRECISIONS)
    dtype = _PRECISION_DTYPE[cast(Precision, precision)]
    if dtype == "fp32" and float32_matmul_precision != "highest":
        return "tf32"
    return dtype


def measure_flops(fn: Callable[[], object]) -> int:
    """Count the FLOPs ``fn`` runs, with ``torch.utils.flop_counter.FlopCounterMode``.

    Matmuls, convolutions and attention are counted; elementwise work (bias adds, activations, norms) is not. If
    ``fn`` calls ``backward()``, the backward FLOPs are included.

    Args:
        fn: A callable taking no arguments, e.g. ``lambda: model(x).sum().backward()``.

    Returns:
        The total FLOPs counted.

    Raises:
        TypeError: If ``fn`` is not callable.

    Example:
        >>> import torch
        >>> measure_flops(lambda: torch.nn.Linear(3, 5)(torch.ones(4, 3)))  # 2 * 4 * 3 * 5
        120
    """
    if not callable(fn):
        raise TypeError(f"`fn` must be a callable taking no arguments, got {fn!r} ({type(fn).__name__})")
    with FlopCounterMode(display=False) as mode:
        fn()
    return int(mode.get_total_flops())


class FlopCounter:
    """FLOP counting that starts in one place and stops in another, e.g. in two callback hooks.

    Between :meth:`start` and :meth:`stop` a ``FlopCounterMode`` is active on this thread (and on the autograd
    threads its backward runs on). Stop it on the thread that started it, after any counter started later.

    Example:
        >>> import torch
        >>> counter = FlopCounter()
        >>> counter.start()
        >>> _ = torch.ones(2, 3) @ torch.ones(3, 4)
        >>> counter.stop()  # 2 * 2 * 3 * 4
        48
    """

    def __init__(self) -> None:
        self._mode: FlopCounterMode | None = None

    @property
    def running(self) -> bool:
        """Whether :meth:`start` was called and :meth:`stop` has not been since."""
        return self._mode is not None

    def start(self) -> None:
        """Start counting.

        Raises:
            RuntimeError: If the counter is already running.
        """
        if self._mode is not None:
            raise RuntimeError("FlopCounter.start() was called twice without a stop() in between.")
        mode = FlopCounterMode(display=False)
        mode.__enter__()
        self._mode = mode

    def stop(self) -> int:
        """Stop counting.

        Returns:
            The FLOPs counted since :meth:`start`.

        Raises:
            RuntimeError: If the counter is not running.
        """
        mode = self._mode
        if mode is None:
            raise RuntimeError("FlopCounter.stop() was called without a start(): call start() first.")
        self._mode = None
        mode.__exit__(None, None, None)
        return int(mode.get_total_flops())


def mfu(flops_per_sec: float, peak: float) -> float:
    """Model FLOPs utilisation: achieved FLOP/s over the peak.

    Args:
        flops_per_sec: Achieved model FLOP/s, at least 0.
        peak: The device's dense peak FLOP/s for the training dtype (:func:`peak_flops`), greater than 0.

    Returns:
        ``flops_per_sec / peak``.

    Raises:
        TypeError: If either argument is not a number.
        ValueError: If ``flops_per_sec`` is negative or not finite, or ``peak`` is not positive and finite.

    Example:
        >>> mfu(156e12, 312e12)
        0.5
    """
    check_float("flops_per_sec", flops_per_sec, low=0.0)
    check_float("peak", peak, low=0.0, low_inclusive=False)
    return flops_per_sec / peak
