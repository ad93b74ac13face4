"""Route a model's attention through a chosen kernel: flash-attn, PyTorch SDPA's fused kernels, or the math path.

:func:`swap_attention` finds three kinds of attention in a model and changes only those module *instances* (never a
class, and never a function of torch or transformers):

=======================  ==============================================================================================
Kind                     What is changed
=======================  ==============================================================================================
``MultiheadAttention``   Each ``torch.nn.MultiheadAttention`` (so also ``nn.Transformer*`` layers): its ``forward`` is
                         wrapped to run under ``torch.nn.attention.sdpa_kernel`` with the chosen SDPA kernels. The
                         owning ``nn.TransformerEncoderLayer`` is wrapped too, since its inference fast path calls the
                         fused attention op without going through the attention module's ``forward``.
``transformers``         Each outermost Hugging Face ``PreTrainedModel``: its attention implementation is switched
                         through the model's own API (``set_attn_implementation``, or ``config._attn_implementation``
                         on versions without it) to ``"flash_attention_2"``, ``"sdpa"`` or ``"eager"``; with ``"sdpa"``
                         its ``forward`` also runs under ``sdpa_kernel``.
``sdpa-call``            Any other module whose class source (any class in its MRO outside torch, Lightning and
                         transformers) mentions ``scaled_dot_product_attention``: its ``forward`` runs under
                         ``sdpa_kernel``. The source is read once per class.
=======================  ==============================================================================================

Backends (:data:`BACKENDS`):

- ``"flash"``: flash-attn (FlashAttention-2) for transformers models; PyTorch's own FlashAttention kernel through SDPA
  for the other kinds, whose tensors this module cannot reshape for flash-attn safely. Needs flash-attn installed, a
  CUDA device of compute capability 8.0 or newer, float16/bfloat16 and a head dimension of at most 256.
- ``"sdpa"``: ``F.scaled_dot_product_attention`` restricted to its FLASH_ATTENTION and EFFICIENT_ATTENTION kernels
  on CUDA, so a call neither fused kernel accepts fails loudly instead of silently running the slow math kernel. Off
  CUDA the MATH kernel stays as the last resort: PyTorch has no memory-efficient kernel on CPU, and its CPU flash
  kernel declines some calls (attention dropout, for one).
- ``"eager"``: the reference math: SDPA's MATH kernel, transformers' ``"eager"`` implementation.
- ``"auto"``: ``"flash"`` where it can run, else ``"sdpa"`` with one message saying why.

Everything is undone by :meth:`AttentionSwapResult.restore`. Swapping an already swapped module again does not wrap it
twice, and restoring any of the results returns the original forwards and attention implementations.
"""

from __future__ import annotations

import functools
import inspect
import sys
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from lightning_tune import _imports
from lightning_tune._surgery import InstanceForward, SurgeryResult, remove_forward
from lightning_tune._validation import check_choice

__all__ = [
    "AttentionBackend",
    "AttentionSite",
    "AttentionSwapResult",
    "BACKENDS",
    "FLASH_MAX_HEAD_DIM",
    "ResolvedBackend",
    "SWAP_KINDS",
    "SwapEntry",
    "SwapKind",
    "find_attention",
    "precision_dtype",
    "resolve_backend",
    "sdpa_backends",
    "swap_attention",
]

#: Attention backends :func:`swap_attention` accepts.
AttentionBackend = Literal["auto", "flash", "sdpa", "eager"]
BACKENDS: tuple[str, ...] = get_args(AttentionBackend)

#: What ``"auto"`` resolves to: every backend but ``"auto"``.
ResolvedBackend = Literal["flash", "sdpa", "eager"]
_RESOLVED: tuple[str, ...] = get_args(ResolvedBackend)

#: The kinds of attention :func:`swap_attention` detects.
SwapKind = Literal["MultiheadAttention", "transformers", "sdpa-call"]
SWAP_KINDS: tuple[str, ...] = get_args(SwapKind)

#: The largest head dimension flash-attn supports.
FLASH_MAX_HEAD_DIM = 256

