"""What :class:`~lightning_tune.DynamicBatchSize` decides, without a Trainer: :class:`DynamicStep`.

Sizes, budget, a step's cut into weighted micro-batches (run by a :class:`~lightning_tune.batch.runner.MicroBatchRunner`
on the caller's forward and backward), decisions and compile shapes, told one :class:`DynamicBatchSettings`.
"""

from __future__ import annotations

import functools
import itertools
import logging
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import KW_ONLY, dataclass
from typing import Any, Literal, Protocol, get_args

import torch

from lightning_tune import keys
from lightning_tune._validation import (
    changed_arguments,
    check_bool,
    check_callable,
    check_choice,
    check_float,
    check_instance,
    check_int,
    check_strings,
)
from lightning_tune.batch.control import BatchSizeController, Decision
from lightning_tune.batch.evaluate import EvalSizer, live_bytes
from lightning_tune.batch.memory import MemoryModel
from lightning_tune.batch.pack import check_packed, cut_packed, ignore_first_labels, no_cache, unpacked
from lightning_tune.batch.probes import MemoryProbe
from lightning_tune.batch.runner import MicroBatch, MicroBatchRunner, StepOutcome, count_step, cut_step
from lightning_tune.batch.tokens import TokenBudget
from lightning_tune.batch.trim import (
    PaddingLayout,
    causal_lm_shift,
    cut_sequences,
    hf_models,
    padding_layout,
    sample_tokens,
)
from lightning_tune.lr.scaling import SCALE_RULES, ScaleRule, scale_lr
from lightning_tune.perf.batch import BatchLayout
from lightning_tune.perf.step_run import StepRun
from lightning_tune.plan.estimate import MemoryEstimate

Keep = Literal["effective", "lr", "none"]
#: What ``keep`` accepts.
KEEPS: tuple[str, ...] = get_args(Keep)
LossWeight = Literal["auto", "samples", "tokens"]
#: What ``loss_weight`` accepts.
LOSS_WEIGHTS: tuple[str, ...] = get_args(LossWeight)
#: What a step's micro-batch losses are weighted by (``"auto"`` resolved).
Weighting = Literal["samples", "tokens"]
#: The settings a checkpoint records (with ``trim_keys`` and ``per_batch``), in the order a resumed run names them.
_RECORDED = (
    "target_vram min_batch_size max_batch_size adjust_every keep lr_rule multiple_of reserve_gib loss_weight "
    "label_shift pad_to_multiple_of pack size_eval min_change"
)
#: The sizes and counters a checkpoint holds, besides the controllers.
_SAVED = "batch_size user_batch_size user_accumulation lr_factor oom_recoveries decisions steps consumed batches_done"
_GIB = 1 << 30
_LOG = logging.getLogger(__name__)


