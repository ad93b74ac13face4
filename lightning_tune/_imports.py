"""Lazy access to optional packages: importing lightning_tune imports none, and a missing one names its extra."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from types import ModuleType
from typing import Final

#: Import name -> (extra that installs it, distribution name).
OPTIONAL_PACKAGES: Final[dict[str, tuple[str, str]]] = {
    "bitsandbytes": ("bnb", "bitsandbytes"),
    "deepspeed": ("deepspeed", "deepspeed"),
    "flash_attn": ("flash2", "flash-attn"),
    "flash_attn.cute": ("flash4", "flash-attn-4"),
    "liger_kernel": ("liger", "liger-kernel"),
    "pynvml": ("gpu", "nvidia-ml-py"),
}


def is_available(module: str) -> bool:
    """Whether the optional package ``module`` (a key of :data:`OPTIONAL_PACKAGES`) can be imported, not importing it.

    flash-attn-4 alone installs ``flash_attn`` as a namespace package, which does not count as flash-attn 2 (Hugging
    Face models would otherwise be sent to ``flash_attention_2``).

    Example:
        >>> is_available("flash_attn") in (True, False)
        True
    """
    _check_known(module)
    top, _, sub = module.partition(".")
    if module in sys.modules:  # imported already (or marked missing with None)
        found = sys.modules[module]
        return found is not None and (bool(sub) or getattr(found, "__file__", None) is not None)
    loaded = sys.modules.get(top, False)
    if loaded is None:
        return False
    if loaded is not False:  # the parent is imported: look beside it
        locations = list(getattr(loaded, "__path__", None) or [])
    else:
        spec = importlib.util.find_spec(top)
        if spec is None:
            return False
        if not sub:
            return spec.origin is not None and spec.origin != "namespace"  # a regular package, not a namespace
        locations = list(spec.submodule_search_locations or [])
    return any(os.path.isdir(os.path.join(location, sub)) for location in locations)


def require(module: str, *, feature: str) -> ModuleType:
    """Import the optional package ``module``, or raise ``ModuleNotFoundError`` naming the extra ``feature`` needs."""
    _check_known(module)
    extra, distribution = OPTIONAL_PACKAGES[module]
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as err:
        if err.name is not None and not (module == err.name or module.startswith(f"{err.name}.")):
            raise  # the package is there but one of its own dependencies is missing: keep the real error
        raise ModuleNotFoundError(
            f"{feature} needs the optional package `{distribution}`, which is not installed. "
            f"Install it with: pip install 'lightning-tune[{extra}]'",
            name=module,
        ) from err


def _check_known(module: str) -> None:
    if module not in OPTIONAL_PACKAGES:
        raise ValueError(f"`module` must be one of {sorted(OPTIONAL_PACKAGES)}, got {module!r}")
