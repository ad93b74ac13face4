from __future__ import annotations

import fcntl
import json
import os
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch

os.environ.setdefault("PL_DISABLE_FORK", "1")


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> None:
    """Two worker processes, one test file each at a time, where pytest-xdist is installed (the ``dev`` extra).

    ``-n 0`` or ``-p no:xdist`` runs in one process; ``-n N`` chooses. A file stays on one worker, so a module fixture
    runs once.
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


@pytest.fixture(scope="session")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], list[Any]]:
    """One scenario's results on both ranks, from the one 2-process launch of the test run (``tests/scripts``).

    The first test that asks starts the launch, which runs every scenario; the workers of the run share it.
    """
    # imported here, not at collection: Lightning imported before pytest's log capture starts keeps its messages
    # from reaching ``caplog``
    from tests.helpers import launch_two_ranks

    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    out = tmp_path_factory.getbasetemp().parent / f"two-ranks-{run}" if run else tmp_path_factory.mktemp("two-ranks")
    out.mkdir(exist_ok=True)
    with open(out / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        done = out / "results.json"
        if not done.exists():
            try:
                results: dict[str, Any] = launch_two_ranks(out)
            except Exception as error:  # noqa: BLE001 - every scenario's test reports it, without a second launch
                results = {"failed": str(error)}
            done.write_text(json.dumps(results))
        results = json.loads(done.read_text())

    def scenario(name: str) -> list[Any]:
        assert "failed" not in results, results.get("failed")
        for rank, result in enumerate(results[name]):
            assert not (isinstance(result, dict) and "error" in result), f"{name}, rank {rank}:\n{result['error']}"
        return results[name]

    return scenario
