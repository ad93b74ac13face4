"""Route a model's attention through a chosen kernel: flash-attn, PyTorch SDPA's fused kernels, or the math path.

:func:`swap_attention` changes module *instances* and configs only, never a class nor a function of torch or
transformers; docs/attention_swap.md describes the kinds it detects, the backends and the undo.
"""

from __future__ import annotations

import functools
import inspect
import sys
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, cast, get_args

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode

from lightning_tune import _imports
from lightning_tune._surgery import (
    InstanceForward,
    SurgeryResult,
    inside,
    pretrained_model_class,
    refuse_wrapped,
    remove_forward,
    table,
)
from lightning_tune._validation import check_choice, check_instance
from lightning_tune.vocab import canonical_attention

#: What ``"auto"`` resolves to: every backend but ``"auto"``.
ResolvedBackend = Literal["flash", "sdpa", "eager"]
_RESOLVED: tuple[str, ...] = get_args(ResolvedBackend)

#: The kinds of attention :func:`swap_attention` detects.
SwapKind = Literal["MultiheadAttention", "transformers", "sdpa-call"]
SWAP_KINDS: tuple[str, ...] = get_args(SwapKind)

#: The largest head dimension flash-attn supports.
FLASH_MAX_HEAD_DIM = 256

# classes of these packages are never "sdpa-call" modules: torch's attention is nn.MultiheadAttention, transformers'
# is switched through its own API, and Lightning's base classes hold no attention
_LIBRARY_PREFIXES = ("torch.", "lightning.", "lightning_fabric.", "pytorch_lightning.", "transformers.")
_CALLS_SDPA: weakref.WeakKeyDictionary[type, bool] = weakref.WeakKeyDictionary()
# transformers model -> the attention implementation of each of its configs before the first swap
_HF_ORIGINALS: weakref.WeakKeyDictionary[nn.Module, list[tuple[Any, str, Any]]] = weakref.WeakKeyDictionary()
_MISSING = "<missing>"


def sdpa_backends(backend: ResolvedBackend, device: torch.device | str) -> list[SDPBackend]:
    """The SDPA kernels a swapped module may use for a call on ``device``.

    Args:
        backend: ``"flash"``, ``"sdpa"`` or ``"eager"``.
        device: Device of the call's tensors.

    Returns:
        MATH alone for ``"eager"``; else the fused kernels the device has, plus MATH off CUDA (docs/attention_swap.md).

    Raises:
        ValueError: If ``backend`` is not one of the resolved backends.

    Example:
        >>> [kernel.name for kernel in sdpa_backends("sdpa", "cpu")]
        ['FLASH_ATTENTION', 'MATH']
    """
    check_choice("backend", backend, _RESOLVED)
    if backend == "eager":
        return [SDPBackend.MATH]
    kind = torch.device(device).type
    if kind == "cpu":
        return [SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]  # PyTorch has no memory-efficient kernel on CPU
    fused = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
    return fused if kind == "cuda" else [*fused, SDPBackend.MATH]


def _kernel_text(backend: ResolvedBackend, device: torch.device) -> str:
    return "SDPA " + ", ".join(kernel.name.partition("_")[0].lower() for kernel in sdpa_backends(backend, device))


#: FlashAttention packages, newest first: flash-attn-4 (``flash_attn.cute``) on Hopper and Blackwell, flash-attn 2 on
#: Ampere and newer.
FlashEngine = Literal["flash-attn-4", "flash-attn-2"]
_ENGINE_MODULE: dict[str, str] = {"flash-attn-4": "flash_attn.cute", "flash-attn-2": "flash_attn"}
_FLASH_EXTRAS = "pip install 'lightning-tune[flash4]' on Hopper or newer, 'lightning-tune[flash2]' on Ampere"


