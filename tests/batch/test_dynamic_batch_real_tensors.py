"""DynamicBatchSize on the real tensors of real models: TrackedMemory counts every live byte of the run on the CPU.

Each row fine-tunes a Hugging Face model built from its config on a device sized so that its target holds about
``SAMPLES`` samples at one micro-batch a step, and checks what a user of a GPU of that size would see: the run
settles with its peak within the target and above 0.85 of it, recovers at most one out-of-memory error after its
first decision, and (``keep="effective"``) trains the weights a fixed-batch run trains.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from lightning.pytorch import Callback
from torch import nn

import lightning_tune as lt
from lightning_tune.callbacks.dynamic_batch import Keep
from tests.batch.test_tracked_memory import VOCAB, CausalLM, fit_tracked, gpt2, llama, token_data, weights

SAMPLES, SEQ, STEPS, TARGET = 24, 32, 14, 0.9


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def qwen2(width: int = 64, seq: int = 32) -> transformers.PretrainedConfig:
    return transformers.Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=width,
        intermediate_size=2 * width,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=seq,
    )


def lora(model: nn.Module) -> nn.Module:
    import peft

    config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    return peft.get_peft_model(model, config)


def checkpointed(model: nn.Module) -> nn.Module:
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


@dataclass(frozen=True)
class Row:
    config: Callable[..., transformers.PretrainedConfig]
    keep: Keep = "effective"
    accumulation: int = 1
    adapt: Callable[[nn.Module], nn.Module] | None = None
    callbacks: Callable[[], list[Callback]] = list
    trainer: dict[str, Any] = field(default_factory=dict)
    validation: bool = False  # a validation batch of 64 samples every 4 steps, inside fit

    @property
    def loader_batch(self) -> int:
        """The DataLoader's batch: the effective batch of 64 held with keep="effective", else where it starts."""
        return 64 // self.accumulation if self.keep == "effective" else 4


ROWS = [
    pytest.param(Row(gpt2), id="gpt2-full"),
    pytest.param(Row(llama), id="llama-full"),
    pytest.param(Row(gpt2, keep="none"), id="gpt2-full-keep-none"),
    pytest.param(Row(gpt2, accumulation=4), id="gpt2-accumulate-4"),
    pytest.param(Row(llama, adapt=lora), id="llama-lora"),
    pytest.param(Row(gpt2, adapt=checkpointed), id="gpt2-checkpointing"),
    pytest.param(Row(llama, callbacks=lambda: [lt.LossSwap(verbose=False)]), id="llama-loss-swap"),
    pytest.param(Row(qwen2), id="qwen2-full"),
    pytest.param(Row(llama, keep="lr"), id="llama-keep-lr"),
    pytest.param(Row(gpt2, keep="none", trainer={"precision": "bf16-mixed"}), id="gpt2-bf16-mixed-keep-none"),
    pytest.param(Row(gpt2, validation=True), id="gpt2-validation-in-fit"),
]


def device_bytes(row: Row, tmp_path: Path) -> int:
    """A device whose target holds the peak of two steps of ``SAMPLES`` samples, one micro-batch each."""
    memory = lt.TrackedMemory(total_bytes=1 << 34)
    module = CausalLM(row.config(seq=SEQ), adapt=row.adapt)
    data = token_data(2 * SAMPLES, SEQ)
    fit_tracked(tmp_path, module, memory, None, data, SAMPLES, max_steps=2, callbacks=row.callbacks(), **row.trainer)
    return int(memory.peak_bytes() / TARGET)


@pytest.mark.parametrize("row", ROWS)
@pytest.mark.slow
def test_settles_within_the_target_of_the_real_memory(row: Row, tmp_path: Path) -> None:
    data = token_data(STEPS * 64, SEQ)
    memory = lt.TrackedMemory(total_bytes=device_bytes(row, tmp_path))
    dyn = lt.DynamicBatchSize(TARGET, keep=row.keep, adjust_every=2, multiple_of=1, probe=memory)
    module = CausalLM(row.config(seq=SEQ), adapt=row.adapt)
    extra = {"accumulate_grad_batches": row.accumulation, **row.trainer}
    val = token_data(64, SEQ) if row.validation else None
    if row.validation:
        extra |= {"limit_val_batches": 1, "val_check_interval": 4}
    record = fit_tracked(
        tmp_path,
        module,
        memory,
        dyn,
        data,
        row.loader_batch,
        max_steps=STEPS,
        callbacks=row.callbacks(),
        val=val,
        **extra,
    )
    assert record is not None
    budget = TARGET * memory.capacity_bytes()
    size, peak = record.after_first_decision()[-1]
    assert 0.85 * budget < peak <= budget, f"settled at {size} samples, {peak / budget:.3f} of the target"
    assert record.oom_recoveries_after_first_decision() <= 1
    if row.validation:
        assert "val_loss" in module.trainer.callback_metrics
    if row.keep == "effective":
        reference = CausalLM(row.config(seq=SEQ), adapt=row.adapt)
        fit_tracked(
            tmp_path,
            reference,
            lt.TrackedMemory(total_bytes=1 << 34),
            None,
            data,
            row.loader_batch,
            max_steps=STEPS,
            callbacks=row.callbacks(),
            **extra,
        )
        for ours, theirs in zip(weights(module), weights(reference), strict=True):
            torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)
