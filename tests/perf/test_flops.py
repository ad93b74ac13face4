"""Peak-FLOPs table, device-name matching, compute dtype -> peak, and FLOP counting behind MFU."""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import Tensor, nn
from torch.utils.data import DataLoader
from torch.utils.flop_counter import FlopCounterMode

import lightning_tune as lt
from lightning_tune.perf.flops import DEVICES, DTYPES, PEAK_FLOPS, canonical_device, mfu, peak_flops
from lightning_tune.vocab import PRECISIONS, precision_dtype


def measure_flops(fn: Any) -> int:
    """FLOPs ``fn`` runs, as torch's own ``FlopCounterMode`` counts them (the reference for the conventions)."""
    with FlopCounterMode(display=False) as mode:
        fn()
    return int(mode.get_total_flops())


# What torch.cuda.get_device_name() returns on each card, and the row it must map to.
DEVICE_NAMES = [
    pytest.param("NVIDIA H100 80GB HBM3", "H100 SXM", id="h100-sxm"),
    pytest.param("NVIDIA H100 SXM5 80GB", "H100 SXM", id="h100-sxm5-spelled-out"),
    pytest.param("NVIDIA H100 PCIe", "H100 PCIe", id="h100-pcie"),
    pytest.param("NVIDIA H100 80GB HBM2e", "H100 PCIe", id="h100-pcie-by-hbm2e"),
    pytest.param("NVIDIA H100 NVL", "H100 NVL", id="h100-nvl"),
    pytest.param("NVIDIA H200", "H200 SXM", id="h200"),
    pytest.param("NVIDIA H200 141GB HBM3e", "H200 SXM", id="h200-hbm3e"),
    pytest.param("NVIDIA H200 NVL", "H200 NVL", id="h200-nvl-not-sxm"),
    pytest.param("NVIDIA B200", "B200", id="b200"),
    pytest.param("NVIDIA A100-SXM4-80GB", "A100", id="a100-sxm4-80"),
    pytest.param("NVIDIA A100-SXM4-40GB", "A100", id="a100-sxm4-40"),
    pytest.param("NVIDIA A100-PCIE-40GB", "A100", id="a100-pcie-40"),
    pytest.param("NVIDIA A100 80GB PCIe", "A100", id="a100-pcie-80"),
    pytest.param("NVIDIA A10G", "A10G", id="a10g-not-a10"),
    pytest.param("NVIDIA A10", "A10", id="a10-not-a100"),
    pytest.param("NVIDIA L40S", "L40S", id="l40s-not-l40-or-l4"),
    pytest.param("NVIDIA L40", "L40", id="l40-not-l4"),
    pytest.param("NVIDIA L4", "L4", id="l4"),
    pytest.param("NVIDIA GeForce RTX 4090", "RTX 4090", id="rtx4090"),
    pytest.param("NVIDIA GeForce RTX 5090", "RTX 5090", id="rtx5090"),
    pytest.param("NVIDIA GeForce RTX 4080", "RTX 4080", id="rtx4080"),
    pytest.param("NVIDIA GeForce RTX 4080 SUPER", "RTX 4080 SUPER", id="rtx4080-super-not-4080"),
    pytest.param("NVIDIA GeForce RTX 3090 Ti", "RTX 3090 Ti", id="rtx3090ti-not-3090"),
    pytest.param("NVIDIA GeForce RTX 3090", "RTX 3090", id="rtx3090"),
    pytest.param("NVIDIA GeForce RTX 3080 Ti", "RTX 3080 Ti", id="rtx3080ti"),
    pytest.param("NVIDIA GeForce RTX 3080", "RTX 3080", id="rtx3080"),
    pytest.param("NVIDIA GeForce RTX 3070", "RTX 3070", id="rtx3070"),
    pytest.param("NVIDIA RTX A6000", "RTX A6000", id="rtx-a6000"),
    pytest.param("NVIDIA A40", "A40", id="a40"),
    pytest.param("NVIDIA GeForce RTX 2080 Ti", "RTX 2080 Ti", id="rtx2080ti"),
    pytest.param("NVIDIA GeForce RTX 2080 SUPER", "RTX 2080 SUPER", id="rtx2080-super"),
    pytest.param("NVIDIA GeForce RTX 2080", "RTX 2080", id="rtx2080"),
    pytest.param("NVIDIA GeForce RTX 2070 Super", "RTX 2070 SUPER", id="rtx2070-super"),
    pytest.param("NVIDIA TITAN RTX", "TITAN RTX", id="titan-rtx"),
    pytest.param("Quadro RTX 5000", "Quadro RTX 5000", id="quadro-rtx5000"),
    pytest.param("Tesla V100-SXM2-16GB", "V100 SXM2", id="v100-sxm2"),
    pytest.param("Tesla V100-PCIE-32GB", "V100 PCIe", id="v100-pcie"),
    pytest.param("Tesla V100S-PCIE-32GB", "V100S PCIe", id="v100s-pcie"),
    pytest.param("Tesla T4", "T4", id="t4"),
    pytest.param("nvidia h100 80gb hbm3", "H100 SXM", id="lower-case"),
    pytest.param("  NVIDIA  L40S ", "L40S", id="extra-spaces"),
    # unknown devices, variants with other peaks, and CPUs: no row
    pytest.param("NVIDIA H800", None, id="h800-unknown"),
    pytest.param("NVIDIA GH200 480GB", None, id="gh200-not-h200"),
    pytest.param("NVIDIA GB200", None, id="gb200-not-b200"),
    pytest.param("NVIDIA A100X", None, id="a100x-not-a100"),
    pytest.param("NVIDIA GeForce RTX 4090 D", None, id="rtx4090d-variant"),
    pytest.param("NVIDIA GeForce RTX 4090 Laptop GPU", None, id="rtx4090-laptop"),
    pytest.param("NVIDIA GeForce RTX 3060", None, id="rtx3060-unknown"),
    pytest.param("NVIDIA RTX 6000 Ada Generation", None, id="rtx6000-ada-not-a6000"),
    pytest.param("NVIDIA GeForce RTX 3080 Laptop GPU", None, id="rtx3080-laptop"),
    pytest.param("Quadro RTX 5000 with Max-Q Design", None, id="quadro-rtx5000-max-q"),
    pytest.param("NVIDIA RTX 4000 Ada Generation", None, id="rtx4000-ada"),
    pytest.param("NVIDIA A100-SXM4-40GB MIG 1g.5gb", None, id="mig-slice"),
    pytest.param("Tesla V100-FHHL-16GB", None, id="v100-fhhl-unknown"),
    pytest.param("AMD Instinct MI300X", None, id="amd-unknown"),
    pytest.param("Intel(R) Xeon(R) Platinum 8480C", None, id="cpu-xeon"),
    pytest.param("AMD EPYC 7763 64-Core Processor", None, id="cpu-epyc"),
    pytest.param("cpu", None, id="cpu"),
    pytest.param("", None, id="empty"),
]


