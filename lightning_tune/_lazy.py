"""Lazy re-exports for package ``__init__`` modules: a name is imported from its module on first use.

``import lightning_tune`` and the command line's start-up then cost no torch or Lightning import until a name that
needs one is used; ``lightning_tune.X``, ``from lightning_tune import X`` and ``__all__`` work as with eager imports.

Example:
    >>> getattr_, dir_ = lazy_exports("json", {"dumps": "json"})
    >>> getattr_("dumps")([1])
    '[1]'
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(package: str, origins: Mapping[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The module ``__getattr__`` and ``__dir__`` of ``package`` that import each name from its module on first use.

    Args:
        package: The package's ``__name__``.
        origins: Exported name -> the module it is defined in.

    Returns:
        ``(__getattr__, __dir__)`` to assign in the package's ``__init__``.
    """

    def __getattr__(name: str) -> Any:
        if name not in origins:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(origins[name]), name)
        setattr(sys.modules[package], name, value)  # later look-ups skip this function
        return value

    def __dir__() -> list[str]:
        return sorted({*vars(sys.modules[package]), *origins})

    return __getattr__, __dir__
