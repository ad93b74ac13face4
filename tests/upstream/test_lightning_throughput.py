"""Parity with Lightning's throughput utilities (``tests/tests_fabric/utilities/test_throughput.py``).

Lightning's ``test_get_available_flops_cuda_mapping_exists`` lists the CUDA device names its ``ThroughputMonitor``
has a peak for. A user moving from it to lightning_tune expects MFU on the same cards: every such name must map to a
row here, and the FP32 peak (the one figure both tables read the same way) must be Lightning's. Where the figures
differ on purpose (dense one-card figures, the A10G's own datasheet, laptop variants), the case says so; see
``docs/peak_flops.md``.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from lightning.fabric.utilities.throughput import get_available_flops

from lightning_tune.perf.flops import peak_flops

# The device names of Lightning's case that CUDA reports (its placeholder spellings such as "h100-hbm3" included).
# "NVIDIA H200 SXM1"/"NVL1" are left out: no driver reports those names.
LIGHTNING_DEVICE_NAMES = [
    "h100-hbm3",
    "NVIDIA H100 PCIe",
    "h100-hbm2e",
    "NVIDIA GeForce RTX 4090",
    "NVIDIA GeForce RTX 4080",
    "Tesla L40",
    "NVIDIA L4",
    "NVIDIA A100 80GB PCIe",
    "NVIDIA A100-SXM4-40GB",
    "NVIDIA GeForce RTX 3090",
    "NVIDIA GeForce RTX 3090 Ti",
    "NVIDIA GeForce RTX 3080",
    "NVIDIA GeForce RTX 3080 Ti",
    "NVIDIA GeForce RTX 3070",
    "NVIDIA A6000",
    "NVIDIA A40",
    "NVIDIA GeForce RTX 2080 SUPER",
    "NVIDIA GeForce RTX 2080 Ti",
    "NVIDIA GeForce RTX 2080",
    "NVIDIA GeForce RTX 2070 Super",
    "Tesla T4",
    "TITAN RTX",
    "Tesla V100-SXm2-32GB",
    "Tesla V100-PCIE-32GB",
    "Tesla V100S-PCIE-32GB",
]


def lightning_fp32_peak(device_name: str) -> int | None:
    """Lightning's FP32 peak for ``device_name``, with the CUDA name and architecture mocked as its test does."""
    with (
        mock.patch("lightning.fabric.accelerators.cuda._is_ampere_or_later", return_value=False),
        mock.patch("lightning.fabric.utilities.throughput.torch.cuda.get_device_name", return_value=device_name),
    ):
        return get_available_flops(torch.device("cuda"), torch.float32)


@pytest.mark.parametrize("device_name", LIGHTNING_DEVICE_NAMES)
def test_every_device_lightning_knows_has_a_peak_here(device_name: str) -> None:
    theirs = lightning_fp32_peak(device_name)
    assert theirs is not None
    assert peak_flops(device_name, torch.float32) == pytest.approx(theirs, rel=1e-9)
    # and a mixed-precision peak, which is what MFU is logged against
    half = torch.float16 if peak_flops(device_name, torch.bfloat16) is None else torch.bfloat16
    assert (peak_flops(device_name, half) or 0.0) >= theirs


@pytest.mark.parametrize(
    ("device_name", "dtype", "ours_tflops"),
    [
        # Lightning's H100 NVL row is the two-card NVL pair; ours is one card.
        pytest.param("h100-nvl", torch.float32, 60, id="h100-nvl-one-card"),
        # Lightning's A10G row is the A10's datasheet; the A10G's own gives 35 FP32 and 70 BF16 dense.
        pytest.param("NVIDIA A10G", torch.float32, 35, id="a10g-own-datasheet-fp32"),
        pytest.param("NVIDIA A10G", torch.bfloat16, 70, id="a10g-own-datasheet-bf16"),
        # GeForce BF16: tensor cores with FP32 accumulate, where Lightning has the FP32 shader rate.
        pytest.param("NVIDIA GeForce RTX 3090", torch.bfloat16, 71, id="rtx3090-tensor-bf16"),
        pytest.param("NVIDIA GeForce RTX 2080 Ti", torch.float16, 56.9, id="rtx2080ti-tensor-fp16"),
    ],
)
def test_figures_that_differ_from_lightning_on_purpose(
    device_name: str, dtype: torch.dtype, ours_tflops: float
) -> None:
    with (
        mock.patch("lightning.fabric.accelerators.cuda._is_ampere_or_later", return_value=False),
        mock.patch("lightning.fabric.utilities.throughput.torch.cuda.get_device_name", return_value=device_name),
    ):
        theirs = get_available_flops(torch.device("cuda"), dtype)
    assert theirs is not None and theirs != pytest.approx(ours_tflops * 1e12)
    assert peak_flops(device_name, dtype) == pytest.approx(ours_tflops * 1e12, rel=1e-9)


def test_laptop_variants_get_no_peak() -> None:
    """Lightning gives a Max-Q card the desktop card's figures; its clocks are lower, so here it gets none."""
    assert lightning_fp32_peak("Quadro RTX 5000 with Max-Q Design") is not None
    assert peak_flops("Quadro RTX 5000 with Max-Q Design", torch.float32) is None
    assert peak_flops("Quadro RTX 5000", torch.float32) == pytest.approx(11.2e12)
