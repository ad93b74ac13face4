"""Model FLOPs utilisation (MFU): model FLOP/s over the device's *dense* peak FLOP/s for the dtype its matmuls run in.

The peaks come from NVIDIA's datasheets and architecture whitepapers (sources and reasoning: ``docs/peak_flops.md``).

Example:
    >>> from lightning_tune.vocab import precision_dtype
    >>> peak = peak_flops("NVIDIA H100 80GB HBM3", precision_dtype("bf16-mixed"))
    >>> round(mfu(400e12, peak), 3)
    0.404
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from types import MappingProxyType
from typing import Final, Literal, get_args

import torch

from lightning_tune._validation import check_choice, check_float, check_instance

Dtype = Literal["fp64", "fp32", "tf32", "bf16", "fp16", "fp8"]
DTYPES: Final[tuple[Dtype, ...]] = get_args(Dtype)

MatmulPrecision = Literal["highest", "high", "medium"]
MATMUL_PRECISIONS: Final[tuple[MatmulPrecision, ...]] = get_args(MatmulPrecision)

# The table's row for each compute dtype; float32 is "tf32" unless `float32_matmul_precision` is "highest".
_ROWS: Final[Mapping[torch.dtype, Dtype]] = {
    torch.float64: "fp64",
    torch.float32: "fp32",
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float8_e4m3fn: "fp8",
    torch.float8_e5m2: "fp8",
}

# Dense (no 2:4 sparsity) peak FLOP/s; every number, its source and how it was read: docs/peak_flops.md.
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
    "H100 PCIe": {"fp64": 51.2e12, "fp32": 51.2e12, "tf32": 378e12, "bf16": 756.5e12, "fp16": 756.5e12, "fp8": 1513e12},
    "H100 NVL": _H100_NVL,
    "H200 SXM": dict(_H100_SXM),
    "H200 NVL": dict(_H100_NVL),
    "B200": {"fp64": 37e12, "fp32": 75e12, "tf32": 1.1e15, "bf16": 2.25e15, "fp16": 2.25e15, "fp8": 4.5e15},
    "A100": {"fp64": 19.5e12, "fp32": 19.5e12, "tf32": 156e12, "bf16": 312e12, "fp16": 312e12},
    "A10": {"fp32": 31.2e12, "tf32": 62.5e12, "bf16": 125e12, "fp16": 125e12},
    "A10G": {"fp32": 35e12, "tf32": 35e12, "bf16": 70e12, "fp16": 70e12},
    "L40S": {"fp32": 91.6e12, "tf32": 183e12, "bf16": 362.05e12, "fp16": 362.05e12, "fp8": 733e12},
    "L40": {"fp32": 90.5e12, "tf32": 90.5e12, "bf16": 181.05e12, "fp16": 181.05e12, "fp8": 362e12},
    "L4": {"fp32": 30.3e12, "tf32": 60e12, "bf16": 121e12, "fp16": 121e12, "fp8": 242.5e12},
    "RTX 4090": {"fp32": 82.6e12, "tf32": 82.6e12, "bf16": 165.2e12, "fp16": 165.2e12, "fp8": 330.3e12},
    "RTX 5090": {"fp32": 104.8e12, "tf32": 104.8e12, "bf16": 209.5e12, "fp16": 209.5e12, "fp8": 419e12},
    "RTX 4080": {"fp32": 48.7e12, "tf32": 48.7e12, "bf16": 97.5e12, "fp16": 97.5e12, "fp8": 194.9e12},
    "RTX 4080 SUPER": {"fp32": 52.2e12, "tf32": 52.2e12, "bf16": 104.4e12, "fp16": 104.4e12, "fp8": 208.9e12},
    "RTX 3090": {"fp32": 35.6e12, "tf32": 35.6e12, "bf16": 71e12, "fp16": 71e12},
    "RTX 3080": {"fp32": 29.8e12, "tf32": 29.8e12, "bf16": 59.5e12, "fp16": 59.5e12},
    "RTX 3070": {"fp32": 20.3e12, "tf32": 20.3e12, "bf16": 40.6e12, "fp16": 40.6e12},
    "RTX 3090 Ti": {"fp32": 40e12, "tf32": 40e12, "bf16": 80e12, "fp16": 80e12},
    "RTX 3080 Ti": {"fp32": 34.1e12, "tf32": 34.1e12, "bf16": 68.2e12, "fp16": 68.2e12},
    "RTX A6000": {"fp32": 38.7e12, "tf32": 77.4e12, "bf16": 154.8e12, "fp16": 154.8e12},
    "A40": {"fp32": 37.4e12, "tf32": 74.8e12, "bf16": 149.7e12, "fp16": 149.7e12},
    "RTX 2080 Ti": {"fp32": 14.2e12, "fp16": 56.9e12},
    "RTX 2080": {"fp32": 10.6e12, "fp16": 42.4e12},
    "RTX 2080 SUPER": {"fp32": 11.2e12, "fp16": 44.6e12},
    "RTX 2070 SUPER": {"fp32": 9.1e12, "fp16": 36.2e12},
    "TITAN RTX": {"fp32": 16.3e12, "fp16": 130.5e12},
    "Quadro RTX 5000": {"fp32": 11.2e12, "fp16": 89.2e12},
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


# (key, required tokens, optional tokens): a device name matches when it holds every required token and nothing
# beyond them but optional ones. Most specific first; on whole tokens, so "l4" never matches "L40S", nor "a10" "A10G".
_RULES: Final = tuple(
    (key, frozenset(required.split()), frozenset(optional.split()))
    for key, required, optional in (
        ("H200 NVL", "h200 nvl", "hbm3e"),
        ("H200 SXM", "h200", "hbm3e sxm sxm5"),
        ("H100 NVL", "h100 nvl", "hbm3"),
        ("H100 PCIe", "h100 pcie", "hbm2e"),
        ("H100 PCIe", "h100 hbm2e", ""),
        ("H100 SXM", "h100", "hbm3 sxm sxm5"),
        ("B200", "b200", "hbm3e sxm sxm6"),
        ("A100", "a100", "sxm sxm4 pcie"),
        ("A10G", "a10g", ""),
        ("A10", "a10", ""),
        ("L40S", "l40s", ""),
        ("L40", "l40", ""),
        ("L4", "l4", ""),
        ("RTX 5090", "rtx 5090", ""),
        ("RTX 4090", "rtx 4090", ""),
        ("RTX 4080 SUPER", "rtx 4080 super", ""),
        ("RTX 4080", "rtx 4080", ""),
        ("RTX 3090 Ti", "rtx 3090 ti", ""),
        ("RTX 3090", "rtx 3090", ""),
        ("RTX 3080 Ti", "rtx 3080 ti", ""),
        ("RTX 3080", "rtx 3080", ""),
        ("RTX 3070", "rtx 3070", ""),
        ("RTX A6000", "a6000", "rtx"),
        ("A40", "a40", ""),
        ("RTX 2080 Ti", "rtx 2080 ti", ""),
        ("RTX 2080 SUPER", "rtx 2080 super", ""),
        ("RTX 2080", "rtx 2080", ""),
        ("RTX 2070 SUPER", "rtx 2070 super", ""),
        ("TITAN RTX", "titan rtx", ""),
        ("Quadro RTX 5000", "quadro rtx 5000", ""),
        ("V100S PCIe", "v100s", "pcie"),
        ("V100 PCIe", "v100 pcie", ""),
        ("V100 SXM2", "v100 sxm2", ""),
        ("T4", "t4", ""),
    )
)
_IGNORED_TOKENS: Final[frozenset[str]] = frozenset({"nvidia", "geforce", "tesla", "gpu"})
_CAPACITY = re.compile(r"\d+gb")
_TOKEN = re.compile(r"[a-z0-9]+")


def canonical_device(name: str) -> str | None:
    """Map a CUDA device name, as ``torch.cuda.get_device_name()`` gives it, to a key of :data:`PEAK_FLOPS`.

    The matching rules are in ``docs/peak_flops.md``; anything unrecognised (a variant such as ``RTX 4090 D``, a MIG
    slice) gives ``None`` rather than a wrong peak.

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
    check_instance("name", name, str, "a string")
    tokens = {
        token
        for token in _TOKEN.findall(name.lower())
        if token not in _IGNORED_TOKENS and not _CAPACITY.fullmatch(token)
    }
    for key, required, optional in _RULES:
        if required <= tokens and tokens - required <= optional:
            return key
    return None


