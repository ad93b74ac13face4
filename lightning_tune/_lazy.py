"""Lazy re-exports for package ``__init__`` modules: a name is imported from its module on first use.

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


def lazy_exports(package: str, origins: Mapping[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` of ``package`` that import each name of ``origins`` (name -> module) on first use."""

    def __getattr__(name: str) -> Any:
        if name not in origins:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(origins[name]), name)
        setattr(sys.modules[package], name, value)  # later look-ups skip this function
        return value

    def __dir__() -> list[str]:
        return sorted({*vars(sys.modules[package]), *origins})

    return __getattr__, __dir__