@pytest.mark.parametrize(("name", "key"), DEVICE_NAMES)
def test_canonical_device(name: str, key: str | None) -> None:
    assert canonical_device(name) == key


def test_every_table_row_has_a_device_name_case() -> None:
    covered = {param.values[1] for param in DEVICE_NAMES}
    assert set(DEVICES) <= covered


@pytest.mark.parametrize("key", DEVICES)
def test_table_keys_map_to_themselves(key: str) -> None:
    assert canonical_device(key) == key


# Dense values (sparse datasheet figures halved), in TFLOP/s; see docs/peak_flops.md for the sources.
DENSE_TFLOPS = [
    pytest.param("H100 SXM", {"fp64": 66.9, "fp32": 66.9, "tf32": 494.7, "bf16": 989.4, "fp8": 1978.9}, id="h100-sxm"),
    pytest.param("H100 PCIe", {"fp64": 51.2, "fp32": 51.2, "tf32": 378, "bf16": 756.5, "fp8": 1513}, id="h100-pcie"),
    pytest.param("H100 NVL", {"fp64": 60, "fp32": 60, "tf32": 417.5, "bf16": 835.5, "fp8": 1670.5}, id="h100-nvl"),
    pytest.param("H200 SXM", {"fp32": 66.9, "tf32": 494.7, "bf16": 989.4, "fp8": 1978.9}, id="h200-sxm"),
    pytest.param("H200 NVL", {"fp32": 60, "tf32": 417.5, "bf16": 835.5, "fp8": 1670.5}, id="h200-nvl"),
    pytest.param("B200", {"fp64": 37, "fp32": 75, "tf32": 1100, "bf16": 2250, "fp8": 4500}, id="b200"),
    pytest.param("A100", {"fp64": 19.5, "fp32": 19.5, "tf32": 156, "bf16": 312}, id="a100"),
    pytest.param("A10", {"fp32": 31.2, "tf32": 62.5, "bf16": 125}, id="a10"),
    pytest.param("A10G", {"fp32": 35, "tf32": 35, "bf16": 70}, id="a10g"),
    pytest.param("L40S", {"fp32": 91.6, "tf32": 183, "bf16": 362.05, "fp8": 733}, id="l40s"),
    pytest.param("L40", {"fp32": 90.5, "tf32": 90.5, "bf16": 181.05, "fp8": 362}, id="l40"),
    pytest.param("L4", {"fp32": 30.3, "tf32": 60, "bf16": 121, "fp8": 242.5}, id="l4"),
    pytest.param("RTX 4090", {"fp32": 82.6, "tf32": 82.6, "bf16": 165.2, "fp8": 330.3}, id="rtx4090"),
    pytest.param("RTX 5090", {"fp32": 104.8, "tf32": 104.8, "bf16": 209.5, "fp8": 419}, id="rtx5090"),
    pytest.param("RTX 4080", {"fp32": 48.7, "tf32": 48.7, "bf16": 97.5, "fp8": 194.9}, id="rtx4080"),
    pytest.param("RTX 4080 SUPER", {"fp32": 52.2, "tf32": 52.2, "bf16": 104.4, "fp8": 208.9}, id="rtx4080-super"),
    pytest.param("RTX 3090 Ti", {"fp32": 40, "tf32": 40, "bf16": 80}, id="rtx3090ti"),
    pytest.param("RTX 3090", {"fp32": 35.6, "tf32": 35.6, "bf16": 71}, id="rtx3090"),
    pytest.param("RTX 3080 Ti", {"fp32": 34.1, "tf32": 34.1, "bf16": 68.2}, id="rtx3080ti"),
    pytest.param("RTX 3080", {"fp32": 29.8, "tf32": 29.8, "bf16": 59.5}, id="rtx3080"),
    pytest.param("RTX 3070", {"fp32": 20.3, "tf32": 20.3, "bf16": 40.6}, id="rtx3070"),
    pytest.param("RTX A6000", {"fp32": 38.7, "tf32": 77.4, "bf16": 154.8}, id="rtx-a6000"),
    pytest.param("A40", {"fp32": 37.4, "tf32": 74.8, "bf16": 149.7}, id="a40"),
    pytest.param("RTX 2080 Ti", {"fp32": 14.2, "fp16": 56.9}, id="rtx2080ti"),
    pytest.param("RTX 2080 SUPER", {"fp32": 11.2, "fp16": 44.6}, id="rtx2080-super"),
    pytest.param("RTX 2080", {"fp32": 10.6, "fp16": 42.4}, id="rtx2080"),
    pytest.param("RTX 2070 SUPER", {"fp32": 9.1, "fp16": 36.2}, id="rtx2070-super"),
    pytest.param("TITAN RTX", {"fp32": 16.3, "fp16": 130.5}, id="titan-rtx"),
    pytest.param("Quadro RTX 5000", {"fp32": 11.2, "fp16": 89.2}, id="quadro-rtx5000"),
    pytest.param("V100 SXM2", {"fp64": 7.8, "fp32": 15.7, "fp16": 125}, id="v100-sxm2"),
    pytest.param("V100 PCIe", {"fp64": 7, "fp32": 14, "fp16": 112}, id="v100-pcie"),
    pytest.param("V100S PCIe", {"fp64": 8.2, "fp32": 16.4, "fp16": 130}, id="v100s-pcie"),
    pytest.param("T4", {"fp32": 8.1, "fp16": 65}, id="t4"),
]


