"""The results on disk, ``bench.json`` and ``bench.csv``, each rewritten atomically after every setting."""

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

#: File names written into the output directory.
JSON_NAME = "bench.json"
CSV_NAME = "bench.csv"


def sweep_record(
    settings: BenchSettings,
    results: Sequence[BenchResult],
    *,
    run: Mapping[str, Any],
    command: str | None = None,
    complete: bool,
    recommendation: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The JSON document of a sweep (``bench.json``): when (UTC), where and how it ran, and its results."""
    import lightning
    import torch

    import lightning_tune

    record = {
        "command": command,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "versions": {
            "python": platform.python_version(),
            "torch": str(torch.__version__),
            "lightning": str(lightning.__version__),
            "lightning_tune": str(lightning_tune.__version__),
        },
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


def write_results(
    output_dir: str | os.PathLike[str], record: Mapping[str, Any], results: Sequence[BenchResult]
) -> tuple[Path, Path]:
    """Write ``bench.json`` (``record``) and ``bench.csv`` (one row per result) into ``output_dir``; their paths."""
    directory = Path(output_dir)
    json_path, csv_path = directory / JSON_NAME, directory / CSV_NAME
    write_atomically(json_path, (json.dumps(record, indent=2) + "\n").encode())
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=COLUMNS, lineterminator="\n")
    writer.writeheader()
    writer.writerows({k: "" if v is None else v for k, v in result.as_dict().items()} for result in results)
    write_atomically(csv_path, buffer.getvalue().encode())
    return json_path, csv_path
