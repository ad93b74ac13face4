"""Parity with DeepSpeed's ZeRO memory estimators (``deepspeed/runtime/zero/stage_1_and_2.py`` and ``stage3.py``).

``estimate_zero2_model_states_mem_needs`` and ``estimate_zero3_model_states_mem_needs`` give the GPU bytes of the
model states of mixed-precision Adam, per GPU, from the parameter count, the largest layer's parameter count and
the number of GPUs. DeepSpeed is not a dependency here: its formulas are restated below in this file's words (bytes
a parameter for each row), the parameter counts are taken the way DeepSpeed takes them from a model built on the
``meta`` device from the model's Hugging Face config, and :func:`~lightning_tune.plan.zero.zero_bytes` must give the
same bytes once the activations (which DeepSpeed's estimators leave out) are taken away.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from lightning_tune.plan import estimate_memory
from lightning_tune.plan.zero import zero_bytes

GIB = 2**30


def deepspeed_counts(model: torch.nn.Module) -> tuple[int, int]:
    """(parameters, largest layer) as DeepSpeed counts them: shared parameters once; the largest module's own."""
    total = sum({id(p): p.numel() for p in model.parameters()}.values())
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    return total, largest


def deepspeed_gpu_bytes(
    stage: int, offload_optimizer: bool, offload_parameters: bool, p: int, largest: int, n: int
) -> int:
    """DeepSpeed's per-GPU model-state bytes (ZeRO-2: 16-bit weights, then 16-bit and float32 gradients, float32
    weights and two moments sharded; ZeRO-3: all sharded, plus 16-bit weights and gradients of the largest layer)."""
    if stage == 2:
        return 2 * p if offload_optimizer else 2 * p + int(18 * p / n)
    layer = 4 * largest
    if offload_parameters:
        return layer
    return layer + int((2 if offload_optimizer else 18) * p / n)


@pytest.fixture(scope="module")
def llama_2_7b() -> tuple[int, int]:
    config = LlamaConfig(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        max_position_embeddings=4096,
    )
    with torch.device("meta"):
        return deepspeed_counts(LlamaForCausalLM(config))


CONFIGS = [
    pytest.param(2, False, False, id="zero2"),
    pytest.param(2, True, False, id="zero2-offload-optimizer"),
    pytest.param(3, False, False, id="zero3"),
    pytest.param(3, True, False, id="zero3-offload-optimizer"),
    pytest.param(3, True, True, id="zero3-offload-all"),
]


@pytest.mark.parametrize("num_gpus", [1, 2, 8, 64])
@pytest.mark.parametrize(("stage", "offload_optimizer", "offload_parameters"), CONFIGS)
def test_model_states_equal_deepspeeds_estimator(
    llama_2_7b, stage: int, offload_optimizer: bool, offload_parameters: bool, num_gpus: int
) -> None:  # noqa: ANN001
    params, largest = llama_2_7b
    estimate = estimate_memory("llama-2-7b", sequence_length=2048)  # bf16-mixed AdamW, as DeepSpeed assumes
    assert (estimate.parameters, estimate.largest_layer_parameters) == (params, largest)
    activations = estimate.bytes_per_sample + max(0, estimate.fixed_bytes - estimate.state_bytes)
    ours = zero_bytes(estimate, stage, offload_optimizer, offload_parameters, num_gpus, 1) - activations
    theirs = deepspeed_gpu_bytes(stage, offload_optimizer, offload_parameters, params, largest, num_gpus)
    # AdamW's step counters (a few bytes a tensor) are the only state DeepSpeed's figures leave out
    assert ours == pytest.approx(theirs, rel=1e-6)


def test_the_issue_figure_7b_on_8_gpus(llama_2_7b) -> None:  # noqa: ANN001
    estimate = estimate_memory("llama-2-7b", sequence_length=2048)
    activations = estimate.bytes_per_sample + max(0, estimate.fixed_bytes - estimate.state_bytes)
    states = zero_bytes(estimate, 2, False, False, 8, 1) - activations
    assert round(states / GIB, 2) == 26.67  # DeepSpeed: 2 + 18/8 bytes a parameter (the 2 + 14/8 count gave 23.53)


def test_largest_layer_is_the_embedding_not_a_block(llama_2_7b) -> None:  # noqa: ANN001
    _, largest = llama_2_7b
    assert largest == 32000 * 4096  # the token embedding (and the untied head), 131 M; a block is 202 M


def test_float32_training_differs_on_purpose() -> None:
    """DeepSpeed's estimators assume mixed precision; in float32 there is no separate float32 gradient copy."""
    estimate = estimate_memory("llama-2-7b", sequence_length=2048, precision="32-true")
    p = estimate.parameters
    activations = estimate.bytes_per_sample + max(0, estimate.fixed_bytes - estimate.state_bytes)
    states = zero_bytes(estimate, 2, False, False, 8, 1) - activations
    assert states == pytest.approx(4 * p + (4 + 8) * p / 8, rel=1e-6)  # fp32 weights; fp32 gradients and moments
