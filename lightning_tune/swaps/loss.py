"""Compute a causal language model's training loss without its logits: :func:`swap_loss`.

Each Hugging Face ``*ForCausalLM`` (or ``GPT2LMHeadModel``) instance found in the model gets an instance-level
``forward`` (never a class patch), as does a module whose ``forward`` takes ``targets`` and whose output layer is
``head`` (the demo GPT; see :func:`find_causal_lms`). While the model is training and labels are given, that forward
runs the model's own forward with its head replaced, for that call only, by a function that turns the hidden states
straight into the loss, so the ``tokens x vocabulary`` logits are never made; the output's ``loss`` is the model's loss
and it has no ``logits``. Without labels, or in eval mode (validation, predict, generation), the model runs unchanged.

The loss is Hugging Face's ``ForCausalLMLoss``: labels shifted left by one (or the ``shift_labels`` given),
``ignore_index`` (-100 by default), a mean over the real tokens, or the sum divided by ``num_items_in_batch`` when it
is passed. The head's bias and Gemma 2's ``final_logit_softcapping`` are applied; tied embeddings need nothing (the
head's weight is the embedding's tensor). Models that scale their logits some other way, or define another loss, are
refused when swapped.

Backends (:data:`lightning_tune.vocab.LOSS_BACKENDS`): ``"chunked"`` (:func:`linear_cross_entropy`, PyTorch, any
device), ``"liger"`` (Liger-Kernel's fused linear cross-entropy, CUDA only, ``pip install 'lightning-tune[liger]'``)
and ``"auto"`` (liger on CUDA when it is installed, else chunked).
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, Literal, cast

import torch
from torch import Tensor, nn

from lightning_tune import _imports
from lightning_tune._surgery import InstanceForward, SurgeryResult, pretrained_model_class, remove_forward, table
from lightning_tune._validation import check_int
from lightning_tune.swaps.cross_entropy import linear_cross_entropy
from lightning_tune.vocab import canonical_loss

__all__ = ["LossSwapEntry", "LossSwapResult", "find_causal_lms", "resolve_loss_backend", "swap_loss"]

ResolvedLoss = Literal["chunked", "liger"]
_LossFn = Callable[..., Tensor]
# config attributes of models that scale their logits in a way the swap does not reproduce
_LOGIT_SCALES = ("logit_scale", "logits_scaling", "output_multiplier_scale")


def resolve_loss_backend(
    requested: str, *, device: torch.device | str, notify: Callable[[str], object] | None = None
) -> ResolvedLoss:
    """The backend that will run: ``"liger"`` only on CUDA with Liger-Kernel installed.

    Args:
        requested: ``"auto"``, ``"chunked"`` or ``"liger"``.
        device: Device the loss will be computed on.
        notify: Receives the one message saying what ``"auto"`` chose.

    Returns:
        ``"chunked"`` or ``"liger"``.

    Raises:
        ValueError: If ``requested`` is unknown, or ``"liger"`` is asked for off CUDA.
        ModuleNotFoundError: If ``"liger"`` is asked for and Liger-Kernel is not installed.

    Example:
        >>> resolve_loss_backend("auto", device="cpu")
        'chunked'
    """
    requested = canonical_loss(requested, arg="backend")
    cuda = torch.device(device).type == "cuda"
    if requested == "chunked":
        return "chunked"
    if requested == "liger":
        if not cuda:
            raise ValueError(
                "`backend='liger'` needs a CUDA device (Liger-Kernel's kernels are Triton), got device "
                f"{str(device)!r}; use backend='chunked' (or 'auto') off CUDA"
            )
        _imports.require("liger_kernel", feature="LossSwap(backend='liger')")
        return "liger"
    resolved: ResolvedLoss = "liger" if cuda and _imports.is_available("liger_kernel") else "chunked"
    if notify is not None:
        why = f"the device is {torch.device(device).type}, not CUDA"
        if cuda:
            why = "Liger-Kernel on CUDA" if resolved == "liger" else "Liger-Kernel is not installed"
        notify(f"Loss swap: backend 'auto' chose {resolved!r} ({why})")
    return resolved


def _liger_loss(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    *,
    bias: Tensor | None,
    ignore_index: int,
    reduction: str,
    shift: bool,
    softcap: float | None,
) -> Tensor:
    _imports.require("liger_kernel", feature="LossSwap(backend='liger')")
    fused = importlib.import_module("liger_kernel.transformers.fused_linear_cross_entropy")
    loss_fn = fused.LigerFusedLinearCrossEntropyLoss(ignore_index=ignore_index, reduction=reduction, softcap=softcap)
    if shift:
        labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    if torch.is_autocast_enabled(hidden.device.type):  # the head's product in the autocast dtype, as nn.Linear's
        dtype = torch.get_autocast_dtype(hidden.device.type)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
    hidden = hidden.reshape(-1, hidden.shape[-1])
    with torch.autocast(hidden.device.type, enabled=False):
        return loss_fn(weight.to(hidden.dtype), hidden, labels.reshape(-1).to(hidden.device), bias)


_NO_LOGITS = (
    "This {name} has no `logits`: the model was called with `labels` in training under the loss swap (LossSwap / "
    "TunePlugin(loss=...)), which computes the loss without ever making the logits. To keep them, remove the swap, "
    "or call the model without `labels` and compute the loss yourself (or call model.eval() around the call)."
)


@functools.cache
def _without_logits_type(cls: Any) -> type:
    """``cls`` (a ``ModelOutput`` class) whose ``logits`` raises an error that names the swap."""

    def __getattribute__(self: Any, name: str) -> Any:  # noqa: N807
        if name == "logits":
            raise AttributeError(_NO_LOGITS.format(name=cls.__name__))
        return cls.__getattribute__(self, name)

    def __getitem__(self: Any, key: Any) -> Any:  # noqa: N807
        if key == "logits":
            raise KeyError(_NO_LOGITS.format(name=cls.__name__))
        return cls.__getitem__(self, key)

    namespace = {"__getattribute__": __getattribute__, "__getitem__": __getitem__, "__module__": cls.__module__}
    return type(cls.__name__, (cls,), namespace)


def _without_logits(output: Any, loss: Tensor) -> Any:
    fields = {key: value for key, value in output.items() if key not in ("loss", "logits")}
    result = type(output)(loss=loss, **fields)
    if "logits" in result:
        OrderedDict.__delitem__(result, "logits")  # ModelOutput refuses `del`; its dict view must not hold the logits
    result.__class__ = _without_logits_type(cast(Hashable, type(output)))
    return result


class _HeadLoss(InstanceForward):
    """The LM head's ``forward`` for one call: the loss from the hidden states, and an empty ``[..., 0]`` tensor."""

    def __init__(self, module: nn.Linear, original: Any, compute: Callable[[Tensor], Tensor]) -> None:
        super().__init__(module, original)
        self.compute = compute
        self.loss: Tensor | None = None

    def __call__(self, hidden: Tensor) -> Tensor:
        self.loss = self.compute(hidden)
        return hidden.new_empty(*hidden.shape[:-1], 0)


