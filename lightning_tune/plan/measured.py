"""Measured memory estimate: one training step of a real module on fake tensors, so no memory of its size is used.

Every op of the step runs for real on tensors without data; a dispatch mode counts the live storages, and their peak at
two batch sizes gives the fixed and per-sample costs (``docs/planner.md``).

Example:
    >>> from torch import nn
    >>> model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 1))
    >>> estimate = measure_memory(model, torch.zeros(8, 64))
    >>> estimate.parameters, estimate.weight_bytes, estimate.gradient_bytes, estimate.optimizer_bytes
    (16897, 67588, 67588, 135192)
"""

from __future__ import annotations

import functools
import reprlib
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Literal

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_tune._validation import check_choice, check_int
from lightning_tune.plan.estimate import PLAN_PRECISIONS, MemoryEstimate
from lightning_tune.vocab import PLAN_MODES, PlanMode, Precision, canonical_precision, precision_dtype

LossFn = Callable[[nn.Module, Any], Tensor]
OptimizerFactory = Callable[[list[nn.Parameter]], Optimizer]


class LiveBytes:
    """Running total of the bytes held by live tensor storages, and its peak.

    A subclass can hold each storage's bytes elsewhere (an allocator model, which may refuse them): ``_hold(size)``
    is called once per storage first seen and returns a token, ``_drop(size, token)`` when that storage is freed.
    """

    def __init__(self) -> None:
        self.current = 0
        self.peak = 0
        self._refs: dict[int, weakref.ref[Any]] = {}

    def track(self, value: Any) -> None:
        """Count the storages of the tensors in ``value`` (a tensor or nested tuples/lists) not yet counted."""
        for tensor in _tensors(value):
            storage = tensor.untyped_storage()
            key = id(storage)
            ref = self._refs.get(key)
            if ref is not None and ref() is storage:
                continue
            size = storage.nbytes()
            token = self._hold(size)
            self._refs[key] = weakref.ref(storage, functools.partial(self._release, key, size, token))

    def _hold(self, size: int) -> Any:
        self.current += size
        self.peak = max(self.peak, self.current)

    def _drop(self, size: int, token: Any) -> None:
        self.current -= size

    def _release(self, key: int, size: int, token: Any, _: Any) -> None:
        """The storage counted under ``key`` was freed."""
        self._drop(size, token)
        self._refs.pop(key, None)

    def reset_peak(self) -> None:
        """Start a new phase: the peak becomes the current total."""
        self.peak = self.current


def _tensors(value: Any) -> Iterator[Tensor]:
    if isinstance(value, Tensor):
        yield value
    elif isinstance(value, (tuple, list, Mapping)):
        for item in value.values() if isinstance(value, Mapping) else value:
            yield from _tensors(item)


def _fake_modes(counter: LiveBytes) -> tuple[Any, Any]:
    """A fake-tensor mode and a dispatch mode that reports every op's outputs to ``counter``.

    With ``TrackedMemory``'s (which also reads an op's schema to tell an aliasing output) these are the only private
    torch APIs of the package, checked on torch 2.13: ``FakeTensorMode`` (tensors with metadata and no data; torch has
    no public way to run a module without allocating its activations) and ``TorchDispatchMode`` (the hook that sees each
    op's outputs; ``torch.cuda`` memory statistics do not exist for fake tensors). ``tests/plan/test_plan_measured.py``
    fails if either changes what this relies on.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Tracker(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            out = func(*args, **(kwargs or {}))
            counter.track(out)
            return out

    return FakeTensorMode(allow_non_fake_inputs=True), _Tracker()


class _Step(nn.Module):
    """Wraps the user's module so that ``torch.func.functional_call`` can run its loss with fake parameters."""

    def __init__(self, module: nn.Module, loss_fn: LossFn) -> None:
        super().__init__()
        self.module = module
        self.loss_fn = loss_fn

    def forward(self, batch: Any) -> Tensor:
        return self.loss_fn(self.module, batch)


def _step(module: nn.Module, batch: Any, *, hook: str | None, train: bool) -> Any:
    """What ``module.<hook>(batch, 0)`` returns, or the module on the batch (``*`` a tuple/list, ``**`` a mapping).

    A training step's output is reduced to a scalar loss: its ``loss`` tensor, or its first tensor, summed.
    """
    if hook is not None:
        out = getattr(module, hook)(batch, 0)
    elif isinstance(batch, Mapping):
        out = module(**batch)
    elif isinstance(batch, (tuple, list)):
        out = module(*batch)
    else:
        out = module(batch)
    if not train:
        return out
    loss = out.get("loss") if isinstance(out, Mapping) else getattr(out, "loss", None)
    if isinstance(loss, Tensor):
        out = loss
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], Tensor):
        out = out[0]
    if not isinstance(out, Tensor):
        what = hook or "the module's output"
        raise TypeError(
            f"{what} must return a Tensor, a mapping or output with a 'loss' tensor, got {type(out).__name__}"
        )
    return out if out.ndim == 0 else out.float().sum()


