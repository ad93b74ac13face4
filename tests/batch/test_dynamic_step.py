"""DynamicStep without a Trainer: weights worked out by hand, injected out-of-memory errors, and one step that matches
DynamicBatchSize inside a Trainer micro-batch for micro-batch and gradient for gradient."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback
from torch import nn

import lightning_tune as lt
from lightning_tune.batch.control import Decision
from lightning_tune.batch.runner import MicroBatch, MicroBatchRunner
from lightning_tune.batch.step import DynamicBatchSettings, DynamicStep, IntervalFigures
from lightning_tune.perf.step_run import StepRun
from tests.batch.test_dynamic_batch_varlen import LM, fit, roomy, tiny_gpt2
from tests.hf_data import TokenDataset, lm_collator, long_tailed_lengths


def _runner(step: DynamicStep, loss: Any, params: list[torch.Tensor], log: list[MicroBatch]) -> MicroBatchRunner:
    """A runner whose forward notes each micro-batch to ``step`` (as DynamicBatchSize's does) and to ``log``."""

    def forward(piece: MicroBatch) -> torch.Tensor:
        step.before_micro_batch(piece)
        log.append(piece)
        return loss(piece.batch)

    def zero_grad() -> None:
        log.clear()  # an attempt starts again: only the last one's micro-batches count
        for p in params:
            p.grad = None

    return MicroBatchRunner(
        forward=forward,
        backward=lambda value: value.backward(),
        zero_grad=zero_grad,
        free=lambda: None,
        shrink=step.shrink,
        min_size=1,
        on_failure=step.on_failure,
    )


def test_a_short_last_batch_weighs_as_lightning_averages_it() -> None:
    """DataLoader batches of 4 and accumulation 3 over an epoch of 10 samples: the step is 4 + 4 + 2, each a third."""
    w = torch.zeros((), requires_grad=True)
    step = DynamicStep(DynamicBatchSettings(keep="effective"))
    step.start(nn.Linear(1, 1), 3)
    step.install(4)
    pieces: list[MicroBatch] = []
    runner = _runner(step, lambda x: ((x - w) ** 2).mean(), [w], pieces)
    step.run(torch.arange(10.0), runner, epoch_samples=10)
    assert [(p.samples, p.weight) for p in pieces] == [(4, pytest.approx(1 / 3)), (4, pytest.approx(1 / 3)), (2, 1 / 3)]
    # Lightning: the mean loss of each of the three DataLoader batches, divided by the accumulation
    expected = sum(-2 * torch.tensor(b).mean() / 3 for b in ([0.0, 1, 2, 3], [4.0, 5, 6, 7], [8.0, 9]))
    assert w.grad is not None and float(w.grad) == pytest.approx(float(expected))
    assert step.micro_batches == 3 and step.accumulate_grad_batches == 3 and step.effective_batch_size == 12
    # the same step where the epoch goes on (no short batch in it): every sample weighs 1 / 12
    pieces.clear()
    step.run(torch.arange(10.0), runner, epoch_samples=40)
    assert [(p.samples, p.weight) for p in pieces] == [(4, pytest.approx(4 / 12))] * 2 + [(2, pytest.approx(2 / 12))]


def _hf_batch(lengths: list[int]) -> dict[str, torch.Tensor]:
    """A right-padded collator's batch: ids 10 + position at real tokens, labels -100 at the padding."""
    padded = max(lengths)
    mask = torch.tensor([[1] * n + [0] * (padded - n) for n in lengths])
    ids = (10 + torch.arange(padded)).expand(len(lengths), -1) * mask
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def test_token_weights_group_by_length_and_trim() -> None:
    """Lengths 2, 6, 4, 3 in micro-batches of 2: longest first, each trimmed; weights are label-token shares."""
    step = DynamicStep(DynamicBatchSettings(keep="none", loss_weight="tokens", label_shift=1, pad_to_multiple_of=1))
    step.start(nn.Linear(1, 1), 1)
    step.install(4)
    step.batch_size = 2
    pieces: list[MicroBatch] = []
    w = torch.ones((), requires_grad=True)
    step.run(_hf_batch([2, 6, 4, 3]), _runner(step, lambda b: w * b["attention_mask"].sum(), [w], pieces))
    # label tokens after the shift: 1, 5, 3, 2 (of 11); samples 1 and 2 (6 and 4 long), then 3 and 0 (3 and 2 long)
    assert [(p.samples, p.seq_len, p.weight) for p in pieces] == [(2, 6, 8 / 11), (2, 3, 3 / 11)]
    assert pieces[1].batch["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    assert step.step_shapes == [(2, 6), (2, 3)] and step.step_tokens == (15, 18)
    assert step.step_run() == StepRun(2, ((2, 6), (2, 3)), (15, 18))


def test_a_held_effective_batch_of_padded_sequences_becomes_a_token_budget() -> None:
    step = DynamicStep(DynamicBatchSettings(keep="effective", pad_to_multiple_of=1, loss_weight="samples"))
    step.start(nn.Linear(1, 1), 1)
    step.install(4)
    step.batch_size = 2
    assert step.policy is step.controller and step.describe(2) == "2 samples"
    pieces: list[MicroBatch] = []
    w = torch.ones((), requires_grad=True)
    step.run(_hf_batch([2, 6, 4, 3]), _runner(step, lambda b: w * b["attention_mask"].sum(), [w], pieces))
    assert step.micro_batch_tokens == 12 and step.policy is step.tokens and step.describe(12) == "12 padded tokens"
    # 12 tokens: 2 samples padded to 6, then the other 2 (up to 4 at length 3), each micro-batch a half of the step
    assert [(p.samples, p.seq_len, p.weight) for p in pieces] == [(2, 6, 0.5), (2, 3, 0.5)]
    assert step.batch_size == 2  # the most samples a micro-batch of the step held


def test_an_oom_in_a_forward_shrinks_and_runs_the_same_step_again() -> None:
    memory = lt.SimulatedMemory(total_bytes=10_000, fixed_bytes=2_000, bytes_per_sample=1_100)
    w = torch.zeros((), requires_grad=True)
    step = DynamicStep(DynamicBatchSettings(keep="effective", multiple_of=2), probe=memory)
    step.start(nn.Linear(1, 1), 1)
    step.install(16)  # 16 samples need 19 600 bytes of the 10 000
    step.steps, step.agreed = 3, IntervalFigures(1.0, False, 1.0, 0, 0.0)  # an interval under way
    pieces: list[MicroBatch] = []
    with pytest.warns(UserWarning, match="out of memory at a micro-batch of 16 samples.*again at 8 samples"):
        outcome = step.run(torch.arange(16.0), _runner(step, lambda x: ((x - w) ** 2).mean(), [w], pieces))
    assert outcome.failures == 2 and step.oom_recoveries == 2  # 16, then 8 (10 800 bytes) failed: 4 ran
    assert step.batch_size == 4 and [p.samples for p in pieces] == [4, 4, 4, 4]
    assert step.last_decision == Decision(4, None, "oom")
    assert (step.steps, step.agreed, step.validation) == (0, None, (0, False))  # the interval starts again
    assert w.grad is not None and float(w.grad) == pytest.approx(-2 * 7.5)  # the mean over the 16 samples


def test_without_a_probe_an_oom_names_what_to_do() -> None:
    step = DynamicStep(DynamicBatchSettings(keep="none"))
    step.start(nn.Linear(1, 1), 1)
    step.install(8)

    def fail(x: torch.Tensor) -> torch.Tensor:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")

    with pytest.raises(torch.OutOfMemoryError, match="micro-batch of 8 samples, with no memory probe"):
        step.run(torch.arange(8.0), _runner(step, fail, [], []))


def test_the_ranks_agree_on_the_worst_figures_field_by_field() -> None:
    """The maximum of the lists is the largest peak and micro-batch, any pressure, the smallest budget and base."""
    one = IntervalFigures(peak_bytes=900.0, pressure=False, budget_bytes=800.0, largest_tokens=64, base_bytes=300.0)
    two = IntervalFigures(peak_bytes=700.0, pressure=True, budget_bytes=600.0, largest_tokens=96, base_bytes=200.0)
    agreed = IntervalFigures.from_list([max(a, b) for a, b in zip(one.to_list(), two.to_list(), strict=True)])
    assert agreed == IntervalFigures(900.0, True, 600.0, 96, 200.0)


class _Grads(Callback):
    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        self.grads = [p.grad.detach().clone() for p in pl_module.parameters()]


@pytest.mark.parametrize("loss_weight", ["samples", "tokens"])
def test_one_step_through_the_engine_is_the_callbacks_step_in_a_trainer(tmp_path: Path, loss_weight: str) -> None:
    """A collator's padded, -100-labelled batch of 16: the same micro-batches, weights and gradients."""
    lengths = long_tailed_lengths(16, median=12, max_len=48, seed=3)
    data, collate = TokenDataset(lengths), lm_collator()
    model = tiny_gpt2(64)
    # in a Trainer: DataLoader batches of 4 accumulated 4 times, one optimizer step
    dyn = lt.DynamicBatchSize(probe=roomy(), adjust_every=1000, loss_weight=loss_weight)
    ran: list[tuple[int, int | None, float]] = []
    cut = dyn.step.cut

    def spy(*args: Any, **kwargs: Any) -> list[MicroBatch]:
        pieces = cut(*args, **kwargs)
        ran[:] = [(p.samples, p.seq_len, p.weight) for p in pieces]
        return pieces

    dyn.step.cut = spy  # type: ignore[method-assign]
    grads = _Grads()
    module = LM(copy.deepcopy(model), data, collate, batch_size=4)
    fit(module, [dyn, grads], tmp_path, accumulate_grad_batches=4, max_steps=1)
    # the engine alone, on the same samples and weights
    step = DynamicStep(DynamicBatchSettings(loss_weight=loss_weight), probe=roomy())
    step.start(model, 4)
    step.install(4)
    pieces: list[MicroBatch] = []
    batch = collate([data[i] for i in range(16)])
    step.run(batch, _runner(step, lambda b: model(**b).loss, list(model.parameters()), pieces))
    assert [(p.samples, p.seq_len, p.weight) for p in pieces] == ran and len(ran) > 1
    assert step.step_shapes == dyn.step_shapes
    for got, want in zip([p.grad for p in model.parameters()], grads.grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