@pytest.mark.parametrize(("key", "tflops"), DENSE_TFLOPS)
def test_dense_peaks(key: str, tflops: dict[str, float]) -> None:
    row = PEAK_FLOPS[key]
    for dtype, value in tflops.items():
        assert row[dtype] == pytest.approx(value * 1e12, rel=1e-12), (key, dtype)  # type: ignore[index]


def test_exact_reference_values() -> None:
    assert peak_flops("NVIDIA H100 80GB HBM3", torch.bfloat16) == 989.4e12
    assert peak_flops("NVIDIA H100 80GB HBM3", torch.float8_e4m3fn) == 1978.9e12
    assert peak_flops("NVIDIA L40S", torch.bfloat16) == 362.05e12
    assert peak_flops("NVIDIA A10G", torch.bfloat16) == 70e12


def test_every_table_row_is_checked() -> None:
    assert {param.values[0] for param in DENSE_TFLOPS} == set(DEVICES)


@pytest.mark.parametrize("key", DEVICES)
def test_sanity_relations(key: str) -> None:
    row = PEAK_FLOPS[key]
    assert set(row) <= set(DTYPES)
    assert "fp32" in row
    assert all(value > 0 for value in row.values())
    assert row.get("fp16") == row.get("bf16") or "bf16" not in row  # same tensor rate for both halves
    half = row.get("bf16", row.get("fp16"))
    assert half is not None
    assert half >= row.get("tf32", row["fp32"]) >= row["fp32"]
    # FP8 runs at twice, TF32 at half the 16-bit tensor rate; the datasheets round each figure on its own (the
    # L40S sheet lists 362.05 dense BF16 but 733 dense FP8; B200's TF32 is printed as 2.2 PFLOPS sparse, not 2.25)
    if "fp8" in row:
        assert row["fp8"] == pytest.approx(2 * half, rel=0.03)
    if "tf32" in row:
        assert row["tf32"] == pytest.approx(half / 2, rel=0.03)


