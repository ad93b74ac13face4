"""The results on disk: ``bench.json`` (figures plus what they were measured on) and ``bench.csv`` (figures only).

Both are rewritten after every setting, each to a temporary file renamed into place, so a sweep that fails or is
interrupted later keeps the figures of the settings that finished, and no reader ever sees half a file.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import platform
import secrets
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from lightning_tune.bench.result import COLUMNS, BenchResult
from lightning_tune.bench.settings import BenchSettings

__all__ = ["CSV_NAME", "JSON_NAME", "new_version_dir", "sweep_record", "write_atomically", "write_results"]

#: File names written into the output directory.
JSON_NAME = "bench.json"
CSV_NAME = "bench.csv"


def _versions() -> dict[str, str]:
    import lightning
    import torch

    import lightning_tune

    return {
        "python": platform.python_version(),
        "torch": str(torch.__version__),
        "lightning": str(lightning.__version__),
        "lightning_tune": str(lightning_tune.__version__),
    }


def sweep_record(
    settings: BenchSettings,
    results: Sequence[BenchResult],
    *,
    run: Mapping[str, Any],
    command: str | None = None,
    complete: bool,
    recommendation: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The JSON document of a sweep: when, where and how it ran, and its results.

    Its keys: ``command``, ``date`` (UTC), ``versions``, ``run`` (``BenchRunner.describe``), ``settings``,
    ``complete``, ``results`` (keyed like the CSV's columns) and, with a budget, ``recommendation``.
    """
    record = {
        "command": command,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "versions": _versions(),
        "run": dict(run),
        "settings": settings.as_dict(),
        "complete": complete,
        "results": [result.as_dict() for result in results],
    }
    if recommendation is not None:
        record["recommendation"] = dict(recommendation)
    return record


def new_version_dir(root: str | os.PathLike[str]) -> Path:
    """Create and return ``root/version_N``, N one above the highest there, as Lightning's loggers number runs.

    A sweep started at the same moment gets the next number, never the same one.

    Example:
        >>> import tempfile
        >>> root = tempfile.mkdtemp()
        >>> new_version_dir(root).name, new_version_dir(root).name
        ('version_0', 'version_1')
    """
    parent = Path(root)
    parent.mkdir(parents=True, exist_ok=True)
    taken = [int(p.name[8:]) for p in parent.glob("version_*") if p.name[8:].isdigit()]
    number = max(taken, default=-1) + 1
    while True:
        candidate = parent / f"version_{number}"
        try:
            candidate.mkdir()
            return candidate
        except FileExistsError:
            number += 1


def write_atomically(path: Path, data: bytes) -> None:
    """Write ``data`` to a temporary file beside ``path`` (parents created) and rename it into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    try:
        with open(tmp, "xb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def _csv_bytes(results: Sequence[BenchResult]) -> bytes:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=COLUMNS, lineterminator="\n")
    writer.writeheader()
    for result in results:
        writer.writerow({k: "" if v is None else v for k, v in result.as_dict().items()})
    return buffer.getvalue().encode()


def write_results(
    output_dir: str | os.PathLike[str], record: Mapping[str, Any], results: Sequence[BenchResult]
) -> tuple[Path, Path]:
    """Write ``bench.json`` (``record``) and ``bench.csv`` (one row per result) into ``output_dir``; their paths."""
    directory = Path(output_dir)
    json_path, csv_path = directory / JSON_NAME, directory / CSV_NAME
    write_atomically(json_path, (json.dumps(record, indent=2) + "\n").encode())
    write_atomically(csv_path, _csv_bytes(results))
    return json_path, csv_path