# attention implementation names of transformers for each resolved backend
_HF_IMPLEMENTATION: dict[str, str] = {"flash": "flash_attention_2", "sdpa": "sdpa", "eager": "eager"}
_KERNEL_NAMES: dict[SDPBackend, str] = {
    SDPBackend.FLASH_ATTENTION: "flash",
    SDPBackend.EFFICIENT_ATTENTION: "efficient",
    SDPBackend.MATH: "math",
}
# classes of these packages are never "sdpa-call" modules: torch's attention is nn.MultiheadAttention, transformers'
# is switched through its own API, and Lightning's base classes hold no attention
_LIBRARY_PREFIXES = ("torch.", "lightning.", "lightning_fabric.", "pytorch_lightning.", "transformers.")
_CALLS_SDPA: weakref.WeakKeyDictionary[type, bool] = weakref.WeakKeyDictionary()
# transformers model -> the attention implementation of each of its configs before the first swap
_HF_ORIGINALS: weakref.WeakKeyDictionary[nn.Module, list[tuple[Any, str, Any]]] = weakref.WeakKeyDictionary()
_MISSING = "<missing>"


def precision_dtype(precision: str) -> torch.dtype:
    """The dtype attention computes in under a Lightning ``precision`` setting.

    Args:
        precision: Lightning's precision string (``trainer.precision``), e.g. ``"bf16-mixed"`` or ``"32-true"``.

    Returns:
        ``torch.bfloat16`` for the ``bf16`` settings, ``torch.float16`` for the ``16`` ones, ``torch.float64`` for
        the ``64`` ones, else ``torch.float32``.

    Example:
        >>> precision_dtype("bf16-mixed"), precision_dtype("16-true"), precision_dtype("32-true")
        (torch.bfloat16, torch.float16, torch.float32)
    """
    text = str(precision)
    if text.startswith("bf16"):
        return torch.bfloat16
    if text.startswith("16"):
        return torch.float16
    if text.startswith("64"):
        return torch.float64
    return torch.float32


def sdpa_backends(backend: ResolvedBackend, device: torch.device | str) -> list[SDPBackend]:
    """The SDPA kernels a swapped module may use for a call on ``device``.

    Args:
        backend: ``"flash"``, ``"sdpa"`` or ``"eager"``.
        device: Device of the call's tensors.

    Returns:
        FLASH_ATTENTION and EFFICIENT_ATTENTION on CUDA, with MATH appended elsewhere (PyTorch has no
        memory-efficient kernel off CUDA and its CPU flash kernel declines some calls); MATH alone for ``"eager"``.

    Raises:
        ValueError: If ``backend`` is not one of the resolved backends.

    Example:
        >>> [kernel.name for kernel in sdpa_backends("sdpa", "cpu")]
        ['FLASH_ATTENTION', 'EFFICIENT_ATTENTION', 'MATH']
    """
    check_choice("backend", backend, _RESOLVED)
    if backend == "eager":
        return [SDPBackend.MATH]
    fused = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
    return fused if torch.device(device).type == "cuda" else [*fused, SDPBackend.MATH]


def _kernel_text(backend: ResolvedBackend, device: torch.device) -> str:
    names = ", ".join(_KERNEL_NAMES[kernel] for kernel in sdpa_backends(backend, device))
    return f"SDPA {names}"


def _flash_problem(device: torch.device, dtype: torch.dtype, head_dim: int | None) -> str | None:
    """Why flash-attn cannot run with these settings, or ``None`` when it can."""
    if device.type != "cuda":
        return f"flash-attn needs a CUDA device, got device {str(device)!r}"
    if not torch.cuda.is_available():
        return "flash-attn needs a CUDA device, but CUDA is not available"
    if dtype not in (torch.float16, torch.bfloat16):
        return (
            f"flash-attn needs float16 or bfloat16, got {dtype} (train with precision='bf16-mixed' or '16-mixed', "
            "or pass dtype=)"
        )
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 0):
        name = torch.cuda.get_device_name(device)
        return f"flash-attn needs compute capability >= 8.0 (Ampere or newer), got {major}.{minor} ({name})"
    if head_dim is not None and head_dim > FLASH_MAX_HEAD_DIM:
        return f"flash-attn needs a head dimension <= {FLASH_MAX_HEAD_DIM}, got {head_dim}"
    return None


