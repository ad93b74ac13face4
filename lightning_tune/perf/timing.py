"""Timestamps for step timing that never make the host wait for the device.

A timer hands out opaque *marks*: ``time.perf_counter()`` values, or CUDA events recorded on the current stream
(microseconds, no wait for the GPU); only :meth:`Timeline.resolve` with ``wait=True`` (at the end of a run) blocks.
"""

from __future__ import annotations

import sys
from collections import deque
from time import perf_counter
from typing import Any, TypeAlias

import torch

from lightning_tune._validation import check_instance


class HostTimer:
    """Host wall-clock marks from ``time.perf_counter``: a mark is a time already taken.

    Example:
        >>> timer = HostTimer()
        >>> a = timer.mark(); b = timer.mark()
        >>> timer.elapsed_ms(a, b) >= 0.0
        True
    """

    def mark(self) -> float:
        """The current ``perf_counter`` value, in seconds."""
        return perf_counter()

    def elapsed_ms(self, start: float, end: float) -> float:
        """Milliseconds from ``start`` to ``end``."""
        return (end - start) * 1000.0

    def done(self, mark: float) -> bool:
        """Always: a host mark is a time already taken."""
        return True

    def wait(self, mark: float) -> None:
        """Nothing to wait for on the host."""

    def release(self, mark: float) -> None:
        """Nothing to give back."""


class CudaTimer:
    """CUDA-event marks on the current stream of ``device``, pooled: :meth:`release` refills."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pool: list[torch.cuda.Event] = []

    def mark(self) -> torch.cuda.Event:
        """Record a timing event on the current stream (asynchronous); a released event is reused."""
        event = self._pool.pop() if self._pool else torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def elapsed_ms(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        """Milliseconds between two completed events, as measured on the device."""
        return float(start.elapsed_time(end))

    def done(self, mark: torch.cuda.Event) -> bool:
        """Whether all work recorded before the event has run (``Event.query()``: asks, never waits)."""
        return bool(mark.query())

    def wait(self, mark: torch.cuda.Event) -> None:
        """Wait for the event, and so for all work recorded before it."""
        mark.synchronize()

    def release(self, mark: torch.cuda.Event) -> None:
        """Put a completed event that will not be read again back into the pool."""
        self._pool.append(mark)


#: A source of marks and of the milliseconds between two of them, read once :meth:`~CudaTimer.done`.
Timer: TypeAlias = HostTimer | CudaTimer


class Timeline:
    """Marks numbered in the order they were taken, turned into times as the device completes them.

    Marks on one stream complete in order, so :meth:`resolve` stops at the first that has not. A resolved mark's time
    is the previous one's plus the milliseconds between the two (every duration read is a difference of nearby marks),
    and the older mark goes back to the timer's pool.

    Example:
        >>> timeline = Timeline(HostTimer())
        >>> a, b = timeline.mark(), timeline.mark()
        >>> timeline.resolve(), timeline.ms(a, b) >= 0.0
        (2, True)
    """

    def __init__(self, timer: Timer) -> None:
        self.timer = timer
        self._unresolved: deque[Any] = deque()
        self._times: dict[int, float] = {}
        self.resolved = 0  # marks numbered below this have a time
        self._last: Any = None  # the newest resolved mark, the origin of the next difference
        self._now_ms = 0.0

    def mark(self) -> int:
        """Take a mark now (without waiting); its number is the count of marks taken before it."""
        self._unresolved.append(self.timer.mark())
        return self.resolved + len(self._unresolved) - 1

    def resolve(self, *, wait: bool = False) -> int:
        """Resolve the completed marks (a non-blocking query each), or all after one ``wait``; :attr:`resolved`."""
        timer, unresolved = self.timer, self._unresolved
        if wait and unresolved:
            timer.wait(unresolved[-1])
        while unresolved:
            mark = unresolved[0]
            if not wait and not timer.done(mark):
                break
            unresolved.popleft()
            if self._last is not None:
                self._now_ms += timer.elapsed_ms(self._last, mark)
                timer.release(self._last)
            self._last = mark
            self._times[self.resolved] = self._now_ms
            self.resolved += 1
        return self.resolved

    def ms(self, start: int, end: int) -> float:
        """Milliseconds between two resolved marks, by number."""
        return self._times[end] - self._times[start]

    def forget(self, before: int) -> None:
        """Drop the times of the marks numbered below ``before``, the oldest mark still to be read."""
        for number in [n for n in self._times if n < before]:
            del self._times[number]


def timer_for(device: torch.device) -> Timer:
    """The timer to use for work on ``device``: CUDA events on a CUDA device, the host clock elsewhere.

    Args:
        device: The device the model runs on.
    """
    check_instance("device", device, torch.device, "a torch.device")
    return CudaTimer(device) if device.type == "cuda" else HostTimer()


def compiled_graphs() -> int:
    """Graphs ``torch.compile`` has compiled in this process so far (0 if Dynamo was never imported, not imported here).

    Example:
        >>> compiled_graphs() >= 0
        True
    """
    dynamo_utils = sys.modules.get("torch._dynamo.utils")
    # The only count of compilations torch keeps (a private counter, checked on torch 2.13): one per graph Dynamo
    # hands to a backend, so recompilations for new shapes count too.
    counters = getattr(dynamo_utils, "counters", None)
    return 0 if counters is None else int(counters["stats"]["unique_graphs"])
