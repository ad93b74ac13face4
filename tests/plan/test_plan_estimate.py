"""MemoryEstimate's batch arithmetic and margins, and the ZeRO plan chosen from it."""

from __future__ import annotations

from typing import Any

import pytest

from lightning_tune.plan import MemoryEstimate, ZeroPlan, estimate_memory, plan_zero
from lightning_tune.plan.zero import zero_bytes

GIB = 2**30


def simple(**kw: Any) -> MemoryEstimate:
    fields: dict[str, Any] = {"parameters": 1000, "weight_bytes": 4000, "fixed_bytes": 4000, "bytes_per_sample": 1000}
    return MemoryEstimate(**{**fields, **kw})


@pytest.mark.parametrize(
    ("budget", "expected"),
    [
        pytest.param(20_000, {"safe": 12, "optimal": 14, "aggressive": 15}, id="room"),
        pytest.param(5_000, {"safe": 0, "optimal": 0, "aggressive": 0}, id="only-fixed"),
        pytest.param(5_500, {"safe": 0, "optimal": 0, "aggressive": 1}, id="aggressive-only"),
        pytest.param(0, {"safe": 0, "optimal": 0, "aggressive": 0}, id="empty"),
    ],
)
def test_batch_sizes_at_each_margin(budget: int, expected: dict[str, int]) -> None:
    estimate = simple()
    assert estimate.batch_sizes(budget) == expected
    for margin, batch in expected.items():
        assert estimate.max_batch_size(budget, margin) == batch  # type: ignore[arg-type]
        usable = estimate.usable_bytes(budget, margin)  # type: ignore[arg-type]
        assert estimate.total_bytes(batch) <= usable or batch == 0
        assert estimate.total_bytes(batch + 1) > usable