def _warn(message: str) -> None:
    warnings.warn(message, UserWarning, stacklevel=3)


def resolve_backend(
    requested: str,
    *,
    device: torch.device | str,
    dtype: torch.dtype,
    head_dim: int | None = None,
    notify: Callable[[str], object] | None = None,
) -> ResolvedBackend:
    """Pick the backend that will run: ``"flash"`` where flash-attn can, else ``"sdpa"``, as requested.

    ``"sdpa"`` and ``"eager"`` are returned as they are. ``"flash"`` needs flash-attn installed, a CUDA device of
    compute capability >= 8.0, float16/bfloat16 and ``head_dim <= 256``. ``"auto"`` is ``"flash"`` when all of that
    holds and ``"sdpa"`` otherwise, with one message through ``notify`` saying why.

    Args:
        requested: One of :data:`BACKENDS`.
        device: Device the attention will run on.
        dtype: Dtype attention computes in (see :func:`precision_dtype`).
        head_dim: Largest head dimension of the model's attention, if known.
        notify: Receives the message when ``"auto"`` does not pick flash-attn; ``None`` issues it as a
            ``UserWarning``.

    Returns:
        ``"flash"``, ``"sdpa"`` or ``"eager"``.

    Raises:
        ValueError: If ``requested`` is not one of :data:`BACKENDS`, or ``"flash"`` is requested where it cannot run
            (the message names the unmet condition).
        ModuleNotFoundError: If ``"flash"`` is requested and flash-attn is not installed; the message names the extra.

    Example:
        >>> resolve_backend("sdpa", device="cpu", dtype=torch.float32)
        'sdpa'
    """
    check_choice("backend", requested, BACKENDS)
    if requested == "sdpa":
        return "sdpa"
    if requested == "eager":
        return "eager"
    device = torch.device(device)
    say = _warn if notify is None else notify
    sdpa_text = _kernel_text("sdpa", device)
    if not _imports.is_available("flash_attn"):
        if requested == "flash":
            _imports.require("flash_attn", feature="backend='flash'")  # raises, naming the extra
        say(
            "backend='auto': flash-attn is not installed, so attention runs through PyTorch SDPA "
            f"({sdpa_text}). For flash-attn on an Ampere or newer GPU: pip install 'lightning-tune[flash]'"
        )
        return "sdpa"
    problem = _flash_problem(device, dtype, head_dim)
    if problem is not None:
        if requested == "flash":
            raise ValueError(f"backend='flash' cannot run here: {problem}. Use backend='auto' to fall back to SDPA.")
        say(f"backend='auto': {problem}, so attention runs through PyTorch SDPA ({sdpa_text})")
        return "sdpa"
    if requested == "flash":
        _imports.require("flash_attn", feature="backend='flash'")
        return "flash"
    try:
        _imports.require("flash_attn", feature="backend='auto'")
    except ImportError as err:  # installed but broken (e.g. built against another torch)
        say(f"backend='auto': flash-attn is installed but does not import ({err}), so attention runs through SDPA")
        return "sdpa"
    return "flash"


# ---------------------------------------------------------------------------------------------------------- detection


@dataclass(frozen=True, eq=False)
class AttentionSite:
    """One attention module :func:`find_attention` found.

    Args:
        path: Qualified name of the module inside the model (``""`` for the model itself).
        kind: One of :data:`SWAP_KINDS`.
        module: The module.
    """

    path: str
    kind: SwapKind
    module: nn.Module


def _pretrained_model_class() -> type | None:
    # a PreTrainedModel can exist only once transformers' modeling module was imported: never import it here
    modeling = sys.modules.get("transformers.modeling_utils")
    cls = getattr(modeling, "PreTrainedModel", None)
    return cls if isinstance(cls, type) else None


