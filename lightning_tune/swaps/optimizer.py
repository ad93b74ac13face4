"""Replace a configured optimizer with a memory-saving one over the same parameters: the swap engine.

The new optimizer (bitsandbytes 8-bit, or torch's fused AdamW) keeps every group and hyperparameter, and schedulers
are re-pointed to it (docs/optimizer_swap.md). ``OptimizerSwap`` and ``TunePlugin`` call :func:`swap_optimizers`.
"""

from __future__ import annotations

import functools
import math
import warnings
import weakref
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal, get_args

import torch
from torch import Tensor, nn
from torch.optim import Optimizer, optimizer as torch_optimizer

from lightning_tune._imports import require
from lightning_tune._surgery import SurgeryResult, table
from lightning_tune._validation import check_choice, check_instance, check_int
from lightning_tune.lr.scheduler import configured_lr
from lightning_tune.vocab import OptimizerName, canonical_optimizer

#: Named rules for which parameters keep 32-bit optimizer state.
Keep32bitName = Literal["embeddings", "none"]
KEEP_32BIT: Final[tuple[str, ...]] = get_args(Keep32bitName)

#: A named rule, or ``fn(name, param) -> bool`` called with the names of ``module.named_parameters()``.
Keep32bit = Keep32bitName | Callable[[str, nn.Parameter], bool]

_FROZEN = "no state (frozen)"
_EMBEDDINGS = (nn.Embedding, nn.EmbeddingBag)
#: Switches that choose a kernel, not the maths: never carried over (the target picks its own).
_IMPLEMENTATION_KEYS = frozenset({"foreach", "fused", "capturable"})
#: Settings that change the update rule, with the value that means "off" and what they are called in messages.
_VARIANTS: Final[Mapping[str, tuple[Any, str]]] = {
    "amsgrad": (False, "AMSGrad"),
    "nesterov": (False, "Nesterov momentum"),
    "dampening": (0, "momentum dampening"),
    "maximize": (False, "maximisation"),
    "differentiable": (False, "differentiating through the step"),
    "centered": (False, "centred RMSprop"),
}
#: Variants that are an error whatever the families: they flip the objective or autograd's view of the step.
_ALWAYS_REFUSED = frozenset({"maximize", "differentiable"})


@dataclass(frozen=True)
class _Target:
    """What one optimizer name builds and which group settings it honours."""

    class_name: str
    family: str
    hyper: Mapping[str, Any]
    decay: str  # "decoupled" (AdamW style) or "coupled" (an L2 term added to the gradient)
    flags: frozenset[str] = frozenset()
    bnb: bool = True


_ADAM = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
_ADAMW = {**_ADAM, "weight_decay": 1e-2}
_LION = {"lr": 1e-4, "betas": (0.9, 0.99), "weight_decay": 0.0}
_SGD = {"lr": 1e-3, "momentum": 0.9, "weight_decay": 0.0}

_TARGETS: Final[Mapping[str, _Target]] = {
    "adam8bit": _Target("Adam8bit", "adam", _ADAM, "decoupled"),
    "adamw8bit": _Target("AdamW8bit", "adam", _ADAMW, "decoupled"),
    "lion8bit": _Target("Lion8bit", "lion", _LION, "decoupled"),
    "sgd8bit": _Target("SGD8bit", "sgd", _SGD, "coupled"),
    "paged_adam8bit": _Target("PagedAdam8bit", "adam", _ADAM, "decoupled"),
    "paged_adamw8bit": _Target("PagedAdamW8bit", "adam", _ADAMW, "decoupled"),
    "paged_lion8bit": _Target("PagedLion8bit", "lion", _LION, "decoupled"),
    "adamw_fused": _Target("AdamW", "adam", _ADAMW, "decoupled", flags=frozenset({"amsgrad", "maximize"}), bnb=False),
}
#: The optimizers of :data:`lightning_tune.vocab.OPTIMIZERS` a swap builds: all but the module's own AdamW and SGD.
TARGETS: Final[tuple[str, ...]] = tuple(_TARGETS)
#: Each optimizer a swap built -> the class name of the optimizer it replaced (what LR monitors named its LRs after).
_REPLACED: weakref.WeakKeyDictionary[Optimizer, str] = weakref.WeakKeyDictionary()


