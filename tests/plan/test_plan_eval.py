"""Evaluation memory: ``mode="eval"``/``"predict"`` plans what validation, test and predict hold, without gradients,
optimizer state or activations saved for backward."""

from __future__ import annotations

import re
import tempfile
from typing import Any

import pytest
import torch
from transformers import (
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForSeq2SeqLM,
    BertConfig,
    GPT2Config,
    LlamaConfig,
    T5Config,
)

from lightning_tune.demos import DemoGPT, GPTConfig
from lightning_tune.plan import MemoryEstimate, estimate_memory, measure_memory

P_7B = 6_738_415_616
MODES_MESSAGE = "`mode` must be one of 'train', 'eval', 'predict', got 'validate'"


def test_evaluation_holds_the_weights_and_inside_fit_the_training_state() -> None:
    train = estimate_memory("llama-2-7b", sequence_length=2048, precision="bf16-mixed")
    val = estimate_memory("llama-2-7b", sequence_length=2048, precision="bf16-mixed", mode="eval")
    # Lightning's bf16-mixed keeps float32 weights and autocasts: 4 bytes a parameter, nothing else fixed
    assert val.weight_bytes == 4 * P_7B and val.fixed_bytes == 4 * P_7B + val.buffer_bytes
    assert val.gradient_bytes == val.optimizer_bytes == val.master_weight_bytes == 0 and val.mode == "eval"
    assert val.fit_fixed_bytes == train.fixed_bytes and train.fit_fixed_bytes is None
    # nothing saved for backward: one block's working set and the head's, far below a training sample
    assert 1.8 * val.bytes_per_sample < train.bytes_per_sample
    # validation inside fit of a fine-tune that fits batch 2 fits at least 1.8x that
    fine_tune = estimate_memory("llama-3.2-1b", sequence_length=2048, precision="bf16-mixed", mode="eval")
    budget = 80 * 2**30
    trained = estimate_memory("llama-3.2-1b", sequence_length=2048, precision="bf16-mixed").max_batch_size(budget)
    assert fine_tune.fit_fixed_bytes is not None
    in_fit = (fine_tune.usable_bytes(budget) - fine_tune.fit_fixed_bytes) // fine_tune.bytes_per_sample
    assert trained >= 2 and in_fit >= 1.8 * trained


def test_the_loss_swap_shrinks_evaluation_and_predict_keeps_its_logits() -> None:
    def plan(mode: Any, loss_swap: bool) -> MemoryEstimate:
        return estimate_memory("llama-3-8b", sequence_length=4096, mode=mode, loss_swap=loss_swap)

    # at a 128k vocabulary the logits and their float32 loss dominate an evaluation sample; the swap leaves a chunk
    assert plan("eval", True).bytes_per_sample < 0.35 * plan("eval", False).bytes_per_sample
    # predict has no labels: it returns the 16-bit logits, with or without the swap, and computes no loss
    predict = plan("predict", False)
    assert predict == plan("predict", True).__class__(**{**plan("predict", True).__dict__, "notes": predict.notes})
    assert plan("eval", True).bytes_per_sample < predict.bytes_per_sample < plan("eval", False).bytes_per_sample
    assert predict.fit_fixed_bytes is None and any("no loss to swap" in note for note in predict.notes)


@pytest.mark.parametrize(
    "call",
    [
        pytest.param(lambda: estimate_memory("gpt2", sequence_length=8, mode="validate"), id="estimate_memory"),
        pytest.param(
            lambda: measure_memory(torch.nn.Linear(2, 1), torch.zeros(1, 2), mode="validate"), id="measure_memory"
        ),
        pytest.param(
            lambda: MemoryEstimate(parameters=1, weight_bytes=4, bytes_per_sample=1, fixed_bytes=4, mode="validate"),
            id="MemoryEstimate",
        ),
    ],
)
def test_an_unknown_mode_is_refused_naming_the_allowed_ones(call: Any) -> None:
    with pytest.raises(ValueError, match=re.escape(MODES_MESSAGE)):
        call()