class _LossForward(InstanceForward):
    """A causal LM's ``forward`` that, in training with labels, takes its loss from the hidden states.

    ``transformers``: labels are ``labels``, shifted here, and the output a ``ModelOutput`` without logits. A
    ``targets`` model (the demo GPT): its ``targets`` are already aligned with the positions, and it returns the loss.
    """

    def __init__(self, module: nn.Module, original: Any, loss_fn: _LossFn, softcap: float | None, kind: str) -> None:
        super().__init__(module, original)
        self.loss_fn, self.softcap, self.kind = loss_fn, softcap, kind
        self.signature = inspect.signature(self.__wrapped__)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.module.training:
            return self.call_original(*args, **kwargs)
        bound = self.signature.bind(*args, **kwargs)
        arguments = dict(bound.arguments)
        for name, parameter in self.signature.parameters.items():
            if parameter.kind is inspect.Parameter.VAR_KEYWORD:
                arguments.update(arguments.pop(name, {}))
        hf = self.kind == "transformers"
        labels = arguments.pop("labels" if hf else "targets", None)
        if labels is None:
            return self.call_original(*args, **kwargs)
        if hf and arguments.get("return_dict") is False:
            raise ValueError(
                f"{type(self.module).__name__} was called with return_dict=False under the loss swap; it returns a "
                "ModelOutput (with `loss` and no `logits`): call it without return_dict=False"
            )
        head = _head(self.module, self.kind)
        shift_labels = arguments.get("shift_labels")
        items = arguments.get("num_items_in_batch")

        def compute(hidden: Tensor) -> Tensor:
            loss = self.loss_fn(
                hidden,
                head.weight,
                labels if shift_labels is None else shift_labels,
                bias=head.bias,
                ignore_index=arguments.get("ignore_index", -100),
                reduction="mean" if items is None else "sum",
                shift=hf and shift_labels is None,
                softcap=self.softcap,
            )
            return loss if items is None else loss / torch.as_tensor(items, device=loss.device)

        capture = _HeadLoss(head, head.__dict__.get("forward"), compute)
        setattr(head, "forward", capture)  # noqa: B010
        try:
            output = self.call_original(**arguments)
        finally:
            remove_forward(head, _HeadLoss)
        if capture.loss is None:
            raise RuntimeError(
                f"{type(self.module).__name__}.forward never called its LM head, so no loss was computed"
            )
        return _without_logits(output, capture.loss) if hf else capture.loss


