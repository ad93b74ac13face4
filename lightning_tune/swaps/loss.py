"""Compute a causal language model's training loss without its logits: :func:`swap_loss` (docs/loss_swap.md).

Each causal LM gets an instance-level ``forward`` that, called with labels, has its LM head turn the hidden states
straight into Hugging Face's ``ForCausalLMLoss``, so the ``tokens x vocabulary`` logits are never made.
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
from lightning_tune._validation import check_bool, check_instance, check_int
from lightning_tune.swaps.cross_entropy import check_loss_options, head_inputs, linear_cross_entropy
from lightning_tune.vocab import canonical_loss

ResolvedLoss = Literal["chunked", "liger"]
_LossFn = Callable[..., Any]  # the loss, or a LinearCrossEntropyOutput in eval mode
# config attributes of models that scale their logits in a way the swap does not reproduce
_LOGIT_SCALES = ("logit_scale", "logits_scaling", "output_multiplier_scale")


def _resolve_loss_backend(
    requested: str, *, device: torch.device, notify: Callable[[str], object] | None
) -> ResolvedLoss:
    """The backend that will run for a canonical ``requested``: ``"liger"`` only on CUDA with Liger-Kernel installed."""
    cuda = device.type == "cuda"
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
        why = f"the device is {device.type}, not CUDA"
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
    label_smoothing: float = 0.0,
    ce_weight: Tensor | None = None,
    lse_square_scale: float = 0.0,
) -> Tensor:
    fused = importlib.import_module("liger_kernel.transformers.fused_linear_cross_entropy")
    hidden, weight, labels = head_inputs(hidden, weight, labels, shift=shift, ignore_index=ignore_index)
    loss_fn = fused.LigerFusedLinearCrossEntropyLoss(
        ignore_index=ignore_index,
        reduction=reduction,
        softcap=softcap,
        label_smoothing=label_smoothing,
        ce_weight=None if ce_weight is None else ce_weight.to(hidden.device, torch.float32),
        lse_square_scale=lse_square_scale,
    )
    with torch.autocast(hidden.device.type, enabled=False):
        return loss_fn(weight, hidden, labels, bias)


_NO_LOGITS = (
    "This {name} has no `logits`: the model was called with `labels` under the loss swap (LossSwap / "
    "TunePlugin(loss=...) in training; with LossSwap(eval=True) / TunePlugin(loss_eval=True) in eval mode too), "
    "which computes the loss without ever making the logits. In eval mode the output has `token_accuracy` and "
    "`predictions` (each position's argmax) instead. To keep the logits, remove the swap (or its eval option), or call "
    "the model without `labels` and compute the loss yourself."
)


@functools.cache
def _without_logits_type(cls: Any) -> type:
    """``cls`` (a ``ModelOutput`` class) whose ``logits`` raises an error that names the swap.

    ``logits`` is no dataclass field of it either: code that walks an output's fields (FSDP2's hooks on a root
    module's output, ``dataclasses.replace``) sees the fields that hold something and never reads ``logits``.
    """

    def __getattribute__(self: Any, name: str) -> Any:  # noqa: N807
        if name == "logits":
            raise AttributeError(_NO_LOGITS.format(name=cls.__name__))
        return cls.__getattribute__(self, name)

    def __getitem__(self: Any, key: Any) -> Any:  # noqa: N807
        if key == "logits":
            raise KeyError(_NO_LOGITS.format(name=cls.__name__))
        return cls.__getitem__(self, key)

    namespace = {"__getattribute__": __getattribute__, "__getitem__": __getitem__, "__module__": cls.__module__}
    if hasattr(cls, "__dataclass_fields__"):
        namespace["__dataclass_fields__"] = {k: f for k, f in cls.__dataclass_fields__.items() if k != "logits"}
    return type(cls.__name__, (cls,), namespace)


@torch.compiler.disable  # a class made at run time and assigned to `__class__`: built outside a compiled graph
def _without_logits(output: Any, loss: Tensor, metrics: dict[str, Tensor | None]) -> Any:
    fields = {key: value for key, value in output.items() if key not in ("loss", "logits")}
    result = type(output)(loss=loss, **fields)
    if "logits" in result:
        OrderedDict.__delitem__(result, "logits")  # ModelOutput refuses `del`; its dict view must not hold the logits
    result.__class__ = _without_logits_type(cast(Hashable, type(output)))
    for name, value in metrics.items():  # attributes, not fields: the dict view and `to_tuple()` are as in training
        object.__setattr__(result, name, value)
    return result


class _HeadLoss(InstanceForward):
    """The LM head's ``forward`` while its model is swapped: the loss, in the calls its model's forward arms.

    Armed with labels by :class:`_LossForward`, it keeps the loss in :attr:`loss` and returns an empty ``[..., 0]``
    tensor for the logits, through which the loss is taken so that FSDP2's hook on the head's output runs in backward.
    Armed through attributes, so a compiled forward that calls the head is not compiled again.
    """

    def __init__(
        self, module: nn.Linear, original: Any, loss_fn: _LossFn, eval_fn: _LossFn, softcap: float | None
    ) -> None:
        super().__init__(module, original)
        self.loss_fn, self.eval_fn, self.softcap = loss_fn, eval_fn, softcap
        self.labels: Tensor | None = None  # armed while not None
        self.shift, self.items, self.ignore_index, self.evaluating = False, None, -100, False
        self.loss: Tensor | None = None
        self.metrics: dict[str, Tensor | None] = {}  # in eval mode: token_accuracy and predictions

    def __call__(self, hidden: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        if self.labels is None:
            return cast(Tensor, self.call_original(hidden, *args, **kwargs))
        head, items = self.module, self.items
        loss = (self.eval_fn if self.evaluating else self.loss_fn)(
            hidden,
            head.weight,
            self.labels,
            bias=head.bias,
            ignore_index=self.ignore_index,
            reduction="mean" if items is None else "sum",
            shift=self.shift,
            softcap=self.softcap,
        )
        if self.evaluating:  # a LinearCrossEntropyOutput: the metrics too
            self.metrics = {"token_accuracy": loss.token_accuracy, "predictions": loss.predictions}
            loss = loss.loss
        if items is not None:
            loss = loss / torch.as_tensor(items, device=loss.device)
        output = hidden.new_zeros(*hidden.shape[:-1], 0) + loss  # empty, not a view (FSDP2 warns about views)
        self.loss = loss + output.sum()  # adds 0; its gradient goes through `output` (and its hooks) too
        return output


class _LossForward(InstanceForward):
    """A causal LM's ``forward`` that, called with labels in training (or eval mode, with ``eval``), takes its loss.

    ``transformers`` labels are shifted here; a ``targets`` model's are already aligned, and it returns the loss.
    """

    def __init__(self, module: nn.Module, original: Any, head: _HeadLoss, kind: str, *, eval: bool) -> None:
        super().__init__(module, original)
        self.head, self.kind, self.eval = head, kind, eval
        self.signature = inspect.signature(self.__wrapped__)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        evaluating = not self.module.training
        if evaluating and not self.eval:
            return self.call_original(*args, **kwargs)
        arguments = dict(self.signature.bind(*args, **kwargs).arguments)
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
        head, shift_labels = self.head, arguments.get("shift_labels")
        head.labels = labels if shift_labels is None else shift_labels
        head.shift = hf and shift_labels is None
        head.items, head.ignore_index = arguments.get("num_items_in_batch"), arguments.get("ignore_index", -100)
        head.evaluating = evaluating
        try:
            output = self.call_original(**arguments)
        finally:
            head.labels = None
        loss, head.loss = head.loss, None
        if loss is None:
            raise RuntimeError(
                f"{type(self.module).__name__}.forward never called the LM head it had when the loss was swapped, so "
                "no loss was computed (a head replaced since: swap again)"
            )
        metrics, head.metrics = head.metrics, {}
        return _without_logits(output, loss, metrics) if hf else loss


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

    Kinds: ``"transformers"`` (``*ForCausalLM``, ``GPT2LMHeadModel``) and ``"targets"`` (the demo GPT's kind).

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
            f"The loss swap cannot swap {name}: its LM head is {type(head).__name__}, not a torch.nn.Linear (peft's "
            "LoRA adapter or `modules_to_save` on the head, for one: leave `lm_head` out of both, and train the head "
            "itself, if it is to be trained, with `model.get_output_embeddings().weight.requires_grad_(True)`)"
        )
    softcap = getattr(config, "final_logit_softcapping", None)
    return None if softcap is None else float(softcap)


@dataclass(frozen=True)
class LossSwapEntry:
    """One swapped causal LM: qualified name, class name, rows of its LM head, and final logit softcap if any."""

    path: str
    module_type: str
    vocab: int
    softcap: float | None


@dataclass
class LossSwapResult(SurgeryResult):
    """What :func:`swap_loss` changed; :meth:`restore` puts back each model's ``forward``."""

    requested: str
    backend: ResolvedLoss
    eval: bool = False
    entries: list[LossSwapEntry] = field(default_factory=list)

    def describe(self) -> str:
        """A title line, then one row per swapped model, for printing."""
        rows = [[e.path or "(root)", e.module_type, str(e.vocab), str(e.softcap)] for e in self.entries]
        title = f"Loss swap: backend {self.backend!r} (requested {self.requested!r}), {len(rows)} model(s)"
        title += ", evaluation too (chunked)" if self.eval else ""
        return f"{title}\n{table([['Module', 'Class', 'Vocabulary', 'Softcap'], *rows])}"


