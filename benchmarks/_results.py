"""What every benchmark writes: the run's header (device, date, commit, command), and ``<out>.json`` plus ``<out>.md``
side by side."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any


def git_commit() -> str:
    """The checked-out commit, or ``"unknown"`` outside a git checkout."""
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def run_header(benchmark: str, device: str) -> dict[str, Any]:
    """The fields every result starts with: what ran, where, when, at which commit, by which command."""
    import torch

    return {
        "benchmark": benchmark,
        "device": device,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "command": " ".join(["python", *sys.argv]),
        "torch": torch.__version__,
    }


def write_results(out: Path | None, record: dict[str, Any], report: str) -> None:
    """Print the Markdown report and, when ``out`` is given, write ``<out>.json`` and ``<out>.md``."""
    print(report)
    if out is None:
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(record, indent=2) + "\n")
    out.with_suffix(".md").write_text(report)
