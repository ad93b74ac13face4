"""The public surface: sorted ``__all__`` lists that match what is importable, and optional packages behind extras."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

from lightning_tune import _imports

PACKAGES = [
    "lightning_tune",
    "lightning_tune.callbacks",
    "lightning_tune.lr",
    "lightning_tune.perf",
    "lightning_tune.demos",
    "lightning_tune.batch",
    "lightning_tune.plan",
    "lightning_tune.bench",
    "lightning_tune.config",
    "lightning_tune.plugins",
    "lightning_tune.swaps",
]


@pytest.mark.parametrize("name", PACKAGES)
def test_all_is_sorted_and_importable(name: str) -> None:
    module = importlib.import_module(name)
    assert module.__all__ == sorted(module.__all__)
    assert len(set(module.__all__)) == len(module.__all__)
    for symbol in module.__all__:
        assert hasattr(module, symbol), f"{name}.{symbol} is listed in __all__ but missing"
    public = {
        k for k, v in vars(module).items() if not k.startswith("_") and getattr(v, "__module__", "").startswith(name)
    }
    assert public <= set(module.__all__), f"public names missing from {name}.__all__: {public - set(module.__all__)}"


def test_import_pulls_in_no_optional_package() -> None:
    optional = "('bitsandbytes', 'flash_attn', 'deepspeed', 'liger_kernel', 'pynvml')"
    code = f"import sys, lightning_tune; print(sorted(m for m in {optional} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]"


@pytest.mark.parametrize(
    ("module", "extra"),
    [
        ("bitsandbytes", "bnb"),
        ("flash_attn", "flash2"),
        ("flash_attn.cute", "flash4"),
        ("deepspeed", "deepspeed"),
        ("liger_kernel", "liger"),
        ("pynvml", "gpu"),
    ],
)
def test_missing_optional_package_names_the_extra(monkeypatch: pytest.MonkeyPatch, module: str, extra: str) -> None:
    real_import = importlib.import_module

    def fake_import(name: str, *args: object) -> object:
        if name == module:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return real_import(name, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(_imports.importlib, "import_module", fake_import)
    with pytest.raises(ModuleNotFoundError, match=rf"pip install 'lightning-tune\[{extra}\]'"):
        _imports.require(module, feature="SomeFeature")


def test_require_rejects_unknown_packages() -> None:
    with pytest.raises(
        ValueError,
        match=r"`module` must be one of \['bitsandbytes', 'deepspeed', 'flash_attn', 'flash_attn.cute', "
        r"'liger_kernel', 'pynvml'\], got 'numpy'",
    ):
        _imports.require("numpy", feature="x")


def test_version_is_the_installed_distributions() -> None:
    import importlib.metadata

    import lightning_tune

    assert lightning_tune.__version__ == importlib.metadata.version("lightning-tune")
    assert "__version__" in lightning_tune.__all__


def test_version_falls_back_when_the_package_is_not_installed() -> None:
    # a source tree on sys.path without installed metadata: the import must still work and say the version is unknown
    code = (
        "import importlib.metadata as m\n"
        "def missing(name): raise m.PackageNotFoundError(name)\n"
        "m.version = missing\n"
        "import lightning_tune; print(lightning_tune.__version__)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "0.0.0+unknown"
