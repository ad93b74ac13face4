"""Count a training step's FLOPs on a meta-device copy of the model, never on the model that is timed.

The real model is never called, so a compiled model is compiled as usual (Dynamo does not compile a frame it first
meets under a dispatch mode). The counting conventions: ``docs/peak_flops.md``.
"""

from __future__ import annotations

import contextlib
import copy
import math
import types
import warnings
from collections.abc import Callable, Mapping
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils.flop_counter import FlopCounterMode

from lightning_tune._surgery import InstanceForward
from lightning_tune._validation import check_bool, check_float, check_instance, check_int
from lightning_tune.perf.batch import map_children, sequence_length

__all__ = ["FlopModel", "attention_pairs", "count_step_flops", "meta_copy"]


def attention_pairs(q_len: int, k_len: int, *, causal: bool) -> int:
    """Number of (query, key) pairs an attention call attends; causal: query ``i`` sees keys ``0..i`` (top left).

    Raises:
        TypeError: If a length is not an integer or ``causal`` not a bool.
        ValueError: If a length is negative.

    Example:
        >>> attention_pairs(4, 4, causal=False), attention_pairs(4, 4, causal=True)
        (16, 10)
    """
    check_int("q_len", q_len, minimum=0)
    check_int("k_len", k_len, minimum=0)
    check_bool("causal", causal)
    if not causal:
        return q_len * k_len
    seen = min(q_len, k_len)  # queries 0..seen-1 see i + 1 keys; the rest see all k_len keys
    return seen * (seen + 1) // 2 + (q_len - seen) * k_len


@dataclass(frozen=True)
class FlopModel:
    """FLOPs of one training micro-batch as a function of its shape, from one count at a known shape.

    Args:
        samples: Samples of the counted batch.
        seq_len: Sequence length of the counted batch, ``None`` when it held no ``(batch, seq)`` token ids.
        dense: FLOPs of everything but attention in the counted batch (grows with samples x positions).
        causal_attention: Causal attention FLOPs in the counted batch (grows with ``L * (L + 1) / 2``).
        full_attention: Other attention FLOPs in the counted batch (grows with ``L ** 2``).

    Raises:
        TypeError: If a field has the wrong type.
        ValueError: If ``samples`` or ``seq_len`` is below 1, or a FLOP count is negative or not finite.

    Example:
        >>> model = FlopModel(samples=2, seq_len=4, dense=800.0, causal_attention=200.0, full_attention=0.0)
        >>> model.total  # the counted batch
        1000.0
        >>> model.flops(samples=1, seq_len=8)  # half the sequences, twice as long: 800 dense, 36/10 x 100 causal
        1160.0
    """

    samples: int
    seq_len: int | None
    dense: float
    causal_attention: float
    full_attention: float

    def __post_init__(self) -> None:
        check_int("samples", self.samples, minimum=1)
        check_int("seq_len", self.seq_len, minimum=1, allow_none=True)
        for name in ("dense", "causal_attention", "full_attention"):
            check_float(name, getattr(self, name), low=0.0)

    @property
    def total(self) -> float:
        """FLOPs of the counted batch."""
        return self.dense + self.causal_attention + self.full_attention

    def flops(self, samples: int, seq_len: int | None = None) -> float:
        """FLOPs of a micro-batch of ``samples`` sequences of ``seq_len`` positions (``None``: by samples alone)."""
        per_sample = samples / self.samples
        base = self.seq_len
        if base is None or seq_len is None or seq_len == base:
            return per_sample * self.total
        causal = seq_len * (seq_len + 1) / (base * (base + 1))  # the causal pairs' ratio, L * (L + 1) / 2 each
        return per_sample * (
            self.dense * seq_len / base + self.causal_attention * causal + self.full_attention * (seq_len / base) ** 2
        )


class _AttentionCounter(TorchFunctionMode):
    """Counts ``F.scaled_dot_product_attention`` calls by formula and runs an uncounted stand-in of the same shape."""

    def __init__(self) -> None:
        super().__init__()
        self.flops = {True: 0.0, False: 0.0}  # forward and backward FLOPs, by causality
        self.forward = {True: 0.0, False: 0.0}  # forward FLOPs alone, by causality

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        bound = dict(zip(("query", "key", "value", "attn_mask", "dropout_p", "is_causal"), args, strict=False)) | kwargs
        q, k, v = bound["query"], bound["key"], bound["value"]
        causal = bool(bound.get("is_causal", False)) and bound.get("attn_mask") is None
        heads = math.prod(q.shape[:-2])
        forward = 2 * heads * attention_pairs(q.shape[-2], k.shape[-2], causal=causal) * (q.shape[-1] + v.shape[-1])
        needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
        flops = forward * (3 if needs_grad else 1)  # backward: dS, dQ, dK, dV = twice the forward's two matmuls
        self.forward[causal] += forward
        self.flops[causal] += flops
        # same shape and gradient paths as the real output; sums and broadcasts are not counted as FLOPs
        return q.sum(-1, keepdim=True).expand(*q.shape[:-1], v.shape[-1]) + (k.sum() + v.sum())