@dataclass
class OptimizerSwapResult(SurgeryResult):
    """What one swap did. :meth:`restore` re-points the schedulers :func:`swap_optimizers` moved back to ``old``.

    Attributes:
        old: The optimizer that was replaced (left untouched).
        new: The optimizer that replaces it, over the same parameter objects.
        optimizer: The name it was built from, one of :data:`TARGETS`.
        kept_32bit: Names of the parameters ``keep_32bit`` kept in 32-bit state (every alias of a tied parameter).
        changes: One line per setting a swap across algorithm families dropped or filled in.
        min_8bit_size: Tensors with fewer elements keep 32-bit state.
    """

    old: Optimizer
    new: Optimizer
    optimizer: str
    kept_32bit: tuple[str, ...]
    changes: tuple[str, ...] = ()
    min_8bit_size: int = 4096
    kept_params: tuple[Tensor, ...] = field(default=(), repr=False, compare=False)

    def describe(self) -> str:
        """The swap as plain-text tables, for printing: groups, state precision and what changed."""
        target = _TARGETS[self.optimizer]
        title = f"{type(self.old).__name__} -> {type(self.new).__name__} ({self.optimizer!r})"
        keys = [k for k in ("lr", "betas", "momentum", "eps", "weight_decay") if k in target.hyper]
        rows = [["group", "tensors", "elements", *keys]]
        for index, group in enumerate(self.new.param_groups):
            values = {**group, "lr": configured_lr(group)}
            if target.family == "sgd":
                values["momentum"] = group["betas"][0]  # bitsandbytes keeps SGD's momentum there
            counts = [str(index), str(len(group["params"])), f"{_numel(group['params']):,}"]
            rows.append(counts + [_fmt(values.get(key)) for key in keys])
        buckets = self.state_buckets()
        state = [["state", "tensors", "elements", ""]]
        for label, members in buckets.items():
            names = ", ".join(self.kept_32bit) if label == "32-bit (kept)" else ""
            state.append([label, str(len(members)), f"{_numel(members):,}", names])
        changes = "changes:\n" + "\n".join(f"  {c}" for c in self.changes) if self.changes else "changes: none"
        return "\n".join([title, table(rows), table(state), changes])

    def state_buckets(self) -> dict[str, list[Tensor]]:
        """The new optimizer's parameters by the row label of :meth:`describe`'s state table (``"8-bit"``, ...)."""
        kept = {id(p) for p in self.kept_params}
        small = f"32-bit (< {self.min_8bit_size:,})"
        if _TARGETS[self.optimizer].bnb:
            buckets: dict[str, list[Tensor]] = {"8-bit": [], "32-bit (kept)": [], small: []}
        else:
            buckets = {f"32-bit ({'fused AdamW' if self.new.param_groups[0].get('fused') else 'AdamW'})": []}
        buckets[_FROZEN] = []
        for p in _unique_params(self.new):
            if not p.requires_grad:
                buckets[_FROZEN].append(p)
            elif "8-bit" not in buckets:
                buckets[next(iter(buckets))].append(p)
            elif id(p) in kept:
                buckets["32-bit (kept)"].append(p)
            else:
                buckets[small if p.numel() < self.min_8bit_size else "8-bit"].append(p)
        return buckets

    @property
    def saves_nothing(self) -> bool:
        """Whether a bitsandbytes swap put no trainable tensor in 8-bit state (all small or kept 32-bit)."""
        buckets = self.state_buckets()
        trainable = sum(len(v) for k, v in buckets.items() if k != _FROZEN)
        return "8-bit" in buckets and not buckets["8-bit"] and trainable > 0


def check_state_options(keep_32bit: Any, min_8bit_size: Any) -> None:
    """Raise ``TypeError``/``ValueError`` for a ``keep_32bit`` or ``min_8bit_size`` that a swap does not take."""
    if not callable(keep_32bit) and not isinstance(keep_32bit, str):
        allowed = ", ".join(repr(c) for c in KEEP_32BIT)
        raise TypeError(
            f"`keep_32bit` must be one of {allowed} or a callable (name, param) -> bool, "
            f"got {keep_32bit!r} ({type(keep_32bit).__name__})"
        )
    if not callable(keep_32bit):
        check_choice("keep_32bit", keep_32bit, KEEP_32BIT)
    check_int("min_8bit_size", min_8bit_size, minimum=1)