def test_docs_table_matches_peak_flops() -> None:
    text = (Path(__file__).resolve().parents[2] / "docs" / "peak_flops.md").read_text()
    documented = {}
    for match in re.finditer(r"^\| `([^`]+)` \|(.*)\|$", text, flags=re.MULTILINE):
        cells = [cell.strip() for cell in match.group(2).split("|")]
        if match.group(1) in DEVICES:
            documented[match.group(1)] = {
                dtype: float(cell) * 1e12 for dtype, cell in zip(DTYPES, cells[:6], strict=True) if cell != "—"
            }
    assert set(documented) == set(DEVICES)
    for key, row in documented.items():
        assert row == pytest.approx(dict(PEAK_FLOPS[key]), rel=1e-12), key


def test_dtypes_missing_where_the_card_lacks_them() -> None:
    for key in ("V100 SXM2", "V100 PCIe", "V100S PCIe", "T4"):
        assert "bf16" not in PEAK_FLOPS[key] and "tf32" not in PEAK_FLOPS[key] and "fp8" not in PEAK_FLOPS[key]
    for key in ("A100", "A10", "A10G"):
        assert "fp8" not in PEAK_FLOPS[key]
    assert peak_flops("Tesla T4", torch.bfloat16) is None
    assert peak_flops("NVIDIA A100-SXM4-80GB", torch.float8_e4m3fn) is None
    assert peak_flops("NVIDIA L4", torch.float64) is None


def test_h200_has_h100_compute() -> None:
    assert PEAK_FLOPS["H200 SXM"] == PEAK_FLOPS["H100 SXM"]
    assert PEAK_FLOPS["H200 NVL"] == PEAK_FLOPS["H100 NVL"]


def test_tf32_without_tf32_cores_is_fp32() -> None:
    assert peak_flops("Tesla T4", torch.float32, float32_matmul_precision="high") == 8.1e12
    assert peak_flops("Tesla V100-SXM2-16GB", torch.float32, float32_matmul_precision="medium") == 15.7e12


def test_unknown_device_has_no_peak() -> None:
    assert peak_flops("NVIDIA GeForce RTX 3060", torch.bfloat16) is None
    assert peak_flops("cpu", torch.float32) is None


def test_table_is_read_only() -> None:
    with pytest.raises(TypeError):
        PEAK_FLOPS["H100 SXM"]["bf16"] = 1.0  # type: ignore[index]
    with pytest.raises(TypeError):
        PEAK_FLOPS["X"] = {}  # type: ignore[index]


