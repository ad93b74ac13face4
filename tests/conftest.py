from __future__ import annotations

import os
import warnings

import pytest
import torch

os.environ.setdefault("PL_DISABLE_FORK", "1")


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> None:
    """Two worker processes, one test file each at a time, where pytest-xdist is installed (the ``dev`` extra).

    ``-n 0`` or ``-p no:xdist`` runs in one process; ``-n N`` chooses. A file stays on one worker because several
    files start one multi-process run in a module fixture that every test of the file reads.
    """
    option = config.option
    if not config.pluginmanager.hasplugin("xdist") or getattr(option, "numprocesses", 0) is not None:
        return
    if option.usepdb or option.collectonly or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    option.numprocesses = 2
    if option.dist == "no":
        option.dist = "loadfile"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; none is present on this machine")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _quiet_lightning() -> None:
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*GPU available but not used.*")
    torch.manual_seed(0)