def _head(model: nn.Module, kind: str) -> Any:
    return model.get_output_embeddings() if kind == "transformers" else getattr(model, "head", None)  # type: ignore[operator]


def _kind(module: nn.Module, pretrained: type | None) -> str | None:
    if pretrained is not None and isinstance(module, pretrained):
        name = type(module).__name__
        return "transformers" if name.endswith("ForCausalLM") or name == "GPT2LMHeadModel" else None
    if isinstance(getattr(module, "head", None), nn.Linear):
        return "targets" if "targets" in inspect.signature(module.forward).parameters else None
    return None


def find_causal_lms(module: nn.Module) -> list[tuple[str, nn.Module, str]]:
    """The outermost causal LMs in ``module`` the loss swap knows, with their qualified names and kinds.

    Kinds: ``"transformers"``, a Hugging Face ``*ForCausalLM`` or ``GPT2LMHeadModel``; ``"targets"``, a module whose
    ``forward`` takes ``targets`` (aligned with the positions, ``-100`` ignored) and then returns the mean cross-entropy
    of its output layer ``head``, an ``nn.Linear`` (the demo GPT).

    Example:
        >>> find_causal_lms(nn.Linear(2, 2))
        []
    """
    pretrained = pretrained_model_class()
    found: list[tuple[str, nn.Module, str]] = []
    for path, child in module.named_modules():
        outer = any(path.startswith(f"{done}.") or done == "" for done, _, _ in found)
        kind = None if outer else _kind(child, pretrained)
        if kind is not None:
            found.append((path, child, kind))
    return found


def _check_model(path: str, model: nn.Module, kind: str) -> float | None:
    """Refuse what the swap would compute wrongly; return the model's logit softcap."""
    name = f"{type(model).__name__} at {path or '(root)'!r}"
    if kind == "targets":
        return None
    config = getattr(model, "config", None)
    for attr in _LOGIT_SCALES:
        scale = getattr(config, attr, None)
        if scale not in (None, 1, 1.0):
            raise ValueError(
                f"The loss swap cannot swap {name}: it scales its logits (config.{attr}={scale!r}), which the swap "
                "does not reproduce"
            )
    loss_function = getattr(model, "loss_function", None)
    if getattr(loss_function, "__name__", "ForCausalLMLoss") != "ForCausalLMLoss":
        raise ValueError(
            f"The loss swap cannot swap {name}: its loss is {getattr(loss_function, '__name__', loss_function)!r}, "
            "not Hugging Face's ForCausalLMLoss"
        )
    head = _head(model, kind)
    if not isinstance(head, nn.Linear):
        raise TypeError(
            f"The loss swap cannot swap {name}: its LM head is {type(head).__name__}, not a torch.nn.Linear (a LoRA "
            "adapter on the head, for one: leave `lm_head` out of the adapter's target modules)"
        )
    softcap = getattr(config, "final_logit_softcapping", None)
    return None if softcap is None else float(softcap)