# Lightning's precision -> the H100 SXM row its peak is read from, with each float32 matmul precision
PRECISION_CASES = [
    pytest.param("64-true", "highest", "fp64", id="64-true"),
    pytest.param("64-true", "high", "fp64", id="64-not-switched"),
    pytest.param("32-true", "highest", "fp32", id="32-true-highest"),
    pytest.param("32-true", "high", "tf32", id="32-true-high"),
    pytest.param("32-true", "medium", "tf32", id="32-true-medium"),
    pytest.param("fp32", "high", "tf32", id="alias-fp32-high"),
    pytest.param("16-mixed", "highest", "fp16", id="16-mixed"),
    pytest.param("16-mixed", "high", "fp16", id="16-mixed-not-switched"),
    pytest.param("16-true", "highest", "fp16", id="16-true"),
    pytest.param("bf16-mixed", "highest", "bf16", id="bf16-mixed"),
    pytest.param("bf16-true", "medium", "bf16", id="bf16-true"),
    pytest.param("bf16", "highest", "bf16", id="alias-bf16"),
    pytest.param("transformer-engine", "highest", "fp8", id="te"),
    pytest.param("transformer-engine-float16", "highest", "fp8", id="te-float16"),
]


@pytest.mark.parametrize(("precision", "matmul", "row"), PRECISION_CASES)
def test_the_peak_of_a_precision(precision: str, matmul: str, row: str) -> None:
    dtype = precision_dtype(precision)
    assert peak_flops("NVIDIA H100 80GB HBM3", dtype, float32_matmul_precision=matmul) == PEAK_FLOPS["H100 SXM"][row]  # type: ignore[index]


def test_every_precision_has_a_peak() -> None:
    assert {param.values[0] for param in PRECISION_CASES} >= set(PRECISIONS) - {"auto"}
    assert peak_flops("NVIDIA H100 80GB HBM3", torch.float32) == PEAK_FLOPS["H100 SXM"]["fp32"]  # default: "highest"


BAD_INPUTS = [
    pytest.param(
        lambda: peak_flops("NVIDIA H100 PCIe", torch.int8),
        ValueError,
        "`dtype` must be one of torch.float64, torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, "
        "torch.float8_e5m2, got torch.int8",
        id="dtype-without-a-peak",
    ),
    pytest.param(
        lambda: peak_flops("cpu", torch.int8),
        ValueError,
        "`dtype` must be one of torch.float64, torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, "
        "torch.float8_e5m2, got torch.int8",
        id="dtype-checked-for-unknown-device",
    ),
    pytest.param(
        lambda: peak_flops("NVIDIA L4", "bf16"),  # type: ignore[arg-type]
        TypeError,
        "`dtype` must be a torch.dtype, got 'bf16' (str)",
        id="dtype-string",
    ),
    pytest.param(
        lambda: peak_flops(None, torch.bfloat16),  # type: ignore[arg-type]
        TypeError,
        "`device_name` must be a string, got None (NoneType)",
        id="device-none",
    ),
    pytest.param(
        lambda: canonical_device(0),  # type: ignore[arg-type]
        TypeError,
        "`name` must be a string, got 0 (int)",
        id="canonical-device-int",
    ),
    pytest.param(
        lambda: peak_flops("NVIDIA L4", torch.float32, float32_matmul_precision="low"),
        ValueError,
        "`float32_matmul_precision` must be one of 'highest', 'high', 'medium', got 'low'",
        id="matmul-precision-unknown",
    ),
    pytest.param(
        lambda: mfu(1e12, 0.0),
        ValueError,
        "`peak` must be in (0, inf], got 0.0",
        id="mfu-zero-peak",
    ),
    pytest.param(
        lambda: mfu(1e12, -1.0),
        ValueError,
        "`peak` must be in (0, inf], got -1.0",
        id="mfu-negative-peak",
    ),
    pytest.param(
        lambda: mfu(1e12, float("nan")),
        ValueError,
        "`peak` must be a finite number, got nan",
        id="mfu-nan-peak",
    ),
    pytest.param(
        lambda: mfu(1e12, None),  # type: ignore[arg-type]
        TypeError,
        "`peak` must be a number, got None (NoneType)",
        id="mfu-none-peak",
    ),
    pytest.param(
        lambda: mfu(-1.0, 1e12),
        ValueError,
        "`flops_per_sec` must be in [0, inf], got -1.0",
        id="mfu-negative-flops",
    ),
]


@pytest.mark.parametrize(("call", "error", "message"), BAD_INPUTS)
def test_bad_inputs(call: object, error: type[Exception], message: str) -> None:
    with pytest.raises(error) as info:
        call()  # type: ignore[operator]
    assert str(info.value) == message


