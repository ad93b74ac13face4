"""What :class:`~lightning_tune.DynamicBatchSize` decides, without a Trainer: :class:`DynamicStep`.

The sizes and what ``keep`` makes of them, the memory budget, a step's cut into weighted micro-batches (run by a
:class:`~lightning_tune.batch.MicroBatchRunner` on the caller's forward and backward), the size policy, the
interval's figures, the decisions and the compile-shape policy.
"""

from __future__ import annotations

import functools
import itertools
import logging
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, get_args

import torch

from lightning_tune import keys
from lightning_tune._validation import check_bool, check_callable, check_choice, check_float, check_int, check_strings
from lightning_tune.batch.control import BatchSizeController, Decision
from lightning_tune.batch.memory import MemoryModel
from lightning_tune.batch.probes import MemoryProbe
from lightning_tune.batch.runner import MicroBatch, MicroBatchRunner, StepOutcome, cut_step
from lightning_tune.batch.tokens import TokenBudget
from lightning_tune.batch.trim import PaddingLayout, causal_lm_shift, cut_sequences, padding_layout, sample_tokens
from lightning_tune.lr.scaling import SCALE_RULES, ScaleRule, scale_lr
from lightning_tune.perf.batch import count_samples
from lightning_tune.perf.ran import StepRun
from lightning_tune.plan.estimate import MemoryEstimate

__all__ = ["KEEPS", "LOSS_WEIGHTS", "DynamicStep", "IntervalFigures", "Keep", "LossWeight", "SizePolicy"]

Keep = Literal["effective", "lr", "none"]
#: What ``keep`` accepts.
KEEPS: tuple[str, ...] = get_args(Keep)
LossWeight = Literal["samples", "tokens"]
#: What ``loss_weight`` accepts.
LOSS_WEIGHTS: tuple[str, ...] = get_args(LossWeight)
_GIB = 1 << 30
_LOG = logging.getLogger(__name__)


class SizePolicy(Protocol):
    """How the micro-batch size moves, in its unit: :class:`BatchSizeController` (samples), :class:`TokenBudget`.

    ``effective`` is the configured effective batch, ``cap`` the same when it is held (else ``None``), ``ran`` the
    largest micro-batch the interval ran in samples; ``memory`` is the controller's (``total_bytes``, ...).
    """

    unit: str

    def next_size(self, size: int, *, effective: int, cap: int | None, ran: int, **memory: Any) -> Decision:
        """The decision after an interval run at ``size``."""

    def smaller(self, failed: int, *, effective: int, cap: int | None, **memory: Any) -> int:
        """A smaller size after ``failed`` ran out of memory."""

    def samples_at(self, size: int, length: int, n: int) -> int:
        """Samples of padded length ``length`` (of a step of ``n``) in a micro-batch of ``size``."""


@dataclass(frozen=True)
class IntervalFigures:
    """A decision interval's memory figures; agreed over ranks, the worst rank's (see :meth:`to_list`)."""

    peak_bytes: float  # validation's included
    pressure: bool  # whether the allocator retried allocations
    budget_bytes: float  # the peak allowed (over ranks, the smallest)
    largest_tokens: int  # the largest micro-batch run, in padded tokens
    base_bytes: float  # what live tensors held at the interval's start (over ranks, the smallest)

    def to_list(self) -> list[float]:
        """The floats the ranks all-reduce with max: the figures whose smallest counts travel negated."""
        return [self.peak_bytes, float(self.pressure), -self.budget_bytes, float(self.largest_tokens), -self.base_bytes]

    @classmethod
    def from_list(cls, values: Sequence[float]) -> IntervalFigures:
        """The figures from :meth:`to_list`'s floats (their maximum over ranks)."""
        peak, pressure, budget, largest, base = values
        return cls(peak, pressure > 0, -budget, int(largest), -base)