def swap_optimizer(
    old: Optimizer,
    /,
    *,
    optimizer: OptimizerName,
    module: nn.Module | None = None,
    keep_32bit: Keep32bit = "embeddings",
    min_8bit_size: int = 4096,
) -> OptimizerSwapResult:
    """Build the optimizer named ``optimizer`` over the parameters and groups of ``old`` (left unmodified).

    Args:
        old: A torch optimizer that has not stepped yet (no state).
        optimizer: What to build, one of :data:`TARGETS` or an alias (``"adamw_8bit"``).
        module: The model owning the parameters; needed by a bitsandbytes target unless ``keep_32bit="none"``.
        keep_32bit: Which parameters keep 32-bit optimizer state (docs/optimizer_swap.md's argument table).
        min_8bit_size: Tensors with fewer elements keep 32-bit state (bitsandbytes' own rule), >= 1.

    Raises:
        TypeError: If an argument has the wrong type.
        ValueError: If ``optimizer``, ``keep_32bit`` or ``min_8bit_size`` is not allowed, ``old`` is already a
            bitsandbytes optimizer or has state, ``module`` is missing where needed, or a setting cannot be honoured.
        ModuleNotFoundError: If a bitsandbytes target is asked for and bitsandbytes is not installed.
        RuntimeError: If the installed bitsandbytes keeps no per-optimizer override manager (older than 0.50).

    Example:
        >>> import torch
        >>> net = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 2))
        >>> opt = torch.optim.AdamW(net.parameters(), lr=1e-3, weight_decay=0.1)
        >>> result = swap_optimizer(opt, optimizer="adamw_fused", module=net)
        >>> type(result.new).__name__, result.new.param_groups[0]["weight_decay"]
        ('AdamW', 0.1)
        >>> all(a is b for a, b in zip(result.new.param_groups[0]["params"], net.parameters()))
        True
    """
    check_instance("old", old, Optimizer, "a torch.optim.Optimizer")
    name = canonical_optimizer(optimizer, allowed=TARGETS)
    check_instance("module", module, nn.Module, "a torch.nn.Module", allow_none=True)
    check_state_options(keep_32bit, min_8bit_size)
    target = _TARGETS[name]
    old_name = type(old).__name__
    if type(old).__module__.split(".")[0] == "bitsandbytes":
        raise ValueError(
            f"`old` is already a bitsandbytes optimizer ({old_name}); swap the torch optimizer it replaced instead"
        )
    stepped = sum(1 for state in old.state.values() if state)
    if stepped:
        raise ValueError(
            f"`old` ({old_name}) already holds state for {stepped} parameter(s); swap it before its first step "
            "(state restored from a checkpoint afterwards goes into the new optimizer)"
        )
    if target.bnb and keep_32bit != "none" and module is None:
        rule = repr(keep_32bit) if isinstance(keep_32bit, str) else "a callable"
        raise ValueError(
            f"`module` must be given with keep_32bit={rule}: it is where embeddings and parameter "
            "names are found; pass the model, or keep_32bit='none'"
        )
    if target.bnb and any(_is_dtensor(p) for p in _unique_params(old)):
        raise ValueError(
            f"{name!r} ({target.class_name}) cannot step these parameters: they are DTensors, as FSDP2's "
            "`fully_shard` (ModelParallelStrategy) makes them, and bitsandbytes' 8-bit kernels take plain tensors "
            "only. Use 'adamw_fused' (torch's AdamW steps DTensors, and its state is sharded with the parameters, "
            "1/N per rank), or an 8-bit optimizer under DDP or FSDPStrategy"
        )
    bnb = require("bitsandbytes", feature="OptimizerSwap") if target.bnb else None

    groups, changes = _plan_groups(old, name, target)
    if changes:
        warnings.warn(
            f"swapping {old_name} into {name!r} ({target.class_name}) changes the algorithm:\n  "
            + "\n  ".join(changes),
            UserWarning,
            stacklevel=2,
        )
    kept, kept_names = _kept_params(old, module, keep_32bit) if bnb is not None else ([], ())
    if bnb is None:
        new = _fused_adamw(groups, name)
    elif target.family == "sgd":  # bitsandbytes keeps SGD's momentum in betas[0] (it ignores a group's "momentum")
        for group in groups:
            group["betas"] = (group.pop("momentum"), 0.0)
            group["eps"] = 0.0
        first = groups[0]["betas"][0] or 0.9  # constructor default only; every group sets its own
        new = bnb.optim.SGD8bit(groups, lr=groups[0]["lr"], momentum=first, min_8bit_size=min_8bit_size)
    else:
        new = getattr(bnb.optim, target.class_name)(groups, min_8bit_size=min_8bit_size)
    if bnb is not None:
        _install_overrides(bnb, new, kept, module)
    _REPLACED[new] = _REPLACED.get(old, old_name)
    result = OptimizerSwapResult(old, new, name, kept_names, tuple(changes), min_8bit_size, tuple(kept))
    if result.saves_nothing:
        buckets = result.state_buckets()
        small = buckets[f"32-bit (< {min_8bit_size:,})"]
        largest = max((p.numel() for p in small), default=0)
        frozen = f" ({len(buckets[_FROZEN])} frozen tensor(s) get no state at all)" if buckets[_FROZEN] else ""
        help_small = (
            f"Trainable tensors this small are typical of LoRA adapters, whose optimizer state is tiny anyway: keep "
            f"the module's own optimizer, or pass min_8bit_size={largest} (or lower) to quantise them too"
            if small
            else "Choose fewer parameters for keep_32bit"
        )
        warnings.warn(
            f"{name!r} stores no optimizer state in 8 bits, so it saves no memory: of the "
            f"{sum(len(v) for k, v in buckets.items() if k != _FROZEN)} trainable tensor(s), {len(small)} are under "
            f"min_8bit_size={min_8bit_size:,} elements (the largest has {largest:,}) and "
            f"{len(buckets['32-bit (kept)'])} are kept 32-bit{frozen}. {help_small}.",
            UserWarning,
            stacklevel=2,
        )
    return result


