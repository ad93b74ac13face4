"""The micro-batch as a budget of padded tokens, for steps cut by length and trimmed (:mod:`.trim`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from lightning_tune.batch.control import BatchSizeController, Decision


class TokenBudget:
    """Padded tokens per micro-batch, beside the controller in samples: a trimmed micro-batch's memory follows them.

    A micro-batch of padded length ``L`` holds ``budget // L`` samples. ``controller`` moves the budget on the grid of
    ``samples`` × ``pad_to_multiple_of`` tokens, capped at :meth:`cap`; ``largest`` is the largest micro-batch (tokens)
    run since the allocator's cache was emptied, ``longest`` the longest padded length of a step seen.

    Example:
        >>> samples = BatchSizeController(target=0.9, min_batch_size=1, max_batch_size=None, multiple_of=8)
        >>> tokens = TokenBudget(samples, pad_to_multiple_of=8)
        >>> tokens.start(512, 16)  # the micro-batch of 16 samples, padded to 512
        8192
        >>> [tokens.samples_at(8192, length, n=64) for length in (64, 512, 1000, 2048)]
        [64, 16, 8, 4]
    """

    def __init__(self, samples: BatchSizeController, *, pad_to_multiple_of: int) -> None:
        self.budget: int | None = None  # until the first step with a padding layout
        self.samples, self.longest, self.largest = samples, 0, 0
        self.controller = BatchSizeController(
            target=samples.target,
            min_batch_size=samples.min_batch_size * pad_to_multiple_of,
            max_batch_size=None,
            multiple_of=samples.multiple_of * pad_to_multiple_of,
            min_change=samples.min_change,
            probe_growth=1.0,  # as a probe from 8 samples to 16: a grid step of tokens changes too little
        )

    #: The unit of its sizes, as a :class:`~lightning_tune.batch.step.SizePolicy`.
    unit = "padded tokens"

    def next_size(self, size: int, *, effective: int, cap: int | None, ran: int, **memory: Any) -> Decision:
        """:meth:`decide` as a size policy (its size is :attr:`budget`, what ran :attr:`largest`)."""
        return self.decide(effective, **memory)

    def smaller(self, failed: int, *, effective: int, cap: int | None, **memory: Any) -> int:
        """:meth:`on_oom` as a size policy."""
        return self.on_oom(failed, effective, **memory)

    def start(self, padded: int, size: int, *, agree: Callable[[list[float]], Sequence[float]] | None = None) -> int:
        """The budget; the first step converts ``size`` samples at ``padded`` (``agree``: the ranks' longest)."""
        self.longest = max(self.longest, padded)
        if self.budget is None:
            self.budget = size * (padded if agree is None else int(agree([padded])[0]))
        return self.budget

    def samples_at(self, tokens: int, length: int, n: int) -> int:
        """Samples of padded length ``length`` in ``tokens``, on the sample grid within its limits (or ``n``)."""
        s = self.samples
        return s.round_down(max(s.min_batch_size, min(tokens // length, s.max_batch_size or n)))

    def cap(self, effective: int) -> int:
        """The most padded tokens a step of ``effective`` samples holds: at the longest padded length seen."""
        return effective * self.longest

    def decide(self, effective: int, **memory: Any) -> Decision:
        """Record an interval's ``memory`` (as the controller's ``decide``) against :attr:`largest`, choose the next."""
        assert self.budget is not None
        size = self.budget
        decision = self.controller.decide(size, cap=self.cap(effective), observed_size=self.largest or size, **memory)
        self.budget, self.largest = decision.batch_size, 0  # the caller empties the cache after every decision
        return decision

    def on_oom(self, failed: int, effective: int, **memory: Any) -> int:
        """A smaller budget after ``failed`` tokens ran out of memory (``memory``: as the controller's ``on_oom``)."""
        self.budget = self.controller.on_oom(failed, cap=self.cap(effective), **memory)
        return self.budget

    def state_dict(self) -> dict[str, Any]:
        """The budget, the longest length and the controller's state (``None`` before a budget), for a checkpoint."""
        state = None if self.budget is None else self.controller.state_dict()
        return {"micro_batch_tokens": self.budget, "longest": self.longest, "token_controller": state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved (a checkpoint from before token budgets has none of it)."""
        self.budget, self.longest = state.get("micro_batch_tokens"), state.get("longest", 0)
        if self.budget is not None and state.get("token_controller") is not None:
            self.controller.load_state_dict(state["token_controller"])
