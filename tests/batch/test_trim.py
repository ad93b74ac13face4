"""Trimming micro-batches of padded sequences: layouts read from real collators, and unchanged model gradients."""

from __future__ import annotations

import pytest
import torch
import transformers

from lightning_tune.batch.split import select
from lightning_tune.batch.trim import cut_sequences, label_tokens, length_order, padding_layout, trim
from tests.hf_data import TokenDataset, lm_collator


def _batch(lengths: list[int], side: str = "right") -> dict[str, torch.Tensor]:
    ds = TokenDataset(lengths)
    return dict(lm_collator(side)([ds[i] for i in range(len(ds))]))


@pytest.mark.parametrize("side", ["right", "left"])
def test_layout_from_hf_collator(side: str) -> None:
    batch = _batch([3, 7, 2, 5], side)
    layout = padding_layout(batch)
    assert layout is not None
    assert (layout.lengths, layout.side, layout.padded) == ((3, 7, 2, 5), side, 7)
    assert set(layout.keys) == {"input_ids", "attention_mask", "labels"}


def test_no_padding_is_right_with_full_lengths() -> None:
    layout = padding_layout(_batch([4, 4]))
    assert layout is not None and layout.lengths == (4, 4)


@pytest.mark.parametrize(
    "batch",
    [
        pytest.param({"input_ids": torch.zeros(2, 4, dtype=torch.long)}, id="no-mask"),
        pytest.param(torch.zeros(2, 4), id="tensor"),
        pytest.param({"attention_mask": torch.tensor([[0, 1, 1, 0], [1, 1, 1, 1]])}, id="both-sides"),
        pytest.param({"attention_mask": torch.tensor([[1, 0, 1, 0], [1, 1, 1, 1]])}, id="holes"),
    ],
)
def test_untrimmable_batches_are_left_alone(batch: object) -> None:
    assert padding_layout(batch) is None


def test_unknown_sequence_key_leaves_batch_untrimmed_with_warning() -> None:
    batch = _batch([2, 5])
    batch["loss_weights"] = torch.ones(2, 5)
    with pytest.warns(UserWarning, match="'loss_weights' has the padded length 5.*trim_keys"):
        assert padding_layout(batch) is None
    layout = padding_layout(batch, trim_keys=["loss_weights"])
    assert layout is not None and "loss_weights" in layout.keys
    assert trim(select(batch, [0]), layout, 2)["loss_weights"].shape == (1, 2)


def test_order_groups_lengths_and_select_keeps_samples_together() -> None:
    batch = _batch([3, 9, 3, 7])
    batch["id"] = ["a", "b", "c", "d"]
    order = length_order(padding_layout(batch).lengths)
    assert order == [1, 3, 0, 2]
    taken = select(batch, order)
    assert taken["id"] == ["b", "d", "a", "c"]
    assert taken["attention_mask"].sum(1).tolist() == [9, 7, 3, 3]
    assert torch.equal(taken["input_ids"][2], batch["input_ids"][0])


def test_select_on_a_device_copies_its_index_without_blocking() -> None:
    """A blocking host-to-device copy waits for the device's queue: once per micro-batch, it would stall the GPU.

    ``torch.as_tensor(..., device=...)`` copies blocking and out of the dispatcher's sight, so the test sees what it
    allows: every copy from the host to the batch's device ("meta" stands in for CUDA) is non-blocking.
    """
    from torch.utils._python_dispatch import TorchDispatchMode

    class Copies(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.seen: list[tuple[str, bool]] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            kwargs = kwargs or {}
            if func is torch.ops.aten._to_copy.default and args[0].device.type == "cpu":
                self.seen.append((str(kwargs.get("device")), bool(kwargs.get("non_blocking", False))))
            return func(*args, **kwargs)

    batch = {k: v.to("meta") for k, v in _batch([3, 9, 3, 7]).items()}
    with Copies() as copies:
        taken = select(batch, [1, 3])
    assert taken["input_ids"].shape == (2, batch["input_ids"].shape[1]) and taken["input_ids"].device.type == "meta"
    assert copies.seen == [("meta", True)]  # one index, copied once for all the batch's tensors, non-blocking


def _tiny_gpt2() -> transformers.GPT2LMHeadModel:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=64, n_embd=32, n_layer=2, n_head=2)
    return transformers.GPT2LMHeadModel(cfg).eval()


