"""Module surgery shared by the swaps: instance-level ``forward`` wrappers, undoable results, and the checks before.

A wrapper replaces one module *instance*'s ``forward`` (never its class, nor another library's globals) and can be
removed again; a result runs its undo steps, last first, on :meth:`SurgeryResult.restore` or leaving a ``with`` block.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from typing_extensions import Self


@dataclass
class SurgeryResult:
    """Base of the results of module surgery: the steps that undo it."""

    _undo: list[Callable[[], object]] = field(default_factory=list, init=False, repr=False, compare=False)

    @property
    def restored(self) -> bool:
        """Whether nothing is left to undo (:meth:`restore` ran, or nothing was changed)."""
        return not self._undo

    def describe(self) -> str:
        """What was changed, for printing; each kind of result says it its own way."""
        raise NotImplementedError

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
    """Give ``module`` back the ``forward`` it had before a wrapper of type ``kind`` (another kind's is left alone)."""
    current = module.__dict__.get("forward")
    if not isinstance(current, kind):
        return
    if current.original is None:
        del module.__dict__["forward"]
    else:
        setattr(module, "forward", current.original)  # noqa: B010


def refuse_wrapped(module: nn.Module, *, surgery: str, callback: str) -> None:
    """Raise ``TypeError`` if ``module`` is or holds a DataParallel/DDP/FSDP wrapper: surgery is for the bare model."""
    wrappers: list[type] = [nn.DataParallel, nn.parallel.DistributedDataParallel]
    if torch.distributed.is_available():
        from torch.distributed import fsdp

        wrappers += [cls for name in ("FullyShardedDataParallel", "FSDPModule") if (cls := getattr(fsdp, name, None))]
    for path, child in module.named_modules():
        if isinstance(child, tuple(wrappers)):
            where = "the model" if path == "" else f"{path!r} inside {type(module).__name__}"
            raise TypeError(
                f"{surgery} got {where} wrapped in {type(child).__name__}. Apply it to the bare model, before the "
                f"strategy wraps it (the {callback} callback does this in `setup`)."
            )


def pretrained_model_class() -> type | None:
    """Hugging Face's ``PreTrainedModel``; ``None`` until transformers' modeling module was imported (never here)."""
    cls = getattr(sys.modules.get("transformers.modeling_utils"), "PreTrainedModel", None)
    return cls if isinstance(cls, type) else None


def inside(path: str, roots: list[str]) -> bool:
    """Whether the module at qualified name ``path`` is one of ``roots`` or nested in one."""
    return any(root == "" or path == root or path.startswith(root + ".") for root in roots)


def table(rows: list[list[str]]) -> str:
    """Rows as plain-text columns, two spaces apart: the tables the results' ``describe`` prints."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows
    )