@dataclass(frozen=True)
class LossSwapEntry:
    """One swapped causal LM.

    Args:
        path: Qualified name inside the model (``""`` for the model itself).
        module_type: Its class name.
        vocab: Rows of its LM head.
        softcap: Its final logit softcap, if any.
    """

    path: str
    module_type: str
    vocab: int
    softcap: float | None


@dataclass
class LossSwapResult(SurgeryResult):
    """What :func:`swap_loss` changed; :meth:`restore` puts back each model's ``forward``.

    Args:
        requested: The backend asked for.
        backend: The backend that runs.
        entries: One entry per swapped model.
    """

    requested: str
    backend: ResolvedLoss
    entries: list[LossSwapEntry] = field(default_factory=list)

    def describe(self) -> str:
        """A title line, then one row per swapped model, for printing."""
        if not self.entries:
            return f"Loss swap (backend={self.requested!r}): no causal language model found"
        rows = [[e.path or "(root)", e.module_type, str(e.vocab), str(e.softcap)] for e in self.entries]
        title = f"Loss swap: backend {self.backend!r} (requested {self.requested!r}), {len(rows)} model(s)"
        return f"{title}\n{table([['Module', 'Class', 'Vocabulary', 'Softcap'], *rows])}"


def swap_loss(
    module: nn.Module,
    backend: str = "auto",
    *,
    device: torch.device | str | None = None,
    chunk_size: int | None = None,
    notify: Callable[[str], object] | None = None,
) -> LossSwapResult:
    """Make each Hugging Face causal LM in ``module`` compute its training loss without logits (see the module doc).

    Args:
        module: The model (a LightningModule, a peft model or a ``*ForCausalLM``).
        backend: ``"auto"``, ``"chunked"`` or ``"liger"``.
        device: Device the loss runs on; ``None``: that of the model's first parameter.
        chunk_size: Tokens per chunk of the ``"chunked"`` backend; ``None`` chooses
            (:func:`~lightning_tune.swaps.cross_entropy.default_chunk_size`).
        notify: Receives the message saying what ``"auto"`` chose.

    Returns:
        The swapped models, with :meth:`~LossSwapResult.restore` and :meth:`~LossSwapResult.describe`.

    Raises:
        TypeError: If ``module`` is not an ``nn.Module``, or a causal LM's head is not an ``nn.Linear``.
        ValueError: If ``backend`` is unknown or cannot run here, or a model scales its logits or defines another
            loss.

    Example:
        >>> result = swap_loss(nn.Linear(2, 2), "chunked")
        >>> print(result.describe())
        Loss swap (backend='chunked'): no causal language model found
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"`module` must be a torch.nn.Module, got {module!r} ({type(module).__name__})")
    check_int("chunk_size", chunk_size, minimum=1, allow_none=True)
    requested = canonical_loss(backend, arg="backend")
    first = next(module.parameters(), None)
    run_device = (
        torch.device(device) if device is not None else (torch.device("cpu") if first is None else first.device)
    )
    resolved = resolve_loss_backend(requested, device=run_device, notify=notify)
    loss_fn: _LossFn = (
        _liger_loss if resolved == "liger" else functools.partial(linear_cross_entropy, chunk_size=chunk_size)
    )
    result = LossSwapResult(requested=requested, backend=resolved)
    models = find_causal_lms(module)
    softcaps = [_check_model(path, model, kind) for path, model, kind in models]  # refuse before changing anything
    for (path, model, kind), softcap in zip(models, softcaps, strict=True):
        current = model.__dict__.get("forward")
        original = current.original if isinstance(current, _LossForward) else current
        setattr(model, "forward", _LossForward(model, original, loss_fn, softcap, kind))  # noqa: B010
        result._undo.append(functools.partial(remove_forward, model, _LossForward))
        vocab = _head(model, kind).weight.shape[0]
        result.entries.append(LossSwapEntry(path, type(model).__name__, vocab, softcap))
    return result