def _choose_flash(
    device: torch.device, dtype: torch.dtype, head_dim: int | None
) -> tuple[FlashEngine | None, str | None]:
    """The installed FlashAttention that can run here, or ``None`` and why not (``None, None``: none installed)."""
    engines = [engine for engine, module in _ENGINE_MODULE.items() if _imports.is_available(module)]
    if not engines:
        return None, None
    if device.type != "cuda":
        return None, f"flash-attn needs a CUDA device, got device {str(device)!r}"
    if not torch.cuda.is_available():
        return None, "flash-attn needs a CUDA device, but CUDA is not available"
    if dtype not in (torch.float16, torch.bfloat16):
        return None, (
            f"flash-attn needs float16 or bfloat16, got {dtype} (train with precision='bf16-mixed' or '16-mixed', "
            "or pass dtype=)"
        )
    if head_dim is not None and head_dim > FLASH_MAX_HEAD_DIM:
        return None, f"flash-attn needs a head dimension <= {FLASH_MAX_HEAD_DIM}, got {head_dim}"
    capability = torch.cuda.get_device_capability(device)
    if "flash-attn-4" in engines and capability[0] in (9, 10, 11):  # its kernels: SM90 Hopper, SM100/110 Blackwell
        return "flash-attn-4", None
    if "flash-attn-2" in engines and capability >= (8, 0):
        return "flash-attn-2", None
    name = torch.cuda.get_device_name(device)
    got = f"got {capability[0]}.{capability[1]} ({name})"
    if "flash-attn-2" not in engines:
        return None, (
            f"flash-attn-4 runs on compute capability 9.x-11.x (Hopper, Blackwell), {got}; on Ampere install "
            "flash-attn 2: pip install 'lightning-tune[flash2]'"
        )
    return None, f"flash-attn needs compute capability >= 8.0 (Ampere or newer), {got}"


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
    """Pick the backend that will run: ``"auto"`` is ``"flash"`` where FlashAttention can (docs/attention_swap.md).

    Args:
        requested: One of :data:`~lightning_tune.vocab.ATTENTIONS`, or an alias.
        device: Device the attention will run on.
        dtype: Dtype attention computes in (see :func:`lightning_tune.vocab.precision_dtype`).
        head_dim: Largest head dimension of the model's attention, if known.
        notify: Receives the message when ``"auto"`` does not pick FlashAttention; ``None``: a ``UserWarning``.

    Raises:
        ValueError: If ``requested`` names no attention backend, or ``"flash"`` cannot run here (naming why).
        ModuleNotFoundError: If ``"flash"`` is requested and no FlashAttention is installed.

    Example:
        >>> resolve_backend("sdpa", device="cpu", dtype=torch.float32)
        'sdpa'
    """
    requested = canonical_attention(requested, arg="backend")
    if requested in ("sdpa", "eager"):
        return cast(ResolvedBackend, requested)
    device = torch.device(device)
    say = _warn if notify is None else notify
    engine, problem = _choose_flash(device, dtype, head_dim)
    if engine is None and requested == "flash" and problem is None:
        raise ModuleNotFoundError(
            f"backend='flash' needs FlashAttention, which is not installed. Install it with: {_FLASH_EXTRAS}"
            + ("" if device.type == "cuda" else f". It also needs a CUDA GPU, got device {str(device)!r}"),
            name="flash_attn",
        )
    if engine is None and requested == "flash":
        raise ValueError(f"backend='flash' cannot run here: {problem}. Use backend='auto' to fall back to SDPA.")
    if engine is None:
        why = problem or "flash-attn is not installed"
        advice = "" if problem else f". For FlashAttention: {_FLASH_EXTRAS}"
        say(f"backend='auto': {why}, so attention runs through PyTorch SDPA ({_kernel_text('sdpa', device)}){advice}")
        return "sdpa"
    try:
        _imports.require(_ENGINE_MODULE[engine], feature=f"backend={requested!r}")
    except ImportError as err:  # installed but broken (e.g. built against another torch)
        if requested == "flash":
            raise
        say(f"backend='auto': {engine} is installed but does not import ({err}), so attention runs through SDPA")
        return "sdpa"
    return "flash"