def swap_optimizers(
    optimizers: Sequence[Optimizer],
    lr_scheduler_configs: Sequence[Any],
    module: nn.Module | None,
    *,
    optimizer: OptimizerName,
    keep_32bit: Keep32bit = "embeddings",
    min_8bit_size: int = 4096,
) -> tuple[list[Optimizer], list[Any], list[OptimizerSwapResult]]:
    """Swap several optimizers and re-point their schedulers: the hook for a precision plugin's ``connect``.

    Args:
        optimizers: The optimizers, e.g. ``trainer.strategy.optimizers``.
        lr_scheduler_configs: ``LRSchedulerConfig`` objects and/or torch schedulers, re-pointed in place.
        module: The model owning the parameters; a DDP wrapper works too.
        optimizer: As :func:`swap_optimizer`.
        keep_32bit: As :func:`swap_optimizer`.
        min_8bit_size: As :func:`swap_optimizer`.

    Returns:
        ``(new optimizers, the scheduler configs, one OptimizerSwapResult per optimizer)``.

    Raises:
        TypeError: If an argument has the wrong type.
        ValueError: As :func:`swap_optimizer`.
        ModuleNotFoundError: If bitsandbytes is needed and not installed.
    """
    for name, value in (("optimizers", optimizers), ("lr_scheduler_configs", lr_scheduler_configs)):
        if isinstance(value, (str, Optimizer)) or not isinstance(value, Iterable):
            raise TypeError(f"`{name}` must be a sequence (a list of them), got {value!r} ({type(value).__name__})")
    results = [
        swap_optimizer(old, optimizer=optimizer, module=module, keep_32bit=keep_32bit, min_8bit_size=min_8bit_size)
        for old in optimizers
    ]
    configs = list(lr_scheduler_configs)
    for result in results:
        if repoint_schedulers(configs, result.old, result.new):
            result._undo.append(functools.partial(repoint_schedulers, configs, result.new, result.old))
    for config in name_lr_configs(configs):
        owner = next((result for result in results if result.new is config.scheduler.optimizer), None)
        if owner is not None:  # else swapped by an earlier call, whose undo keeps its own name
            owner._undo.append(functools.partial(setattr, config, "name", None))
    return [result.new for result in results], configs, results