def _llama() -> torch.nn.Module:
    config = LlamaConfig(vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    return AutoModelForCausalLM.from_config(config)


def _tokens(n: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 1000, (n, 64))
    return {"input_ids": ids, "labels": ids}


def test_measured_evaluation_runs_the_module_in_eval_mode_without_gradients_and_gives_its_modes_back() -> None:
    model = _llama().train()
    model.model.layers[0].eval()  # a user's own mix of modes is given back as it was
    seen: list[tuple[bool, bool]] = []
    model.model.norm.register_forward_hook(lambda m, i, o: seen.append((m.training, torch.is_grad_enabled())))
    train = measure_memory(model, _tokens(1), for_device="cpu")
    seen.clear()
    val = measure_memory(model, _tokens(1), for_device="cpu", mode="eval")
    assert seen == [(False, False), (False, False)]  # one forward pass at each batch size, eval mode, no autograd
    assert model.training and not model.model.layers[0].training and model.model.layers[1].training
    # the weights are the real model's bytes, and nothing of training is held
    assert val.weight_bytes == sum(p.nbytes for p in model.parameters()) == train.weight_bytes
    assert val.gradient_bytes == val.optimizer_bytes == 0 and val.fit_fixed_bytes is None and val.mode == "eval"
    assert val.weight_bytes <= val.fixed_bytes < train.fixed_bytes
    assert 1.8 * val.bytes_per_sample < train.bytes_per_sample


@pytest.mark.filterwarnings("ignore:.*self.log.*")
def test_a_lightning_module_is_evaluated_by_its_own_steps_without_building_its_optimizer() -> None:
    class NeedsTrainer(DemoGPT):
        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-3 * self.trainer.num_devices)

    config = GPTConfig(vocab_size=64, seq_len=32, d_model=64, n_layers=2, n_heads=4)
    calls: list[str] = []
    model = NeedsTrainer(config)
    for hook in ("validation_step", "predict_step"):
        original = getattr(model, hook)
        setattr(model, hook, lambda batch, i, hook=hook, original=original: calls.append(hook) or original(batch, i))
    tokens = torch.zeros(1, 32, dtype=torch.long)
    val = measure_memory(model, (tokens, tokens), mode="eval")
    predict = measure_memory(model, (tokens, tokens), mode="predict")
    assert calls == ["validation_step"] * 2 + ["predict_step"] * 2
    assert val.mode == "eval" and predict.mode == "predict" and val.optimizer_bytes == 0


def _families() -> dict[str, tuple[Any, Any, Any]]:
    hidden, layers, vocab = 128, 2, 1000
    ids = {"bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}

    def lm(model: Any, batch: Any) -> Any:
        return model(input_ids=batch[0], labels=batch[1])

    def pooled(model: Any, batch: Any) -> Any:
        return model(input_ids=batch[0]).pooler_output

    return {
        "gpt2": (GPT2Config(n_embd=hidden, n_layer=layers, n_head=4, vocab_size=vocab, **ids),
                 AutoModelForCausalLM.from_config, lm),
        "llama": (LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                              num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, **ids),
                  AutoModelForCausalLM.from_config, lm),
        "bert": (BertConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                            intermediate_size=2 * hidden, pad_token_id=0), AutoModel.from_config, pooled),
        "t5": (T5Config(vocab_size=vocab, d_model=hidden, d_kv=32, d_ff=2 * hidden, num_layers=layers, num_heads=4,
                        decoder_start_token_id=0, **ids), AutoModelForSeq2SeqLM.from_config, lm),
    }  # fmt: skip


@pytest.mark.parametrize("family", ["gpt2", "llama", "bert", "t5"])
def test_the_analytic_evaluation_peak_is_near_a_measured_step_of_the_hugging_face_model(family: str) -> None:
    """Hugging Face's own model of each family from its config (width 128, 2 layers, sequence 64, fp32, eager
    attention), measured on fake tensors under ``torch.no_grad()``: the analytic evaluation peak at batch 8 is
    0.94 (GPT-2), 1.25 (Llama), 1.12 (BERT) and 1.00 (T5) of it; a training plan would be over 2x."""
    config, build, step = _families()[family]
    config._attn_implementation = "eager"
    with torch.device("meta"):
        model = build(config)

    def batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.randint(0, 1000, (n, 64))
        return ids, ids

    measured = measure_memory(model, batch, loss_fn=step, for_device="cpu", mode="eval")
    with tempfile.TemporaryDirectory() as folder:
        config.save_pretrained(folder)
        plan = {
            mode: estimate_memory(folder, sequence_length=64, precision="32-true", attention="eager", mode=mode)
            for mode in ("eval", "train")
        }
    assert 0.8 <= plan["eval"].total_bytes(8) / measured.total_bytes(8) <= 1.3
    assert plan["train"].total_bytes(8) / measured.total_bytes(8) > 2