def _grads(model: torch.nn.Module, loss: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad()
    loss.backward()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def test_trimmed_causal_lm_gives_the_same_loss_and_gradients() -> None:
    model = _tiny_gpt2()
    batch = _batch([30, 4, 6, 3])  # the step's longest (30) is not in the micro-batch below
    layout = padding_layout(batch)
    micro = select(batch, [1, 2, 3])
    trimmed = trim(micro, layout, layout.longest([1, 2, 3]))
    assert trimmed["input_ids"].shape == (3, 6)
    # Hugging Face's own causal-LM loss, token mean over the labels (-100 ignored)
    full = model(**micro).loss
    cut = model(**trimmed).loss
    torch.testing.assert_close(cut, full)
    for a, b in zip(_grads(model, cut), _grads(model, model(**micro).loss), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_trimmed_classifier_gives_the_same_logits_and_gradients() -> None:
    torch.manual_seed(0)
    cfg = transformers.BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, num_labels=3
    )
    model = transformers.BertForSequenceClassification(cfg).eval()
    batch = _batch([25, 5, 8])
    del batch["labels"]
    layout = padding_layout(batch)
    micro = select(batch, [1, 2])
    trimmed = trim(micro, layout, layout.longest([1, 2]))
    assert trimmed["input_ids"].shape == (2, 8)
    target = torch.tensor([0, 2])
    full = model(**micro, labels=target)
    cut = model(**trimmed, labels=target)
    torch.testing.assert_close(cut.logits, full.logits, rtol=1e-5, atol=1e-6)
    for a, b in zip(_grads(model, cut.loss), _grads(model, model(**micro, labels=target).loss), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_left_padding_with_position_ids_trims_them_together() -> None:
    model = _tiny_gpt2()
    batch = _batch([20, 4, 6], "left")
    batch["position_ids"] = (batch["attention_mask"].cumsum(1) - 1).clamp(min=0)
    layout = padding_layout(batch)
    assert layout.side == "left" and "position_ids" in layout.keys
    micro = select(batch, [1, 2])
    trimmed = trim(micro, layout, 6)
    assert trimmed["attention_mask"][:, -1].all() and trimmed["input_ids"].shape == (2, 6)
    # positions come from the mask, so the real tokens see the same inputs: same logits where labels count
    full = model(**micro).logits[:, -6:]
    torch.testing.assert_close(model(**trimmed).logits, full, rtol=1e-5, atol=1e-5)


def test_label_tokens_match_hugging_face_trainer_count() -> None:
    batch = _batch([3, 7, 2])
    # Hugging Face's Trainer counts `labels[..., 1:] != -100` for causal LMs (num_items_in_batch)
    assert int(label_tokens(batch, shift=1)) == int(batch["labels"][..., 1:].ne(-100).sum()) == 2 + 6 + 1
    assert int(label_tokens(batch)) == 12
    del batch["labels"]
    assert int(label_tokens(batch)) == 12
    with pytest.raises(TypeError, match="needs batches with `labels`.*input_ids"):
        label_tokens({"input_ids": batch["input_ids"]})


def test_short_samples_rounded_up_to_the_multiple_share_one_micro_batch() -> None:
    lengths = [3, 3, 2, 2, 2]
    mask = torch.tensor([[1] * n + [0] * (16 - n) for n in lengths])  # collated to a multiple of 16
    batch = {"input_ids": mask * 5, "attention_mask": mask}
    parts = cut_sequences(batch, 5, padding_layout(batch), lambda length: 64, sample_weight=0.2, multiple=8)
    assert [(p.samples, p.seq_len) for p in parts] == [(5, 8)]  # not one micro-batch per sample of length 2