def test_mfu() -> None:
    assert mfu(494.7e12, 989.4e12) == 0.5
    assert mfu(0, 1e12) == 0.0


B, IN, OUT = 8, 16, 32
FORWARD = 2 * B * IN * OUT  # addmm: B*OUT outputs, each IN multiply-adds = 2*B*IN*OUT = 8192; the bias add is free


def test_linear_forward_flops() -> None:
    layer, x = nn.Linear(IN, OUT), torch.randn(B, IN)
    assert measure_flops(lambda: layer(x)) == FORWARD == 8192


def test_linear_forward_backward_flops_with_input_grad() -> None:
    # backward: grad_input = grad_out @ W (B x OUT @ OUT x IN: 2*B*OUT*IN) and grad_weight = grad_out.T @ x
    # (OUT x B @ B x IN: 2*OUT*B*IN); grad_bias is a sum over the batch, not counted.
    # total = 2*B*IN*OUT (forward) + 2 * 2*B*IN*OUT (backward) = 3 * 8192 = 24576
    layer, x = nn.Linear(IN, OUT), torch.randn(B, IN, requires_grad=True)
    assert measure_flops(lambda: layer(x).sum().backward()) == 3 * FORWARD == 24576


def test_linear_forward_backward_flops_without_input_grad() -> None:
    # an input that needs no gradient gets no grad_input matmul: forward + grad_weight = 2 * 8192 = 16384
    layer, x = nn.Linear(IN, OUT), torch.randn(B, IN)
    assert measure_flops(lambda: layer(x).sum().backward()) == 2 * FORWARD == 16384


def test_bias_is_not_counted() -> None:
    x = torch.randn(B, IN, requires_grad=True)
    with_bias, without_bias = nn.Linear(IN, OUT), nn.Linear(IN, OUT, bias=False)
    assert measure_flops(lambda: with_bias(x).sum().backward()) == measure_flops(
        lambda: without_bias(x).sum().backward()
    )


@pytest.mark.gpu
def test_cuda_forward_backward_flops_and_device_name() -> None:
    layer = nn.Linear(IN, OUT).cuda()
    x = torch.randn(B, IN, device="cuda", requires_grad=True)
    assert measure_flops(lambda: layer(x).sum().backward()) == 3 * FORWARD  # backward runs on the device thread
    name = torch.cuda.get_device_name()
    key = canonical_device(name)
    assert key is None or peak_flops(name, torch.float32) == PEAK_FLOPS[key]["fp32"]


# ------------------------------------------------------------------- counting on a meta copy (perf/counting.py)

from lightning_tune.demos import DemoGPT, GPTConfig  # noqa: E402
from lightning_tune.perf.counting import FlopModel, attention_pairs, count_step_flops, meta_copy  # noqa: E402


def demo_step(module: nn.Module, batch: object) -> object:
    return type(module).training_step(module, batch, 0)  # type: ignore[operator]


