"""The loss swap in evaluation (``LossSwap(eval=True)``, ``TunePlugin(loss_eval=True)``): the validation, test and
predict loss, token accuracy and predictions of a Hugging Face causal LM without its logits, against the unswapped
model's own loss and torchmetrics' accuracy of its logits."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import transformers
from lightning.pytorch import LightningModule
from torch import Tensor, nn
from torch.utils.data import DataLoader
from torchmetrics.functional.classification import multiclass_accuracy

import lightning_tune as lt
from lightning_tune.callbacks import LossSwap
from lightning_tune.swaps import linear_cross_entropy
from tests.helpers import make_trainer
from tests.hf_data import TokenDataset, lm_collator

VOCAB = 32_000  # Llama 2's: the logits are the largest tensor of an evaluation step
SMALL = {"vocab_size": VOCAB, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}


def llama() -> nn.Module:
    config = transformers.LlamaConfig(**SMALL, intermediate_size=128, num_key_value_heads=2)
    return transformers.LlamaForCausalLM(config)


def qwen2() -> nn.Module:
    return transformers.Qwen2ForCausalLM(
        transformers.Qwen2Config(**SMALL, intermediate_size=128, num_key_value_heads=2)
    )


def gemma() -> nn.Module:  # tied embeddings, scaled input embeddings
    config = transformers.GemmaConfig(**SMALL, intermediate_size=128, num_key_value_heads=2, head_dim=16)
    return transformers.GemmaForCausalLM(config)


def gpt2() -> nn.Module:  # tied embeddings, Conv1D layers
    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


FAMILIES = [
    pytest.param(llama, id="llama"),
    pytest.param(qwen2, id="qwen2"),
    pytest.param(gemma, id="gemma"),
    pytest.param(gpt2, id="gpt2"),
]


@torch.no_grad()
def greedy_batch(model: nn.Module, lengths: list[int]) -> dict[str, Tensor]:
    """A Hugging Face collator's batch (right padding, labels -100 there) whose every other token is the model's own
    prediction, so the accuracy is neither 0 nor 1."""
    batch = dict(lm_collator()([TokenDataset(lengths)[i] for i in range(len(lengths))]))
    ids, labels = batch["input_ids"], batch["labels"]
    for t in range(0, ids.shape[1] - 1, 2):
        predicted = model(input_ids=ids, attention_mask=batch["attention_mask"]).logits[:, t].argmax(-1)
        ids[:, t + 1] = torch.where(labels[:, t + 1] != -100, predicted, ids[:, t + 1])
    batch["labels"] = torch.where(labels != -100, ids, -100)
    return batch


class EvalLM(LightningModule):
    """Evaluation as a user writes it: ``outputs.loss``, and the accuracy from the logits when there are any."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.seen: list[tuple[Tensor, Tensor, Tensor]] = []

    def _step(self, batch: dict[str, Tensor], stage: str) -> tuple[Tensor, Tensor, Tensor]:
        out = self.model(**batch)
        if "logits" in out:  # unswapped: torchmetrics' accuracy of the shifted logits
            logits = out.logits
            accuracy = multiclass_accuracy(
                logits[:, :-1].flatten(0, 1),
                batch["labels"][:, 1:].flatten(),
                num_classes=logits.shape[-1],
                average="micro",
                ignore_index=-100,
            )
            predictions = logits.argmax(-1)
        else:  # LossSwap(eval=True): no logits
            accuracy, predictions = out.token_accuracy, out.predictions
        size = batch["input_ids"].shape[0]
        self.log(f"{stage}_loss", out.loss, batch_size=size)
        self.log(f"{stage}_accuracy", accuracy, batch_size=size)
        self.seen.append((out.loss, accuracy, predictions))
        return out.loss, accuracy, predictions

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self._step(batch, "val")

    def test_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self._step(batch, "test")

    def predict_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        return self.model(**batch).predictions


def models_and_batches(factory: Callable[[], nn.Module]) -> tuple[nn.Module, nn.Module, list[dict[str, Tensor]]]:
    torch.manual_seed(0)
    model = factory().eval()
    batches = [greedy_batch(model, [12, 5, 9]), greedy_batch(model, [7, 7])]
    return model, copy.deepcopy(model), batches


def head_output_sizes(model: nn.Module) -> list[int]:
    sizes: list[int] = []
    model.get_output_embeddings().register_forward_hook(lambda m, args, out: sizes.append(out.numel()))
    return sizes


def assert_same_evaluation(swapped: EvalLM, plain: EvalLM) -> None:
    assert len(swapped.seen) == len(plain.seen) == 2
    for (loss, accuracy, predictions), (want_loss, want_accuracy, want_predictions) in zip(
        swapped.seen, plain.seen, strict=True
    ):
        torch.testing.assert_close(loss, want_loss, atol=1e-5, rtol=0)
        torch.testing.assert_close(accuracy, want_accuracy, atol=1e-5, rtol=0)
        assert predictions.dtype == torch.int64 and torch.equal(predictions, want_predictions)
    assert 0.2 < float(plain.seen[0][1]) < 0.9  # the accuracy says something


