"""DynamicBatchSize with its defaults on a Hugging Face causal LM: the training of the whole-step fixed-batch run."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from lightning.pytorch import LightningModule
from torch import nn
from torch.utils.data import DataLoader

import lightning_tune as lt
from lightning_tune.batch.step import DynamicBatchSettings, DynamicStep, auto_weighting
from tests.helpers import fit
from tests.hf_data import VOCAB, TokenDataset, long_tailed_lengths, tokenizer

transformers.logging.set_verbosity_error()


def tiny_llama() -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        pad_token_id=0,
    )
    return transformers.LlamaForCausalLM(config)


class Collate:
    """Hugging Face's collators: the causal-LM one, or padding with labels -100 on the padding.

    Left-padded batches get `position_ids` from the mask, as Hugging Face's `generate` builds them, so that a sample's
    positions do not depend on how far it is padded.
    """

    def __init__(self, collator: str, side: str) -> None:
        tok = tokenizer(side)
        if collator == "lm":
            self.inner: Any = transformers.DataCollatorForLanguageModeling(tok, mlm=False, return_tensors="pt")
        else:
            self.inner = transformers.DataCollatorWithPadding(tok, return_tensors="pt")
        self.collator, self.side = collator, side

    def __call__(self, samples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        batch = dict(self.inner(samples))
        mask = batch["attention_mask"]
        if self.collator == "padding":
            batch["labels"] = batch["input_ids"].masked_fill(mask == 0, -100)
        if self.side == "left":
            batch["position_ids"] = (mask.cumsum(1) - 1).clamp(min=0)
        return batch


class CausalLM(LightningModule):
    def __init__(self, dataset: Any, collate: Collate, batch_size: int) -> None:
        super().__init__()
        self.model, self.dataset, self.collate, self.batch_size = tiny_llama(), dataset, collate, batch_size
        self.samples_run: list[int] = []  # samples of each training_step call

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.samples_run.append(len(batch["input_ids"]))
        return self.model(**batch).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.dataset, batch_size=self.batch_size, shuffle=False, collate_fn=self.collate)


def lengths() -> list[int]:
    """Long-tailed lengths; the first step (16 samples) holds two of the longest, 40 tokens."""
    found = long_tailed_lengths(48, median=10, max_len=40, seed=3)
    found[0] = found[5] = 40
    return found


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("collator", ["lm", "padding"])
def test_the_default_on_a_causal_lm_trains_as_the_whole_step_token_mean_run_through_an_oom(
    tmp_path: Path, collator: str, side: str, caplog: pytest.LogCaptureFixture
) -> None:
    data, collate = TokenDataset(lengths()), Collate(collator, side)
    # the reference: plain Lightning, a DataLoader batch of the effective batch, Hugging Face's token-mean loss
    reference = CausalLM(data, collate, batch_size=16)
    fit(reference, [], tmp_path)
    # DataLoader batches of 4 x 4 accumulated; a simulated device on which two 40-token samples do not fit
    memory = lt.SimulatedMemory(
        total_bytes=(1 << 20) + 60 * 1024, fixed_bytes=1 << 20, bytes_per_sample=1, bytes_per_token=1024
    )
    dyn = lt.DynamicBatchSize(probe=memory)
    tuned = CausalLM(data, collate, batch_size=4)
    with caplog.at_level(logging.INFO), warnings.catch_warnings():
        warnings.filterwarnings("ignore", "DynamicBatchSize: out of memory")
        fit(tuned, [dyn], tmp_path, accumulate_grad_batches=4)
    assert dyn.oom_recoveries >= 1 and memory.out_of_memory_errors == dyn.oom_recoveries
    assert len(set(tuned.samples_run)) > 1  # micro-batches of unequal samples and token counts
    for got, want in zip(tuned.model.parameters(), reference.model.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert dyn.weighting == "tokens"
    summary = next(r.getMessage() for r in caplog.records if "DynamicBatchSize: settled" in r.getMessage())
    assert "losses weighted by tokens" in summary


AUTO = [
    pytest.param(
        {"input_ids": torch.ones(2, 5, dtype=torch.long), "labels": torch.full((2, 5), -100)},
        False,
        "tokens",
        id="per-token-labels",
    ),
    pytest.param(
        {"input_ids": torch.ones(2, 5, dtype=torch.long), "attention_mask": torch.ones(2, 5)},
        True,
        "tokens",
        id="causal-lm-with-a-mask",
    ),
    pytest.param(
        {"input_ids": torch.ones(2, 5, dtype=torch.long), "attention_mask": torch.ones(2, 5)},
        False,
        "samples",
        id="mask-without-labels",
    ),
    pytest.param(
        {"input_ids": torch.ones(2, 5, dtype=torch.long), "attention_mask": torch.ones(2, 5), "labels": torch.ones(2)},
        False,
        "samples",
        id="classifier",
    ),
    pytest.param((torch.ones(2, 5, dtype=torch.long), torch.ones(2, 5, dtype=torch.long)), True, "samples", id="tuple"),
]


@pytest.mark.parametrize(("batch", "causal_lm", "weighting"), AUTO)
def test_auto_weighs_token_mean_losses_by_tokens_and_the_rest_by_samples(
    batch: Any, causal_lm: bool, weighting: str
) -> None:
    assert auto_weighting(batch, causal_lm=causal_lm)[0] == weighting


def _checkpoint(loss_weight: str, *, before_auto: bool = False) -> dict[str, Any]:
    step = DynamicStep(DynamicBatchSettings(loss_weight=loss_weight))  # type: ignore[arg-type]
    step.start(nn.Linear(1, 1), 1)
    step.install(4)
    step.weigh_by({"input_ids": torch.ones(4, 3, dtype=torch.long), "labels": torch.ones(4, 3, dtype=torch.long)})
    state = step.state_dict()
    if before_auto:  # a checkpoint written before loss_weight="auto": its argument is all it says
        del state["weighting"]
    return state


def _resume(state: dict[str, Any], loss_weight: str) -> tuple[DynamicStep, list[str]]:
    warned: list[str] = []
    step = DynamicStep(DynamicBatchSettings(loss_weight=loss_weight), warn=warned.append)  # type: ignore[arg-type]
    step.start(nn.Linear(1, 1), 1)
    step.install(4)
    step.load_state_dict(state)
    return step, warned


@pytest.mark.parametrize(
    ("saved", "before_auto", "resumed", "weighting", "warning"),
    [
        pytest.param("samples", True, "auto", "samples", None, id="old-samples-resumed-with-the-new-default"),
        pytest.param("tokens", True, "auto", "tokens", None, id="old-tokens-resumed-with-the-new-default"),
        pytest.param("auto", False, "auto", "tokens", None, id="auto-resumed-as-auto"),
        pytest.param("auto", False, "tokens", "tokens", None, id="auto-resumed-with-its-choice"),
        pytest.param("samples", True, "tokens", "tokens", "loss_weight 'samples' -> 'tokens'", id="old-changed"),
        pytest.param("auto", False, "samples", "samples", "loss_weight 'tokens' -> 'samples'", id="auto-changed"),
    ],
)
def test_the_weighting_a_checkpoint_ran_with_goes_on_unless_changed_with_a_warning(
    saved: str, before_auto: bool, resumed: str, weighting: str, warning: str | None
) -> None:
    step, warned = _resume(_checkpoint(saved, before_auto=before_auto), resumed)
    assert step.weighting == weighting
    batch = {"input_ids": torch.ones(4, 3, dtype=torch.long)}  # would choose samples: the checkpoint's choice stands
    assert step.weigh_by(batch) == weighting
    if warning is None:
        assert warned == []
    else:
        assert len(warned) == 1 and warning in warned[0]


def test_without_a_probe_the_messages_say_what_ran(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    data, collate = TokenDataset(lengths()), Collate("lm", "right")
    module = CausalLM(data, collate, batch_size=4)
    dyn = lt.DynamicBatchSize()
    with caplog.at_level(logging.INFO), pytest.warns(UserWarning, match="no device memory to target") as caught:
        fit(module, [dyn], tmp_path, accumulate_grad_batches=4)
    warning = next(str(w.message) for w in caught if "no device memory" in str(w.message))
    notes = [r.getMessage() for r in caplog.records if r.getMessage().startswith("DynamicBatchSize")]
    summary = notes[-1]
    # the first step's padded length is 40: the DataLoader's 4 samples of it make the budget every micro-batch had
    assert dyn.micro_batch_tokens == 4 * 40
    assert "as many padded tokens as that batch at the first step's padded length" in warning
    assert any("a budget of 160 padded tokens" in note and "padded length 40" in note for note in notes)
    low, high = min(module.samples_run), max(module.samples_run)
    assert low != high and f"kept micro-batches of at most 160 padded tokens ({low} to {high} samples each" in summary
    assert "settled" not in summary  # nothing was decided