def name_lr_configs(configs: Iterable[Any]) -> list[Any]:
    """Name each unnamed config of a swapped optimizer ``lr-<replaced class>``, numbered as ``LearningRateMonitor``.

    The monitor logs an unnamed config's LR under ``lr-<optimizer class>`` (``-1``, ``-2``, ... when the class comes
    again), so without a name the curve would move to ``lr-AdamW8bit``. Returns the configs named here.
    """
    named: list[Any] = []
    seen: Counter[str] = Counter()
    for config in configs:
        optimizer = getattr(getattr(config, "scheduler", None), "optimizer", None)
        if optimizer is None or getattr(config, "name", "") is not None:
            continue
        replaced = _REPLACED.get(optimizer)
        seen[replaced or type(optimizer).__name__] += 1
        if replaced is not None:
            count = seen[replaced]
            config.name = f"lr-{replaced}" + (f"-{count - 1}" if count > 1 else "")
            named.append(config)
    return named


def repoint_schedulers(configs_or_schedulers: Iterable[Any], old: Optimizer, new: Optimizer) -> int:
    """Make the schedulers that drive ``old`` drive ``new`` instead; their own state is unchanged.

    Composite schedulers' children are looked through. Keys of ``old``'s groups that are no hyperparameter
    (``initial_lr``, ``max_lr``...) are copied where missing, and ``new.step`` gets torch's scheduler wrapper.

    Args:
        configs_or_schedulers: Schedulers or objects with a ``scheduler`` attribute (``LRSchedulerConfig``).
        old: The optimizer being replaced.
        new: Its replacement, with as many parameter groups.

    Returns:
        How many schedulers were re-pointed (children of composite schedulers counted).

    Raises:
        ValueError: If a scheduler drives ``old`` and the two optimizers have different numbers of groups.
    """
    count = 0
    for item in configs_or_schedulers:
        scheduler = item if hasattr(item, "optimizer") else getattr(item, "scheduler", item)
        count += _repoint(scheduler, old, new)
    if count:
        if len(old.param_groups) != len(new.param_groups):
            raise ValueError(
                f"the new optimizer has {len(new.param_groups)} parameter group(s) but the schedulers were built for "
                f"{len(old.param_groups)}"
            )
        for old_group, new_group in zip(old.param_groups, new.param_groups, strict=True):
            for key, value in old_group.items():
                if key != "params" and key not in old.defaults and key not in new_group:
                    new_group[key] = value
        _track_step_calls(new)
    return count


def optimizer_state_bytes(optimizer: Optimizer, params: Iterable[Tensor] | None = None) -> int:
    """Exact bytes held by the optimizer's state tensors: shared ones once, DTensors (FSDP2) by this rank's shard.

    Args:
        optimizer: Any torch optimizer.
        params: Only count the state of these parameters; ``None`` for all.

    Example:
        >>> w = torch.nn.Parameter(torch.zeros(1000))
        >>> opt = torch.optim.AdamW([w])
        >>> w.grad = torch.ones(1000)
        >>> opt.step()
        >>> optimizer_state_bytes(opt)  # exp_avg + exp_avg_sq (4000 bytes each) + a float32 step
        8004
    """
    wanted = None if params is None else {id(p) for p in params}
    seen: set[tuple[str, int, int]] = set()
    total = 0
    for param, state in optimizer.state.items():
        if wanted is not None and id(param) not in wanted:
            continue
        for tensor in _tensors(state):
            key = (str(tensor.device), tensor.data_ptr(), tensor.nbytes)
            if tensor.nbytes and key in seen:
                continue
            seen.add(key)
            total += tensor.nbytes
    return total


def estimate_state_bytes(optimizer: Optimizer) -> int | None:
    """State bytes of a torch ``Adam``/``AdamW``/``SGD`` once every trainable parameter stepped; else ``None``.

    Args:
        optimizer: The optimizer.

    Example:
        >>> opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1000))])
        >>> estimate_state_bytes(opt)
        8004
    """
    total = 0
    for group in optimizer.param_groups:
        params = [p for p in group["params"] if p.requires_grad]
        sizes = sum(_local(p).numel() * p.element_size() for p in params)
        if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
            step = 4 if group.get("fused") or torch.get_default_dtype() != torch.float64 else 8
            total += sizes * (3 if group.get("amsgrad") else 2) + step * len(params)
        elif isinstance(optimizer, torch.optim.SGD):
            total += sizes if group.get("momentum", 0) != 0 else 0
        else:
            return None
    return total