def peak_flops(device_name: str, dtype: torch.dtype, *, float32_matmul_precision: str = "highest") -> float | None:
    """Dense peak FLOP/s of a device for the dtype its matmuls run in (float32: TF32 unless ``"highest"``).

    Args:
        device_name: A CUDA device name (see :func:`canonical_device`) or a key of :data:`PEAK_FLOPS`.
        dtype: The compute dtype, e.g. ``lightning_tune.vocab.precision_dtype("bf16-mixed")``.
        float32_matmul_precision: ``torch.get_float32_matmul_precision()``.

    Returns:
        The peak in FLOP/s, or ``None`` when the device is unknown or lacks the dtype.

    Raises:
        TypeError: If ``device_name`` is not a string or ``dtype`` not a ``torch.dtype``.
        ValueError: If ``dtype`` has no row in the table or ``float32_matmul_precision`` is not an allowed value.

    Example:
        >>> peak_flops("NVIDIA A100-SXM4-80GB", torch.bfloat16)
        312000000000000.0
        >>> peak_flops("NVIDIA A100-SXM4-80GB", torch.float32, float32_matmul_precision="high")
        156000000000000.0
        >>> peak_flops("NVIDIA L4", torch.float64) is None
        True
    """
    check_instance("device_name", device_name, str, "a string")
    check_instance("dtype", dtype, torch.dtype, "a torch.dtype")
    if dtype not in _ROWS:
        raise ValueError(f"`dtype` must be one of {', '.join(map(str, _ROWS))}, got {dtype}")
    check_choice("float32_matmul_precision", float32_matmul_precision, MATMUL_PRECISIONS)
    key = canonical_device(device_name)
    if key is None:
        return None
    row = PEAK_FLOPS[key]
    name = _ROWS[dtype]
    if name == "fp32" and float32_matmul_precision != "highest":
        return row.get("tf32", row.get("fp32"))
    return row.get(name)


def mfu(flops_per_sec: float, peak: float) -> float:
    """Model FLOPs utilisation: achieved FLOP/s over the peak.

    Args:
        flops_per_sec: Achieved model FLOP/s, at least 0.
        peak: The device's dense peak FLOP/s for the training dtype (:func:`peak_flops`), greater than 0.

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