@dataclass(frozen=True, eq=False)
class AttentionSite:
    """One attention module :func:`find_attention` found: its qualified name, kind and the module."""

    path: str
    kind: SwapKind
    module: nn.Module


def _source(obj: Any) -> str:
    """The source of a class or module; empty where there is none to read (defined in a REPL or exec, a builtin)."""
    try:
        return inspect.getsource(obj)
    except (OSError, TypeError):
        return ""


def _calls_sdpa(cls: type) -> bool:
    """Whether the source of ``cls`` (or of a class it inherits outside the libraries) mentions SDPA."""
    if cls not in _CALLS_SDPA:
        own = [k for k in cls.__mro__ if not k.__module__.startswith(_LIBRARY_PREFIXES) and k.__module__ != "torch"]
        _CALLS_SDPA[cls] = any("scaled_dot_product_attention" in _source(k) for k in own)  # `object` has no source
    return _CALLS_SDPA[cls]


def find_attention(module: nn.Module) -> list[AttentionSite]:
    """Find the attention :func:`swap_attention` would route, in module order, without changing anything.

    Args:
        module: The model.

    Raises:
        TypeError: If ``module`` is not a ``torch.nn.Module``.

    Example:
        >>> [(site.path, site.kind) for site in find_attention(nn.TransformerEncoderLayer(8, 2))]
        [('self_attn', 'MultiheadAttention')]
    """
    check_instance("module", module, nn.Module, "a torch.nn.Module")
    pretrained = pretrained_model_class()
    hf_roots: list[str] = []
    sites: list[AttentionSite] = []
    for path, child in module.named_modules(remove_duplicate=True):
        is_pretrained = pretrained is not None and isinstance(child, pretrained)
        if is_pretrained and not inside(path, hf_roots):
            hf_roots.append(path)
            sites.append(AttentionSite(path, "transformers", child))
        elif isinstance(child, nn.MultiheadAttention):
            sites.append(AttentionSite(path, "MultiheadAttention", child))
        elif not inside(path, hf_roots) and _calls_sdpa(type(child)):
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


def _routes(device: torch.device) -> bool:
    """Whether SDPA calls on ``device`` go through the router (CUDA, where the kernel list has no MATH)."""
    return device.type == "cuda"