def test_linear_model() -> None:
    estimate = simple()
    assert [estimate.total_bytes(b) for b in (0, 1, 10)] == [4000, 5000, 14000]
    assert estimate.trainable_parameters == estimate.largest_layer_parameters == 1000


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        pytest.param(
            lambda: simple(bytes_per_sample=0),
            ValueError,
            r"`bytes_per_sample` must be an integer >= 1, got 0",
            id="per-sample",
        ),
        pytest.param(
            lambda: simple(fixed_bytes=-1), ValueError, r"`fixed_bytes` must be an integer >= 0, got -1", id="fixed"
        ),
        pytest.param(
            lambda: simple(weight_bytes=1.5), TypeError, r"`weight_bytes` must be an integer, got 1.5", id="float"
        ),
        pytest.param(
            lambda: simple(source="guess"), ValueError, r"`source` must be one of 'analytic', 'measured'", id="source"
        ),
        pytest.param(
            lambda: simple().max_batch_size(100, "tight"),
            ValueError,
            r"`margin` must be one of 'safe', 'optimal', 'aggressive', got 'tight'",
            id="margin",
        ),
        pytest.param(
            lambda: simple().max_batch_size(-5),
            ValueError,
            r"`budget_bytes` must be an integer >= 0, got -5",
            id="budget",
        ),
        pytest.param(
            lambda: simple().total_bytes(-1), ValueError, r"`batch_size` must be an integer >= 0, got -1", id="batch"
        ),
        pytest.param(
            lambda: plan_zero(simple(), gpu_memory_bytes=0),
            ValueError,
            r"`gpu_memory_bytes` must be an integer >= 1, got 0",
            id="gpu",
        ),
        pytest.param(
            lambda: plan_zero(simple(), gpu_memory_bytes=10, num_gpus=0),
            ValueError,
            r"`num_gpus` must be an integer >= 1",
            id="gpus",
        ),
        pytest.param(
            lambda: plan_zero({"fixed_bytes": 1}, gpu_memory_bytes=10),
            TypeError,
            r"`estimate` must be a MemoryEstimate",
            id="estimate",
        ),
    ],
)
def test_bad_arguments(call: Any, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        call()


# DeepSpeed's memory model for mixed-precision Adam: 2 bytes of fp16 weights, 2 of gradients, 12 of fp32 master
# weights and moments per parameter (ZeRO paper, K = 12).
P = 1_000_000_000
DEEPSPEED = MemoryEstimate(
    parameters=P,
    weight_bytes=2 * P,
    gradient_bytes=2 * P,
    master_weight_bytes=4 * P,
    optimizer_bytes=8 * P,
    fixed_bytes=16 * P,
    bytes_per_sample=GIB,
    largest_layer_parameters=P // 100,
)


@pytest.mark.parametrize(
    ("gpus", "gpu_gib", "expected"),
    [
        # per GPU at batch 1 (activations 1 GiB): stage 0 15.9 GiB; on 8 GPUs stage 1 6.1, stage 2 4.5, stage 3 2.9;
        # on 1 GPU optimizer offloaded 2.9, everything offloaded 1.04; usable = 90 % of the GPU
        pytest.param(1, 20, (0, False, False), id="fits-plain"),
        pytest.param(8, 8, (1, False, False), id="stage1"),
        pytest.param(8, 6, (2, False, False), id="stage2"),
        pytest.param(8, 4, (3, False, False), id="stage3"),
        pytest.param(1, 4, (2, True, False), id="offload-optimizer"),
        pytest.param(1, 2, (3, True, True), id="offload-everything"),
    ],
)
def test_least_sharding_that_fits(gpus: int, gpu_gib: int, expected: tuple[int, bool, bool]) -> None:
    plan = plan_zero(DEEPSPEED, gpu_memory_bytes=gpu_gib * GIB, num_gpus=gpus, batch_size=1)
    assert (plan.stage, plan.offload_optimizer, plan.offload_parameters) == expected
    assert plan.fits and plan.per_gpu_bytes <= 0.9 * gpu_gib * GIB
    assert plan.per_gpu_bytes == zero_bytes(DEEPSPEED, *expected, gpus, 1)


def test_per_gpu_bytes_follow_the_zero_paper() -> None:
    n, act = 8, GIB
    assert zero_bytes(DEEPSPEED, 0, False, False, n, 1) == 16 * P + act
    # the float32 gradient partition DeepSpeed steps on (4 bytes) joins the sharded state from stage 1 on
    assert zero_bytes(DEEPSPEED, 1, False, False, n, 1) == 4 * P + 16 * P // n + act
    assert zero_bytes(DEEPSPEED, 2, False, False, n, 1) == 2 * P + 18 * P // n + act
    assert zero_bytes(DEEPSPEED, 3, False, False, n, 1) == 18 * P // n + 4 * (P // 100) + act
    # DeepSpeed's estimate_zero2_model_states_mem_needs with cpu_offload: 2 bytes per parameter on the GPU
    assert zero_bytes(DEEPSPEED, 2, True, False, n, 1) == 2 * P + act
    # estimate_zero3_model_states_mem_needs, offloading both: the largest layer's 4 bytes per parameter
    assert zero_bytes(DEEPSPEED, 3, True, True, n, 1) == 4 * (P // 100) + act


def test_nothing_fits_returns_the_most_saving_plan_and_says_so() -> None:
    plan = plan_zero(DEEPSPEED, gpu_memory_bytes=GIB, batch_size=1)
    assert isinstance(plan, ZeroPlan) and not plan.fits
    assert (plan.stage, plan.offload_optimizer, plan.offload_parameters) == (3, True, True)
    assert plan.reason.startswith("nothing fits: ZeRO stage 3 with optimizer and weights offloaded to CPU still needs")


def test_plan_from_an_analytic_estimate_names_the_figures() -> None:
    estimate = estimate_memory("llama-2-7b", sequence_length=2048, gradient_checkpointing=True)
    plan = plan_zero(estimate, gpu_memory_bytes=80 * GIB, num_gpus=1, batch_size=4)
    assert (plan.stage, plan.offload_optimizer) == (2, True)
    assert plan.reason.startswith(
        "ZeRO stage 2 with the optimizer offloaded to CPU needs 18.29 GiB per GPU of 72.00 GiB"
    )
    assert "no ZeRO sharding would need 106.15 GiB" in plan.reason
