"""DynamicBatchSize's size control on a simulated device: it grows back once memory frees up, and it settles in at
most two decisions from one measured interval or from a plan, never above the target."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, Trainer

import lightning_tune as lt
from lightning_tune.batch import BatchSizeController
from lightning_tune.batch.control import Decision
from lightning_tune.batch.tokens import TokenBudget
from tests.batch.test_dynamic_batch import Net, fit

GiB = 1 << 30
TARGET = 0.9


class Device(lt.SimulatedMemory):
    """10 GiB, 1 GiB fixed, 0.1 GiB a sample; remembers the highest memory reserved over the whole run."""

    def __init__(self, **kwargs: Any) -> None:
        kwargs = {"total_bytes": 10 * GiB, "fixed_bytes": GiB, "bytes_per_sample": GiB // 10, **kwargs}
        super().__init__(**kwargs)
        self.run_peak = self.reserved_bytes()

    def before_micro_batch(self, batch_size: int, seq_len: int | None = None) -> None:
        super().before_micro_batch(batch_size, seq_len)
        self.run_peak = max(self.run_peak, self.reserved_bytes())

    def hold(self, nbytes: int, owner: torch.Tensor | None = None) -> None:
        super().hold(nbytes, owner)
        self.run_peak = max(self.run_peak, self.reserved_bytes())


def settled_after(sizes: list[int]) -> int:
    """Decisions until the size stopped changing: ``sizes`` is the start, then the size after each decision."""
    return next(i for i in range(len(sizes)) if set(sizes[i:]) == {sizes[-1]})


# -- the engines, driven as the callback drives them -------------------------------------------------------------------
@dataclass
class Run:
    sizes: list[int] = field(default_factory=list)  # the size each step ran at
    decisions: list[Decision] = field(default_factory=list)
    oom_at: list[int] = field(default_factory=list)  # decisions taken before each out-of-memory error


def new_interval(memory: lt.SimulatedMemory) -> float:
    """What the callback does after every decision: empty the cache, reset the peak, read the base."""
    memory.empty_cache()
    memory.reset_peak()
    return float(memory.peak_bytes())


def drive(
    memory: lt.SimulatedMemory,
    steps: int,
    run_step: Callable[[], int],
    decide: Callable[[float], Decision],
    on_oom: Callable[[], None],
    before_step: Callable[[int], None] = lambda step: None,
    adjust_every: int = 5,
) -> Run:
    """Steps of one micro-batch each, a decision every ``adjust_every`` steps, a retry after an out-of-memory error."""
    run, base, in_interval = Run(), new_interval(memory), 0
    for step in range(steps):
        before_step(step)
        while True:
            try:
                ran = run_step()
                break
            except torch.OutOfMemoryError:
                memory.free()
                run.oom_at.append(len(run.decisions))
                on_oom()
                memory.reset_peak()
                in_interval = 0  # the interval starts again
        run.sizes.append(ran)
        in_interval += 1
        if in_interval == adjust_every:
            run.decisions.append(decide(base))
            base, in_interval = new_interval(memory), 0
    return run


def memory_doubles(memory: lt.SimulatedMemory, attribute: str, normal: int) -> Callable[[int], None]:
    """Per-sample (or per-token) memory doubles for steps 100 to 199, then returns."""

    def before_step(step: int) -> None:
        setattr(memory, attribute, 2 * normal if 100 <= step < 200 else normal)

    return before_step


class SampleLoop:
    """One micro-batch of ``size`` samples a step, sized by a controller; ``state`` bytes held after the first step."""

    def __init__(self, memory: Device, size: int = 8, state: int = 0) -> None:
        self.memory, self.size, self.state = memory, size, state
        self.ctl = BatchSizeController(target=TARGET, min_batch_size=1, max_batch_size=512, multiple_of=8)

    def run_step(self) -> int:
        self.memory.before_micro_batch(self.size)
        if self.state:  # an optimizer's state, created by its first step
            self.memory.hold(self.state)
            self.state = 0
        return self.size

    def decide(self, base: float) -> Decision:
        figures = {"peak_bytes": self.memory.peak_bytes(), "pressure": self.memory.pressure()}
        decision = self.ctl.decide(self.size, total_bytes=self.memory.capacity_bytes(), base_bytes=base, **figures)
        self.size = decision.batch_size
        return decision

    def on_oom(self) -> None:
        self.size = self.ctl.on_oom(self.size, total_bytes=self.memory.capacity_bytes())


def test_the_engine_grows_back_within_ceiling_decisions_once_memory_frees_up() -> None:
    memory = Device()
    loop = SampleLoop(memory)
    run = drive(
        memory, 400, loop.run_step, loop.decide, loop.on_oom, memory_doubles(memory, "bytes_per_sample", GiB // 10)
    )
    # 1 + 0.1 x 80 = 9 GiB; doubled, 80 runs out of memory and 40 is the target; then 80 fits again
    assert run.sizes[5:100] == [80] * 95 and len(run.oom_at) == 1 and set(run.sizes[100:200]) == {40}
    assert run.sizes[205] > 40  # the first decision after memory freed up grows (below 80, off limits a while)
    back = run.sizes.index(80, 200)
    assert back // 5 <= run.oom_at[0] + loop.ctl.ceiling_decisions + 2  # decisions taken before it ran at 80 again
    assert set(run.sizes[back:]) == {80}
    assert memory.run_peak <= TARGET * memory.capacity_bytes()


def test_the_token_budget_grows_back_within_ceiling_decisions_once_memory_frees_up() -> None:
    per_token = GiB // 10 // 512  # 0.1 GiB a sample of 512 padded tokens
    memory = Device(bytes_per_sample=1, bytes_per_token=per_token)
    samples = BatchSizeController(target=TARGET, min_batch_size=1, max_batch_size=512, multiple_of=8)
    tokens, effective = TokenBudget(samples, pad_to_multiple_of=8), 512
    tokens.start(512, 8)

    def run_step() -> int:
        assert tokens.budget is not None
        n = tokens.samples_at(tokens.budget, 512, effective)
        tokens.largest = max(tokens.largest, n * 512)
        memory.before_micro_batch(n, 512)
        return n

    def decide(base: float) -> Decision:
        figures = {"peak_bytes": memory.peak_bytes(), "pressure": memory.pressure()}
        return tokens.decide(effective, total_bytes=memory.capacity_bytes(), base_bytes=base, **figures)

    def on_oom() -> None:
        assert tokens.budget is not None
        tokens.largest = 0
        tokens.on_oom(tokens.budget, effective, total_bytes=memory.capacity_bytes())

    run = drive(memory, 400, run_step, decide, on_oom, memory_doubles(memory, "bytes_per_token", per_token))
    assert run.sizes[5:100] == [80] * 95 and len(run.oom_at) == 1 and set(run.sizes[100:200]) == {40}
    assert run.sizes[205] > 40
    back = run.sizes.index(80, 200)
    assert back // 5 <= run.oom_at[0] + tokens.controller.ceiling_decisions + 2
    assert set(run.sizes[back:]) == {80}
    assert memory.run_peak <= TARGET * memory.capacity_bytes()


@pytest.mark.parametrize(
    ("state", "settled", "most"),
    [
        pytest.param(0, 80, 1, id="the fixed part is there from the start: one decision"),
        pytest.param(2 * GiB, 56, 2, id="optimizer state comes with the first step: two decisions"),
    ],
)
def test_the_engine_settles_within_two_decisions_of_one_measured_interval(state: int, settled: int, most: int) -> None:
    memory = Device()
    loop = SampleLoop(memory, state=state)
    run = drive(memory, 60, loop.run_step, loop.decide, loop.on_oom)
    sizes = [8, *(d.batch_size for d in run.decisions)]
    assert sizes[-1] == settled  # (9 GiB - fixed) / 0.1 GiB on the grid of 8
    assert settled_after(sizes) <= most
    assert memory.run_peak <= TARGET * memory.capacity_bytes() and not run.oom_at


def test_without_a_base_or_a_prior_the_first_decision_still_probes() -> None:
    # one size seen, nothing to separate the fixed part from: the slope is probed for, a grid step at a time
    ctl = BatchSizeController(target=TARGET, min_batch_size=1, max_batch_size=512, multiple_of=8)
    assert ctl.decide(8, peak_bytes=1.8 * GiB, total_bytes=10 * GiB) == Decision(16, None, "probe")
    # two sizes: as far as the line from 0 through the larger one allows (9 / 0.1625 = 55.4), beyond double
    assert ctl.decide(16, peak_bytes=2.6 * GiB, total_bytes=10 * GiB).batch_size == 48
    fresh = BatchSizeController(target=TARGET, min_batch_size=1, max_batch_size=512, multiple_of=8)
    assert fresh.decide(8, peak_bytes=1.8 * GiB, total_bytes=10 * GiB, base_bytes=GiB).batch_size == 80


# -- through a Trainer ----------------------------------------------------------------------------------------------
class Sizes(Callback):
    """The callback's size and decision count after every optimizer step."""

    def __init__(self, dyn: lt.DynamicBatchSize) -> None:
        self.dyn, self.steps = dyn, list[tuple[int, int]]()

    def on_train_batch_end(self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.steps.append((self.dyn.batch_size or 0, self.dyn.decisions))

    def after_decisions(self) -> list[int]:
        """The size before the first decision, then after each."""
        sizes = [self.dyn.batch_size or 0] * (self.dyn.decisions + 1)
        for size, decisions in self.steps:
            sizes[decisions] = size
        return sizes


class DoubleForAWhile(Callback):
    """Per-sample memory doubles for optimizer steps 20 to 39, then returns."""

    def __init__(self, memory: lt.SimulatedMemory) -> None:
        self.memory = memory

    def on_train_batch_start(self, trainer: Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.memory.bytes_per_sample = GiB // 5 if 20 <= trainer.global_step < 40 else GiB // 10


def test_a_trainer_run_grows_back_once_memory_frees_up(tmp_path: Path) -> None:
    memory = Device()
    dyn = lt.DynamicBatchSize(TARGET, adjust_every=1, keep="none", max_batch_size=512, probe=memory)
    sizes = Sizes(dyn)
    fit(Net(batch_size=8, n=6_000), [dyn, DoubleForAWhile(memory), sizes], tmp_path, max_steps=60)
    after = [size for size, _ in sizes.steps[40:]]
    assert after[0] > 40 and after[-1] == 80, after  # it grows once memory frees up (80 is off limits a while)
    assert dyn.oom_recoveries == 1 and {size for size, _ in sizes.steps[20:40]} == {40}  # 80 ran out of memory
    back = next(i for i, (size, _) in enumerate(sizes.steps) if i >= 40 and size == 80)
    assert sizes.steps[back][1] - sizes.steps[19][1] <= dyn.controller.ceiling_decisions + 2  # decisions since the OOM
    assert {size for size, _ in sizes.steps[back:]} == {80}
    assert memory.run_peak <= TARGET * memory.capacity_bytes()


class OptimizerState(Callback):
    """Holds ``nbytes`` from the first optimizer step on, as Adam's state does."""

    def __init__(self, memory: lt.SimulatedMemory, nbytes: int) -> None:
        self.memory, self.nbytes = memory, nbytes

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: Any, optimizer: Any) -> None:
        if self.nbytes:
            self.memory.hold(self.nbytes)
            self.nbytes = 0


@pytest.mark.parametrize(
    ("prior", "state", "settled", "most"),
    [
        pytest.param(None, 0, 80, 1, id="no plan: one measured interval"),
        pytest.param(None, 2 * GiB, 56, 2, id="no plan, optimizer state from the first step"),
        pytest.param((3 * GiB, GiB // 10), 2 * GiB, 56, 0, id="an exact plan"),
        pytest.param((8 * GiB, GiB // 10), 0, 80, 1, id="a plan over-estimating the fixed part 8x"),
    ],
)
def test_a_trainer_run_settles_within_two_decisions_never_above_the_target(
    tmp_path: Path, prior: tuple[int, int] | None, state: int, settled: int, most: int
) -> None:
    memory = Device()
    plan = None
    if prior is not None:
        fixed, per_sample = prior
        plan = lt.MemoryEstimate(parameters=1, weight_bytes=GiB, bytes_per_sample=per_sample, fixed_bytes=fixed)
    dyn = lt.DynamicBatchSize(TARGET, adjust_every=2, probe=memory, prior=plan)
    sizes, callbacks = Sizes(dyn), [dyn, OptimizerState(memory, state)]
    fit(Net(batch_size=8, n=128 * 14), [*callbacks, sizes], tmp_path, accumulate_grad_batches=16)
    history = sizes.after_decisions()
    assert history[-1] == settled  # (9 GiB - fixed) / 0.1 GiB on the grid of 8, within the effective batch of 128
    assert settled_after(history) <= most
    assert memory.run_peak <= TARGET * memory.capacity_bytes() and dyn.oom_recoveries == 0


class Fragmented(Device):
    """A CUDA cache after ``empty_cache``: ``hole`` bytes stay reserved though free, the room left in a segment that a
    live tensor still holds (Adam's state placed in an earlier step's activation segment), and the next micro-batch's
    activations reuse that room before the device gives more."""

    def __init__(self, hole: int) -> None:
        self.hole = hole
        super().__init__()

    def empty_cache(self) -> None:
        super().empty_cache()
        self._cache.append(self.hole)


def test_the_base_is_what_live_tensors_hold_not_the_reserved_room_the_next_step_fills(tmp_path: Path) -> None:
    # 8 samples (0.8 GiB) fit in the 1.5 GiB hole: the reserved peak does not rise above the reserved base. Anchored at
    # the reserved base the slope is ~0 and the size jumps to 512 (51 GiB, an OOM); at the allocated base (1 GiB) the
    # slope is 1.5 GiB / 8 samples, an over-estimate of 0.1 GiB, and the size it allows fits.
    memory = Fragmented(hole=3 * GiB // 2)
    dyn = lt.DynamicBatchSize(TARGET, adjust_every=1, keep="none", max_batch_size=512, probe=memory)
    sizes = Sizes(dyn)
    fit(Net(batch_size=8, n=1024), [dyn, sizes], tmp_path, max_steps=4)
    assert dyn.oom_recoveries == 0, sizes.steps
    assert memory.run_peak <= TARGET * memory.capacity_bytes()
    assert 8 < sizes.steps[-1][0] <= 80, sizes.steps