def replaced_state_bytes(results: Sequence[OptimizerSwapResult]) -> int | None:
    """:func:`estimate_state_bytes` of the optimizers the swaps replaced, summed (``None`` if a class is unknown)."""
    estimates = [estimate_state_bytes(result.old) for result in results]
    return None if any(e is None for e in estimates) else sum(e or 0 for e in estimates)


def state_summary(owner: str, results: Sequence[OptimizerSwapResult], before: int | None, after: int | None) -> str:
    """The line a swap prints after the first step: the state ``after`` it beside the estimate ``before`` the swap."""
    measured = "not measured yet" if after is None else f"{after / 2**20:.2f} MiB"
    old = ", ".join(type(result.old).__name__ for result in results) or "the original optimizer"
    text = f"{old}: {'unknown' if before is None else f'{before / 2**20:.2f} MiB'}"
    if after is not None and before:
        text += f", {after / before:.1%}"
    if any(result.saves_nothing for result in results):
        text += "; nothing is stored in 8 bits: every trainable tensor is under `min_8bit_size` or kept 32-bit"
    return f"{owner}: optimizer state {measured} after the first step ({text})"


def _source(optimizer: Optimizer, group: Mapping[str, Any]) -> tuple[str | None, str | None]:
    """The family and weight decay of a torch ``Adam``/``AdamW``/``SGD`` group; ``None`` for other optimizers."""
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        decoupled = group.get("decoupled_weight_decay", isinstance(optimizer, torch.optim.AdamW))
        return "adam", "decoupled" if decoupled else "coupled"
    if isinstance(optimizer, torch.optim.SGD):
        return "sgd", "coupled"
    return None, None


def _plan_groups(optimizer: Optimizer, name: str, target: _Target) -> tuple[list[dict[str, Any]], list[str]]:
    """New parameter groups for ``target``, and the changes of a cross-family swap; raises what cannot be honoured."""
    old_name = type(optimizer).__name__
    hyper = set(target.hyper) | target.flags
    problems: list[str] = []
    changes: list[str] = []
    groups: list[dict[str, Any]] = []
    for index, group in enumerate(optimizer.param_groups):
        family, decay = _source(optimizer, group)
        same = family == target.family
        new_group: dict[str, Any] = {"params": group["params"]}
        dropped: list[str] = []
        for key, value in group.items():
            if key == "params" or key in _IMPLEMENTATION_KEYS or key == "decoupled_weight_decay":
                continue
            if key not in optimizer.defaults or key in hyper:
                new_group[key] = value  # metadata (initial_lr, name, ...) or a setting the target takes as is
                continue
            if key in _VARIANTS:
                off, what = _VARIANTS[key]
                if value == off:
                    continue
                if key in _ALWAYS_REFUSED or same:
                    problems.append(
                        f"group {index} has {key}={value!r} ({target.class_name} does not implement {what})"
                    )
                    continue
            elif same:
                problems.append(f"group {index} has {key}={value!r}, which {target.class_name} has no setting for")
                continue
            dropped.append(f"{key}={_fmt(value)}")
        if group.get("weight_decay", 0) and decay is not None and decay != target.decay:
            if same:
                problems.append(
                    f"group {index} has weight_decay={group['weight_decay']!r} applied as an L2 term added to the "
                    f"gradient ({old_name} without decoupled_weight_decay); {target.class_name} decays weights "
                    "decoupled, like AdamW: use AdamW in configure_optimizers, or weight_decay=0"
                )
            else:
                changes.append(f"group {index}: weight decay becomes {target.decay} (was {decay})")
        if target.family == "sgd" and same and not group.get("momentum"):
            problems.append(
                f"group {index} has momentum={group.get('momentum')!r}; {target.class_name} needs momentum > 0 "
                "(plain SGD keeps no state, so there is nothing to shrink)"
            )
        if target.bnb:
            for key in target.hyper:
                if key in new_group and any(True for _ in _tensors(new_group[key])):
                    problems.append(
                        f"group {index} has a tensor {key} "
                        f"({target.class_name} reads hyperparameters as Python numbers)"
                    )
        filled = [f"{key}={_fmt(default)}" for key, default in target.hyper.items() if key not in new_group]
        for key, default in target.hyper.items():
            new_group.setdefault(key, default)
        if not same:
            shown = {**new_group, "lr": configured_lr(group)}
            carried = [f"{key}={_fmt(shown[key])}" for key in target.hyper if key in group]
            if carried:
                changes.append(f"group {index}: carried over by name: {', '.join(carried)}")
            lr, default_lr = shown["lr"], target.hyper["lr"]
            if isinstance(lr, (int, float)) and lr > 10 * default_lr:
                changes.append(
                    f"group {index}: lr={_fmt(lr)} was chosen for {old_name}; {target.class_name} usually trains with "
                    f"a much smaller one (its default is {_fmt(default_lr)}), so lower it in configure_optimizers "
                    "(or set it with lightning_tune.InitialLR)"
                )
            if dropped:
                changes.append(f"group {index}: dropped (no counterpart in {target.class_name}): {', '.join(dropped)}")
            if filled:
                changes.append(f"group {index}: {target.class_name} defaults: {', '.join(filled)}")
        groups.append(new_group)
    if problems:
        raise ValueError(
            f"`old` ({old_name}) cannot be swapped into {name!r} ({target.class_name}) without changing its update "
            "rule: " + "; ".join(problems) + ". Change these settings in configure_optimizers, or choose another "
            f"optimizer from {', '.join(repr(o) for o in TARGETS)}"
        )
    if changes:
        changes.insert(0, f"{old_name} -> {target.class_name}: a different algorithm; settings mapped by name")
    return groups, changes