def _sdpa_call(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    return (
        {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None}
        | dict(zip(names, args, strict=False))
        | dict(kwargs)
    )


def fused_problem(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> str | None:
    """Why neither fused SDPA kernel (flash, memory-efficient) on CUDA takes a call, or ``None`` when one may.

    Example:
        >>> q = torch.zeros(2, 4, 8, dtype=torch.float64)
        >>> fused_problem(q, q, q)
        'float64 inputs (the fused kernels take float16, bfloat16 and float32)'
    """
    if query.dtype == torch.float64:
        return "float64 inputs (the fused kernels take float16, bfloat16 and float32)"
    if query.dim() != 4:
        return f"{query.dim()}-D inputs (the fused kernels take (batch, heads, seq, head_dim))"
    alignment = 4 if query.dtype == torch.float32 else 8
    head_dims = (query.shape[-1], key.shape[-1], value.shape[-1])
    if max(head_dims) > FLASH_MAX_HEAD_DIM and any(dim % alignment for dim in head_dims):
        return (
            f"head dimension {query.shape[-1]} in {str(query.dtype).removeprefix('torch.')} (flash takes at most "
            f"{FLASH_MAX_HEAD_DIM}, memory-efficient a multiple of {alignment})"
        )
    return None


def _flash4_call(call: Mapping[str, Any]) -> torch.Tensor | None:
    """Run an SDPA call through flash-attn-4, or return ``None`` when it cannot take the call as it stands."""
    q, k, v = call["query"], call["key"], call["value"]
    if q.dim() != 4 or q.dtype not in (torch.float16, torch.bfloat16) or call["attn_mask"] is not None:
        return None
    if call["dropout_p"] or (call["is_causal"] and q.shape[-2] != k.shape[-2]):  # flash aligns causal bottom right
        return None
    if k.shape[1] != v.shape[1] or q.shape[1] % k.shape[1]:
        return None
    largest = FLASH_MAX_HEAD_DIM if torch.cuda.get_device_capability(q.device)[0] == 9 else 128
    if any(dim % 8 or not 8 <= dim <= largest for dim in (q.shape[-1], v.shape[-1])):
        return None
    flash = _imports.require("flash_attn.cute", feature="backend='flash'").flash_attn_func
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, S, D) -> flash-attn's (B, S, H, D)
    out = flash(q, k, v, softmax_scale=call["scale"], causal=bool(call["is_causal"]))
    out = out[0] if isinstance(out, tuple) else out  # it returns (out, lse)
    return out.transpose(1, 2)


class _SdpaRouter(TorchFunctionMode):
    """Inside a swapped forward on CUDA: sends each SDPA call to FlashAttention, a fused kernel, or MATH."""

    def __init__(self, owner: _KernelForward) -> None:
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        return self.owner.attend(args, kwargs)


class _KernelForward(InstanceForward):
    """An instance-level ``forward`` that runs the module's own forward under ``sdpa_kernel``.

    On CUDA its SDPA calls go through :class:`_SdpaRouter` to :meth:`attend` (flash-attn-4, fused SDPA, else MATH).
    """

    def __init__(
        self,
        module: nn.Module,
        backend: ResolvedBackend,
        original: Any,
        fallback: torch.device,
        engine: FlashEngine | None = None,
    ) -> None:
        super().__init__(module, original)
        self.backend: ResolvedBackend = backend
        self.fallback = fallback
        self.engine = engine if backend == "flash" else None
        self.warned_weights = False
        self.warned_math = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        mha = isinstance(self.module, nn.MultiheadAttention) and not self.warned_weights
        if mha and kwargs.get("need_weights", args[4] if len(args) > 4 else True):
            self.warned_weights = True
            warnings.warn(
                "nn.MultiheadAttention was called with need_weights=True (its default): it then computes the "
                "attention weights explicitly instead of calling scaled_dot_product_attention, so the attention "
                "swap does not change it. Pass need_weights=False where the weights are not used.",
                UserWarning,
                stacklevel=2,
            )
        tensors = (v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor))
        device = next((t.device for t in tensors), self.fallback)
        with sdpa_kernel(sdpa_backends(self.backend, device)):
            if self.backend == "eager" or not _routes(device):
                return self.call_original(*args, **kwargs)
            with _SdpaRouter(self):
                return self.call_original(*args, **kwargs)

    def attend(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Any:
        """Run one SDPA call: on flash-attn-4 where it suits, else a fused kernel, else MATH with one warning."""
        call = _sdpa_call(args, kwargs)
        if self.engine == "flash-attn-4":
            out = _flash4_call(call)
            if out is not None:
                return out
        problem = fused_problem(call["query"], call["key"], call["value"])
        if problem is None:
            try:
                return F.scaled_dot_product_attention(*args, **kwargs)
            except RuntimeError as err:
                if "No available kernel" not in str(err):
                    raise
                problem = "this call (PyTorch found no fused kernel for it; its warnings above say why)"
        if not self.warned_math:
            self.warned_math = True
            warnings.warn(
                f"{type(self.module).__name__}: neither fused SDPA kernel (flash, memory-efficient) takes {problem}, "
                "so these calls run on the MATH kernel, slower and with more memory.",
                UserWarning,
                stacklevel=2,
            )
        with sdpa_kernel([SDPBackend.MATH]):
            return F.scaled_dot_product_attention(*args, **kwargs)


def _wrap_forward(
    module: nn.Module, backend: ResolvedBackend, device: torch.device, engine: FlashEngine | None = None
) -> Callable[[], None]:
    """Route ``module.forward`` through ``sdpa_kernel``; return the undo."""
    current = module.__dict__.get("forward")
    if isinstance(current, _KernelForward):
        if (current.backend, current.engine) != (backend, engine):  # re-swap: replace the wrap, keep the original
            setattr(module, "forward", _KernelForward(module, backend, current.original, device, engine))  # noqa: B010
    else:
        setattr(module, "forward", _KernelForward(module, backend, current, device, engine))  # noqa: B010
    return lambda: remove_forward(module, _KernelForward)


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
    return source_module is not None and "ALL_ATTENTION_FUNCTIONS" in _source(source_module)


def _hf_name(backend: ResolvedBackend, engine: FlashEngine | None) -> str:
    """Transformers' attention implementation for a backend: ``"sdpa"`` and ``"eager"`` keep their names."""
    return backend if backend != "flash" else "flash_attention_4" if engine == "flash-attn-4" else "flash_attention_2"


def _switch_transformers(
    site: AttentionSite,
    backend: ResolvedBackend,
    requested: str,
    pretrained: type,
    say: Callable[[str], object],
    engine: FlashEngine | None = None,
) -> tuple[ResolvedBackend, str] | None:
    """Switch a transformers model's attention implementation; return (backend used, detail) or None if skipped."""
    model = site.module
    name = type(model).__name__
    if not _hf_switchable(model):
        warnings.warn(
            f"{name} chose its attention classes when it was built (transformers before the AttentionInterface), so "
            f"its attention implementation cannot be switched now; it stays {_hf_current(model)!r}. Load it with "
            f"`attn_implementation={_hf_name(backend, engine)!r}` instead.",
            UserWarning,
            stacklevel=3,
        )
        return None
    if model not in _HF_ORIGINALS:
        names = ("_attn_implementation_internal", "_attn_implementation_autoset")
        configs = _hf_configs(model, pretrained)
        _HF_ORIGINALS[model] = [(c, name, vars(c).get(name, _MISSING)) for c in configs for name in names]
    original = _HF_ORIGINALS[model]
    first = original[0][2] if original else _MISSING  # the model's own config comes first
    shown = _hf_current(model) if first is _MISSING or first is None else first
    fallbacks: list[ResolvedBackend] = ["sdpa", "eager"] if requested == "auto" else []
    candidates = list(dict.fromkeys([backend, *fallbacks]))  # "auto" walks down to what the model supports
    for candidate in candidates:
        target = _hf_name(candidate, engine)
        setter = getattr(model, "set_attn_implementation", None)
        try:
            if callable(setter):
                setter(target)
            else:
                model.config._attn_implementation = target  # type: ignore[union-attr]
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
    _restore_transformers(model)
    warnings.warn(
        f"{name} did not take attn_implementation={_hf_name(backend, engine)!r} (it stays "
        f"{_hf_current(model)!r}); see transformers' log for why.",
        UserWarning,
        stacklevel=3,
    )
    return None


def _restore_transformers(model: nn.Module) -> None:
    _hf_apply_snapshot(_HF_ORIGINALS.pop(model, []))  # nothing to restore when another result restored it first


@dataclass(frozen=True)
class SwapEntry:
    """One swapped attention module; ``detail`` is what runs (SDPA kernels, or the transformers implementation)."""

    path: str
    kind: SwapKind
    module_type: str
    backend: ResolvedBackend
    detail: str


@dataclass
class AttentionSwapResult(SurgeryResult):
    """What :func:`swap_attention` changed (``backend`` is ``None`` when nothing was); :meth:`restore` undoes it."""

    requested: str
    backend: ResolvedBackend | None
    entries: list[SwapEntry] = field(default_factory=list)

    def describe(self) -> str:
        """A title line, then one row per swapped module (path, class, kind, backend, kernel), for printing."""
        if not self.entries:
            return f"Attention swap (backend={self.requested!r}): no attention found"
        rows = [[e.path or "(root)", e.module_type, e.kind, e.backend, e.detail] for e in self.entries]
        title = f"Attention swap: backend {self.backend!r} (requested {self.requested!r}), {len(rows)} module(s)"
        return f"{title}\n{table([['Module', 'Class', 'Kind', 'Backend', 'Kernel'], *rows])}"


def swap_attention(
    module: nn.Module,
    backend: str = "auto",
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    notify: Callable[[str], object] | None = None,
) -> AttentionSwapResult:
    """Route every attention module of ``module`` through ``backend`` (docs/attention_swap.md), in place.

    Args:
        module: The model, not wrapped in DDP/FSDP (a LightningModule is fine).
        backend: One of :data:`~lightning_tune.vocab.ATTENTIONS`, or an alias (``"flash_attention_2"``).
        device: Device attention will run on; ``None``: that of the model's first parameter.
        dtype: Dtype attention computes in; ``None``: that of the model's first floating-point parameter.
        notify: Receives informative messages (why ``"auto"`` did not pick flash-attn); ``None``: ``UserWarning``.

    Raises:
        TypeError: If ``module`` is not an ``nn.Module``, or is (or holds) a DataParallel, DDP or FSDP wrapper.
        ValueError: If ``backend`` is unknown or cannot run, or a transformers model refuses the implementation.
        ModuleNotFoundError: If ``backend="flash"`` and flash-attn is not installed.

    Example:
        >>> layer = nn.TransformerEncoderLayer(d_model=8, nhead=2, batch_first=True)
        >>> result = swap_attention(layer, "sdpa", device="cpu")
        >>> print(result.describe())
        Attention swap: backend 'sdpa' (requested 'sdpa'), 1 module(s)
        Module     Class               Kind                Backend  Kernel
        self_attn  MultiheadAttention  MultiheadAttention  sdpa     SDPA flash, math
        >>> result.restore()
        >>> "forward" in vars(layer.self_attn)
        False
    """
    backend = canonical_attention(backend, arg="backend")
    check_instance("module", module, nn.Module, "a torch.nn.Module")
    refuse_wrapped(module, surgery="swap_attention", callback="AttentionSwap")
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
    tensors = [*module.parameters(), *module.buffers()]
    run_device = torch.device(device) if device is not None else next((t.device for t in tensors), torch.device("cpu"))
    floats = (p.dtype for p in module.parameters() if p.is_floating_point())
    run_dtype = dtype if dtype is not None else next(floats, torch.get_default_dtype())
    head_dim = max((dim for dim in map(_head_dim, sites) if dim is not None), default=None)
    say = _warn if notify is None else notify
    resolved = resolve_backend(backend, device=run_device, dtype=run_dtype, head_dim=head_dim, notify=say)
    result = AttentionSwapResult(requested=backend, backend=resolved)
    engine = _choose_flash(run_device, run_dtype, head_dim)[0] if resolved == "flash" else None
    pretrained = pretrained_model_class()
    modules = dict(module.named_modules())
    try:
        for site in sites:
            target = site.module
            entry_backend = resolved
            if site.kind == "transformers":
                assert pretrained is not None
                switched = _switch_transformers(site, resolved, backend, pretrained, say, engine)
                if switched is None:
                    continue
                entry_backend, detail = switched
                result._undo.append(functools.partial(_restore_transformers, target))
                if entry_backend == "sdpa":
                    result._undo.append(_wrap_forward(target, "sdpa", run_device))
                    detail += f" under {_kernel_text('sdpa', run_device)}"
            else:
                result._undo.append(_wrap_forward(target, resolved, run_device, engine))
                parent = modules.get(site.path.rpartition(".")[0]) if site.path else None
                if isinstance(parent, nn.TransformerEncoderLayer) and parent.self_attn is target:
                    # its fast path skips MHA.forward
                    result._undo.append(_wrap_forward(parent, resolved, run_device, engine))
                detail = _kernel_text(resolved, run_device)
                if engine == "flash-attn-4":
                    detail = f"flash-attn-4 where a call suits it, else {detail}"

            result.entries.append(SwapEntry(site.path, site.kind, type(target).__name__, entry_backend, detail))
    except BaseException:
        result.restore()
        raise
    return result
