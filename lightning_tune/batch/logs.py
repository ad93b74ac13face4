"""What a ``training_step`` logs while its step runs as micro-batches: one value per key, as the uncut step's.

Without it, the last micro-batch (under length grouping, the shortest samples) would stand for the step.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator
from numbers import Real
from typing import Any

import torch
from torch import Tensor

_COMBINE: dict[str, Callable[[Tensor], Tensor]] = {"sum": torch.sum, "max": torch.max, "min": torch.min}
#: Each ``reduce_fx`` (a name or a torch function) whose micro-batch values can be combined, to its name.
_REDUCTIONS: dict[Any, str] = {"mean": "mean", "avg": "mean", torch.mean: "mean"}
_REDUCTIONS |= {name: name for name in _COMBINE} | {fn: name for name, fn in _COMBINE.items()}


@functools.cache
def _parameters(log: Callable[..., Any], bound: bool) -> tuple[str, ...]:
    """The names a ``log`` function takes positionally, in order (without ``self`` when bound): read once."""
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    names = tuple(p.name for p in inspect.signature(log).parameters.values() if p.kind in kinds)
    return names[1:] if bound else names


class StepLogs:
    """Collect the values the micro-batches of a step log and combine them into the step's values.

    Each micro-batch's value is weighted as its loss is (:attr:`weight`, set before it runs), so a mean over the step is
    the weighted mean of the micro-batches' means; ``reduce_fx`` ``"sum"``, ``"max"`` or ``"min"`` combine that way. A
    value that is not a number or a one-element tensor (a ``torchmetrics`` metric) is not collected.

    Example:
        >>> logs = StepLogs()
        >>> logs.weight = 0.75
        >>> logs.add("train_loss", torch.tensor(2.0), {"prog_bar": True})
        True
        >>> logs.weight = 0.25
        >>> logs.add("train_loss", torch.tensor(4.0), {"prog_bar": True})
        True
        >>> [(name, round(float(value), 4), options) for name, value, options in logs.values()]
        [('train_loss', 2.5, {'prog_bar': True})]
    """

    def __init__(self) -> None:
        self.weight = 1.0
        self._keys: dict[str, tuple[list[Any], list[float], list[Any], dict[str, Any]]] = {}

    def clear(self) -> None:
        """Forget what was collected (a step starts, or starts again after an out-of-memory error)."""
        self._keys = {}

    def add(self, name: str, value: Any, options: dict[str, Any]) -> bool:
        """Collect ``value`` for ``name`` at :attr:`weight`; ``False`` (nothing kept) for a value it cannot combine.

        ``options`` are the other arguments of ``LightningModule.log`` (``batch_size`` is summed over the micro-batches
        when each gave one).
        """
        if isinstance(value, Tensor):
            if value.numel() != 1 or value.is_complex():
                return False
            value = value.detach()
        elif not isinstance(value, Real):
            return False
        if _REDUCTIONS.get(options.get("reduce_fx", "mean")) is None:
            return False  # a reduction of the user's own: the micro-batches' values cannot be combined for it
        values, weights, sizes, _ = self._keys.setdefault(name, ([], [], [], dict(options)))
        values.append(value)
        weights.append(self.weight)
        sizes.append(options.get("batch_size"))
        return True

    def values(self) -> Iterator[tuple[str, Any, dict[str, Any]]]:
        """Each key with the step's value and the options to log it with (those of its first micro-batch)."""
        for name, (values, weights, sizes, options) in self._keys.items():
            how = _REDUCTIONS[options.get("reduce_fx", "mean")]
            if how == "mean":  # tensor times float: no copy to the device, no wait for it
                total = sum(weights)
                value: Any = sum((v * (w / total) for v, w in zip(values, weights, strict=True)), start=0.0)
            else:
                device = next((v.device for v in values if isinstance(v, Tensor)), torch.device("cpu"))
                value = _COMBINE[how](torch.stack([torch.as_tensor(v, device=device).double() for v in values]))
            value = value.float() if isinstance(value, Tensor) else float(value)
            out = dict(options)
            if "batch_size" in out:
                out["batch_size"] = sum(sizes) if all(s is not None for s in sizes) else None
            yield name, value, out

    @contextlib.contextmanager
    def collecting(self, module: Any) -> Iterator[None]:
        """While a step's micro-batches run, collect what ``module.log`` logs; then log each key's step value once."""
        original = module.log
        names = _parameters(getattr(original, "__func__", original), hasattr(original, "__self__"))

        def collect(*args: Any, **kwargs: Any) -> None:
            options = dict(zip(names, args, strict=False)) | kwargs
            if len(args) > len(names) or "name" not in options or "value" not in options:
                original(*args, **kwargs)  # not a call `log` takes: its own error
                return
            name, value = options.pop("name"), options.pop("value")
            if not self.add(name, value, options):
                original(name, value, **options)  # a torchmetrics metric accumulates by itself

        own = vars(module).get("log")
        module.log = collect
        try:
            yield
        finally:
            if own is None:
                del module.log
            else:
                module.log = own
        for name, value, options in self.values():
            original(name, value, **options)
        self.clear()
