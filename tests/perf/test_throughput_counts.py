"""A step's readers share the counts of its batch: the batch is walked once by the rule and once for its tensors."""

from __future__ import annotations

from typing import Any

import torch

from lightning_tune.batch.runner import cut_step
from lightning_tune.perf.batch import LAST_BATCH, BatchLayout, count_samples, count_tokens, sequence_length


class Walked(dict[str, Any]):
    """A mapping batch that counts how often its items are read: once for each walk of the batch."""

    walks = 0

    def items(self) -> Any:
        type(self).walks += 1
        return super().items()


def batch(n: int = 4, length: int = 6) -> Walked:
    ids = torch.ones(n, length, dtype=torch.long)
    return Walked(input_ids=ids, attention_mask=torch.ones(n, length, dtype=torch.long), labels=ids)


def test_a_steps_readers_walk_its_batch_twice_not_six_times() -> None:
    Walked.walks = 0
    step = batch()
    layout = BatchLayout()  # DynamicBatchSize's, kept for the fit
    # DynamicBatchSize counts the step and cuts it (one micro-batch here), then the monitor counts it at its end
    assert layout.samples(step) == 4
    assert [piece.samples for piece in cut_step(step, 8, sample_weight=0.25, layout=layout)] == [4]
    assert count_samples(step) == 4 and int(count_tokens(step) or 0) == 24 and sequence_length(step) == 6
    assert Walked.walks == 2  # the rule's walk and the tensors' walk (every reader walked it before: 5)


def test_counts_are_taken_again_for_another_batch_or_one_refilled_in_place() -> None:
    first, layout = batch(4), BatchLayout()
    assert layout.samples(first) == 4 and count_samples(first) == 4
    second = batch(3)  # the next step's batch
    assert count_samples(second) == 3 and int(count_tokens(second) or 0) == 18
    second["input_ids"] = torch.ones(5, 2, dtype=torch.long)  # the same mapping, refilled
    second["attention_mask"] = torch.ones(5, 2, dtype=torch.long)
    second["labels"] = second["input_ids"]
    assert count_samples(second) == 5 and sequence_length(second) == 2 and int(count_tokens(second) or 0) == 10
    LAST_BATCH.clear()  # as the monitor does at the end of a run: the batch is let go
    assert LAST_BATCH.batch is None


def test_the_monitor_reads_the_count_of_the_layout_that_cut_the_step() -> None:
    # a per-batch tensor of another length named by DynamicBatchSize's per_batch: the step's count is the layout's
    step = {"x": torch.zeros(3, 2), "scale": torch.zeros(5), "weights": torch.zeros(5)}
    assert BatchLayout(["scale", "weights"]).samples(step) == 3
    assert count_samples(step) == 3  # by a fresh layout it would be 5, the length most tensors share
    assert count_samples(dict(step)) == 5