def _meta_tensor(tensor: Tensor, memo: dict[int, Any]) -> Tensor:
    found = memo.get(id(tensor))
    if found is None:
        meta = torch.empty_like(tensor, device="meta")
        found = nn.Parameter(meta, requires_grad=tensor.requires_grad) if isinstance(tensor, nn.Parameter) else meta
        memo[id(tensor)] = found
    return found


class _Tally:
    """The counters of one count, and the forward FLOPs of the checkpointed blocks (what their backward recomputes)."""

    def __init__(self) -> None:
        self.counter = FlopCounterMode(display=False)
        self.attention = _AttentionCounter()
        self.recomputed = [0.0, 0.0, 0.0]  # dense, causal attention, full attention

    def forward_flops(self) -> list[float]:
        forward = self.attention.forward
        return [float(self.counter.get_total_flops()), forward[True], forward[False]]

    def probe(self, run: Callable[..., Any]) -> Callable[..., Any]:
        """Stands in the copy for a checkpointing wrapper: runs the block once and notes its forward FLOPs."""

        def forward(*args: Any, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():  # nothing saved, nothing recomputed (as in the real wrapper)
                return run(*args, **kwargs)
            before = self.forward_flops()
            out = run(*args, **kwargs)
            after = self.forward_flops()
            self.recomputed = [r + b - a for r, a, b in zip(self.recomputed, before, after, strict=True)]
            return out

        return forward


def _is_metric(module: nn.Module) -> bool:
    """Whether ``module`` is a torchmetrics ``Metric`` (told apart without importing torchmetrics)."""
    return any(k.__name__ == "Metric" and k.__module__ == "torchmetrics.metric" for k in type(module).__mro__)


def _skip_metric(*args: Any, **kwargs: Any) -> Tensor:
    """What a torchmetrics metric's ``forward`` and ``update`` do on the copy: nothing, but give a value to log."""
    return torch.zeros(())  # on the meta device, as the count runs under it


def _copy_module(module: nn.Module, tally: _Tally | None, memo: dict[int, Any]) -> nn.Module:
    if id(module) in memo:
        return memo[id(module)]
    inner = getattr(module, "_orig_mod", None)
    if isinstance(inner, nn.Module) and type(module).__name__ == "OptimizedModule":  # torch.compile(module)
        memo[id(module)] = clone = _copy_module(inner, tally, memo)
        return clone
    clone = copy.copy(module)  # shallow: the copy shares every attribute but those replaced below
    memo[id(module)] = clone
    clone._parameters = {
        name: None if p is None else _meta_tensor(p, memo)  # type: ignore[misc]
        for name, p in module._parameters.items()
    }
    clone._buffers = {name: None if b is None else _meta_tensor(b, memo) for name, b in module._buffers.items()}
    clone._modules = {
        name: None if child is None else _copy_module(child, tally, memo) for name, child in module._modules.items()
    }
    state = vars(clone)
    for key, value in state.items():  # e.g. `self.outputs.append(loss)` in training_step: meta tensors stay in the copy
        if key not in ("_parameters", "_buffers", "_modules") and isinstance(value, (list, dict, set)):
            state[key] = copy.copy(value)
    if state.get("_compiled_call_impl") is not None:  # module.compile(): run the copy eagerly
        state["_compiled_call_impl"] = None
    if "_trainer" in state:  # a LightningModule: the copy logs nothing and touches no Trainer
        state["_trainer"] = None
    if isinstance(state.get("_device"), torch.device):  # `self.device` of a LightningModule: tensors made on it
        state["_device"] = torch.device("meta")
    if _is_metric(module):  # not model FLOPs, and some have no meta kernel (a multiclass accuracy's bincount)
        state["forward"] = state["update"] = _skip_metric
    hf_checkpointed = state.get("gradient_checkpointing") is True  # Hugging Face's switch: off in the copy
    if hf_checkpointed:
        state["gradient_checkpointing"] = False
    _copy_config(state, memo)
    # the layers Hugging Face checkpoints (its own switch, which ActivationCheckpointing uses for these models)
    checkpointed = hf_checkpointed and any(k.__name__ == "GradientCheckpointingLayer" for k in type(module).__mro__)
    original = state.get("forward")
    if isinstance(original, InstanceForward):  # swaps and presets run as the module's own forward on the copy
        from lightning_tune.swaps.checkpointing import CheckpointedForward  # the package's own checkpointing

        # wrappers stack (the loss swap around the attention swap's): each holds the real module, so unwrap them all
        while isinstance(original, InstanceForward):
            checkpointed = checkpointed or isinstance(original, CheckpointedForward)
            original = original.original
        if original is None:
            del state["forward"]
        elif isinstance(original, types.MethodType) and original.__self__ is module:  # the module's own: the copy's
            state["forward"] = types.MethodType(original.__func__, clone)
        else:
            state["forward"] = original
    if checkpointed and tally is not None:
        state["forward"] = tally.probe(clone.forward)
    return clone


def _copy_config(state: dict[str, Any], memo: dict[int, Any]) -> None:
    """A Hugging Face model on flash-attn is counted through its SDPA path: meta tensors reach no CUDA kernel."""
    config = state.get("config")
    implementation = getattr(config, "_attn_implementation", None)
    if not (isinstance(implementation, str) and "flash" in implementation):
        return
    if id(config) not in memo:
        replaced = copy.copy(config)
        vars(replaced)["_attn_implementation_internal"] = "sdpa"
        memo[id(config)] = replaced
    state["config"] = memo[id(config)]


def meta_copy(module: nn.Module) -> nn.Module:
    """A copy of ``module`` whose parameters and buffers live on the meta device, for counting without computing.

    Submodules are copied shallowly (``module`` is left untouched): each copy holds its own parameter, buffer and
    child dicts and its own lists, dicts and sets, and shares every other attribute. ``torch.compile`` wrappers are
    unwrapped, the Trainer reference is dropped, this package's ``forward`` wrappers are removed, activation
    checkpointing is off (a Hugging Face model on flash-attn runs its SDPA path) and torchmetrics metrics do nothing.

    Raises:
        TypeError: If ``module`` is not a ``torch.nn.Module``.

    Example:
        >>> layer = nn.Linear(3, 4)
        >>> copied = meta_copy(layer)
        >>> copied.weight.device, layer.weight.device
        (device(type='meta'), device(type='cpu'))
    """
    check_instance("module", module, nn.Module, "a torch.nn.Module")
    return _copy_module(module, None, {})


def _meta_batch(batch: Any) -> Any:
    return torch.empty_like(batch, device="meta") if isinstance(batch, Tensor) else map_children(batch, _meta_batch)


def count_step_flops(
    module: nn.Module, batch: Any, step: Callable[[nn.Module, Any], Any], *, samples: int
) -> tuple[FlopModel, FlopModel | None]:
    """Count the FLOPs of one training step (forward and backward) on a meta copy of ``module``.

    Args:
        module: The model.
        batch: A real batch; only its shapes and dtypes are used.
        step: ``step(copy, meta_batch)`` runs the forward and returns the loss (a tensor, or a mapping with
            ``"loss"``); its ``backward`` is counted too.
        samples: Samples in ``batch``.

    A mapping batch whose step cannot run on meta tensors is counted once more without its ``attention_mask``: a
    padding mask makes Hugging Face models read values (``.item()``) that meta tensors do not have, and without it
    they attend causally, which is how the count treats causal models (the pairs attended).

    Returns:
        The model FLOPs, and the hardware FLOPs when this package's activation checkpointing recomputes blocks
        (``None`` otherwise).

    Raises:
        TypeError: If ``module`` is not a ``torch.nn.Module``, ``step`` is not callable or ``samples`` not an integer.
        ValueError: If ``samples`` is negative.
        Exception: Whatever the step raises on meta tensors (data-dependent Python control flow, ``.item()``, a
            device given by hand): the caller decides what to do without a count.

    Example:
        >>> model = nn.Linear(8, 4)
        >>> flops, hardware = count_step_flops(model, torch.ones(2, 8), lambda m, x: m(x).sum(), samples=2)
        >>> flops.total, hardware  # forward 2*2*8*4, and the weight gradient (the input needs none)
        (256.0, None)
    """
    check_instance("module", module, nn.Module, "a torch.nn.Module")
    if not callable(step):
        raise TypeError(f"`step` must be a callable step(copy, batch) -> loss, got {step!r} ({type(step).__name__})")
    check_int("samples", samples, minimum=0)
    try:
        return _count_step(module, batch, step, samples)
    except Exception:
        if not (isinstance(batch, Mapping) and "attention_mask" in batch):
            raise
        unmasked = {key: value for key, value in batch.items() if key != "attention_mask"}
        with contextlib.suppress(Exception):  # the first error is the one to report
            return _count_step(module, unmasked, step, samples)
        raise


def _count_step(
    module: nn.Module, batch: Any, step: Callable[[nn.Module, Any], Any], samples: int
) -> tuple[FlopModel, FlopModel | None]:
    tally = _Tally()
    copied = _copy_module(module, tally, {})
    stance = getattr(torch.compiler, "set_stance", None)  # torch >= 2.6: compiled functions run eagerly, uncompiled
    with (
        stance("force_eager") if stance is not None else nullcontext(),
        torch.device("meta"),  # tensors the step makes without a device
        tally.counter,
        tally.attention,
        warnings.catch_warnings(),
    ):
        warnings.simplefilter("ignore")  # e.g. `self.log` without a Trainer
        loss = step(copied, _meta_batch(batch))
        loss = loss.get("loss") if isinstance(loss, Mapping) else loss
        if isinstance(loss, Tensor) and loss.requires_grad:
            loss.backward()
    counts = [float(tally.counter.get_total_flops()), tally.attention.flops[True], tally.attention.flops[False]]
    counted, length = max(samples, 1), sequence_length(batch)
    flops = FlopModel(counted, length, *counts)
    if not any(tally.recomputed):
        return flops, None
    return flops, FlopModel(counted, length, *(c + r for c, r in zip(counts, tally.recomputed, strict=True)))