def _fused_adamw(groups: list[dict[str, Any]], name: str) -> Optimizer:
    """Fused AdamW, or the foreach implementation where torch's fused kernel would refuse a parameter."""
    # torch checks this only when it steps; its list of devices with fused kernels is private, hence the fallback
    supported = getattr(torch_optimizer, "_get_fused_kernels_supported_devices", lambda: ["cuda"])()
    params = (p for group in groups for p in group["params"])
    bad = next((p for p in params if p.device.type not in supported or not torch.is_floating_point(p)), None)
    if bad is None:
        return torch.optim.AdamW(groups, fused=True)
    warnings.warn(
        f"{name!r}: torch's fused AdamW cannot step these parameters (a {bad.dtype} parameter on {bad.device.type}; "
        f"fused kernels need floating point on {supported}); using the foreach implementation instead (same maths "
        "and state, without the fused kernel)",
        UserWarning,
        stacklevel=3,
    )
    return torch.optim.AdamW(groups, foreach=True)


def _install_overrides(bnb: Any, optimizer: Optimizer, kept: Sequence[Tensor], module: nn.Module | None) -> None:
    """Give ``optimizer`` its own override manager: ``optim_bits=32`` for ``kept``, and the module-registered overrides.

    bitsandbytes 0.50 looks overrides up at step time through ``optimizer.mng`` by parameter id (``pid2config``) and
    by group/parameter position (``index2config``). Both tables live on the process-wide ``GlobalOptimManager``
    singleton, which keeps an entry after its parameter is freed; a manager of the same class private to this
    optimizer holds them instead. Of the process-wide overrides, those registered by module
    (``register_module_override``, as ``bnb.nn.StableEmbedding`` and Hugging Face's Trainer do) reach their parameter
    through a module the manager holds, so each is copied when that module's attribute *is* one of these parameters.
    Those of ``override_config`` are keyed by ``id()`` alone: an entry a freed parameter left cannot be told from one
    made for the parameter that now has its id, so none is copied: a warning names the parameters that have one.
    """
    manager_cls = bnb.optim.GlobalOptimManager
    if not isinstance(getattr(optimizer, "mng", None), manager_cls):
        raise RuntimeError(
            f"this bitsandbytes version keeps no per-optimizer override manager on {type(optimizer).__name__}; "
            "OptimizerSwap supports bitsandbytes >= 0.50"
        )
    shared = manager_cls.get_instance()
    manager = manager_cls.__new__(manager_cls)
    manager.initialize()
    params = _unique_params(optimizer)
    ids = {id(p) for p in params}  # all alive: an attribute with one of these ids is that very parameter
    for owner, attr, config in shared.module_weight_config_triple:
        tensor = getattr(owner, attr, None)
        if tensor is not None and id(tensor) in ids:
            manager.override_config(tensor, key_value_dict=dict(config))
    for param in kept:
        manager.override_config(param, "optim_bits", 32)
    manager.register_parameters(optimizer.param_groups)
    optimizer.mng = manager  # type: ignore[attr-defined]
    unverified = [p for p in params if id(p) in shared.pid2config and id(p) not in manager.pid2config]
    if not unverified:
        return
    names = {id(p): name for name, p in module.named_parameters()} if module is not None else {}
    listed = [f"{names.get(id(p), f'a {tuple(p.shape)} tensor')} {shared.pid2config[id(p)]}" for p in unverified[:3]]
    more = f" and {len(unverified) - 3} more" if len(unverified) > 3 else ""
    warnings.warn(
        f"bitsandbytes' process-wide GlobalOptimManager holds `override_config` entries under the id() of "
        f"{len(unverified)} parameter(s) being swapped ({', '.join(listed)}{more}). It keys them by id() alone and "
        "keeps them after their parameter is freed, so each may belong to a freed parameter whose id this one reuses; "
        "the swap does not apply them. For 32-bit state pass `keep_32bit=`; for other settings register them with "
        "`GlobalOptimManager.get_instance().register_module_override(module, 'weight', config)`, which names the "
        "parameter through its module and which the swap applies.",
        UserWarning,
        stacklevel=3,
    )