def _lightning_optimizer(model: nn.Module) -> Optimizer:
    """The single optimizer a LightningModule's ``configure_optimizers`` returns, in any of Lightning's forms."""
    try:
        config = model.configure_optimizers()  # type: ignore[operator]
    except RuntimeError as err:  # e.g. it reads self.trainer, which is not attached
        raise ValueError(
            f"`model`: configure_optimizers() failed outside a Trainer ({err}); pass `optimizer=` to measure_memory"
        ) from err
    if isinstance(config, Mapping):
        config = config.get("optimizer")
    if isinstance(config, (tuple, list)) and len(config) == 2 and isinstance(config[0], (tuple, list)):
        config = config[0]  # ([optimizers], [schedulers])
    if isinstance(config, (tuple, list)) and len(config) == 1:
        config = config[0]
    if isinstance(config, Mapping):
        config = config.get("optimizer")
    if not isinstance(config, Optimizer):
        raise ValueError(
            "`model`: configure_optimizers() must give exactly one optimizer for measure_memory, got "
            f"{type(config).__name__}; pass `optimizer=`"
        )
    return config


def _check_batch(batch: Any, what: str) -> None:
    """Refuse a batch without a tensor, before torch fails on it somewhere inside the model."""
    if next(_tensors(batch), None) is None:
        raise TypeError(
            f"{what} must be a tensor, or a tuple, list or dict holding tensors (first dimension: the batch), or a "
            f"function batch_size -> batch; got {reprlib.repr(batch)} ({type(batch).__name__}), which holds no tensor"
        )