def _calls_sdpa(cls: type) -> bool:
    """Whether the source of ``cls`` (or of a class it inherits outside the libraries) mentions SDPA."""
    cached = _CALLS_SDPA.get(cls)
    if cached is not None:
        return cached
    found = False
    for klass in cls.__mro__:
        if (
            klass in (nn.Module, object)
            or klass.__module__.startswith(_LIBRARY_PREFIXES)
            or klass.__module__ == "torch"
        ):
            continue
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):  # defined in a REPL or exec, or a builtin: no source to read
            continue
        if "scaled_dot_product_attention" in source:
            found = True
            break
    _CALLS_SDPA[cls] = found
    return found


def _inside(path: str, roots: list[str]) -> bool:
    return any(root == "" or path == root or path.startswith(root + ".") for root in roots)


def find_attention(module: nn.Module) -> list[AttentionSite]:
    """Find the attention :func:`swap_attention` would route, without changing anything.

    Args:
        module: The model.

    Returns:
        The sites in module order: every ``nn.MultiheadAttention``, every outermost transformers ``PreTrainedModel``
        and, outside those, every module whose class source mentions ``scaled_dot_product_attention``.

    Raises:
        TypeError: If ``module`` is not a ``torch.nn.Module``.

    Example:
        >>> [(site.path, site.kind) for site in find_attention(nn.TransformerEncoderLayer(8, 2))]
        [('self_attn', 'MultiheadAttention')]
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"`module` must be a torch.nn.Module, got {module!r} ({type(module).__name__})")
    pretrained = _pretrained_model_class()
    hf_roots: list[str] = []
    sites: list[AttentionSite] = []
    for path, child in module.named_modules(remove_duplicate=True):
        is_pretrained = pretrained is not None and isinstance(child, pretrained)
        if is_pretrained and not _inside(path, hf_roots):
            hf_roots.append(path)
            sites.append(AttentionSite(path, "transformers", child))
        elif isinstance(child, nn.MultiheadAttention):
            sites.append(AttentionSite(path, "MultiheadAttention", child))
        elif not _inside(path, hf_roots) and _calls_sdpa(type(child)):
            sites.append(AttentionSite(path, "sdpa-call", child))
    return sites


def _head_dim(site: AttentionSite) -> int | None:
    if site.kind == "transformers":
        config = getattr(site.module, "config", None)
        head_dim = getattr(config, "head_dim", None)
        if isinstance(head_dim, int):
            return head_dim
        try:
            return int(config.hidden_size) // int(config.num_attention_heads)  # type: ignore[union-attr]
        except (AttributeError, TypeError, ValueError, ZeroDivisionError):
            return None
    head_dim = getattr(site.module, "head_dim", None)
    return head_dim if isinstance(head_dim, int) and not isinstance(head_dim, bool) else None


def _refuse_wrapped(module: nn.Module) -> None:
    wrappers: list[type] = [nn.DataParallel, nn.parallel.DistributedDataParallel]
    if torch.distributed.is_available():
        from torch.distributed import fsdp

        wrappers += [cls for name in ("FullyShardedDataParallel", "FSDPModule") if (cls := getattr(fsdp, name, None))]
    for path, child in module.named_modules():
        if isinstance(child, tuple(wrappers)):
            where = "the model" if path == "" else f"{path!r} inside {type(module).__name__}"
            raise TypeError(
                f"swap_attention got {where} wrapped in {type(child).__name__}. Swap attention on the bare model, "
                "before the strategy wraps it (the AttentionSwap callback does this in `setup`, a Precision plugin "
                "in `convert_module`)."
            )


# ------------------------------------------------------------------------------------------------------ forward wraps


def _call_device(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> torch.device | None:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value.device
    return None


class _KernelForward(InstanceForward):
    """An instance-level ``forward`` that runs the module's own forward under ``sdpa_kernel``."""

    def __init__(self, module: nn.Module, backend: ResolvedBackend, original: Any, fallback: torch.device) -> None:
        super().__init__(module, original)
        self.backend: ResolvedBackend = backend
        self.fallback = fallback
        self.warned_weights = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if isinstance(self.module, nn.MultiheadAttention) and not self.warned_weights:
            self._check_need_weights(args, kwargs)
        device = _call_device(args, kwargs) or self.fallback
        with sdpa_kernel(sdpa_backends(self.backend, device)):
            return self.call_original(*args, **kwargs)

    def _check_need_weights(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> None:
        need_weights = kwargs.get("need_weights", args[4] if len(args) > 4 else True)
        if need_weights:
            self.warned_weights = True
            warnings.warn(
                "nn.MultiheadAttention was called with need_weights=True (its default): it then computes the "
                "attention weights explicitly instead of calling scaled_dot_product_attention, so the attention "
                "swap does not change it. Pass need_weights=False where the weights are not used.",
                UserWarning,
                stacklevel=3,
            )


def _wrap_forward(module: nn.Module, backend: ResolvedBackend, device: torch.device) -> Callable[[], None]:
    """Route ``module.forward`` through ``sdpa_kernel``; return the undo."""
    current = module.__dict__.get("forward")
    if isinstance(current, _KernelForward):
        if current.backend != backend:  # re-swap to another backend: replace the wrap, keep the true original
            setattr(module, "forward", _KernelForward(module, backend, current.original, device))  # noqa: B010
    else:
        setattr(module, "forward", _KernelForward(module, backend, current, device))  # noqa: B010
    return lambda: remove_forward(module, _KernelForward)


# ------------------------------------------------------------------------------------------------------- transformers


def _hf_configs(model: nn.Module, pretrained: type) -> Iterator[Any]:
    seen: set[int] = set()
    pending: list[Any] = [getattr(child, "config", None) for child in model.modules() if isinstance(child, pretrained)]
    while pending:
        config = pending.pop(0)
        if config is None or id(config) in seen:
            continue
        seen.add(id(config))
        yield config
        pending.extend(getattr(config, key, None) for key in getattr(config, "sub_configs", None) or {})


def _hf_snapshot(model: nn.Module, pretrained: type) -> list[tuple[Any, str, Any]]:
    names = ("_attn_implementation_internal", "_attn_implementation_autoset")
    return [
        (config, name, vars(config).get(name, _MISSING)) for config in _hf_configs(model, pretrained) for name in names
    ]


def _hf_apply_snapshot(snapshot: list[tuple[Any, str, Any]]) -> None:
    for config, name, value in snapshot:
        if value is _MISSING:
            vars(config).pop(name, None)
        else:
            vars(config)[name] = value


def _hf_current(model: nn.Module) -> str | None:
    value = getattr(getattr(model, "config", None), "_attn_implementation", None)
    return value if isinstance(value, str) else None


def _hf_switchable(model: nn.Module) -> bool:
    """Whether the model picks its attention function at call time, so switching after construction takes effect."""
    probe = getattr(type(model), "_can_set_attn_implementation", None)
    if callable(probe):
        return bool(probe())
    # transformers before `set_attn_implementation`: the functional AttentionInterface (4.48+) reads the config at
    # each call; older models chose their attention classes in __init__
    source_module = sys.modules.get(type(model).__module__)
    try:
        return source_module is not None and "ALL_ATTENTION_FUNCTIONS" in inspect.getsource(source_module)
    except (OSError, TypeError):
        return False


def _hf_set(model: nn.Module, implementation: str) -> None:
    setter = getattr(model, "set_attn_implementation", None)
    if callable(setter):
        setter(implementation)
    else:
        model.config._attn_implementation = implementation  # type: ignore[union-attr]


def _switch_transformers(
    site: AttentionSite,
    backend: ResolvedBackend,
    requested: str,
    pretrained: type,
    say: Callable[[str], object],
) -> tuple[ResolvedBackend, str] | None:
    """Switch a transformers model's attention implementation; return (backend used, detail) or None if skipped."""
    model = site.module
    name = type(model).__name__
    if not _hf_switchable(model):
        warnings.warn(
            f"{name} chose its attention classes when it was built (transformers before the AttentionInterface), so "
            f"its attention implementation cannot be switched now; it stays {_hf_current(model)!r}. Load it with "
            f"`attn_implementation={_HF_IMPLEMENTATION[backend]!r}` instead.",
            UserWarning,
            stacklevel=3,
        )
        return None
    if model not in _HF_ORIGINALS:
        _HF_ORIGINALS[model] = _hf_snapshot(model, pretrained)
    original = _HF_ORIGINALS[model]
    first = original[0][2] if original else _MISSING  # the model's own config comes first
    shown = _hf_current(model) if first is _MISSING or first is None else first
    fallbacks: list[ResolvedBackend] = ["sdpa", "eager"] if requested == "auto" else []
    candidates = list(dict.fromkeys([backend, *fallbacks]))  # "auto" walks down to what the model supports
    for candidate in candidates:
        target = _HF_IMPLEMENTATION[candidate]
        try:
            _hf_set(model, target)
        except (ValueError, ImportError) as err:
            _hf_apply_snapshot(original)
            if requested != "auto" or candidate == candidates[-1]:
                del _HF_ORIGINALS[model]
                raise ValueError(
                    f"{name} cannot use attn_implementation={target!r} (backend={requested!r}): {err}"
                ) from err
            say(f"backend='auto': {name} cannot use attn_implementation={target!r} ({err}); trying the next backend")
            continue
        actual = _hf_current(model)
        if actual == target or (candidate == "flash" and actual is not None and "flash" in actual):
            return candidate, f"attn_implementation {shown!r} -> {actual!r}"
        break
    _hf_apply_snapshot(original)
    del _HF_ORIGINALS[model]
    warnings.warn(
        f"{name} did not take attn_implementation={_HF_IMPLEMENTATION[backend]!r} (it stays "
        f"{_hf_current(model)!r}); see transformers' log for why.",
        UserWarning,
        stacklevel=3,
    )
    return None


def _restore_transformers(model: nn.Module) -> None:
    snapshot = _HF_ORIGINALS.pop(model, None)
    if snapshot is not None:
        _hf_apply_snapshot(snapshot)


# ------------------------------------------------------------------------------------------------------------ results


@dataclass(frozen=True)
class SwapEntry:
    """One swapped attention module.

    Args:
        path: Qualified name inside the model (``""`` for the model itself).
        kind: One of :data:`SWAP_KINDS`.
        module_type: Class name of the module.
        backend: Backend its attention now uses.
        detail: What runs: the SDPA kernels allowed, or the transformers implementation before and after.
    """

    path: str
    kind: SwapKind
    module_type: str
    backend: ResolvedBackend
    detail: str


@dataclass
class AttentionSwapResult(SurgeryResult):
    """What :func:`swap_attention` changed, and how to undo it.

    :meth:`restore` puts back each module's original ``forward`` and attention implementation. Usable as a context
    manager: leaving the ``with`` block restores the model. After a module was swapped twice, restoring either result
    returns it to its state before the first swap.

    Args:
        requested: The backend asked for.
        backend: The backend it resolved to, ``None`` when nothing was swapped.
        entries: One entry per swapped attention module.
    """

    requested: str
    backend: ResolvedBackend | None
    entries: list[SwapEntry] = field(default_factory=list)

    def describe(self) -> str:
        """A table of the swapped modules, for printing.

        Returns:
            One header line, then one row per entry (path, class, kind, backend, detail).
        """
        if not self.entries:
            return f"Attention swap (backend={self.requested!r}): no attention found"
        header = ("Module", "Class", "Kind", "Backend", "Kernel")
        rows = [(e.path or "(root)", e.module_type, e.kind, e.backend, e.detail) for e in self.entries]
        widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header) - 1)]
        lines = [
            "  ".join([*(cell.ljust(width) for cell, width in zip(row[:-1], widths, strict=True)), row[-1]]).rstrip()
            for row in [header, *rows]
        ]
        title = f"Attention swap: backend {self.backend!r} (requested {self.requested!r}), {len(rows)} module(s)"
        return "\n".join([title, *lines])