class DynamicStep:
    """The step policy of :class:`~lightning_tune.DynamicBatchSize`: sizes, cut, weights and decisions.

    It takes the callback's arguments (documented there), and:

    Args:
        warn: Gives a warning's text to the user (``rank_zero_warn`` under a Trainer).
        info: Gives a note's text to the user.
    """

    def __init__(
        self,
        target_vram: float = 0.9,
        *,
        min_batch_size: int = 1,
        max_batch_size: int | None = None,
        adjust_every: int = 100,
        keep: Keep = "effective",
        lr_rule: ScaleRule = "sqrt",
        multiple_of: int = 8,
        probe: MemoryProbe | None = None,
        prior: MemoryEstimate | None = None,
        min_change: float = 0.1,
        sync_oom: bool = True,
        reserve_gib: float = 0.0,
        agree_timeout: float = 600.0,
        loss_weight: LossWeight = "samples",
        label_shift: int | None = None,
        trim_keys: Sequence[str] = (),
        pad_to_multiple_of: int = 8,
        warn: Callable[[str], Any] = warnings.warn,
        info: Callable[[str], Any] = _LOG.info,
    ) -> None:
        # min/max_batch_size, multiple_of and min_change are checked by the controller, pad_to_multiple_of by the tokens
        check_float("target_vram", target_vram, low=0.0, high=0.98, low_inclusive=False)
        check_int("adjust_every", adjust_every, minimum=1)
        check_bool("sync_oom", sync_oom)
        check_float("agree_timeout", agree_timeout, low=0.0, low_inclusive=False)
        check_choice("keep", keep, KEEPS)
        check_choice("lr_rule", lr_rule, SCALE_RULES)
        check_float("reserve_gib", reserve_gib, low=0.0)
        check_choice("loss_weight", loss_weight, LOSS_WEIGHTS)
        check_int("label_shift", label_shift, minimum=0, allow_none=True)
        if label_shift is not None and loss_weight != "tokens":
            raise ValueError(f"`label_shift` is read only with `loss_weight='tokens'`, got {loss_weight=!r}")
        check_strings("trim_keys", trim_keys, what="key names (strings)")
        check_callable("warn", warn)
        check_callable("info", info)
        if probe is not None and not isinstance(probe, MemoryProbe):
            raise TypeError(
                "`probe` must be a memory probe (CudaMemory, SimulatedMemory or an object with total_bytes, "
                f"capacity_bytes, reset_peak, peak_bytes, pressure, before_micro_batch, free and empty_cache), got "
                f"{type(probe).__name__}"
            )
        if prior is not None and not isinstance(prior, MemoryEstimate):
            raise TypeError(f"`prior` must be a MemoryEstimate (estimate_memory, measure_memory) or None, got {prior}")
        fixed, per_sample = (None, None) if prior is None else (prior.fixed_bytes, prior.bytes_per_sample)
        self.target_vram, self.min_batch_size, self.max_batch_size = target_vram, min_batch_size, max_batch_size
        self.keep, self.lr_rule, self.multiple_of, self.reserve_gib = keep, lr_rule, multiple_of, reserve_gib
        self.adjust_every, self.sync_oom, self.agree_timeout = adjust_every, sync_oom, agree_timeout
        self.probe: MemoryProbe | None = probe
        self.loss_weight, self.label_shift, self.pad_to_multiple_of = loss_weight, label_shift, pad_to_multiple_of
        self.trim_keys, self.warn, self.info = tuple(trim_keys), warn, info
        self.controller = BatchSizeController(
            target=target_vram,
            min_batch_size=min_batch_size,
            max_batch_size=max_batch_size,
            multiple_of=multiple_of,
            min_change=min_change,
            model=MemoryModel(prior_fixed_bytes=fixed, prior_bytes_per_sample=per_sample),
        )
        self.tokens = TokenBudget(self.controller, pad_to_multiple_of=pad_to_multiple_of)
        #: Micro-batch size in use, in samples (``None`` before the first DataLoader is installed).
        self.batch_size: int | None = None
        self.user_batch_size, self.user_accumulation = 0, 1  # the DataLoader's batch, the Trainer's accumulation
        self.oom_recoveries = self.decisions = 0  # out-of-memory errors recovered from, decisions taken
        self.last_decision: Decision | None = None
        self.steps = 0  # optimizer steps in the current decision interval
        self.consumed = self.batches_done = 0  # samples and steps of the running epoch trained on
        self.agreed: IntervalFigures | None = None  # the interval's figures, agreed in the last step's collective
        self.validation: tuple[float, bool] = (0, False)  # training's peak and pressure before validation runs
        self.base = 0.0  # memory live tensors hold at the interval's start (the model's base_bytes)
        self.shift, self.compiled = 0, False  # label_shift as resolved, and whether the module runs compiled code
        self.lr_factor = 1.0  # with keep="lr", what the LR is multiplied by now
        self.recoverable = True  # whether an out-of-memory error can be recovered (not under DDP without agreement)
        self.step_tokens: tuple[int, int] | None = None  # real and padded tokens the last step ran (None: no mask)
        self.step_shapes: list[tuple[int, int]] | None = None  # its micro-batches' (samples, padded length), trimmed
        self.shapes: set[tuple[int, int]] = set()  # the distinct shapes run (each a compile under torch.compile)
        self.micro_batches = 0  # micro-batches the last step ran
        self._layout_warned = self._compile_warned = False

    # -- the keep arithmetic and the budget --------------------------------------------------------------------------
    @property
    def configured_effective(self) -> int:
        """The effective batch as configured: the DataLoader's batch size times the Trainer's accumulation."""
        return self.user_batch_size * self.user_accumulation

    def cap(self) -> int | None:
        """The largest micro-batch ``keep`` allows: the configured effective batch when it is held."""
        return self.configured_effective if self.keep == "effective" else None

    def window_size(self) -> int:
        """Samples per optimizer step: held at the configured effective batch, or the micro-batch's accumulation."""
        assert self.batch_size is not None
        return self.configured_effective if self.keep == "effective" else self.batch_size * self.user_accumulation

    @property
    def effective_batch_size(self) -> int | None:
        """Samples per optimizer step: held constant with ``keep="effective"``."""
        return None if self.batch_size is None else self.window_size()

    @property
    def micro_batch_tokens(self) -> int | None:
        """Padded tokens per micro-batch in use, when micro-batches are budgeted in tokens (else ``None``)."""
        return self.tokens.budget

    @property
    def token_controller(self) -> BatchSizeController | None:
        """The controller of :attr:`micro_batch_tokens` (``None`` while there is no budget)."""
        return None if self.tokens.budget is None else self.tokens.controller

    @property
    def accumulate_grad_batches(self) -> int | None:
        """Micro-batches per optimizer step."""
        if self.batch_size is None or self.effective_batch_size is None:
            return None
        if self.micro_batch_tokens is not None and self.micro_batches:
            return self.micro_batches  # micro-batches of the last step, as long as its samples were
        return -(-self.effective_batch_size // self.batch_size)

    @property
    def policy(self) -> SizePolicy:
        """The size policy in use: the token budget once there is one, else the controller in samples."""
        return self.tokens if self.tokens.budget is not None else self.controller

    def describe(self, size: int) -> str:
        """A micro-batch size with the policy's unit."""
        return f"{size} {self.policy.unit}"

    def budget(self) -> tuple[int, float]:
        """What PyTorch can get now, and the peak allowed: ``target_vram`` of it, ``reserve_gib`` kept free."""
        assert self.probe is not None
        capacity = self.probe.capacity_bytes()
        return capacity, max(1.0, min(self.target_vram * capacity, capacity - self.reserve_gib * _GIB))

    def lr_ratio(self, batch: Any) -> float:
        """With ``keep="lr"``, what the LR is multiplied by before the step of ``batch`` (1.0: unchanged).

        The LR follows the step's samples with ``lr_rule`` against the configured effective batch: :attr:`lr_factor`.
        """
        n = count_samples(batch) if self.keep == "lr" else None
        factor = self.lr_factor if n is None else scale_lr(1.0, self.configured_effective, n, rule=self.lr_rule)
        ratio, self.lr_factor = factor / self.lr_factor, factor
        return ratio

    # -- the run's start ---------------------------------------------------------------------------------------------
    def start(self, module: torch.nn.Module, accumulation: int) -> None:
        """Training of ``module`` starts with the Trainer's gradient ``accumulation``.

        Raises:
            ValueError: If ``reserve_gib`` is all the device has.
        """
        self.user_accumulation = accumulation
        self.lr_factor = 1.0  # from the configured LR (a checkpoint may say otherwise)
        self.shift = self.label_shift if self.label_shift is not None else causal_lm_shift(module)
        self.compiled = has_compiled(module)
        capacity = self.probe.capacity_bytes() if self.probe is not None else None
        if capacity is not None and self.reserve_gib * _GIB >= capacity:
            raise ValueError(
                f"`reserve_gib` must leave memory to train in: PyTorch can get {capacity / _GIB:.3g} GiB on this "
                f"device, got reserve_gib={self.reserve_gib!r}"
            )

    def install(self, loader_batch: int) -> None:
        """Take a DataLoader's batch size; the first time, choose the first micro-batch (from the prior if any)."""
        self.user_batch_size = loader_batch
        if self.batch_size is None:
            start, cap = loader_batch, self.cap()
            if self.controller.model.prior is not None and self.probe is not None:  # start from its prediction
                start = self.controller.round_down(self.controller.model.largest_batch(self.budget()[1]) or 1, cap)
            self.batch_size = max(self.min_batch_size, min(start, cap or start, self.max_batch_size or start))

    # -- a step ------------------------------------------------------------------------------------------------------
    def run(
        self,
        batch: Any,
        runner: MicroBatchRunner,
        *,
        epoch_samples: int | None = None,
        agree: Callable[[list[float]], Sequence[float]] | None = None,
        leave_last_backward: bool = False,
    ) -> StepOutcome:
        """Lay out one optimizer step's ``batch`` and run it through ``runner`` (forward and backward the caller's).

        ``epoch_samples``: the epoch's samples, when its short last batch may be in this step (after :attr:`consumed`);
        ``agree``: the maximum over ranks (of the padded length a token budget starts from; the step that ends an
        interval agrees :meth:`figures` in the runner's agreement); ``leave_last_backward``: as the runner's.
        """
        n = count_samples(batch)
        if n is None:
            raise TypeError(
                f"DynamicBatchSize cannot count the samples of a batch of type {type(batch).__name__}: it needs a "
                "tensor whose first dimension is the batch"
            )
        assert self.batch_size is not None
        self.step_tokens = self.step_shapes = None
        layout, size = self.layout(batch), self.batch_size
        tokens = sample_tokens(batch, self.shift) if self.loss_weight == "tokens" else None
        if layout is not None and self.keep == "effective":  # micro-batches become budgets of padded tokens
            size = self.tokens.start(layout.padded, size, agree=agree)
            runner.min_size, runner.min_samples = self.tokens.controller.min_batch_size, self.min_batch_size
        tail = 0
        if epoch_samples is not None and self.keep == "effective":
            tail = short_batch_in(n, epoch_samples, self.consumed, self.user_batch_size)
        cut = functools.partial(self.cut, n=n, layout=layout, tokens=tokens, tail=tail)
        deciding = runner.agree is not None and self.steps + 1 >= self.adjust_every
        payload_fn = (lambda: self.figures().to_list()) if deciding else None
        outcome = runner.run(
            batch, [0.0] * 4, cut, size, leave_last_backward=leave_last_backward, payload_fn=payload_fn
        )
        if deciding and not outcome.failures:  # after a failure the interval starts again
            self.agreed = IntervalFigures.from_list(outcome.payload)
        return outcome

    def cut(
        self, batch: Any, size: int, *, n: int, layout: PaddingLayout | None, tokens: Sequence[int] | None, tail: int
    ) -> list[MicroBatch]:
        """The step's micro-batches with their weights (see ``docs/dynamic_batch.md``, "Short last batch").

        ``size`` is in the policy's unit. With a ``layout`` the samples are grouped by length and each micro-batch is
        trimmed; with ``tokens`` (per sample) it weighs its share of them; the last ``tail`` samples are the
        DataLoader's short last batch, weighted as Lightning weighs it.
        """
        sample_weight, tail_weight = 1.0 / n, 0.0
        if self.keep == "effective":
            sample_weight, tail_weight = 1.0 / self.configured_effective, 1.0 / max(tail * self.user_accumulation, 1)
        weights: dict[str, Any] = {"sample_weight": sample_weight, "tail": tail, "tail_weight": tail_weight}
        policy = self.policy

        def fits(length: int | None) -> int:
            return policy.samples_at(size, length, n) if length else size

        if layout is None and tokens is None:
            pieces = cut_step(batch, size, **weights)
        else:
            pieces = cut_sequences(batch, n, layout, fits, **weights, tokens=tokens, multiple=self.pad_to_multiple_of)
        if layout is not None:
            self._shapes(pieces, layout)
        self.micro_batches = len(pieces)
        return pieces

    def layout(self, batch: Any) -> PaddingLayout | None:
        """The step's padding layout; an unknown sequence key is warned about once."""
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            layout = padding_layout(batch, self.trim_keys)
        if caught and not self._layout_warned:
            self._layout_warned = True
            self.warn(f"DynamicBatchSize: {caught[0].message}")
        return layout

    def _shapes(self, pieces: list[MicroBatch], layout: PaddingLayout) -> None:
        """Record the trimmed micro-batches' shapes and tokens; under ``torch.compile``, mark them dynamic."""
        run = [(p.samples, p.seq_len or layout.padded) for p in pieces]
        self.step_shapes, self.step_tokens = run, (sum(layout.lengths), sum(b * length for b, length in run))
        self.shapes.update(run)
        if self.compiled:  # one graph for every shape instead of one per shape (and a fall back to eager)
            for piece, key, dim in itertools.product(pieces, layout.keys, (0, 1)):
                torch._dynamo.maybe_mark_dynamic(piece.batch[key], dim)
        if self.tokens.budget is not None:
            self.batch_size = max(b for b, _ in run)
        if not self.compiled or self._compile_warned:
            return
        config = torch._dynamo.config  # warn once when nearly as many shapes ran as Dynamo compiles before giving up
        limit = int(getattr(config, "recompile_limit", 0) or getattr(config, "cache_size_limit", 8))
        if config.automatic_dynamic_shapes or len(self.shapes) < max(limit - 2, 1):
            return
        self._compile_warned = True
        self.warn(
            f"DynamicBatchSize: the compiled model has run {len(self.shapes)} micro-batch shapes (samples x padded "
            f"length) and torch._dynamo's recompile limit is {limit}; past it the model runs eagerly. Turn on "
            "torch._dynamo.config.automatic_dynamic_shapes, raise `pad_to_multiple_of` (fewer lengths) or raise "
            "torch._dynamo.config.recompile_limit"
        )

    def before_micro_batch(self, piece: MicroBatch) -> None:
        """Note a micro-batch about to run (its tokens; the probe's simulated allocation)."""
        self.tokens.largest = max(self.tokens.largest, piece.samples * (piece.seq_len or 1))
        if self.probe is not None:
            self.probe.before_micro_batch(piece.samples, piece.seq_len)

    def step_run(self) -> StepRun:
        """The micro-batches the last step ran, as the monitor reads them."""
        shapes = None if self.step_shapes is None else tuple(self.step_shapes)
        return StepRun(self.micro_batches, shapes, self.step_tokens)

    # -- decisions ---------------------------------------------------------------------------------------------------
    def step_done(
        self, batch: Any, runner: MicroBatchRunner, *, agree: Callable[[list[float]], Sequence[float]]
    ) -> bool:
        """The step of ``batch`` ended; every ``adjust_every`` :meth:`decide`. Whether the micro-batch changed.

        The figures are the worst rank's: agreed in the step's own collective, or by ``agree`` when none ran.
        """
        self.consumed, self.batches_done = self.consumed + (count_samples(batch) or 0), self.batches_done + 1
        self.steps += 1
        if self.steps < self.adjust_every or self.probe is None:
            return False
        figures = self.agreed or IntervalFigures.from_list(agree(self.figures().to_list()))
        resized = self.decide(figures, runner.largest_run)
        runner.largest_run = 0
        return resized

    def figures(self) -> IntervalFigures:
        """This rank's figures of the interval so far."""
        assert self.probe is not None
        peak, pressure = self.validation
        peak, pressure = max(self.probe.peak_bytes(), peak), self.probe.pressure() or pressure
        return IntervalFigures(float(peak), bool(pressure), self.budget()[1], self.tokens.largest, self.base)

    def decide(self, figures: IntervalFigures, ran: int) -> bool:
        """Decide on the interval's ``figures`` (``ran``: its largest micro-batch in samples) and start the next.

        Returns:
            Whether the micro-batch in samples changed (with ``keep`` other than ``"effective"``, the step's too).
        """
        assert self.probe is not None and self.batch_size is not None
        self.agreed, self.validation, self.steps = None, (0, False), 0
        self.tokens.largest = figures.largest_tokens  # the ranks' largest micro-batch in tokens: one decision on all
        policy, size = self.policy, self.tokens.budget or self.batch_size  # in the policy's unit
        memory = {k: v for k, v in vars(figures).items() if k != "largest_tokens"}  # peak, pressure, budget, base
        effective, cap, total = self.configured_effective, self.cap(), self.probe.capacity_bytes()
        decision = policy.next_size(size, effective=effective, cap=cap, ran=ran, total_bytes=total, **memory)
        self.last_decision, self.decisions = decision, self.decisions + 1
        if decision.batch_size != size:
            self.info(
                f"DynamicBatchSize: micro-batch {self.describe(size)} -> {self.describe(decision.batch_size)} "
                f"({decision.reason})"
            )
        if policy is self.controller:
            self.batch_size = decision.batch_size
        self.new_interval()
        return policy is self.controller and decision.batch_size != size

    def new_interval(self) -> None:
        """Empty the cache and start an interval; what stays reserved is its base (weights, optimizer state).

        Emptied, the cache no longer holds an earlier, larger need: the next peak of reserved memory is the interval's.
        """
        assert self.probe is not None
        self.probe.empty_cache()
        self.probe.reset_peak()
        # the base is what live tensors hold, not what stays reserved: a segment a live tensor holds keeps its free
        # room reserved, the next step's activations fill that room first, and a reserved base would under-state the
        # slope (to nothing when they fit in it) and so over-state the size that fits
        allocated = getattr(self.probe, "allocated_bytes", None)
        self.base = float(allocated() if callable(allocated) else self.probe.peak_bytes())

    def shrink(self, failed: int) -> int:
        """A smaller micro-batch after ``failed`` ran out of memory; the interval starts again.

        Raises:
            torch.OutOfMemoryError: Without a memory probe to choose from.
        """
        if self.probe is None:
            raise torch.OutOfMemoryError(
                f"DynamicBatchSize: out of memory at a micro-batch of {self.describe(failed)}, with no memory probe "
                "to choose a smaller one from; lower the DataLoader's batch size or give DynamicBatchSize a probe"
            )
        if not self.recoverable:
            raise torch.OutOfMemoryError(
                f"DynamicBatchSize: out of memory at a micro-batch of {self.describe(failed)}; without `sync_oom` an "
                "out-of-memory error cannot be recovered under several processes"
            )
        capacity, budget = self.budget()
        self.tokens.largest = 0
        policy = self.policy
        effective, cap = self.configured_effective, self.cap()
        smaller = policy.smaller(failed, effective=effective, cap=cap, total_bytes=capacity, budget_bytes=budget)
        if policy is self.controller:
            self.batch_size = smaller
        self.last_decision = Decision(smaller, None, "oom")
        self.probe.reset_peak()
        self.steps, self.agreed, self.validation = 0, None, (0, False)
        return smaller

    def on_failure(self, old: int, new: int, message: str) -> None:
        """Count and report an out-of-memory error recovered from (the runner's ``on_failure``)."""
        self.oom_recoveries += 1
        self.warn(
            f"DynamicBatchSize: out of memory at a micro-batch of {self.describe(old)} ({message}); recovered: "
            f"running the same step again at {self.describe(new)}"
        )
        self.info(f"DynamicBatchSize: micro-batch {self.describe(old)} -> {self.describe(new)} (oom)")

    def validation_starts(self) -> None:
        """Validation runs inside the interval: keep training's peak and pressure so far."""
        assert self.probe is not None
        peak, pressure = self.validation
        self.validation = (max(peak, self.probe.peak_bytes()), pressure or self.probe.pressure())

    def validation_ends(self) -> None:
        """Validation's memory is not training's: free it and start the peak again."""
        assert self.probe is not None
        self.probe.free()
        self.probe.reset_peak()
        self.tokens.largest = 0

    def metrics(self) -> dict[str, float]:
        """The decision keys, logged every ``log_every_n_steps`` optimizer steps."""
        metrics = {
            keys.BATCH_SIZE: float(self.batch_size or 0),
            keys.ACCUMULATE_GRAD_BATCHES: float(self.accumulate_grad_batches or 0),
            keys.EFFECTIVE_BATCH_SIZE: float(self.effective_batch_size or 0),
            keys.OOM_RECOVERIES: float(self.oom_recoveries),
        }
        if self.micro_batch_tokens is not None:
            metrics[keys.MICRO_BATCH_TOKENS] = float(self.micro_batch_tokens)
        if self.last_decision is not None and self.last_decision.predicted_fraction is not None:
            metrics[keys.PREDICTED_VRAM_FRAC] = self.last_decision.predicted_fraction
        return metrics

    def summary(self) -> str:
        """Where the run settled, for the end of training."""
        return (
            f"DynamicBatchSize: settled at micro-batch {self.batch_size} samples ({self.accumulate_grad_batches} "
            f"per optimizer step of {self.effective_batch_size} samples"
            + ("" if self.micro_batch_tokens is None else f", {self.micro_batch_tokens} padded tokens at most")
            + f"); {self.decisions} decision{'s' * (self.decisions != 1)}, "
            f"{self.oom_recoveries} out-of-memory error{'s' * (self.oom_recoveries != 1)} recovered"
        )

    # -- checkpoints -------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The sizes, counters and controllers (``DynamicBatchSize``'s checkpoint keys of them)."""
        return {
            "batch_size": self.batch_size,
            "user_batch_size": self.user_batch_size,
            "user_accumulation": self.user_accumulation,
            "lr_factor": self.lr_factor,
            "oom_recoveries": self.oom_recoveries,
            "decisions": self.decisions,
            "steps": self.steps,
            "consumed": self.consumed,
            "batches_done": self.batches_done,
            "controller": self.controller.state_dict(),
            **self.tokens.state_dict(),  # micro_batch_tokens, longest, token_controller
            "arguments": self.arguments(),
        }

    def arguments(self) -> dict[str, Any]:
        """The arguments a checkpoint records, so that a run resumed with other values can say which it uses."""
        names = (
            "target_vram min_batch_size max_batch_size adjust_every keep lr_rule multiple_of reserve_gib loss_weight"
        )
        values = {name: getattr(self, name) for name in (*names.split(), "label_shift", "pad_to_multiple_of")}
        return values | {"min_change": self.controller.min_change, "trim_keys": list(self.trim_keys)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s keys; this run's configuration, limits and arguments win, with a warning."""
        saved = state["user_batch_size"], state["user_accumulation"]
        now = self.user_batch_size, self.user_accumulation
        if saved != now:
            self.warn(
                f"DynamicBatchSize: the checkpoint was trained with DataLoader batch {saved[0]} x "
                f"accumulate_grad_batches {saved[1]}; this run configures {now[0]} x {now[1]}, which is used from "
                "here on"
            )
        limits = [x for x in (state["batch_size"], self.cap(), self.max_batch_size) if x is not None]
        self.batch_size = max(self.min_batch_size, min(limits))
        before = state.get("arguments", {})
        changed = [f"{k} {before[k]!r} -> {v!r}" for k, v in self.arguments().items() if k in before and before[k] != v]
        if changed:
            moved = f"; micro-batch {state['batch_size']} -> {self.batch_size}"
            self.warn(
                "DynamicBatchSize: resumed with other arguments than the checkpoint's, which are used from here on: "
                + ", ".join(changed)
                + (moved if self.batch_size != state["batch_size"] else "")
            )
        self.lr_factor = state["lr_factor"] if self.keep == "lr" else 1.0  # (the caller undoes another keep's scaling)
        self.steps, self.oom_recoveries = state["steps"], state["oom_recoveries"]
        self.decisions = state.get("decisions", 0)
        self.controller.load_state_dict(state["controller"])
        self.tokens.load_state_dict(state)


def short_batch_in(n: int, epoch_samples: int, consumed: int, loader_batch: int) -> int:
    """Samples of the DataLoader's short last batch of the epoch inside a step of ``n`` after ``consumed`` (0 if none).

    Example:
        >>> short_batch_in(10, 50, 40, 8), short_batch_in(10, 50, 30, 8)  # 50 = 6 x 8 + 2
        (2, 0)
    """
    short = epoch_samples % loader_batch
    return short if short and consumed + n == epoch_samples and n >= short else 0


def has_compiled(module: torch.nn.Module) -> bool:
    """Whether ``module`` runs compiled code: a ``torch.compile``d submodule or a TorchCompile-compiled forward."""
    from lightning_tune.swaps.compile import is_compiled

    return any(isinstance(m, torch._dynamo.eval_frame.OptimizedModule) or is_compiled(m) for m in module.modules())
