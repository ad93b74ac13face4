"""Activation checkpointing for the repeated blocks of an unmodified model.

:func:`checkpoint_blocks` finds the transformer blocks of a model and makes each one recompute its activations in the
backward pass instead of keeping them (``torch.utils.checkpoint``, non-reentrant), by giving each block instance a
``forward`` of its own. The classes, the parameters and the module tree are untouched, so optimizers and checkpoints
stay valid, and the returned :class:`CheckpointResult` undoes it.
:class:`~lightning_tune.callbacks.surgery.ActivationCheckpointing` does it for the duration of each Trainer run.

Blocks found, in this order, when no ``block_types`` are given:

1. Hugging Face ``PreTrainedModel``s that support it: their own switch (``activation_checkpointing_enable()``, or
   ``gradient_checkpointing_enable()`` before transformers 5), non-reentrant.
2. ``nn.TransformerEncoderLayer`` and ``nn.TransformerDecoderLayer`` instances outside those models.
3. Failing both, the children of the largest ``nn.ModuleList`` (most parameters) whose children, at least two, are
   all of one class: the ``blocks``/``layers``/``h`` list of a hand-written transformer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_tune._surgery import (
    InstanceForward,
    SurgeryResult,
    inside,
    pretrained_model_class,
    refuse_wrapped,
    remove_forward,
)
from lightning_tune._validation import check_bool

__all__ = [
    "BlockTypes",
    "CheckpointEntry",
    "CheckpointResult",
    "CheckpointedForward",
    "checkpoint_blocks",
    "type_matcher",
]

#: Blocks to checkpoint: module classes, or class names (``"Block"``) / qualified names (``"torch.nn.X"``) for YAML.
BlockTypes = type[nn.Module] | str | Sequence[type[nn.Module] | str]
#: How a block was checkpointed: its ``forward`` wrapped here, or the Hugging Face model's own switch.
CheckpointMethod = Literal["forward", "transformers"]
_TORCH_LAYERS: Final[tuple[type[nn.Module], ...]] = (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)


@dataclass(frozen=True)
class CheckpointEntry:
    """One checkpointed block (or Hugging Face model).

    Args:
        path: Qualified name inside the model (``""`` for the model itself).
        module_type: Class name of the module.
        method: ``"forward"`` (its ``forward`` runs under ``torch.utils.checkpoint``) or ``"transformers"`` (the
            model's own ``activation_checkpointing_enable()``/``gradient_checkpointing_enable()``).
    """

    path: str
    module_type: str
    method: CheckpointMethod


@dataclass
class CheckpointResult(SurgeryResult):
    """What :func:`checkpoint_blocks` changed, and how to undo it. Leaving a ``with`` block restores the model.

    :meth:`restore` gives every block back the ``forward`` it had and switches Hugging Face checkpointing back off.

    Args:
        entries: One entry per checkpointed block or Hugging Face model.
    """

    entries: list[CheckpointEntry] = field(default_factory=list)

    def describe(self) -> str:
        """A title line, then the checkpointed blocks grouped by class, for printing."""
        by_type: dict[tuple[str, str], list[str]] = {}
        for entry in self.entries:
            by_type.setdefault((entry.module_type, entry.method), []).append(entry.path or "(root)")
        lines = [f"Activation checkpointing: {len(self.entries)} module(s)"]
        for (module_type, method), paths in by_type.items():
            how = "the model's own switch" if method == "transformers" else "torch.utils.checkpoint"
            shown = ", ".join(paths[:4]) + (f", ... ({len(paths)} in all)" if len(paths) > 4 else "")
            lines.append(f"  {module_type} via {how}: {shown}")
        return "\n".join(lines)


class CheckpointedForward(InstanceForward):
    """An instance-level ``forward`` that runs the block's own forward under ``torch.utils.checkpoint``."""

    def __init__(self, module: nn.Module, original: Any, preserve_rng_state: bool) -> None:
        super().__init__(module, original)
        self.preserve_rng_state = preserve_rng_state

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the block, under ``torch.utils.checkpoint`` when gradients are enabled."""
        if not torch.is_grad_enabled():  # nothing is saved for backward: recomputing would only cost time
            return self.call_original(*args, **kwargs)
        return checkpoint(
            self.call_original, *args, use_reentrant=False, preserve_rng_state=self.preserve_rng_state, **kwargs
        )


def _wrap(module: nn.Module, preserve_rng_state: bool) -> Callable[[], None]:
    current = module.__dict__.get("forward")
    if not isinstance(current, CheckpointedForward):
        setattr(module, "forward", CheckpointedForward(module, current, preserve_rng_state))  # noqa: B010
    return lambda: remove_forward(module, CheckpointedForward)


def _outermost(module: nn.Module, match: Callable[[nn.Module], bool]) -> Iterator[tuple[str, nn.Module]]:
    """Modules for which ``match`` holds, skipping those nested inside an earlier match."""
    roots: list[str] = []
    for path, child in module.named_modules():
        if not inside(path, roots) and match(child):
            roots.append(path)
            yield path, child


def type_matcher(block_types: BlockTypes) -> Callable[[nn.Module], bool]:
    """A test for the modules ``block_types`` names; raises ``TypeError``/``ValueError`` for a bad ``block_types``."""
    items = (
        [block_types] if isinstance(block_types, (str, type)) or not isinstance(block_types, Sequence) else block_types
    )
    if not items:
        raise ValueError("`block_types` must name at least one module class, got an empty sequence")
    for item in items:
        if isinstance(item, str):
            if not item:
                raise ValueError("`block_types` must not contain an empty class name")
        elif not (isinstance(item, type) and issubclass(item, nn.Module)):
            raise TypeError(
                "`block_types` must be nn.Module subclasses or class names (e.g. 'Block' or "
                f"'torch.nn.TransformerEncoderLayer'), got {item!r} ({type(item).__name__})"
            )
    classes = tuple(item for item in items if isinstance(item, type))
    names = {item for item in items if isinstance(item, str)}

    def match(module: nn.Module) -> bool:
        cls = type(module)
        return isinstance(module, classes) or cls.__name__ in names or f"{cls.__module__}.{cls.__qualname__}" in names

    return match


def _largest_uniform_list(module: nn.Module) -> tuple[str, nn.Module] | None:
    """The ``nn.ModuleList`` of at least two children of one class with the most parameters (the first of equals)."""
    lists = [
        (path, child)
        for path, child in module.named_modules()
        if isinstance(child, nn.ModuleList) and len(child) >= 2 and len({type(block) for block in child}) == 1
    ]
    return max(lists, key=lambda item: sum(p.numel() for p in item[1].parameters()), default=None)


def checkpoint_blocks(
    module: nn.Module, block_types: BlockTypes | None = None, *, preserve_rng_state: bool = True
) -> CheckpointResult:
    """Make the repeated blocks of ``module`` recompute their activations in the backward pass.

    Each block's ``forward`` runs under ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`` whenever
    gradients are enabled, so only its inputs are kept for backward; with ``preserve_rng_state`` the recomputation
    replays the same dropout masks, and gradients equal those of the unchanged model.

    Args:
        module: The model (not wrapped in DDP/FSDP).
        block_types: Classes (or class names) of the blocks to checkpoint; the outermost instances are wrapped.
            ``None`` finds them as described in the module docstring.
        preserve_rng_state: Restore the RNG state for the recomputation (needed for equal gradients with dropout).

    Returns:
        What was changed; its :meth:`~CheckpointResult.restore` undoes it.

    Raises:
        TypeError: If ``module`` is wrapped in DDP/FSDP, or ``block_types`` holds something other than module classes
            and class names.
        ValueError: If no block is found.

    Example:
        >>> layer = nn.TransformerEncoderLayer(d_model=8, nhead=2, batch_first=True)
        >>> model = nn.TransformerEncoder(layer, num_layers=3, enable_nested_tensor=False)
        >>> result = checkpoint_blocks(model)
        >>> [entry.path for entry in result.entries]
        ['layers.0', 'layers.1', 'layers.2']
        >>> result.restore()
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"`module` must be a torch.nn.Module, got {type(module).__name__}")
    check_bool("preserve_rng_state", preserve_rng_state)
    refuse_wrapped(module, surgery="checkpoint_blocks", callback="ActivationCheckpointing")
    result = CheckpointResult()
    blocks: list[tuple[str, nn.Module]] = []
    if block_types is not None:
        blocks = list(_outermost(module, type_matcher(block_types)))
        if not blocks:
            raise ValueError(f"`block_types` {block_types!r} matched no module of {type(module).__name__}")
    else:
        pretrained = pretrained_model_class()
        hf_roots: list[str] = []
        if pretrained is not None:
            for path, model in _outermost(module, lambda m: isinstance(m, pretrained)):
                if getattr(model, "supports_gradient_checkpointing", False):
                    _enable_transformers(model, result)
                    result.entries.append(CheckpointEntry(path, type(model).__name__, "transformers"))
                    hf_roots.append(path)
        blocks = [
            (path, child)
            for path, child in _outermost(module, lambda m: isinstance(m, _TORCH_LAYERS))
            if not inside(path, hf_roots)
        ]
        found = None if blocks or hf_roots else _largest_uniform_list(module)
        if found is not None:
            prefix, blocks_list = found
            blocks = [(f"{prefix}.{name}".lstrip("."), child) for name, child in blocks_list.named_children()]
        elif not blocks and not hf_roots:
            raise ValueError(
                f"found no transformer blocks in {type(module).__name__}: no Hugging Face model, no "
                "nn.TransformerEncoderLayer/DecoderLayer and no nn.ModuleList of identical blocks. Name the blocks "
                "with `block_types=` (classes or class names)."
            )
    for path, block in blocks:
        result._undo.append(_wrap(block, preserve_rng_state))
        result.entries.append(CheckpointEntry(path, type(block).__name__, "forward"))
    return result


def _enable_transformers(model: Any, result: CheckpointResult) -> None:
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5 (the old names warn there)
        was_on = bool(model.is_activation_checkpointing)
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        disable = model.activation_checkpointing_disable
    else:
        was_on = bool(model.is_gradient_checkpointing)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        disable = model.gradient_checkpointing_disable
    if not was_on:
        result._undo.append(disable)
