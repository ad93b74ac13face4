"""``torch.compile`` of an unmodified model, in place and undoably: :func:`compile_modules` (docs/presets.md).

Each chosen submodule gets an instance ``forward`` compiled by ``torch.compile``; the module objects and parameters
stay, so optimizers, checkpoints and ``state_dict`` keys do too.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal, get_args

import torch
from torch import nn

from lightning_tune._surgery import SurgeryResult
from lightning_tune._validation import check_bool, check_choice, check_keys, check_mapping, check_strings

#: ``torch.compile`` modes.
CompileMode = Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]
COMPILE_MODES: Final[tuple[str, ...]] = get_args(CompileMode)
#: Compiled ``forward`` functions this module installed.
_INSTALLED: weakref.WeakSet[Callable[..., Any]] = weakref.WeakSet()


@dataclass
class CompileResult(SurgeryResult):
    """The qualified names of the modules :func:`compile_modules` compiled; :meth:`restore` makes them eager again."""

    paths: list[str] = field(default_factory=list)

    def describe(self) -> str:
        """One line naming the compiled modules."""
        return f"torch.compile: {', '.join(p or '(root)' for p in self.paths)}"


def is_compiled(module: nn.Module) -> bool:
    """Whether ``module`` already runs compiled: by ``nn.Module.compile()`` or by a compiled instance ``forward``."""
    # `nn.Module.compile()` stores its compiled `_call_impl` in this instance attribute (read only, never written)
    compiled_call = module.__dict__.get("_compiled_call_impl") is not None
    return compiled_call or module.__dict__.get("forward") in _INSTALLED  # `None in` a WeakSet is False


def _compile_forward(module: nn.Module, kwargs: Mapping[str, Any]) -> Callable[[], None]:
    """Give ``module`` an instance ``forward`` compiled from its current one; return the undo.

    Not ``nn.Module.compile()``: that compiles ``_call_impl``, and TorchDynamo does not start tracing in torch's own
    files, so on torch's module classes (``nn.Sequential``, ``nn.Linear``, ...) it compiled nothing (torch 2.13).
    """
    previous = module.__dict__.get("forward")
    compiled = torch.compile(module.forward, **kwargs)
    _INSTALLED.add(compiled)
    setattr(module, "forward", compiled)  # noqa: B010

    def undo() -> None:
        if module.__dict__.get("forward") is not compiled:
            return  # replaced by someone else since: leave it
        if previous is None:
            del module.__dict__["forward"]
        else:
            setattr(module, "forward", previous)  # noqa: B010

    return undo


def check_compile_options(
    *, mode: str | None, fullgraph: bool, dynamic: bool | None, backend: str | Callable[..., Any], options: Any
) -> None:
    """Raise ``TypeError``/``ValueError`` for ``torch.compile`` arguments that :func:`compile_modules` refuses."""
    if mode is not None:
        check_choice("mode", mode, COMPILE_MODES)
    check_bool("fullgraph", fullgraph)
    if dynamic is not None:
        check_bool("dynamic", dynamic)
    if isinstance(backend, str):
        check_choice("backend", backend, torch.compiler.list_backends(exclude_tags=()))
    elif not callable(backend):
        raise TypeError(f"`backend` must be a backend name or a callable, got {backend!r} ({type(backend).__name__})")
    if options is not None:
        check_mapping("options", options, allow_none=True)
        if mode is not None:
            raise ValueError(f"give `mode` or `options`, not both (torch.compile refuses both), got mode={mode!r}")
        if backend == "inductor":  # torch.compile checks them only when it compiles
            from torch._inductor import list_options

            check_keys("options", options, list_options())


def compile_modules(
    module: nn.Module,
    modules: Sequence[str] | None = None,
    *,
    mode: CompileMode | None = None,
    fullgraph: bool = False,
    dynamic: bool | None = None,
    backend: str | Callable[..., Any] = "inductor",
    options: Mapping[str, Any] | None = None,
) -> CompileResult:
    """Compile submodules of ``module`` in place (compilation itself happens at each module's first call).

    Args:
        module: The model.
        modules: Qualified names of the submodules to compile (``""``: ``module`` itself); ``None``: every direct
            child that holds parameters.
        mode: ``torch.compile`` mode, one of :data:`COMPILE_MODES`; ``None`` is torch's default.
        fullgraph: Make a graph break an error.
        dynamic: Shape dynamism: ``None`` detects it, ``True``/``False`` force it.
        backend: A name from ``torch.compiler.list_backends(exclude_tags=())``, or a callable.
        options: Backend options (not together with ``mode``).

    Returns:
        What was compiled; its :meth:`~CompileResult.restore` makes the modules eager again.

    Raises:
        TypeError: If an argument has the wrong type.
        ValueError: If an option is not allowed, a named submodule does not exist, or nothing would be compiled.

    Example:
        >>> model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
        >>> result = compile_modules(model, backend="eager")
        >>> result.paths
        ['0', '2']
        >>> result.restore()
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"`module` must be a torch.nn.Module, got {type(module).__name__}")
    check_compile_options(mode=mode, fullgraph=fullgraph, dynamic=dynamic, backend=backend, options=options)
    if modules is None:
        targets = [(name, child) for name, child in module.named_children() if any(True for _ in child.parameters())]
        if not targets:
            raise ValueError(f"{type(module).__name__} has no child module with parameters to compile; name `modules`")
    else:
        check_strings("modules", modules, what="submodule names", allow_empty=False)
        targets = []
        for name in modules:
            try:
                targets.append((name, module.get_submodule(name)))
            except AttributeError:
                children = ", ".join(repr(n) for n, _ in module.named_children())
                raise ValueError(
                    f"`modules` names {name!r}, which is not a submodule of {type(module).__name__} "
                    f"(its children: {children}; '' is the module itself)"
                ) from None
    kwargs: dict[str, Any] = {"fullgraph": fullgraph, "dynamic": dynamic, "backend": backend, "mode": mode}
    kwargs["options"] = None if options is None else dict(options)  # torch.compile's defaults are None too
    result = CompileResult()
    for name, target in targets:
        if is_compiled(target):
            continue  # compiled before (by the user or an earlier call): leave theirs
        result._undo.append(_compile_forward(target, kwargs))
        result.paths.append(name)
    return result