def _kept_params(
    optimizer: Optimizer, module: nn.Module | None, keep_32bit: Keep32bit
) -> tuple[list[Tensor], tuple[str, ...]]:
    if keep_32bit == "none" or module is None:
        return [], ()
    names: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    if keep_32bit == "embeddings":
        chosen = {id(p) for m in module.modules() if isinstance(m, _EMBEDDINGS) for p in m.parameters(recurse=False)}
    else:
        chosen = {id(p) for name, p in module.named_parameters(remove_duplicate=False) if keep_32bit(name, p)}
    kept = [p for p in _unique_params(optimizer) if id(p) in chosen]
    # a frozen parameter gets no state at all: it is counted in the frozen row, not named as kept 32-bit
    return kept, tuple(name for p in kept if p.requires_grad for name in names.get(id(p), ()))


def _repoint(scheduler: Any, old: Optimizer, new: Optimizer) -> int:
    count = 0
    if getattr(scheduler, "optimizer", None) is old:
        scheduler.optimizer = new
        count += 1
    for child in getattr(scheduler, "_schedulers", ()):
        count += _repoint(child, old, new)
    return count


def _track_step_calls(optimizer: Optimizer) -> None:
    """Wrap ``optimizer.step`` as torch's ``LRScheduler`` does, so its call-order check sees the new optimizer."""
    if hasattr(optimizer.step, "_wrapped_by_lr_sched"):
        return
    ref = weakref.ref(optimizer)
    func = optimizer.step.__func__  # type: ignore[attr-defined]

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        opt = ref()
        opt._opt_called = True  # type: ignore[union-attr]
        return func.__get__(opt, opt.__class__)(*args, **kwargs)

    wrapper._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = wrapper  # type: ignore[method-assign]


def _unique_params(optimizer: Optimizer) -> list[Tensor]:
    """Each parameter once, in the order the groups hold them."""
    return list({id(p): p for group in optimizer.param_groups for p in group["params"]}.values())


def _is_dtensor(value: Any) -> bool:
    dtensor = getattr(getattr(torch.distributed, "tensor", None), "DTensor", None)
    return dtensor is not None and isinstance(value, dtensor)


def _local(tensor: Tensor) -> Tensor:
    """This rank's part of a DTensor (what its memory holds); any other tensor as it is."""
    return tensor.to_local() if _is_dtensor(tensor) else tensor  # type: ignore[attr-defined]


def _tensors(value: Any) -> Iterator[Tensor]:
    if isinstance(value, Tensor):
        yield _local(value)
    elif isinstance(value, (Mapping, list, tuple)):
        for item in value.values() if isinstance(value, Mapping) else value:
            yield from _tensors(item)


def _numel(params: Iterable[Tensor]) -> int:
    return sum(p.numel() for p in params)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:g}" if math.isfinite(value) else repr(value)
    if isinstance(value, tuple):
        return "(" + ", ".join(_fmt(v) for v in value) + ")"
    return "-" if value is None else repr(value) if isinstance(value, str) else str(value)