@pytest.mark.parametrize("factory", FAMILIES)
@pytest.mark.slow
def test_validation_loss_and_accuracy_equal_the_unswapped_model_without_the_logits(
    factory: Callable[[], nn.Module], tmp_path: Any
) -> None:
    model, twin, batches = models_and_batches(factory)
    plain, swapped = EvalLM(model), EvalLM(twin)
    sizes = head_output_sizes(twin)
    loader = DataLoader(batches, batch_size=None)
    want = make_trainer(tmp_path, [], limit_val_batches=None).validate(plain, loader, verbose=False)
    swap = LossSwap("chunked", eval=True, verbose=False)
    got = make_trainer(tmp_path, [swap], limit_val_batches=None).validate(swapped, loader, verbose=False)
    assert_same_evaluation(swapped, plain)
    assert got[0].keys() == {"val_loss", "val_accuracy"}
    for key, value in want[0].items():
        assert got[0][key] == pytest.approx(value, abs=1e-5), key
    assert sizes == [0, 0]  # the head never made its logits: an empty output per batch
    assert "forward" not in vars(twin)  # teardown restored the model


@pytest.mark.slow
def test_test_and_predict_are_swapped_too_and_the_plugin_option_does_the_same(tmp_path: Any) -> None:
    model, twin, batches = models_and_batches(llama)
    plain, swapped = EvalLM(model), EvalLM(twin)
    loader = DataLoader(batches, batch_size=None)
    want = make_trainer(tmp_path, []).test(plain, loader, verbose=False)
    got = make_trainer(tmp_path, [LossSwap("chunked", eval=True, verbose=False)]).test(swapped, loader, verbose=False)
    assert_same_evaluation(swapped, plain)
    assert got[0] == pytest.approx(want[0], abs=1e-5)
    predicted = make_trainer(tmp_path, [LossSwap("chunked", eval=True, verbose=False)]).predict(swapped, loader)
    assert [torch.equal(p, w) for p, (_, _, w) in zip(predicted, plain.seen, strict=True)] == [True, True]

    via_plugin = EvalLM(copy.deepcopy(model))
    plugin = lt.TunePlugin("32-true", loss="chunked", loss_eval=True)
    make_trainer(tmp_path, [], plugins=[plugin], limit_val_batches=None).validate(via_plugin, loader, verbose=False)
    assert_same_evaluation(via_plugin, plain)  # the same batches, as the unswapped test run saw them


def test_reading_logits_in_evaluation_is_the_swap_error_and_eval_off_keeps_them(tmp_path: Any) -> None:
    model, _, batches = models_and_batches(llama)

    class ReadsLogits(EvalLM):
        def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
            self.seen.append(self.model(**batch).logits)

    loader = DataLoader(batches[:1], batch_size=None)
    with pytest.raises(AttributeError, match=r"has no `logits`.*LossSwap\(eval=True\)"):
        make_trainer(tmp_path, [LossSwap("chunked", eval=True)], limit_val_batches=None).validate(
            ReadsLogits(model), loader, verbose=False
        )
    module = ReadsLogits(model)
    make_trainer(tmp_path, [LossSwap("chunked")], limit_val_batches=None).validate(module, loader, verbose=False)
    assert module.seen[0].shape == (3, 12, VOCAB)  # the default: evaluation is left as it was


@pytest.mark.parametrize("chunk_size", [None, 5])
def test_predictions_are_the_argmax_of_the_logits_per_position(chunk_size: int | None) -> None:
    torch.manual_seed(0)
    hidden, weight, bias = torch.randn(2, 7, 16), torch.randn(300, 16), torch.randn(300)
    labels = torch.randint(0, 300, (2, 7))
    labels[1, 4:] = -100
    got = linear_cross_entropy(hidden, weight, labels, bias=bias, chunk_size=chunk_size, return_predictions=True)
    logits = hidden @ weight.T + bias
    assert got.predictions is not None and got.predictions.dtype == torch.int64
    assert torch.equal(got.predictions, logits.argmax(-1))  # every position, ignored ones included
    assert got.token_accuracy is None and got.z_loss is None
    torch.testing.assert_close(got.loss, torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()))


@pytest.mark.parametrize(
    ("make", "error", "message"),
    [
        pytest.param(
            lambda: LossSwap(eval=1), TypeError, r"`eval` must be True or False, got 1 \(int\)", id="eval-int"
        ),
        pytest.param(
            lambda: lt.TunePlugin(loss_eval=True),
            ValueError,
            r"`loss_eval=True` swaps the evaluation loss and needs `loss`",
            id="plugin-eval-without-loss",
        ),
        pytest.param(
            lambda: lt.TunePlugin(loss="chunked", loss_eval="yes"),
            TypeError,
            r"`loss_eval` must be True or False, got 'yes' \(str\)",
            id="plugin-eval-str",
        ),
        pytest.param(
            lambda: linear_cross_entropy(
                torch.zeros(2, 4), torch.zeros(3, 4), torch.zeros(2).long(), return_predictions=1
            ),
            TypeError,
            r"`return_predictions` must be True or False, got 1 \(int\)",
            id="return-predictions-int",
        ),
    ],
)
def test_bad_eval_options(make: Callable[[], Any], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        make()