def _make_batch(batch: Any, size: int, device: torch.device) -> Any:
    """A batch of ``size`` on ``device``: templates are made there, what a function makes is moved there."""
    if callable(batch):
        from lightning.fabric.utilities.apply_func import move_data_to_device

        made = batch(size)
        _check_batch(made, f"`batch({size})`")
        # the Trainer's own transfer (nested dicts, lists, tuples, anything with ``.to``), as a real step gets it
        return move_data_to_device(made, device)
    if isinstance(batch, Tensor):
        if batch.ndim == 0:
            raise ValueError("`batch`: a tensor in the example batch has no batch dimension (it is 0-dimensional)")
        return torch.empty((size, *batch.shape[1:]), dtype=batch.dtype, device=device)
    if isinstance(batch, Mapping):
        return {key: _make_batch(value, size, device) for key, value in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(_make_batch(value, size, device) for value in batch)
    return batch


def _storage_bytes(tensors: Iterator[Tensor]) -> int:
    """Bytes of the storages behind ``tensors``, each storage once (views share one)."""
    storages = {id(s): s for s in (t.untyped_storage() for t in tensors)}
    return sum(s.nbytes() for s in storages.values())


def _optimizer(
    optimizer: OptimizerFactory | Optimizer | None,
    fakes: Mapping[int, nn.Parameter],
    params: list[nn.Parameter],
    foreach: bool,
) -> Optimizer:
    """The step's optimizer over the fake parameters: ``optimizer``'s class and groups, its factory's, or AdamW."""
    if isinstance(optimizer, Optimizer):
        groups = [{**group, "params": [fakes[id(p)] for p in group["params"]]} for group in optimizer.param_groups]
        factory: Callable[[list[dict[str, Any]]], Optimizer] = type(optimizer)  # torch optimizers take groups alone
        opt = factory(groups)
    elif optimizer is not None:
        opt = optimizer(params)
    else:
        opt = torch.optim.AdamW(params)
    if foreach:  # torch's default on CUDA; its own check would refuse fake tensors, whatever their device
        for group in opt.param_groups:
            if "foreach" in group and group["foreach"] is None:
                group["foreach"] = True
    return opt


def _run(
    model: nn.Module,
    batch: Any,
    batch_size: int,
    *,
    precision: str,
    loss_fn: LossFn,
    optimizer: OptimizerFactory | Optimizer | None,
    device: torch.device,
    foreach: bool,
    train: bool = True,
) -> dict[str, int]:
    """Two training steps (else one no-grad forward) on fake tensors at one batch size: the last one's figures."""
    counter = LiveBytes()
    fake_mode, tracker = _fake_modes(counter)
    step = _Step(model, loss_fn)
    mixed = precision.endswith("-mixed")  # float32 weights, autocast to the 16-bit dtype
    dtype = torch.float32 if mixed else precision_dtype(precision)
    half = precision_dtype(precision) if mixed else None  # autocast's dtype
    with fake_mode, tracker:
        fakes: dict[int, nn.Parameter] = {}
        state: dict[str, Tensor] = {}
        for name, param in step.named_parameters(remove_duplicate=False):
            if id(param) not in fakes:
                kind = dtype if param.is_floating_point() else param.dtype
                empty = torch.empty(param.shape, dtype=kind, device=device)
                fakes[id(param)] = nn.Parameter(empty, requires_grad=param.requires_grad)
            state[name] = fakes[id(param)]
        for name, buffer in step.named_buffers(remove_duplicate=False):
            buffer_dtype = dtype if buffer.is_floating_point() and precision.endswith("-true") else buffer.dtype
            state[name] = torch.empty(buffer.shape, dtype=buffer_dtype, device=device)
        params = [p for p in fakes.values() if p.requires_grad]
        record: dict[str, int] = {"gradient_bytes": 0, "optimizer_bytes": 0, "optimizer_step_peak": 0}
        opt = _optimizer(optimizer, fakes, params, foreach) if train else None
        for index in range(2 if train else 1):
            counter.reset_peak()
            inputs = _make_batch(batch, batch_size, device)
            with torch.set_grad_enabled(train), torch.autocast(device.type, dtype=half, enabled=half is not None):
                loss = torch.func.functional_call(step, state, (inputs,))
            if opt is None:  # an evaluation step: its forward pass alone
                record["forward_backward_peak"] = counter.peak
                break
            loss.backward()
            record["forward_backward_peak"] = counter.peak
            record["gradient_bytes"] = _storage_bytes(p.grad for p in params if p.grad is not None)
            counter.reset_peak()
            opt.step()
            record["optimizer_step_peak"] = counter.peak
            opt.zero_grad(set_to_none=True)
            del loss, inputs
            if index == 0:
                record["optimizer_bytes"] = _storage_bytes(t for s in opt.state.values() for t in _tensors(dict(s)))
        record["weight_bytes"] = _storage_bytes(iter(fakes.values()))
        record["buffer_bytes"] = _storage_bytes(t for k, t in state.items() if id(t) not in map(id, fakes.values()))
    return record


def measure_memory(
    model: nn.Module,
    batch: Any,
    *,
    precision: Precision = "32-true",
    optimizer: OptimizerFactory | None = None,
    loss_fn: LossFn | None = None,
    for_device: Literal["cuda", "cpu"] = "cuda",
    batch_sizes: tuple[int, int] = (1, 2),
    mode: PlanMode = "train",
) -> MemoryEstimate:
    """Measure a module's training (or evaluation) memory from one step on fake tensors, without memory of its size.

    The module is not changed and may live on any device, ``meta`` included (build a large model under
    ``torch.device("meta")`` to plan it on a laptop).

    Args:
        model: The module. A LightningModule runs ``training_step(batch, 0)`` with its ``configure_optimizers()``;
            any other module is called on the batch (``*`` a tuple/list, ``**`` a mapping), its output summed (or
            its ``loss`` used).
        batch: An example batch (first dimension: the batch; values never read), or a function
            ``fn(batch_size) -> batch``, called under fake-tensor mode, what it returns moved to the step's device.
        precision: One of :data:`~lightning_tune.plan.estimate.PLAN_PRECISIONS` or an alias, reproduced (autocast
            under ``-mixed``, else weights of that width).
        optimizer: ``fn(params) -> Optimizer``; default: the LightningModule's own, else ``torch.optim.AdamW``.
            Only torch optimizers run on fake tensors (not bitsandbytes).
        loss_fn: ``fn(module, batch) -> loss`` replacing the default call described under ``model``.
        for_device: ``"cuda"`` makes the optimizer take its multi-tensor path as on a GPU.
        batch_sizes: Two distinct batch sizes the step is measured at, to separate fixed and per-sample costs.
        mode: ``"train"``; or ``"eval"``/``"predict"``: one forward pass under ``torch.no_grad()`` in eval mode, no
            optimizer; a LightningModule runs ``validation_step`` / ``predict_step(batch, 0)``.

    Returns:
        A ``"measured"`` estimate; weights, gradients, optimizer state and buffers are exact byte counts.
        ``fit_fixed_bytes`` is ``None``: inside ``fit`` add the training estimate's ``state_bytes`` less its weights.

    Raises:
        TypeError: If ``model`` is not an ``nn.Module``, ``optimizer``/``loss_fn`` are not callable, ``batch`` (or
            what it makes) holds no tensor, or the step does not give a tensor loss.
        ValueError: If ``precision``, ``for_device``, ``batch_sizes`` or ``mode`` are not allowed, the LightningModule's
            optimizer cannot be built outside a Trainer, or the peak does not grow with the batch.
        RuntimeError: If the step fails on fake tensors (the message says why).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"`model` must be an nn.Module, got {model!r} ({type(model).__name__}); for a model name or shape use "
            "estimate_memory"
        )
    precision = canonical_precision(precision, allowed=PLAN_PRECISIONS)
    check_choice("for_device", for_device, ("cuda", "cpu"))
    check_choice("mode", mode, PLAN_MODES)
    train = mode == "train"
    if optimizer is not None and not callable(optimizer):
        raise TypeError(f"`optimizer` must be a function params -> Optimizer or None, got {type(optimizer).__name__}")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"`loss_fn` must be a function (module, batch) -> Tensor or None, got {type(loss_fn).__name__}")
    if not (isinstance(batch_sizes, tuple) and len(batch_sizes) == 2):
        raise TypeError(f"`batch_sizes` must be a tuple of two integers, got {batch_sizes!r}")
    for size in batch_sizes:
        check_int("batch_sizes", size, minimum=1)
    small, large = sorted(batch_sizes)
    if small == large:
        raise ValueError(f"`batch_sizes` must hold two different sizes, got {batch_sizes!r}")
    if not callable(batch):
        _check_batch(batch, "`batch`")

    import lightning.pytorch as pl

    lightning = isinstance(model, pl.LightningModule)
    template: OptimizerFactory | Optimizer | None = optimizer
    if template is None and lightning and train:
        template = _lightning_optimizer(model)
    hook = {"train": "training_step", "eval": "validation_step", "predict": "predict_step"}[mode] if lightning else None
    step_loss: LossFn = loss_fn or functools.partial(_step, hook=hook, train=train)
    what = "a training step" if train else f"an evaluation step ({mode})"
    device = torch.device("cuda" if for_device == "cuda" and torch.cuda.is_available() else "cpu")
    modes = {m: m.training for m in model.modules()}
    run = functools.partial(_run, model, batch, precision=precision, loss_fn=step_loss, optimizer=template)
    records = []
    for size in (small, large):
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*self.log.*")  # training_step logs; no Trainer is attached
            try:
                model.train(train)
                records.append(run(size, device=device, foreach=for_device == "cuda", train=train))
            except (TypeError, ValueError):
                raise
            except Exception as err:
                raise RuntimeError(
                    f"measure_memory could not run {what} of {type(model).__name__} on fake tensors: "
                    f"{type(err).__name__}: {err}"
                ) from err
            finally:
                for module, training in modes.items():
                    module.training = training
    low, high = records
    growth = high["forward_backward_peak"] - low["forward_backward_peak"]
    if growth <= 0:
        raise ValueError(
            f"`batch`: the peak did not grow from batch {small} to {large}; does `batch` make batches of the size "
            "it is asked for?"
        )
    per_sample = -(-growth // (large - small))
    intercept = low["forward_backward_peak"] - per_sample * small
    params = {id(p): p for p in model.parameters()}.values()
    largest = max((sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()), default=0)
    step_peak = max(low["optimizer_step_peak"], high["optimizer_step_peak"])
    return MemoryEstimate(
        parameters=sum(p.numel() for p in params),
        trainable_parameters=sum(p.numel() for p in params if p.requires_grad),
        weight_bytes=low["weight_bytes"],
        gradient_bytes=low["gradient_bytes"],
        optimizer_bytes=low["optimizer_bytes"],
        buffer_bytes=low["buffer_bytes"],
        fixed_bytes=max(intercept, step_peak, low["weight_bytes"] + low["buffer_bytes"]),
        bytes_per_sample=per_sample,
        largest_layer_parameters=largest,
        source="measured",
        notes=(f"{type(model).__name__}: {what} on fake {device.type} tensors, {precision}",),
        mode=mode,
    )