class SizePolicy(Protocol):
    """How the micro-batch size moves, in its unit: :class:`BatchSizeController` (samples), :class:`TokenBudget`.

    ``cap``: the effective batch when it is held; ``ran``: the interval's largest micro-batch in samples.
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


@dataclass(frozen=True)
class DynamicBatchSettings:
    """What :class:`~lightning_tune.DynamicBatchSize` is told, checked once: its arguments but ``probe`` (see there).

    Raises:
        TypeError: If an argument has the wrong type.
        ValueError: If an argument is out of range, or arguments conflict as ``DynamicBatchSize`` lists.

    Example:
        >>> DynamicBatchSettings(0.8, keep="lr").keep
        'lr'
    """

    target_vram: float = 0.9
    _: KW_ONLY
    min_batch_size: int = 1
    max_batch_size: int | None = None
    adjust_every: int = 100
    keep: Keep = "effective"
    lr_rule: ScaleRule = "sqrt"
    multiple_of: int = 8
    prior: MemoryEstimate | None = None
    min_change: float = 0.1
    sync_oom: bool = True
    reserve_gib: float = 0.0
    agree_timeout: float = 600.0
    loss_weight: LossWeight = "auto"
    label_shift: int | None = None
    trim_keys: Sequence[str] = ()
    pad_to_multiple_of: int = 8
    per_batch: Sequence[str] = ()
    split_batch: Callable[[Any, list[int]], Sequence[Any]] | None = None
    pack: bool = False
    pack_guard: bool = True
    size_eval: bool = True

    def __post_init__(self) -> None:
        check_float("target_vram", self.target_vram, low=0.0, high=0.98, low_inclusive=False)
        check_int("adjust_every", self.adjust_every, minimum=1)
        for name in ("sync_oom", "pack", "pack_guard", "size_eval"):
            check_bool(name, getattr(self, name))
        check_float("agree_timeout", self.agree_timeout, low=0.0, low_inclusive=False)
        check_choice("keep", self.keep, KEEPS)
        check_choice("lr_rule", self.lr_rule, SCALE_RULES)
        check_float("reserve_gib", self.reserve_gib, low=0.0)
        check_choice("loss_weight", self.loss_weight, LOSS_WEIGHTS)
        check_int("label_shift", self.label_shift, minimum=0, allow_none=True)
        if self.label_shift is not None and self.loss_weight == "samples":
            raise ValueError(
                f"`label_shift` is read only when losses are weighted by tokens (`loss_weight` 'tokens' or 'auto'), "
                f"got loss_weight={self.loss_weight!r}"
            )
        check_strings("trim_keys", self.trim_keys, what="key names (strings)")
        check_callable("split_batch", self.split_batch, allow_none=True)
        if self.pack and self.keep != "effective":
            raise ValueError(
                "`pack=True` packs the samples of an optimizer step held at its effective batch: `keep` must be "
                f"'effective', got {self.keep!r}"
            )
        if self.pack and self.loss_weight == "samples":
            raise ValueError(
                "`pack=True` weighs each packed row by its label tokens (its loss is a mean over them): `loss_weight` "
                f"must be 'tokens' or 'auto', got {self.loss_weight!r}"
            )
        if self.pack and self.split_batch is not None:
            raise ValueError("`pack=True` packs the samples itself: `split_batch` must be None, got a callable")
        what = "a MemoryEstimate (estimate_memory, measure_memory)"
        check_instance("prior", self.prior, MemoryEstimate, what, allow_none=True)
        check_int("pad_to_multiple_of", self.pad_to_multiple_of, minimum=1)
        self.new_controller()  # the controller checks the sizes and `min_change`
        check_strings("per_batch", self.per_batch, what="mapping keys or places in the batch (strings)")
        object.__setattr__(self, "trim_keys", tuple(self.trim_keys))
        object.__setattr__(self, "per_batch", tuple(self.per_batch))

    def new_controller(self, *, training: bool = True) -> BatchSizeController:
        """A controller of these sizes: training's, from the prior if any; an evaluation loop's, bounded by memory."""
        prior = self.prior if training else None
        return BatchSizeController(
            target=self.target_vram,
            min_batch_size=self.min_batch_size,
            max_batch_size=self.max_batch_size if training else None,
            multiple_of=self.multiple_of,
            min_change=self.min_change,
            model=MemoryModel(
                prior_fixed_bytes=None if prior is None else prior.fixed_bytes,
                prior_bytes_per_sample=None if prior is None else prior.bytes_per_sample,
            ),
        )


class DynamicStep:
    """The step policy of :class:`~lightning_tune.DynamicBatchSize`: sizes, cut, weights and decisions.

    Args:
        settings: What it is told (the callback's arguments but ``probe``).
        probe: Where memory is read (``None``: nothing is resized, as the callback without one).
        warn: Gives a warning's text to the user (``rank_zero_warn`` under a Trainer).
        info: Gives a note's text to the user.

    Raises:
        TypeError: If an argument has the wrong type.
    """

    def __init__(
        self,
        settings: DynamicBatchSettings,
        *,
        probe: MemoryProbe | None = None,
        warn: Callable[[str], Any] = warnings.warn,
        info: Callable[[str], Any] = _LOG.info,
    ) -> None:
        check_instance("settings", settings, DynamicBatchSettings, "a DynamicBatchSettings")
        check_callable("warn", warn)
        check_callable("info", info)
        if probe is not None and not isinstance(probe, MemoryProbe):
            raise TypeError(
                "`probe` must be a memory probe (CudaMemory, SimulatedMemory or an object with total_bytes, "
                f"capacity_bytes, reset_peak, peak_bytes, pressure, before_micro_batch, free and empty_cache), got "
                f"{type(probe).__name__}"
            )
        self.settings = settings
        self.probe: MemoryProbe | None = probe
        self.warn = warn
        self.info = info
        self.evaluation: dict[str, EvalSizer] = {}  # by loop: "fit", "validate", "test", "predict"
        self.guard_due = False  # whether the fit's next packed micro-batch is checked against its padded samples
        self.guard_batch: Any = None  # those samples, padded, while the check is due
        self.hf_models: list[torch.nn.Module] = []  # the module's Hugging Face models (use_cache off when packed)
        self.batch_layout = BatchLayout(settings.per_batch)  # how a step is counted and cut
        self.drawn = 0  # samples the sampler drew for the last step (its collated batch may hold fewer)
        self.controller = settings.new_controller()
        self.tokens = TokenBudget(self.controller, pad_to_multiple_of=settings.pad_to_multiple_of)
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
        self.base_due = False  # whether the interval's first micro-batch reads the base again (new_interval)
        self.shift, self.compiled = 0, False  # label_shift as resolved, and whether the module runs compiled code
        self.causal_lm = False  # whether the module holds a Hugging Face causal LM
        self.weighting: Weighting | None = None  # the losses' weighting: `loss_weight`, or what "auto" chose
        self.weighting_reason = ""
        self._given_weighting()
        self.lr_factor = 1.0  # with keep="lr", what the LR is multiplied by now
        self.recoverable = True  # whether an out-of-memory error can be recovered (not under DDP without agreement)
        self.step_tokens: tuple[int, int] | None = None  # real and padded tokens the last step ran (None: no mask)
        self.step_shapes: list[tuple[int, int]] | None = None  # its micro-batches' (samples, padded length), trimmed
        self.shapes: set[tuple[int, int]] = set()  # the distinct shapes run (each a compile under torch.compile)
        self.micro_batches = 0  # micro-batches the last step ran
        self.sequences: list[tuple[int, int]] = []  # packed: each sequence the last step ran, (1, its length)
        self.model_name, self.precise = "the model", True  # what the packing guard names, and its tolerance's
        self.module: torch.nn.Module | None = None  # packed: the module the guard runs in eval mode
        self._layout_warned = self._compile_warned = False

    # -- the keep arithmetic and the budget --------------------------------------------------------------------------
    @property
    def configured_effective(self) -> int:
        """The effective batch as configured: the DataLoader's batch size times the Trainer's accumulation."""
        return self.user_batch_size * self.user_accumulation

    def cap(self) -> int | None:
        """The largest micro-batch ``keep`` allows: the configured effective batch when it is held."""
        return self.configured_effective if self.settings.keep == "effective" else None

    def window_size(self) -> int:
        """Samples per optimizer step: held at the configured effective batch, or the micro-batch's accumulation."""
        assert self.batch_size is not None
        held = self.cap()
        return self.batch_size * self.user_accumulation if held is None else held

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
        if self.batch_size is None:
            return None
        if self.micro_batch_tokens is not None and self.micro_batches:
            return self.micro_batches  # micro-batches of the last step, as long as its samples were
        return -(-self.window_size() // self.batch_size)

    @property
    def policy(self) -> SizePolicy:
        """The size policy in use: the token budget once there is one, else the controller in samples."""
        return self.tokens if self.tokens.budget is not None else self.controller

    def describe(self, size: int) -> str:
        """A micro-batch size with the policy's unit."""
        return f"{size} {'tokens' if self.settings.pack and self.policy is self.tokens else self.policy.unit}"

    def budget(self) -> tuple[int, float]:
        """What PyTorch can get now, and the peak allowed: ``target_vram`` of it, ``reserve_gib`` kept free."""
        assert self.probe is not None
        capacity = self.probe.capacity_bytes()
        allowed = min(self.settings.target_vram * capacity, capacity - self.settings.reserve_gib * _GIB)
        return capacity, max(1.0, allowed)

    def lr_ratio(self, batch: Any) -> float:
        """With ``keep="lr"``, what the LR is multiplied by before the step of ``batch`` (1.0: unchanged)."""
        s = self.settings
        n = self.batch_layout.samples(batch, check=False) if s.keep == "lr" and batch is not None else None
        factor = self.lr_factor if not n else scale_lr(1.0, self.configured_effective, n, rule=s.lr_rule)
        ratio, self.lr_factor = factor / self.lr_factor, factor
        return ratio

    # -- the run's start ---------------------------------------------------------------------------------------------
    def start(self, module: torch.nn.Module, accumulation: int) -> None:
        """Training of ``module`` starts with the Trainer's gradient ``accumulation``.

        Raises:
            ValueError: If ``reserve_gib`` is all the device has.
        """
        s = self.settings
        self.user_accumulation = accumulation
        self.lr_factor = 1.0  # from the configured LR (a checkpoint may say otherwise)
        causal = causal_lm_shift(module)
        self.shift = s.label_shift if s.label_shift is not None else causal
        self.causal_lm = bool(causal)
        # "auto" chooses again at this fit's first step (or takes a checkpoint's choice)
        self._given_weighting()
        if s.pack:
            self.hf_models, self.guard_due, self.module = hf_models(module), s.pack_guard, module
            named = self.hf_models[0] if self.hf_models else module
            implementation = getattr(getattr(named, "config", None), "_attn_implementation", None)
            self.model_name = f"{type(named).__name__} (config._attn_implementation={implementation!r})"
            dtype = next((p.dtype for p in module.parameters() if p.is_floating_point()), torch.float32)
            highest = torch.get_float32_matmul_precision() == "highest"  # TF32 matmuls differ by more
            self.precise = dtype in (torch.float32, torch.float64) and highest
        self.compiled = has_compiled(module)
        self.batch_layout = BatchLayout(s.per_batch)  # read again from this fit's batches
        capacity = self.probe.capacity_bytes() if self.probe is not None else None
        if capacity is not None and s.reserve_gib * _GIB >= capacity:
            raise ValueError(
                f"`reserve_gib` must leave memory to train in: PyTorch can get {capacity / _GIB:.3g} GiB on this "
                f"device, got reserve_gib={s.reserve_gib!r}"
            )

    def install(self, loader_batch: int) -> None:
        """Take a DataLoader's batch size; the first time, choose the first micro-batch (from the prior if any)."""
        self.user_batch_size = loader_batch
        if self.batch_size is None:
            start, cap, largest = loader_batch, self.cap(), self.settings.max_batch_size
            if self.controller.model.prior is not None and self.probe is not None:  # start from its prediction
                start = self.controller.round_down(self.controller.model.largest_batch(self.budget()[1]) or 1, cap)
            self.batch_size = max(self.settings.min_batch_size, min(start, cap or start, largest or start))

    # -- a step ------------------------------------------------------------------------------------------------------
    def run(
        self,
        batch: Any,
        runner: MicroBatchRunner,
        *,
        epoch_samples: int | None = None,
        agree: Callable[[list[float]], Sequence[float]] | None = None,
        leave_last_backward: bool = False,
        drawn: int | None = None,
    ) -> StepOutcome:
        """Lay out one optimizer step's ``batch`` and run it through ``runner`` (forward and backward the caller's).

        ``epoch_samples``: the epoch's samples, when its short last batch may be in this step; ``agree``: the maximum
        over ranks (of the first token budget's padded length); ``drawn``: the samples the sampler drew for the step
        (``None``: as many as the collated batch holds).

        Raises:
            TypeError: If a batch has nothing per-sample to count, or a value the rule cannot cut (no ``split_batch``).
            ValueError: If its per-sample values disagree on the count (see ``docs/dynamic_batch.md``).
        """
        s = self.settings
        n = count_step(batch, self.batch_layout, s.split_batch)  # 0 for a collate that returned None
        self.drawn = n if drawn is None else drawn
        assert self.batch_size is not None
        self.step_tokens = self.step_shapes = None
        reorders = n > 0 and s.split_batch is None  # an empty step runs whole; a user's cut is never reordered
        layout, size = self.layout(batch) if reorders else None, self.batch_size
        if s.pack and n:  # each sample's first label is -100 packed: so it is in the padded step
            batch = ignore_first_labels(batch, layout)
        tokens = sample_tokens(batch, self.shift) if self.weigh_by(batch) == "tokens" and n else None
        if layout is not None and s.keep == "effective":  # micro-batches become budgets of padded tokens
            first, size = self.tokens.budget is None, self.tokens.start(layout.padded, size, agree=agree)
            if first:
                each = f"one row of at most {size} tokens" if s.pack else f"a budget of {size} padded tokens"
                held = "holding as many samples of its own length as fit"
                held = "its samples' real tokens only, with their boundaries" if s.pack else held
                self.info(
                    f"DynamicBatchSize: {'packed rows' if s.pack else 'padded batches'}: each micro-batch is {each} "
                    f"(the micro-batch of {self.batch_size} samples at the first step's padded length "
                    f"{size // self.batch_size}), {held}"
                )
            runner.min_size, runner.min_samples = self.tokens.controller.min_batch_size, s.min_batch_size
        tail = 0
        if epoch_samples is not None and s.keep == "effective" and self.drawn == n:
            tail = short_batch_in(n, epoch_samples, self.consumed, self.user_batch_size)
        cut = functools.partial(self.cut, n=n, layout=layout, tokens=tokens, tail=tail)
        deciding = runner.agree is not None and self.steps + 1 >= s.adjust_every
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
        """The step's micro-batches of ``size`` (the policy's unit) and their weights (docs: "Short last batch").

        The last ``tail`` samples are the DataLoader's short last batch; a collate that kept other samples than were
        :attr:`drawn` shares each DataLoader batch's weight among the step's; an empty step runs whole, once.
        """
        if not n:
            return [MicroBatch(batch, 0, 1.0)]
        if self.settings.pack:
            assert layout is not None and tokens is not None  # (ignore_first_labels refused a batch without them)
            return self._cut_packed(batch, size, layout, tokens)
        sample_weight, tail_weight = 1.0 / n, 0.0
        if self.settings.keep == "effective":
            sample_weight, tail_weight = 1.0 / self.configured_effective, 1.0 / max(tail * self.user_accumulation, 1)
            if self.drawn != n:  # each of the step's DataLoader batches weighs 1/k, as Lightning's averages
                sample_weight = -(-self.drawn // self.user_batch_size) / (self.user_accumulation * n)
        weights: dict[str, Any] = {"sample_weight": sample_weight, "tail": tail, "tail_weight": tail_weight}
        if layout is None:
            split = self.settings.split_batch
            pieces = cut_step(batch, size, **weights, tokens=tokens, layout=self.batch_layout, split=split)
        else:
            policy, multiple = self.policy, self.settings.pad_to_multiple_of

            def fits(length: int | None) -> int:
                return policy.samples_at(size, length, n) if length else size

            pieces = cut_sequences(
                batch, n, layout, fits, **weights, tokens=tokens, multiple=multiple, batch_layout=self.batch_layout
            )
            self._shapes(pieces, layout)
        self.micro_batches = len(pieces)
        return pieces

    def _cut_packed(self, batch: Any, size: int, layout: PaddingLayout, tokens: Sequence[int]) -> list[MicroBatch]:
        """The step's samples packed in rows of at most ``size`` tokens (the first row's kept padded for the guard)."""
        packed = cut_packed(batch, layout, size, tokens=tokens)
        pieces = [piece for piece, _ in packed]
        if self.guard_due:
            self.guard_batch = unpacked(batch, layout, packed[0][1], self.batch_layout)
        rows = [(p.samples, p.seq_len or 0) for p in pieces]
        self.step_shapes, self.step_tokens = rows, (sum(layout.lengths), sum(layout.lengths))
        self.sequences = [(1, layout.lengths[i]) for _, indices in packed for i in indices]
        self.shapes.update(rows)
        self.batch_size, self.micro_batches = max(b for b, _ in rows), len(pieces)
        if self.compiled:  # one graph for every row length and sample count
            for value in itertools.chain.from_iterable(piece.batch.values() for piece in pieces):
                if isinstance(value, torch.Tensor):
                    torch._dynamo.maybe_mark_dynamic(value, value.dim() - 1)
        return pieces

    def forward(self, piece: MicroBatch, run: Callable[[Any], Any], *, quiet: Callable[[], Any]) -> Any:
        """``run(piece.batch)``; packed, with ``use_cache`` off, the fit's first one checked against its samples padded.

        The check's two forwards run without gradients under ``quiet()`` (not logged).

        Raises:
            PackingError: If the packed loss is not the padded one (``pack_guard=False`` turns the check off).
        """
        if not self.settings.pack:
            return run(piece.batch)
        with no_cache(self.hf_models):
            if self.guard_due and self.guard_batch is not None:
                with quiet():
                    name, precise, module = self.model_name, self.precise, self.module
                    check_packed(run, piece.batch, self.guard_batch, model=name, precise=precise, module=module)
                self.guard_due, self.guard_batch = False, None
            return run(piece.batch)

    def _given_weighting(self) -> None:
        """The weighting before a step: ``loss_weight``'s, tokens when packing, or none yet (``"auto"`` chooses)."""
        if self.settings.loss_weight != "auto":
            self.weighting, self.weighting_reason = self.settings.loss_weight, "as given"
        elif self.settings.pack:
            self.weighting, self.weighting_reason = "tokens", "pack=True: a packed row's loss is a mean over tokens"
        else:
            self.weighting, self.weighting_reason = None, ""

    def weigh_by(self, batch: Any) -> Weighting:
        """What the step of ``batch`` weighs its micro-batch losses by: ``"auto"`` chooses (and says why) once."""
        if self.weighting is None:
            self.weighting, self.weighting_reason = auto_weighting(batch, causal_lm=self.causal_lm)
            self.info(
                f"DynamicBatchSize: loss_weight='auto' weighs each micro-batch's loss by its share of the step's "
                f"{'label tokens' if self.weighting == 'tokens' else 'samples'} ({self.weighting_reason})"
            )
        return self.weighting

    def layout(self, batch: Any) -> PaddingLayout | None:
        """The step's padding layout; an unknown sequence key is warned about once."""
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            layout = padding_layout(batch, self.settings.trim_keys)
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
        rows = 1 if self.settings.pack else piece.samples  # a packed micro-batch is one row of seq_len tokens
        self.tokens.largest = max(self.tokens.largest, rows * (piece.seq_len or 1))
        if self.probe is not None:
            if self.base_due:  # the step's zero_grad ran: the last step's gradients, alive at its end, are freed
                self.base, self.base_due = min(self.base, live_bytes(self.probe)), False
            self.probe.before_micro_batch(rows, piece.seq_len)

    def step_run(self) -> StepRun:
        """The micro-batches the last step ran, as the monitor reads them (packed: each sequence's ``(1, length)``).

        A packed row attends within its sequences, so its FLOPs are theirs run apart.
        """
        shapes = None if self.step_shapes is None else tuple(self.sequences if self.settings.pack else self.step_shapes)
        return StepRun(self.micro_batches, shapes, self.step_tokens)

    # -- evaluation ------------------------------------------------------------------------------------------------
    def eval_sizer(self, loop: str) -> EvalSizer:
        """The evaluation batch of ``loop`` (made the first time): the control law of training, its own memory model."""
        assert self.probe is not None
        if loop not in self.evaluation:
            controller, split = self.settings.new_controller(training=False), self.settings.split_batch
            self.evaluation[loop] = EvalSizer(
                controller, self.probe, self.budget, layout=self.batch_layout, split=split, warn=self.warn
            )
        sizer = self.evaluation[loop]
        sizer.probe, sizer.layout = self.probe, self.batch_layout  # both are replaced at each fit's start
        return sizer

    def eval_start(self) -> int | None:
        """The first evaluation batch: what training's memory line allows (a sample costs less without gradients)."""
        model = self.controller.model
        if self.probe is None or self.batch_size is None or not model.sizes_seen:
            return None
        largest = model.largest_batch(self.budget()[1])
        return max(self.batch_size, int(largest)) if largest is not None else None

    # -- decisions ---------------------------------------------------------------------------------------------------
    def step_done(
        self,
        batch: Any,
        runner: MicroBatchRunner,
        *,
        agree: Callable[[list[float]], Sequence[float]],
        drawn: int | None = None,
    ) -> bool:
        """The step of ``batch`` (``drawn`` samples) ended; every ``adjust_every`` :meth:`decide`. Whether it resized.

        The figures are the worst rank's: agreed in the step's own collective, or by ``agree`` when none ran.
        """
        drawn = drawn if drawn is not None else self.batch_layout.samples(batch, check=False) or 0
        self.consumed, self.batches_done = self.consumed + drawn, self.batches_done + 1
        self.steps += 1
        if self.steps < self.settings.adjust_every or self.probe is None:
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
        """Decide on ``figures`` and ``ran`` (the largest micro-batch in samples), start the next; whether resized."""
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
        """Empty the cache (it held an earlier, larger need) and start an interval; its peak is then its own."""
        assert self.probe is not None
        self.probe.empty_cache()
        self.probe.reset_peak()
        # the base is read again at the interval's first micro-batch, after the step's zero_grad: read here, between
        # steps, it holds the gradients, which a peak need not hold (one micro-batch a step, the first of several), and
        # the line from it through that peak would under-state the slope and over-state the size that fits
        self.base, self.base_due = live_bytes(self.probe), True

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
        """Validation's memory is not training's: empty the cache (no slow garbage collection) and restart the peak."""
        assert self.probe is not None
        self.probe.empty_cache()
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
        """Where the run settled (without a probe: what it kept), and what the losses were weighted by."""
        step = f"optimizer step of {self.effective_batch_size} samples"
        if self.micro_batch_tokens is None:
            size = f"micro-batch {self.batch_size} samples ({self.accumulate_grad_batches} per {step})"
        else:  # a budget of padded tokens: the samples of a micro-batch follow its length
            low, high = min((b for b, _ in self.shapes), default=0), max((b for b, _ in self.shapes), default=0)
            held = f"{low} to {high}" if low != high else f"{high}"
            unit = "tokens packed in one row" if self.settings.pack else "padded tokens"
            size = (
                f"micro-batches of at most {self.micro_batch_tokens} {unit} ({held} samples each; "
                f"{self.micro_batches} in the last {step})"
            )
        weighting = "" if self.weighting is None else f"; losses weighted by {self.weighting} ({self.weighting_reason})"
        return (
            f"DynamicBatchSize: {'settled at' if self.probe is not None else 'kept'} {size}; {self.decisions} "
            f"decision{'s' * (self.decisions != 1)}, {self.oom_recoveries} out-of-memory "
            f"error{'s' * (self.oom_recoveries != 1)} recovered{weighting}"
        )

    # -- checkpoints -------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The sizes, counters and controllers (``DynamicBatchSize``'s checkpoint keys of them)."""
        return {
            **{name: getattr(self, name) for name in _SAVED.split()},
            "controller": self.controller.state_dict(),
            **self.tokens.state_dict(),  # micro_batch_tokens, longest, token_controller
            "arguments": self.arguments(),
            "weighting": self.weighting,  # what loss_weight="auto" chose (None: no step yet)
            "evaluation": {loop: sizer.state_dict() for loop, sizer in self.evaluation.items()},
        }

    def arguments(self) -> dict[str, Any]:
        """The arguments a checkpoint records, so that a run resumed with other values can say which it uses."""
        s = self.settings
        values = {name: getattr(s, name) for name in _RECORDED.split()}
        return values | {"trim_keys": list(s.trim_keys), "per_batch": sorted(set(s.per_batch))}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s keys; this run's configuration, limits and arguments win, with a warning."""
        s = self.settings
        saved = state["user_batch_size"], state["user_accumulation"]
        now = self.user_batch_size, self.user_accumulation
        if saved != now:
            self.warn(
                f"DynamicBatchSize: the checkpoint was trained with DataLoader batch {saved[0]} x "
                f"accumulate_grad_batches {saved[1]}; this run configures {now[0]} x {now[1]}, which is used from "
                "here on"
            )
        limits = [x for x in (state["batch_size"], self.cap(), s.max_batch_size) if x is not None]
        self.batch_size = max(s.min_batch_size, min(limits))
        before = state.get("arguments", {})
        changed = changed_arguments(before, self.arguments(), ignore=("loss_weight",))
        # the weighting the checkpoint's steps ran with (a checkpoint from before "auto" records only its argument)
        ran: Weighting | None = state.get("weighting") or (
            None if before.get("loss_weight") == "auto" else before.get("loss_weight")
        )
        if ran is not None and s.loss_weight == "auto" and not s.pack:  # the resumed run goes on as it started
            self.weighting, self.weighting_reason = ran, "as the checkpoint's run chose"
        elif ran is not None and ran != (self.weighting or s.loss_weight):  # packed "auto" is "tokens"
            changed.append(f"loss_weight {ran!r} -> {s.loss_weight!r}")
        if changed:
            moved = f"; micro-batch {state['batch_size']} -> {self.batch_size}"
            self.warn(
                "DynamicBatchSize: resumed with other arguments than the checkpoint's, which are used from here on: "
                + ", ".join(changed)
                + (moved if self.batch_size != state["batch_size"] else "")
            )
        self.lr_factor = state["lr_factor"] if s.keep == "lr" else 1.0  # (the caller undoes another keep's scaling)
        self.steps, self.oom_recoveries = state["steps"], state["oom_recoveries"]
        self.decisions = state.get("decisions", 0)
        self.controller.load_state_dict(state["controller"])
        self.tokens.load_state_dict(state)
        if self.probe is not None:
            for loop, saved in state.get("evaluation", {}).items():
                self.eval_sizer(loop).load_state_dict(saved)


def auto_weighting(batch: Any, *, causal_lm: bool) -> tuple[Weighting, str]:
    """What ``loss_weight="auto"`` weighs a step like ``batch`` by, and why (see "Which run the defaults equal").

    Example:
        >>> ids = torch.ones(2, 4, dtype=torch.long)
        >>> auto_weighting({"input_ids": ids, "labels": ids}, causal_lm=False)[0]
        'tokens'
        >>> auto_weighting({"input_ids": ids, "attention_mask": ids, "labels": torch.ones(2)}, causal_lm=False)[0]
        'samples'
    """
    labels = batch.get("labels") if isinstance(batch, Mapping) else None
    mask = batch.get("attention_mask") if isinstance(batch, Mapping) else None
    if isinstance(labels, torch.Tensor) and labels.dim() >= 2:
        return "tokens", "the batch has per-token `labels`, whose loss is a mean over those other than -100"
    if causal_lm and isinstance(mask, torch.Tensor) and mask.dim() == 2:
        return "tokens", "a Hugging Face causal LM on padded batches, whose loss is a mean over their tokens"
    return "samples", "no per-token `labels`, and no Hugging Face causal LM on batches with an `attention_mask`"


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
