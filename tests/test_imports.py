"""The package's import structure: no cycle, no reaching into another module's private names, any import order."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_tune"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(module: str) -> list[tuple[str, str | None, int]]:
    """(imported module, imported name or None, line) for every import of the package, function-level included."""
    found = []
    for node in ast.walk(ast.parse(MODULES[module].read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(a.name, None, node.lineno) for a in node.names if a.name.split(".")[0] == "lightning_tune"]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("lightning_tune"):
            found += [(str(node.module), a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level > 0:
            pytest.fail(f"{module}:{node.lineno} uses a relative import; the package imports absolutely")
    return found


def _target(imported: str, name: str | None) -> str:
    """The package module an import depends on: the submodule when ``name`` is one, else the module itself."""
    if name is not None and f"{imported}.{name}" in MODULES:
        return f"{imported}.{name}"
    return imported


def test_every_module_is_seen() -> None:
    assert "lightning_tune.vocab" in MODULES and "lightning_tune.cli" in MODULES and len(MODULES) > 40


def test_no_import_of_another_modules_private_name() -> None:
    offences = [
        f"{module}:{line} imports {name} from {imported}"
        for module in MODULES
        for imported, name, line in _imports(module)
        if name is not None and name.startswith("_") and not name.endswith("__") and f"{imported}.{name}" not in MODULES
    ]
    assert offences == []


def test_no_import_cycle() -> None:
    graph = {m: {_target(i, n) for i, n, _ in _imports(m)} - {m} for m in MODULES}
    cycles: list[list[str]] = []

    def visit(module: str, path: list[str], done: set[str]) -> None:
        for nxt in sorted(graph.get(module, ())):
            if nxt in path:
                cycles.append([*path[path.index(nxt) :], nxt])
            elif nxt not in done:
                visit(nxt, [*path, nxt], done)
        done.add(module)

    done: set[str] = set()
    for module in MODULES:
        if module not in done:
            visit(module, [module], done)
    assert cycles == [], "import cycles: " + "; ".join(" -> ".join(c) for c in cycles[:5])


_FRESH_IMPORTS = """
import importlib, sys
modules = sys.argv[1:]
for first in modules:  # each module imported first, into a package nothing else has loaded
    for name in [n for n in sys.modules if n == "lightning_tune" or n.startswith("lightning_tune.")]:
        del sys.modules[name]
    importlib.import_module(first)
for order in (modules, modules[::-1]):  # then all of them, in both orders
    for name in [n for n in sys.modules if n == "lightning_tune" or n.startswith("lightning_tune.")]:
        del sys.modules[name]
    for name in order:
        importlib.import_module(name)
"""


@pytest.mark.slow
def test_every_module_imports_first_and_in_any_order() -> None:
    modules = [m for m in MODULES if m != "lightning_tune.__main__"]  # __main__ runs the CLI on import
    result = subprocess.run(
        [sys.executable, "-c", _FRESH_IMPORTS, *modules], capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode == 0, result.stderr[-3000:]


ENGINES = tuple(
    f"lightning_tune.{room}" for room in ("batch", "lr", "perf", "plan", "report", "swaps", "_surgery", "vocab", "keys")
)
# runs a LightningModule's own configure_optimizers/training_step on fake tensors; it still knows no Trainer
_READS_LIGHTNING_MODULE = {"lightning_tune.plan.measured"}


def test_engines_and_surgery_know_no_lightning() -> None:
    offences = []
    for module, path in MODULES.items():
        if not module.startswith(ENGINES) or module in _READS_LIGHTNING_MODULE:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            offences += [f"{module}:{node.lineno} imports {n}" for n in names if n.split(".")[0] == "lightning"]
    assert offences == []
