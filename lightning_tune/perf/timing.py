"""Timestamps for step timing without a host-device synchronisation per step.

A timer hands out opaque *marks*. :class:`HostTimer` marks are ``time.perf_counter()`` values. :class:`CudaTimer`
marks are CUDA events recorded on the current stream: recording costs microseconds and never waits for the GPU;
the time between two marks is read later (at logging time), after one wait on the newest mark.
"""

from __future__ import annotations

import sys
from time import perf_counter
from typing import Any, Protocol

import torch


class Timer(Protocol):
    """Source of marks and of the milliseconds between two of them."""

    def mark(self) -> Any:
        """Take a timestamp now (without waiting for the device)."""

    def elapsed_ms(self, start: Any, end: Any) -> float:
        """Milliseconds between two marks; only valid after :meth:`wait` on ``end`` or a later mark."""

    def wait(self, mark: Any) -> None:
        """Block until everything before ``mark`` has run."""


class HostTimer:
    """Host wall-clock marks from ``time.perf_counter``.

    Example:
        >>> timer = HostTimer()
        >>> a = timer.mark(); b = timer.mark()
        >>> timer.elapsed_ms(a, b) >= 0.0
        True
    """

    def mark(self) -> float:
        """Return the current ``perf_counter`` value.

        Returns:
            Seconds, as a float.
        """
        return perf_counter()

    def elapsed_ms(self, start: float, end: float) -> float:
        """Milliseconds from ``start`` to ``end``.

        Args:
            start: Earlier mark.
            end: Later mark.

        Returns:
            The duration in milliseconds.
        """
        return (end - start) * 1000.0

    def wait(self, mark: float) -> None:
        """Nothing to wait for on the host.

        Args:
            mark: Ignored.
        """


class CudaTimer:
    """CUDA-event marks on the current stream of ``device``.

    Args:
        device: The CUDA device whose stream is timed.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def mark(self) -> torch.cuda.Event:
        """Record a timing event on the current stream (asynchronous).

        Returns:
            The recorded event.
        """
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def elapsed_ms(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        """Milliseconds between two recorded events.

        Args:
            start: Earlier event.
            end: Later event (already completed).

        Returns:
            The duration in milliseconds, as measured on the device.
        """
        return float(start.elapsed_time(end))

    def wait(self, mark: torch.cuda.Event) -> None:
        """Wait for the event (and so for all work recorded before it).

        Args:
            mark: The event.
        """
        mark.synchronize()


def timer_for(device: torch.device) -> Timer:
    """The timer to use for work on ``device``: CUDA events on a CUDA device, the host clock elsewhere.

    Args:
        device: The device the model runs on.

    Returns:
        A timer.
    """
    if device.type == "cuda":
        return CudaTimer(device)
    return HostTimer()


def compiled_graphs() -> int:
    """Graphs ``torch.compile`` has compiled in this process so far; a step during which it grows compiled.

    Dynamo is never imported here: a process that has not imported it has compiled nothing.

    Returns:
        The count (0 without Dynamo).

    Example:
        >>> compiled_graphs() >= 0
        True
    """
    dynamo_utils = sys.modules.get("torch._dynamo.utils")
    # The only count of compilations torch keeps (a private counter, checked on torch 2.13): one per graph Dynamo
    # hands to a backend, so recompilations for new shapes count too.
    counters = getattr(dynamo_utils, "counters", None)
    if counters is None:
        return 0
    return int(counters["stats"]["unique_graphs"])
