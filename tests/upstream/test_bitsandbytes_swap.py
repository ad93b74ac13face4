"""Parity with bitsandbytes' own way of building an 8-bit optimizer (its ``GlobalOptimManager`` documentation).

bitsandbytes' documented recipe for an 8-bit optimizer with 32-bit state for embeddings is to build
``bnb.optim.AdamW8bit`` and register ``override_config(param, "optim_bits", 32)`` for each embedding weight on its
``GlobalOptimManager``. ``swap_optimizer`` turns a torch ``AdamW`` into the same thing, with the overrides on a
manager of the optimizer's own: over several steps the two must train bit for bit the same weights, from the same
state layout.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from lightning_tune.swaps.optimizer import swap_optimizer

bnb = pytest.importorskip("bitsandbytes")

STEPS = 3
CONFIG = {"n_embd": 32, "n_layer": 1, "n_head": 2, "vocab_size": 256, "n_positions": 16}


def gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(**CONFIG, bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0,
                                      attn_pdrop=0.0))  # fmt: skip


@pytest.fixture
def shared_manager() -> Iterator[Any]:
    """bitsandbytes' process-wide manager, its override tables restored afterwards (the recipe writes to them)."""
    manager = bnb.optim.GlobalOptimManager.get_instance()
    saved = dict(manager.pid2config), dict(manager.index2config)
    yield manager
    manager.pid2config, manager.index2config = saved


def layout(state: dict[str, Any]) -> dict[str, Any]:
    """Each state tensor's dtype and shape, other entries (the step count) as they are."""
    return {key: (v.dtype, tuple(v.shape)) if isinstance(v, torch.Tensor) else v for key, v in state.items()}


def train(model: GPT2LMHeadModel, optimizer: torch.optim.Optimizer) -> None:
    generator = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        ids = torch.randint(0, CONFIG["vocab_size"], (4, CONFIG["n_positions"]), generator=generator)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


@pytest.mark.parametrize(
    ("torch_kwargs", "bnb_kwargs"),
    [
        pytest.param({}, {}, id="defaults"),  # torch's AdamW and bitsandbytes' AdamW8bit share their defaults
        pytest.param(
            {"lr": 3e-3, "betas": (0.8, 0.95), "eps": 1e-6, "weight_decay": 0.1},
            {"lr": 3e-3, "betas": (0.8, 0.95), "eps": 1e-6, "weight_decay": 0.1},
            id="tuned",
        ),
    ],
)
@pytest.mark.filterwarnings("ignore:swapping:UserWarning")
def test_swap_trains_exactly_what_adamw8bit_built_directly_does(
    torch_kwargs: dict[str, Any], bnb_kwargs: dict[str, Any], shared_manager: Any
) -> None:
    ours = gpt2()
    swap = swap_optimizer(torch.optim.AdamW(ours.parameters(), **torch_kwargs), optimizer="adamw8bit", module=ours)
    theirs = gpt2()
    direct = bnb.optim.AdamW8bit(theirs.parameters(), **bnb_kwargs)
    for embedding in (theirs.transformer.wte, theirs.transformer.wpe):  # the recipe: embeddings keep 32-bit state
        shared_manager.override_config(embedding.weight, "optim_bits", 32)

    train(ours, swap.new)
    train(theirs, direct)

    assert set(swap.kept_32bit) >= {"transformer.wte.weight", "transformer.wpe.weight"}
    for (name, mine), other in zip(ours.named_parameters(), theirs.parameters(), strict=True):
        assert torch.equal(mine, other), name
    for (name, mine), other in zip(ours.named_parameters(), theirs.parameters(), strict=True):
        assert layout(swap.new.state[mine]) == layout(direct.state[other]), name
    assert swap.new.state[ours.transformer.wte.weight]["state1"].dtype == torch.float32
    assert swap.new.state[ours.transformer.h[0].mlp.c_fc.weight]["state1"].dtype == torch.uint8
