"""Lazy access to optional packages.

Every optional dependency of lightning_tune is reached through :func:`require` (or the helpers built on it), so
importing the package never imports bitsandbytes, flash-attn, deepspeed or nvidia-ml-py, and a missing package
raises one clear error that names the extra to install.
"""

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
    """Tell whether an optional package can be imported, without importing it.

    flash-attn 2 (``flash_attn``) and flash-attn-4 (``flash_attn.cute``) share the ``flash_attn`` name: flash-attn-4
    alone installs it as a namespace package, with no ``__init__.py``, which does not count as flash-attn 2 (Hugging
    Face models would otherwise be sent to ``flash_attention_2``). Neither check imports anything.

    Args:
        module: Import name, one of the keys of :data:`OPTIONAL_PACKAGES`.

    Returns:
        ``True`` when the package is installed (or already imported).

    Raises:
        ValueError: If ``module`` is not one of the optional packages.

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
    """Import an optional package or raise an error that names the extra to install.

    Args:
        module: Import name, one of the keys of :data:`OPTIONAL_PACKAGES`.
        feature: What needs it, for the error message (e.g. ``"OptimizerSwap"``).

    Returns:
        The imported module.

    Raises:
        ValueError: If ``module`` is not one of the optional packages.
        ModuleNotFoundError: If the package is not installed; the message names the extra.
    """
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
