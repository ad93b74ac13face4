"""Module surgery shared by the swaps and presets: instance-level ``forward`` wrappers and undoable results.

A wrapper replaces one module *instance*'s ``forward`` (never its class, never another library's globals), remembers
the ``forward`` the instance had before, and can be removed again. A result records what a surgery changed and runs
its undo steps, last first, on :meth:`SurgeryResult.restore` or on leaving a ``with`` block.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn
from typing_extensions import Self


@dataclass
class SurgeryResult:
    """Base of the results of module surgery: the steps that undo it."""

    _undo: list[Callable[[], None]] = field(default_factory=list, init=False, repr=False, compare=False)

    @property
    def restored(self) -> bool:
        """Whether nothing is left to undo (:meth:`restore` ran, or nothing was changed)."""
        return not self._undo

    def restore(self) -> None:
        """Undo every change, last first. Safe to call twice; the second call does nothing."""
        while self._undo:
            self._undo.pop()()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.restore()


class InstanceForward:
    """An instance-level ``forward`` that runs the module's own ``forward`` (subclasses add what goes around it).

    It holds the module rather than a bound method, so a deep copy of the module calls the copy, and remembers the
    ``forward`` the instance had before (``None``: the class's), so the wrap can be undone and never stacks.
    """

    def __init__(self, module: nn.Module, original: Any) -> None:
        self.module = module
        self.original = original

    @property
    def __wrapped__(self) -> Any:
        # read by inspect.signature, so libraries that inspect `module.forward` see the real parameters
        if self.original is not None:
            return self.original
        return type(self.module).forward.__get__(self.module)

    def call_original(self, *args: Any, **kwargs: Any) -> Any:
        """Run the ``forward`` the instance had before the wrap."""
        # The class's forward is called with the module as first argument rather than through a bound method made
        # here: torch.compile cannot trace a method object built inside the compiled region and would fall back to
        # running the whole compiled forward eagerly.
        if self.original is not None:
            return self.original(*args, **kwargs)
        return type(self.module).forward(self.module, *args, **kwargs)


def remove_forward(module: nn.Module, kind: type[InstanceForward]) -> None:
    """Give ``module`` back the ``forward`` it had before a wrapper of type ``kind``.

    Args:
        module: The wrapped module.
        kind: The wrapper class; a ``forward`` of another kind (already restored, or replaced by someone else since)
            is left alone.
    """
    current = module.__dict__.get("forward")
    if not isinstance(current, kind):
        return
    if current.original is None:
        del module.__dict__["forward"]
    else:
        setattr(module, "forward", current.original)  # noqa: B010