def test_demo_gpt_125m_step_flops_match_a_hand_count() -> None:
    config = GPTConfig(vocab_size=50304, seq_len=1024, d_model=768, n_layers=12, n_heads=12)
    with torch.device("meta"):
        module = DemoGPT(config)
    batch, seq, d = 8, 1024, 768
    ids = torch.zeros(batch, seq, dtype=torch.long)
    flops, hardware = count_step_flops(module, (ids, ids), demo_step, samples=batch)
    # per layer: qkv 3d^2, proj d^2, MLP 8d^2 weights; plus the d x vocab head. 6 FLOPs per weight and token
    # (2 forward, 4 backward); the embedding lookups are not matmuls
    dense = 6 * batch * seq * (12 * 12 * d * d + d * 50304)
    # causal attention: QK^T and AV, 2 FLOPs per multiply-add each, over L(L+1)/2 pairs; backward twice the forward
    attention = 12 * 3 * 4 * batch * d * (seq * (seq + 1) // 2)
    assert flops.total == pytest.approx(dense + attention, rel=0.02)
    assert flops.dense == dense and flops.causal_attention == attention and flops.full_attention == 0
    assert hardware is None
    # the usual 6N + 12 L H Q T (full-square) rule counts more: the difference is the causal convention
    assert flops.total < 6 * batch * seq * (12 * 12 * d * d + d * 50304) + 12 * 12 * d * seq * batch * seq


def test_attention_counted_as_torch_counts_the_explicit_matmuls() -> None:
    # a non-causal call: our formula against FlopCounterMode on the same attention written as matmuls
    q, k, v = (torch.randn(2, 3, 5, 4, requires_grad=True) for _ in range(3))

    def explicit() -> None:
        ((q @ k.transpose(-2, -1)).softmax(-1) @ v).sum().backward()

    expected = measure_flops(explicit)
    model, _ = count_step_flops(
        nn.Identity(), q, lambda m, x: torch.nn.functional.scaled_dot_product_attention(q, k, v).sum(), samples=2
    )
    assert model.full_attention == expected == 3 * 2 * 2 * 3 * 5 * 5 * (4 + 4)


def test_attention_pairs() -> None:
    assert [attention_pairs(n, n, causal=True) for n in (1, 2, 3, 1024)] == [1, 3, 6, 1024 * 1025 // 2]
    assert attention_pairs(2, 5, causal=True) == 1 + 2  # torch's top-left alignment
    assert attention_pairs(5, 2, causal=True) == 1 + 2 + 2 + 2 + 2
    assert attention_pairs(3, 7, causal=False) == 21


def test_flop_model_scales_dense_with_tokens_and_attention_with_pairs() -> None:
    model = FlopModel(samples=2, seq_len=4, dense=800.0, causal_attention=100.0, full_attention=160.0)
    assert model.flops(2, 4) == model.total == 1060.0
    assert model.flops(4, 4) == 2120.0  # twice the samples
    # one sequence of 8: dense 800 * (1/2) * 2, causal 100 * (1/2) * 36/10, full 160 * (1/2) * 4
    assert model.flops(1, 8) == pytest.approx(800 + 180 + 320)
    assert model.flops(1, None) == 530.0  # no length: by samples


def test_meta_copy_leaves_the_model_alone_and_computes_nothing() -> None:
    module = DemoGPT(GPTConfig(d_model=32, n_heads=4, n_layers=1, seq_len=16))
    before = {name: p.clone() for name, p in module.named_parameters()}
    copied = meta_copy(module)
    assert all(p.device.type == "meta" for p in copied.parameters())
    assert all(p.device.type == "cpu" and p.grad is None for p in module.parameters())
    ids = torch.zeros(2, 16, dtype=torch.long)
    count_step_flops(module, (ids, ids), demo_step, samples=2)
    assert all(torch.equal(before[name], p) and p.grad is None for name, p in module.named_parameters())
    with pytest.raises(TypeError, match="`module` must be a torch.nn.Module, got 3"):
        meta_copy(3)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        pytest.param(lambda: attention_pairs(-1, 4, causal=True), ValueError, "`q_len` must be an integer", id="q"),
        pytest.param(lambda: attention_pairs(4, 2.0, causal=True), TypeError, "`k_len` must be an integer", id="k"),
        pytest.param(lambda: attention_pairs(4, 4, causal=1), TypeError, "`causal` must be", id="causal"),
        pytest.param(lambda: FlopModel(0, 4, 1.0, 0.0, 0.0), ValueError, "`samples` must be an integer >= 1", id="n"),
        pytest.param(lambda: FlopModel(2, 0, 1.0, 0.0, 0.0), ValueError, "`seq_len` must be an integer >= 1", id="L"),
        pytest.param(lambda: FlopModel(2, 4, -1.0, 0.0, 0.0), ValueError, "`dense` must be in", id="dense"),
        pytest.param(
            lambda: FlopModel(2, 4, 1.0, float("nan"), 0.0), ValueError, "`causal_attention` must be a finite", id="nan"
        ),
        pytest.param(
            lambda: count_step_flops(3, torch.ones(2), demo_step, samples=2),  # type: ignore[arg-type]
            TypeError,
            "`module` must be a torch.nn.Module, got 3",
            id="module",
        ),
        pytest.param(
            lambda: count_step_flops(nn.Linear(2, 2), torch.ones(2), "step", samples=2),  # type: ignore[arg-type]
            TypeError,
            "`step` must be a callable",
            id="step",
        ),
        pytest.param(
            lambda: count_step_flops(nn.Linear(2, 2), torch.ones(2), demo_step, samples=-1),
            ValueError,
            "`samples` must be an integer >= 0, got -1",
            id="samples",
        ),
    ],
)
def test_counting_rejects_bad_arguments(call: Any, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=re.escape(message)):
        call()


