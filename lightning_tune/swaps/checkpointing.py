"""Activation checkpointing for the repeated blocks of an unmodified model: :func:`checkpoint_blocks` (docs/presets.md).

Each block instance gets its own ``forward`` that recomputes its activations in the backward pass; classes,
parameters and the module tree are untouched, and the returned :class:`CheckpointResult` undoes it.
"""

from __future__ import annotations

import functools
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
from lightning_tune._validation import check_bool, check_instance

#: Blocks to checkpoint: module classes, or class names (``"Block"``) / qualified names (``"torch.nn.X"``) for YAML.
BlockTypes = type[nn.Module] | str | Sequence[type[nn.Module] | str]
#: How a block was checkpointed: its ``forward`` wrapped here, or the Hugging Face model's own switch.
CheckpointMethod = Literal["forward", "transformers"]
_TORCH_LAYERS: Final[tuple[type[nn.Module], ...]] = (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)


@dataclass(frozen=True)
class CheckpointEntry:
    """One checkpointed block (or Hugging Face model): its qualified name, class name and how it was checkpointed."""

    path: str
    module_type: str
    method: CheckpointMethod


@dataclass
class CheckpointResult(SurgeryResult):
    """What :func:`checkpoint_blocks` changed; :meth:`restore` (or leaving a ``with`` block) undoes it."""

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
    gradients are enabled.

    Args:
        module: The model (not wrapped in DDP/FSDP).
        block_types: Classes (or class names) of the blocks to checkpoint; the outermost instances are wrapped.
            ``None`` finds them (docs/presets.md).
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
    check_instance("module", module, nn.Module, "a torch.nn.Module")
    check_bool("preserve_rng_state", preserve_rng_state)
    refuse_wrapped(module, surgery="checkpoint_blocks", callback="ActivationCheckpointing")
    result = CheckpointResult()
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
        current = block.__dict__.get("forward")
        if not isinstance(current, CheckpointedForward):
            setattr(block, "forward", CheckpointedForward(block, current, preserve_rng_state))  # noqa: B010
        result._undo.append(functools.partial(remove_forward, block, CheckpointedForward))
        result.entries.append(CheckpointEntry(path, type(block).__name__, "forward"))
    return result


def _enable_transformers(model: Any, result: CheckpointResult) -> None:
    # transformers 5 renamed gradient_checkpointing_* to activation_checkpointing_* (the old names warn there)
    kind = "activation" if hasattr(model, "activation_checkpointing_enable") else "gradient"
    was_on = bool(getattr(model, f"is_{kind}_checkpointing"))
    getattr(model, f"{kind}_checkpointing_enable")(**{f"{kind}_checkpointing_kwargs": {"use_reentrant": False}})
    if not was_on:
        result._undo.append(getattr(model, f"{kind}_checkpointing_disable"))