def swap_loss(
    module: nn.Module,
    backend: str = "auto",
    *,
    device: torch.device | str | None = None,
    chunk_size: int | None = None,
    label_smoothing: float = 0.0,
    ce_weight: Tensor | None = None,
    lse_square_scale: float = 0.0,
    eval: bool = False,
    notify: Callable[[str], object] | None = None,
) -> LossSwapResult:
    """Make each Hugging Face causal LM in ``module`` compute its training loss without logits (docs/loss_swap.md).

    Args:
        module: The model (a LightningModule, a peft model or a ``*ForCausalLM``).
        backend: ``"auto"``, ``"chunked"`` or ``"liger"``.
        device: Device the loss runs on; ``None``: that of the model's first parameter.
        chunk_size: Tokens per chunk of the ``"chunked"`` backend; ``None`` chooses.
        label_smoothing: As :func:`~lightning_tune.swaps.cross_entropy.linear_cross_entropy`'s.
        ce_weight: As :func:`~lightning_tune.swaps.cross_entropy.linear_cross_entropy`'s.
        lse_square_scale: As :func:`~lightning_tune.swaps.cross_entropy.linear_cross_entropy`'s.
        eval: Swap evaluation too (docs/loss_swap.md's "Evaluation", always the ``"chunked"`` backend).
        notify: Receives the message saying what ``"auto"`` chose.

    Raises:
        TypeError: If an argument has the wrong type, or a causal LM's head is not an ``nn.Linear``.
        ValueError: If an argument is not allowed, ``backend`` cannot run here, or ``module`` holds no causal LM the
            swap can compute right (docs/loss_swap.md lists what it refuses).

    Example:
        >>> from lightning_tune.demos import GPT, GPTConfig
        >>> result = swap_loss(GPT(GPTConfig(vocab_size=500)), "chunked")
        >>> print(result.describe())
        Loss swap: backend 'chunked' (requested 'chunked'), 1 model(s)
        Module  Class  Vocabulary  Softcap
        (root)  GPT    500         None
        >>> result.restore()
    """
    check_instance("module", module, nn.Module, "a torch.nn.Module")
    check_int("chunk_size", chunk_size, minimum=1, allow_none=True)
    check_loss_options(label_smoothing, ce_weight, lse_square_scale)
    check_bool("eval", eval)
    requested = canonical_loss(backend, arg="backend")
    first = next(module.parameters(), None)
    run_device = torch.device(device if device is not None else "cpu" if first is None else first.device)
    resolved = _resolve_loss_backend(requested, device=run_device, notify=notify)
    options: dict[str, Any] = dict(
        label_smoothing=label_smoothing, ce_weight=ce_weight, lse_square_scale=lse_square_scale
    )
    chunked = functools.partial(linear_cross_entropy, chunk_size=chunk_size, **options)
    loss_fn: _LossFn = functools.partial(_liger_loss, **options) if resolved == "liger" else chunked
    eval_fn = functools.partial(chunked, return_token_accuracy=True, return_predictions=True)
    result = LossSwapResult(requested=requested, backend=resolved, eval=eval)
    models = find_causal_lms(module)
    if not models:
        raise ValueError(
            f"The loss swap (LossSwap / TunePlugin(loss={requested!r})) found no causal language model in "
            f"{type(module).__name__}. It swaps Hugging Face `*ForCausalLM` and `GPT2LMHeadModel` instances, and "
            "modules whose `forward` takes `targets` and whose output layer `head` is a torch.nn.Linear (the demo "
            "GPT). For another model, remove the swap and compute the loss in `training_step` from the hidden states "
            "before the head: `lightning_tune.linear_cross_entropy(hidden, head.weight, labels, shift=True)`. A model "
            "built in `configure_model` does not exist yet when the LossSwap callback swaps (at `setup`): use "
            f"TunePlugin(loss={requested!r}), which swaps after `configure_model`."
        )
    softcaps = [_check_model(path, model, kind) for path, model, kind in models]  # refuse before changing anything
    for _, model, kind in models:
        check_loss_options(label_smoothing, ce_weight, lse_square_scale, vocab=_head(model, kind).out_features)
    for (path, model, kind), softcap in zip(models, softcaps, strict=True):
        head = _head(model, kind)
        head_loss = _HeadLoss(head, _original(head, _HeadLoss), loss_fn, eval_fn, softcap)
        setattr(head, "forward", head_loss)  # noqa: B010
        result._undo.append(functools.partial(remove_forward, head, _HeadLoss))
        wrapped = _LossForward(model, _original(model, _LossForward), head_loss, kind, eval=eval)
        setattr(model, "forward", wrapped)  # noqa: B010
        result._undo.append(functools.partial(remove_forward, model, _LossForward))
        result.entries.append(LossSwapEntry(path, type(model).__name__, head.weight.shape[0], softcap))
    return result


def _original(module: nn.Module, kind: type[InstanceForward]) -> Any:
    """The instance ``forward`` a new wrap of type ``kind`` calls: the one under an earlier such wrap, never it."""
    current = module.__dict__.get("forward")
    return current.original if isinstance(current, kind) else current
