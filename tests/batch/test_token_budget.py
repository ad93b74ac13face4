"""TokenBudget without a Trainer: the micro-batch as padded tokens, against figures worked out by hand."""

from __future__ import annotations

import pytest
import torch

from lightning_tune.batch import BatchSizeController
from lightning_tune.batch.tokens import TokenBudget


def _budget(min_batch_size: int = 1, max_batch_size: int | None = None) -> TokenBudget:
    samples = BatchSizeController(
        target=0.9, min_batch_size=min_batch_size, max_batch_size=max_batch_size, multiple_of=8
    )
    return TokenBudget(samples, pad_to_multiple_of=8)


def test_the_first_step_converts_the_micro_batch_and_later_steps_keep_the_budget() -> None:
    tokens = _budget(min_batch_size=2)
    assert tokens.budget is None and tokens.state_dict()["token_controller"] is None
    assert tokens.start(512, 16, agree=None) == 16 * 512
    assert tokens.start(1024, 32, agree=None) == 16 * 512  # converted once; a longer step only raises the longest
    assert tokens.longest == 1024
    # the token grid is the sample grid x pad_to_multiple_of, its floor the fewest samples at the shortest length
    assert (tokens.controller.multiple_of, tokens.controller.min_batch_size) == (64, 16)


def test_ranks_start_from_the_budget_at_their_longest_first_step() -> None:
    tokens, seen = _budget(), []

    def agree(values: list[float]) -> list[float]:
        seen.append(list(values))
        return [max(values[0], 700.0)]  # the other rank's first step was padded to 700

    assert tokens.start(512, 16, agree=agree) == 16 * 700
    assert tokens.start(600, 16, agree=agree) == 16 * 700 and seen == [[512]]  # agreed once, on the first budget
    assert tokens.longest == 600  # this rank's own lengths


@pytest.mark.parametrize(
    ("length", "max_batch_size", "n", "samples"),
    [
        pytest.param(64, 48, 64, 48, id="short: 8192 // 64 = 128, held to max_batch_size"),
        pytest.param(512, 48, 64, 16, id="8192 // 512 = 16"),
        pytest.param(1000, 48, 64, 8, id="8192 // 1000 = 8"),
        pytest.param(186, None, 64, 40, id="8192 // 186 = 44, down to the grid (multiples of 8)"),
        pytest.param(64, None, 40, 40, id="no maximum: the step's 40 samples"),
        pytest.param(3000, 48, 64, 2, id="8192 // 3000 = 2, a halving below the grid"),
        pytest.param(8192, 48, 64, 2, id="8192 // 8192 = 1, held to min_batch_size"),
    ],
)
def test_samples_per_length_are_on_the_sample_grid_within_its_limits(
    length: int, max_batch_size: int | None, n: int, samples: int
) -> None:
    assert _budget(min_batch_size=2, max_batch_size=max_batch_size).samples_at(8192, length, n) == samples


def test_the_budget_grows_to_the_effective_batch_at_the_longest_length_and_no_further() -> None:
    tokens = _budget()
    tokens.start(512, 16, agree=None)  # 8192 tokens; 32 samples a step at 512: a cap of 16384
    assert tokens.cap(32) == 16384
    # one size seen, no prior: probe at twice the budget (probe_growth=1), here the cap; 100 / 8192 x 16384 fits
    first = tokens.decide(32, peak_bytes=100, total_bytes=1000, pressure=False, budget_bytes=900)
    assert (first.batch_size, first.reason, tokens.budget) == (16384, "probe", 16384)
    held = tokens.decide(32, peak_bytes=150, total_bytes=1000, pressure=False, budget_bytes=900)
    assert (held.batch_size, held.reason) == (16384, "hold")  # at the cap, though far from the memory target
    tokens.start(1024, 16, agree=None)  # a longer step: the cap becomes 32 x 1024
    grown = tokens.decide(32, peak_bytes=150, total_bytes=1000, pressure=False, budget_bytes=900)
    # 100 bytes at 8192 tokens, 150 at 16384: 50 + 50 / 8192 per token; 32768 tokens -> 250 bytes, 0.25 of 1000
    assert (grown.batch_size, grown.reason, grown.predicted_fraction) == (32768, "grow", 0.25)


def test_the_peak_is_recorded_against_the_largest_micro_batch_held_in_the_cache() -> None:
    tokens = _budget()
    tokens.start(512, 16, agree=None)
    tokens.largest = 4096  # every step was short: no micro-batch came near the budget of 8192
    probe = tokens.decide(32, peak_bytes=200, total_bytes=1000, pressure=False, budget_bytes=900)
    assert tokens.controller.model.state_dict()["points"] == [[4096, 200.0]]
    # 200 / 4096 x 16384 = 800; the caller empties the cache after every decision: the largest starts again
    assert (probe.batch_size, probe.reason, tokens.largest) == (16384, "probe", 0)
    tokens.largest = 16384  # the probe's micro-batch ran, and went over budget
    shrink = tokens.decide(32, peak_bytes=1000, total_bytes=1000, pressure=False, budget_bytes=900)
    # the two points give a negative fixed part: 1000 / 16384 per token, the worst; 900 of it is 14745.6 tokens,
    # 14720 on the grid of 64, 898.4 bytes predicted
    assert (shrink.batch_size, shrink.reason, shrink.predicted_fraction) == (14720, "shrink", 0.898438)
    assert tokens.largest == 0


def test_an_oom_halves_the_budget_on_the_token_grid_and_stops_at_its_floor() -> None:
    tokens = _budget()
    tokens.start(512, 16, agree=None)
    assert tokens.on_oom(8192, 32, total_bytes=1000, budget_bytes=900) == 4096 == tokens.budget  # nothing measured
    assert tokens.on_oom(100, 32, total_bytes=1000, budget_bytes=900) == 32  # 50 -> a halving below the grid of 64
    with pytest.raises(torch.OutOfMemoryError, match=r"min_batch_size=8"):
        tokens.on_oom(8, 32, total_bytes=1000, budget_bytes=900)


def test_the_state_round_trips_and_an_older_checkpoint_loads() -> None:
    tokens = _budget()
    tokens.start(768, 16, agree=None)
    tokens.decide(32, peak_bytes=100, total_bytes=1000, pressure=False, budget_bytes=900)
    tokens.on_oom(tokens.budget or 0, 32, total_bytes=1000, budget_bytes=900)
    state = tokens.state_dict()
    assert set(state) == {"micro_batch_tokens", "longest", "token_controller"}  # the callback's checkpoint keys
    restored = _budget()
    restored.load_state_dict(state)
    assert restored.state_dict() == state and (restored.budget, restored.longest) == (tokens.budget, 768)
    # probed at the cap (32 x 768), which then ran out of memory: a ceiling, and back to half
    assert (restored.budget, restored.state_dict()["token_controller"]["ceiling"]) == (12288, 24576)
    old = _budget()
    old.load_state_dict({"batch_size": 8})  # a checkpoint from before token budgets
    assert (old.budget, old.longest) == (None, 0)