def test_hugging_face_gpt2_with_a_padded_dict_batch_matches_a_hand_count() -> None:
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=100, n_positions=64)
    model = transformers.GPT2LMHeadModel(config)
    model.set_attn_implementation("sdpa")
    ids = torch.randint(0, 100, (2, 16))
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[0, -3:] = 0  # right padding, as a collator makes it
    labels = ids.masked_fill(mask == 0, -100)
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    flops, _ = count_step_flops(model, batch, lambda m, b: m(**b).loss, samples=2)
    d, tokens = 32, 2 * 16
    weights = 2 * 12 * d * d + d * 100  # qkv, proj, MLP per layer (Conv1D), and the tied head
    assert flops.dense == 6 * tokens * weights
    assert flops.causal_attention == 3 * 2 * 4 * 2 * d * attention_pairs(16, 16, causal=True)


def test_hugging_face_gradient_checkpointing_is_hardware_work_not_model_work() -> None:
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=100, n_positions=64)
    model = transformers.GPT2LMHeadModel(config)
    model.set_attn_implementation("sdpa")
    ids = torch.randint(0, 100, (2, 16))
    batch = {"input_ids": ids, "labels": ids}
    plain, none = count_step_flops(model, batch, lambda m, b: m(**b).loss, samples=2)
    if hasattr(model, "activation_checkpointing_enable"):  # transformers 5
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    flops, hardware = count_step_flops(model, batch, lambda m, b: m(**b).loss, samples=2)
    assert none is None and flops == plain  # the model's FLOPs do not change with checkpointing
    d, tokens = 32, 2 * 16
    layer_forward = 2 * tokens * 12 * d * d + 4 * 2 * d * attention_pairs(16, 16, causal=True)
    assert hardware is not None and hardware.total - flops.total == 2 * layer_forward  # each layer's forward again


class _LlamaModule(LightningModule):
    """A Llama built from a config, fine-tuned on random token ids with its own token-mean loss."""

    def __init__(self) -> None:
        super().__init__()
        transformers = pytest.importorskip("transformers", reason="transformers is not installed")
        torch.manual_seed(0)
        config = transformers.LlamaConfig(
            vocab_size=128,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
        )
        self.model = transformers.LlamaForCausalLM(config)

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        return self.model(input_ids=batch, labels=batch).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(torch.randint(0, 128, (8, 32), generator=torch.Generator().manual_seed(0)), batch_size=4)


def _fit_monitored(tmp_path: Path, swaps: list[Callback], plugins: list[Any]) -> lt.ThroughputLatencyMonitor:
    monitor = lt.ThroughputLatencyMonitor(peak_flops=1e12, gpu_stats=False)
    trainer = Trainer(
        default_root_dir=tmp_path,
        accelerator="cpu",
        max_steps=2,
        callbacks=[monitor, *swaps],
        plugins=plugins,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # "could not count the training step's FLOPs" is one
        trainer.fit(_LlamaModule())
    return monitor


@pytest.mark.parametrize(
    "swaps",
    [
        pytest.param(
            lambda: ([lt.LossSwap("chunked", verbose=False), lt.AttentionSwap("sdpa", verbose=False)], []),
            id="loss-then-attention-callbacks",
        ),
        pytest.param(
            lambda: ([lt.AttentionSwap("sdpa", verbose=False), lt.LossSwap("chunked", verbose=False)], []),
            id="attention-then-loss-callbacks",
        ),
        pytest.param(lambda: ([], [lt.TunePlugin(attention="auto", loss="auto")]), id="plugin-auto"),
    ],
)
@pytest.mark.slow
def test_mfu_with_the_loss_and_attention_swaps_together_is_the_unswapped_count(tmp_path: Path, swaps: Any) -> None:
    plain = _fit_monitored(tmp_path, [], [])
    callbacks, plugins = swaps()
    swapped = _fit_monitored(tmp_path, callbacks, plugins)
    assert plain.flop_model is not None and "mfu" in plain.summary
    assert swapped.flop_model == plain.flop_model  # counted on the model as written, whatever runs in its place
    assert isinstance(swapped.summary.get("mfu"), float) and swapped.summary["mfu"] > 0
