"""Parity with Lightning's throughput utilities (``tests/tests_fabric/utilities/test_throughput.py``) and its
``ThroughputMonitor`` (``tests/tests_pytorch/callbacks/test_throughput_monitor.py``).

The rates: Lightning's ``test_throughput_monitor_fit`` runs five steps of one second each, 3 samples and 6 items
(tokens) a batch, 10 FLOPs a batch on a device of 100 FLOP/s, and expects 1 batch/s, 3 samples/s, 6 items/s,
10 FLOP/s and an MFU of 0.1. ``ThroughputLatencyMonitor`` on the same clock and counts must log the same figures,
next to Lightning's own monitor in the same run.

Lightning's ``test_get_available_flops_cuda_mapping_exists`` lists the CUDA device names its ``ThroughputMonitor``
has a peak for. A user moving from it to lightning_tune expects MFU on the same cards: every such name must map to a
row here, and the FP32 peak (the one figure both tables read the same way) must be Lightning's. Where the figures
differ on purpose (dense one-card figures, the A10G's own datasheet, laptop variants), the case says so; see
``docs/peak_flops.md``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
from lightning.fabric.utilities.throughput import get_available_flops
from lightning.pytorch.callbacks import ThroughputMonitor
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.loggers import CSVLogger

import lightning_tune as lt
from lightning_tune.perf.flops import peak_flops
from tests.helpers import csv_rows, make_trainer

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


class OneSecondSteps(BoringModel):
    """Lightning's BoringModel whose every training step takes one second of the shared mocked clock."""

    now = 0.0
    flops_per_batch = 10  # what Lightning's monitor reads

    def clock(self) -> float:
        return self.now

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        OneSecondSteps.now += 1.0
        return super().training_step(batch, batch_idx)


def test_rates_equal_lightning_throughput_monitor_on_its_own_case(tmp_path: Path) -> None:
    model = OneSecondSteps()
    OneSecondSteps.now = 0.0
    theirs = ThroughputMonitor(length_fn=lambda batch: 6, batch_size_fn=lambda batch: 3, window_size=3, separator="|")
    ours = lt.ThroughputLatencyMonitor(
        log_every_n_steps=5,
        batch_size_fn=lambda batch: 3,
        tokens_fn=lambda batch: 6,
        flops_per_batch=10,
        peak_flops=100,
    )
    logger = CSVLogger(str(tmp_path), name="csv")
    trainer = make_trainer(tmp_path, [theirs, ours], max_steps=5, log_every_n_steps=1, logger=logger)
    with (
        mock.patch("lightning.pytorch.callbacks.throughput_monitor.get_available_flops", return_value=100),
        mock.patch("time.perf_counter", model.clock),
        mock.patch("lightning_tune.perf.timing.perf_counter", model.clock),
    ):
        trainer.fit(model)
    last = {}
    for row in csv_rows(logger.log_dir):
        last.update({key: float(value) for key, value in row.items() if value})
    # Lightning's expected values in its case: 1.0, 3.0, 6.0, 10.0 and 0.1
    pairs = {
        "batches_per_sec": ("train|device|batches_per_sec", 1.0),
        "samples_per_sec": ("train|device|samples_per_sec", 3.0),
        "tokens_per_sec": ("train|device|items_per_sec", 6.0),
        "mfu": ("train|device|mfu", 0.1),
    }
    for key, (lightning_key, expected) in pairs.items():
        assert last[lightning_key] == pytest.approx(expected)
        assert last[f"perf/train/{key}"] == pytest.approx(expected), key
    # FLOP/s is not logged here: it is MFU times the peak, Lightning's 10.0
    assert last["perf/train/mfu"] * 100 == pytest.approx(last["train|device|flops_per_sec"]) == pytest.approx(10.0)