# ---------------------------------------------------------------------------------------------------------- the swap


def _default_device(module: nn.Module) -> torch.device:
    for tensor in (*module.parameters(), *module.buffers()):
        return tensor.device
    return torch.device("cpu")


def _default_dtype(module: nn.Module) -> torch.dtype:
    for param in module.parameters():
        if param.is_floating_point():
            return param.dtype
    return torch.get_default_dtype()


def swap_attention(
    module: nn.Module,
    backend: str = "auto",
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    notify: Callable[[str], object] | None = None,
) -> AttentionSwapResult:
    """Route every attention module of ``module`` through ``backend``; the model is changed in place.

    See the module docstring for what is detected and changed. Call it on the bare model, before DDP/FSDP wrap it.

    Args:
        module: The model (a LightningModule is fine).
        backend: One of :data:`BACKENDS`.
        device: Device attention will run on; ``None`` means the device of the model's first parameter.
        dtype: Dtype attention computes in (``precision_dtype(trainer.precision)`` under mixed precision); ``None``
            means the dtype of the model's first floating-point parameter.
        notify: Receives informative messages (why ``"auto"`` did not pick flash-attn); ``None`` issues them as
            ``UserWarning``.

    Returns:
        The swapped entries, with :meth:`~AttentionSwapResult.restore` and :meth:`~AttentionSwapResult.describe`.

    Raises:
        TypeError: If ``module`` is not an ``nn.Module``, or is (or holds) a DataParallel, DDP or FSDP wrapper.
        ValueError: If ``backend`` is unknown, ``"flash"`` cannot run (the message names the unmet condition), or a
            transformers model refuses the requested implementation.
        ModuleNotFoundError: If ``backend="flash"`` and flash-attn is not installed.

    Example:
        >>> layer = nn.TransformerEncoderLayer(d_model=8, nhead=2, batch_first=True)
        >>> result = swap_attention(layer, "sdpa", device="cpu")
        >>> print(result.describe())
        Attention swap: backend 'sdpa' (requested 'sdpa'), 1 module(s)
        Module     Class               Kind                Backend  Kernel
        self_attn  MultiheadAttention  MultiheadAttention  sdpa     SDPA flash, efficient, math
        >>> result.restore()
        >>> "forward" in vars(layer.self_attn)
        False
    """
    check_choice("backend", backend, BACKENDS)
    if not isinstance(module, nn.Module):
        raise TypeError(f"`module` must be a torch.nn.Module, got {module!r} ({type(module).__name__})")
    _refuse_wrapped(module)
    sites = find_attention(module)
    if not sites:
        warnings.warn(
            f"swap_attention found no attention in {type(module).__name__}, so nothing was swapped. It detects "
            f"{', '.join(SWAP_KINDS)} modules: torch.nn.MultiheadAttention (and the nn.Transformer layers), Hugging "
            "Face transformers models, and modules whose class source calls F.scaled_dot_product_attention.",
            UserWarning,
            stacklevel=2,
        )
        return AttentionSwapResult(requested=backend, backend=None)
    run_device = torch.device(device) if device is not None else _default_device(module)
    run_dtype = dtype if dtype is not None else _default_dtype(module)
    head_dims = [dim for dim in map(_head_dim, sites) if dim is not None]
    say = _warn if notify is None else notify
    resolved = resolve_backend(
        backend, device=run_device, dtype=run_dtype, head_dim=max(head_dims, default=None), notify=say
    )
    result = AttentionSwapResult(requested=backend, backend=resolved)
    pretrained = _pretrained_model_class()
    modules = dict(module.named_modules())
    try:
        for site in sites:
            target = site.module
            entry_backend = resolved
            if site.kind == "transformers":
                assert pretrained is not None
                switched = _switch_transformers(site, resolved, backend, pretrained, say)
                if switched is None:
                    continue
                entry_backend, detail = switched
                result._undo.append(functools.partial(_restore_transformers, target))
                if entry_backend == "sdpa":
                    result._undo.append(_wrap_forward(target, "sdpa", run_device))
                    detail += f" under {_kernel_text('sdpa', run_device)}"
            else:
                result._undo.append(_wrap_forward(target, resolved, run_device))
                parent = modules.get(site.path.rpartition(".")[0]) if site.path else None
                if isinstance(parent, nn.TransformerEncoderLayer) and parent.self_attn is target:
                    result._undo.append(_wrap_forward(parent, resolved, run_device))  # its fast path skips MHA.forward
                detail = _kernel_text(resolved, run_device)
            result.entries.append(SwapEntry(site.path, site.kind, type(target).__name__, entry_backend, detail))
    except BaseException:
        result.restore()
        raise
    return result
