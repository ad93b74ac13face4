"""What every benchmark writes: the run's header (device, date, commit, command, versions), and ``<out>.json`` plus
``<out>.md`` side by side, each flushed to disk before the next figure is taken."""

from __future__ import annotations

import importlib.metadata
import json
import platform
import shlex
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from lightning_tune.bench.files import write_atomically

#: Header fields every result file carries (checked by the suite's smoke test).
HEADER_FIELDS = ("benchmark", "device", "date", "commit", "command", "torch", "lightning_tune", "versions")

#: Trainer arguments of every timed run: it writes nothing of its own (no logs, checkpoints, progress bar or summary).
QUIET_TRAINER: dict[str, Any] = {
    "logger": False,
    "enable_checkpointing": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
}

# distributions whose versions change the figures; a missing one is recorded as "not installed"
_DISTRIBUTIONS = ("torch", "lightning", "transformers", "bitsandbytes", "flash-attn", "flash-attn-4", "triton")


def git_commit() -> str:
    """The checked-out commit (``+dirty`` when the tree has changes), or ``"unknown"`` outside a git checkout."""
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True)
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return commit.strip() + ("+dirty" if dirty.stdout.strip() else "")


def versions() -> dict[str, str]:
    """Python, CUDA and the versions of the packages that shape the figures."""
    import torch

    import lightning_tune

    found = {"python": platform.python_version(), "lightning_tune": lightning_tune.__version__}
    for name in _DISTRIBUTIONS:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = "not installed"
    found["cuda"] = str(torch.version.cuda) if torch.version.cuda else "none"
    return found


def device_name() -> str:
    """The CUDA device's name, or the CPU with its thread count."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def run_header(benchmark: str, device: str) -> dict[str, Any]:
    """The fields every result starts with: what ran, where, when, at which commit, by which command, with which
    versions."""
    import torch

    import lightning_tune

    return {
        "benchmark": benchmark,
        "device": device,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "command": shlex.join(["python", *sys.argv]),
        "torch": torch.__version__,
        "lightning_tune": lightning_tune.__version__,
        "versions": versions(),
    }


def header_lines(record: dict[str, Any]) -> list[str]:
    """The Markdown lines that state the header of ``record``."""
    shown = ", ".join(f"{k} {v}" for k, v in record["versions"].items() if v != "not installed")
    return [
        f"{record['device']}, {record['date']}, commit `{record['commit'][:12]}`.",
        "",
        f"Command: `{record['command']}`",
        "",
        f"Versions: {shown}.",
        "",
    ]


def write_results(out: Path | None, record: dict[str, Any], report: str) -> None:
    """Print the Markdown report and, when ``out`` is given, write ``<out>.json`` and ``<out>.md`` (each written to a
    temporary file, flushed, and renamed into place)."""
    print(report, flush=True)
    if out is None:
        return
    write_atomically(out.with_suffix(".json"), (json.dumps(record, indent=2, default=str) + "\n").encode())
    write_atomically(out.with_suffix(".md"), report.encode())
