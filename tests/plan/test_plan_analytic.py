"""Analytic estimate: the byte arithmetic, checked by hand and against the optimizers' real state."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from lightning_tune.plan import MemoryEstimate, TransformerShape, estimate_memory, from_hf_config, get_shape
from lightning_tune.plan.estimate import lora_parameters, resolve_model
from lightning_tune.swaps.optimizer import TARGETS, optimizer_state_bytes, swap_optimizer
from lightning_tune.vocab import OPTIMIZERS

GIB = 2**30
P_7B = 6_738_415_616  # 32000*4096 (embedding) + 32 * (4*4096*4096 + 3*4096*11008 + 2*4096) + 4096 + 32000*4096 (head)
TENSORS_7B = 1 + 32 * 9 + 1 + 1  # embedding, 9 tensors per block, final norm, head


def test_llama_2_7b_fp16_bytes_spelled_out() -> None:
    estimate = estimate_memory("llama-2-7b", sequence_length=2048, precision="16-mixed")
    assert estimate.parameters == P_7B
    assert estimate.weight_bytes == 2 * P_7B  # fp16: 2 bytes per weight = 13,476,831,232 bytes, 12.55 GiB
    assert round(estimate.weight_bytes / GIB, 2) == 12.55
    assert estimate.gradient_bytes == 2 * P_7B
    assert estimate.master_weight_bytes == 4 * P_7B  # float32 copies, the default in 16-bit
    assert estimate.optimizer_bytes == 8 * P_7B + 4 * TENSORS_7B  # AdamW: two float32 moments, a step per tensor
    assert estimate.buffer_bytes == 2 * 64 * 4  # rotary inverse frequencies, twice, head_dim / 2 floats
    assert estimate.fixed_bytes == 16 * P_7B + 4 * TENSORS_7B + 512


def test_llama_2_7b_activations_spelled_out() -> None:
    h, i, v, s, layers = 4096, 11008, 32000, 2048, 32
    # per layer and token, 2 bytes each: two norm inputs, attention input, q + k + v, output-projection input,
    # MLP input, SwiGLU gate + up + SiLU + product; plus a float32 log-sum-exp per head (flash attention)
    layer = 2 * (2 * h + h + 3 * h + h + h + 4 * i) + 4 * 32
    head = 2 * (2 * h) + 2 * v + 2 * 4 * v  # final norm and head inputs, logits, float32 log-probs and gradient
    per_token = layers * layer + head + 16  # + int64 ids and labels
    estimate = estimate_memory("llama-2-7b", sequence_length=s, precision="bf16-mixed")
    assert estimate.bytes_per_sample == s * per_token
    assert estimate.total_bytes(3) == estimate.fixed_bytes + 3 * s * per_token


def test_gpt_block_matches_korthikanti_34_plus_5as_over_h() -> None:
    # Korthikanti et al. 2022, eq. 1: a GPT block with dropout and eager attention keeps s*b*h*(34 + 5*a*s/h) bytes
    shape = TransformerShape("gpt2", 64, 1024, 1, 16, 4096, max_position_embeddings=512, dropout=True, mlp_bias=True)
    s = 512
    estimate = estimate_memory(shape, sequence_length=s, precision="16-true", attention="eager")
    outside = s * (2 * (2 * 1024) + 2 * 64 + 8 * 64 + 16 + 1024)  # head, loss, inputs, embedding dropout mask
    assert estimate.bytes_per_sample - outside == s * 1024 * (34 + 5 * 16 * s // 1024)


def test_flash_attention_drops_the_quadratic_term_and_checkpointing_keeps_block_inputs() -> None:
    def per_sample(**kw: Any) -> int:
        return estimate_memory("llama-2-7b", sequence_length=4096, precision="bf16-mixed", **kw).bytes_per_sample

    s, h, i, a, layers = 4096, 4096, 11008, 32, 32
    eager, flash = per_sample(attention="eager"), per_sample(attention="flash")
    assert eager - flash == s * layers * (2 * a * s - 4 * a)  # the softmax output (a*s per token) minus the lse
    layer = 2 * (2 * h + h + 3 * h + h + h + 4 * i) + 4 * a  # one block per token, as above
    # checkpointing: every block keeps its input (h values per token), one block is recomputed whole at a time
    assert flash - per_sample(gradient_checkpointing=True) == s * (layers * layer - layers * 2 * h - layer)


def test_lora_freezes_the_base() -> None:
    full = estimate_memory("llama-2-7b", sequence_length=1024)
    lora = estimate_memory("llama-2-7b", sequence_length=1024, lora_rank=8)
    adapters = lora_parameters(get_shape("llama-2-7b"), 8)
    assert adapters == 32 * 4 * 8 * (4096 + 4096)
    assert lora.parameters == P_7B + adapters and lora.trainable_parameters == adapters
    assert lora.gradient_bytes == 2 * adapters and lora.master_weight_bytes == 4 * adapters
    assert lora.optimizer_bytes == 8 * adapters + 4 * 32 * 8
    assert lora.bytes_per_sample < full.bytes_per_sample


def test_precision_sets_bytes_per_weight_and_master_weights() -> None:
    fp32 = estimate_memory("gpt2", sequence_length=128, precision="32-true")
    bare = estimate_memory("gpt2", sequence_length=128, precision="bf16-true")
    assert fp32.weight_bytes == 2 * bare.weight_bytes == 4 * 124_439_808
    assert fp32.master_weight_bytes == bare.master_weight_bytes == 0
    # torch's AdamW keeps its moments in the weights' dtype: 2 x 4 bytes in fp32, 2 x 2 bytes in bf16
    assert fp32.optimizer_bytes - bare.optimizer_bytes == 4 * 124_439_808
    no_master = estimate_memory("gpt2", sequence_length=128, precision="bf16-mixed", master_weights=False)
    assert replace(no_master, notes=bare.notes) == bare


def test_mixed_adds_float32_master_weights_and_optimizer_state_to_true() -> None:
    p = 124_439_808  # gpt2, every parameter trainable
    mixed = estimate_memory("gpt2", sequence_length=128, precision="bf16-mixed")
    true = estimate_memory("gpt2", sequence_length=128, precision="bf16-true")
    assert mixed.master_weight_bytes == 4 * p and true.master_weight_bytes == 0
    assert (mixed.weight_bytes, mixed.gradient_bytes) == (true.weight_bytes, true.gradient_bytes) == (2 * p, 2 * p)
    # the master weights, and AdamW's two moments stepping them in float32 instead of bf16
    assert mixed.fixed_bytes - true.fixed_bytes == 4 * p + 2 * (4 - 2) * p
    assert mixed.bytes_per_sample == true.bytes_per_sample  # bf16 activations in both
    # 16 bytes per parameter with AdamW (the ZeRO paper's 2 + 2 + 12), plus a float32 step count per tensor
    assert mixed.fixed_bytes == 16 * p + 4 * sum(count for _, _, count in resolve_model("gpt2").tensors())
    # DeepSpeed's bf16 mode: 16-bit weights with float32 master copies, the same count
    deepspeed = estimate_memory("gpt2", sequence_length=128, precision="bf16-true", master_weights=True)
    assert deepspeed.fixed_bytes == mixed.fixed_bytes


@pytest.mark.parametrize(
    ("alias", "canonical"),
    [
        ({"precision": "bf16"}, {"precision": "bf16-mixed"}),
        ({"precision": "fp16"}, {"precision": "16-mixed"}),
        ({"precision": "fp32"}, {"precision": "32-true"}),
        ({"optimizer": "adamw_8bit"}, {"optimizer": "adamw8bit"}),
        ({"optimizer": "adamw_torch_fused"}, {"optimizer": "adamw_fused"}),
        ({"attention": "flash_attention_2"}, {"attention": "flash"}),
    ],
)
def test_aliases_plan_exactly_what_their_canonical_name_does(alias: dict[str, Any], canonical: dict[str, Any]) -> None:
    assert estimate_memory("gpt2", sequence_length=64, **alias) == estimate_memory(
        "gpt2", sequence_length=64, **canonical
    )


@pytest.mark.parametrize("attention", ["sdpa", "auto"])
def test_sdpa_and_auto_attention_are_planned_as_flash(attention: Any) -> None:
    planned = estimate_memory("gpt2", sequence_length=512, attention=attention)
    flash = estimate_memory("gpt2", sequence_length=512, attention="flash")
    eager = estimate_memory("gpt2", sequence_length=512, attention="eager")
    assert planned.bytes_per_sample == flash.bytes_per_sample < eager.bytes_per_sample
    assert f"{attention} attention (planned as flash)" in planned.notes[0]


TINY_LLAMA = LlamaConfig(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)


def tiny_llama() -> torch.nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(TINY_LLAMA)


def real_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    ids = torch.randint(0, 512, (2, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()


@pytest.mark.parametrize("name", ["adamw", "adamw_fused", "sgd"])
def test_optimizer_bytes_equal_torch_state_after_a_real_step(name: Any) -> None:
    model = tiny_llama()
    optimizer = {
        "adamw": lambda: torch.optim.AdamW(model.parameters()),
        "adamw_fused": lambda: torch.optim.AdamW(model.parameters(), fused=True),
        "sgd": lambda: torch.optim.SGD(model.parameters(), 0.1, 0.9),
    }[name]()
    real_step(model, optimizer)
    estimate = estimate_memory(_shape(), sequence_length=16, precision="32-true", optimizer=name)
    assert estimate.parameters == sum(p.numel() for p in model.parameters())
    assert estimate.optimizer_bytes == optimizer_state_bytes(optimizer)


def _shape() -> TransformerShape:
    return from_hf_config(TINY_LLAMA.to_dict())


def test_every_vocabulary_optimizer_is_planned_by_a_test_here() -> None:
    assert {"adamw", "sgd", *TARGETS} == set(OPTIMIZERS)


@pytest.mark.parametrize("name", [name for name in TARGETS if name != "adamw_fused"])
@pytest.mark.filterwarnings("ignore:swapping:UserWarning", "ignore:Paged optimizers:UserWarning")
def test_8bit_optimizer_bytes_equal_bitsandbytes_state_after_a_real_step(name: Any) -> None:
    # Adam(W): two 8-bit moments; Lion and SGD: one 8-bit state; paged ones as their unpaged twin (on the CPU
    # bitsandbytes pages nothing, and on a GPU the pages hold the same bytes)
    pytest.importorskip("bitsandbytes")
    model = tiny_llama()
    start = (
        torch.optim.SGD(model.parameters(), 0.1, 0.9) if name == "sgd8bit" else torch.optim.AdamW(model.parameters())
    )
    swap = swap_optimizer(start, optimizer=name, module=model)
    real_step(model, swap.new)
    estimate = estimate_memory(_shape(), sequence_length=16, precision="32-true", optimizer=name)
    assert estimate.optimizer_bytes == optimizer_state_bytes(swap.new)
    adamw = estimate_memory(_shape(), sequence_length=16, precision="32-true", optimizer="adamw")
    states = 2 if "adam" in name else 1
    assert math.isclose(estimate.optimizer_bytes / adamw.optimizer_bytes, 0.18 * states, abs_tol=0.03)


def test_config_path_and_name_agree(tmp_path: Any) -> None:
    from transformers import GPT2Config

    GPT2Config().save_pretrained(tmp_path)
    by_name = estimate_memory("gpt2", sequence_length=64)
    by_path = estimate_memory(str(tmp_path / "config.json"), sequence_length=64)
    assert by_name.fixed_bytes == by_path.fixed_bytes and by_name.bytes_per_sample == by_path.bytes_per_sample


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        pytest.param({"sequence_length": 0}, ValueError, r"`sequence_length` must be an integer >= 1, got 0", id="seq"),
        pytest.param(
            {"precision": "fp8"},
            ValueError,
            r"`precision` must be one of '32-true', '16-mixed', .* got 'fp8'",
            id="prec",
        ),
        pytest.param(
            {"precision": "auto"},
            ValueError,
            r"'bf16-true', '64-true' \(or an alias: .*\), got 'auto'; 'auto' is a precision but not one this accepts",
            id="auto",
        ),
        pytest.param(
            {"precision": "transformer-engine"}, ValueError, r"must be one of '32-true', .* got 'transformer", id="te"
        ),
        pytest.param({"optimizer": "adam"}, ValueError, r"`optimizer` must be one of 'adamw', 'sgd', ", id="opt"),
        pytest.param(
            {"attention": "fast"}, ValueError, r"`attention` must be one of 'auto', 'flash', 'sdpa', 'eager'", id="attn"
        ),
        pytest.param({"lora_rank": 0}, ValueError, r"`lora_rank` must be an integer >= 1, got 0", id="rank"),
        pytest.param(
            {"gradient_checkpointing": "yes"}, TypeError, r"`gradient_checkpointing` must be True or False", id="ckpt"
        ),
        pytest.param(
            {"precision": "fp32", "master_weights": True},
            ValueError,
            r"`master_weights` must be False or None with precision '32-true'",
            id="master",
        ),
        pytest.param({"model": "llama-9b"}, ValueError, r"unknown model 'llama-9b'", id="name"),
        pytest.param({"model": torch.nn.Linear(2, 2)}, TypeError, r"for an nn.Module use measure_memory", id="module"),
    ],
)
def test_bad_arguments(kwargs: dict[str, Any], error: type[Exception], message: str) -> None:
    arguments: dict[str, Any] = {"model": "gpt2", "sequence_length": 128, **kwargs}
    with pytest.raises(error, match=message):
        estimate_memory(arguments.pop("model"), **arguments)


def test_result_is_a_memory_estimate() -> None:
    assert isinstance(estimate_memory("gpt2", sequence_length=8), MemoryEstimate)


TINY_GPT2 = {"n_embd": 48, "n_layer": 2, "n_head": 4, "vocab_size": 1000, "n_positions": 64, "bos_token_id": 0}


@pytest.mark.parametrize("name", ["adamw", "adamw8bit"])
@pytest.mark.filterwarnings("ignore:swapping:UserWarning")
def test_gpt2_optimizer_bytes_equal_the_real_state_of_its_fused_qkv(name: Any) -> None:
    # GPT-2 holds query, key and value in one projection (c_attn): one step count, and one tensor of 3h x h values
    # that bitsandbytes quantises where each h x h third alone would keep 32-bit state
    from transformers import GPT2Config, GPT2LMHeadModel

    if name == "adamw8bit":
        pytest.importorskip("bitsandbytes")
    config = GPT2Config(**TINY_GPT2, eos_token_id=0)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    optimizer: torch.optim.Optimizer = torch.optim.AdamW(model.parameters())
    if name == "adamw8bit":
        optimizer = swap_optimizer(optimizer, optimizer=name, module=model).new
    ids = torch.randint(0, 1000, (2, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    shape = from_hf_config(config.to_dict())
    estimate = estimate_memory(shape, sequence_length=16, precision="32-true", optimizer=name)
    assert estimate.parameters == sum(p.numel() for p in model.parameters())
    assert estimate.optimizer_bytes == optimizer_state_bytes(optimizer)
