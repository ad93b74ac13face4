"""Every GPU figure of lightning_tune in one process, inside one time budget:
``python benchmarks/suite.py --out DIR --budget-s 420``.

Parts, in priority order (``--only NAME[,NAME]``):

=================  ============================================================================================
Part               What it measures (script that holds its code)
=================  ============================================================================================
``gpu-tests``      ``pytest -m gpu`` in a subprocess, its output saved
``pack``           plain Lightning / hand-tuned / lightning_tune on the demo GPT, 32k vocabulary (``pack.py``)
``dynamic-batch``  DynamicBatchSize / fixed micro-batch 8 / the best of a sweep / BatchSizeFinder's pick at an
                   effective batch of about 4x what fits in one micro-batch, 32k vocabulary, and sequences doubling
                   mid-run (``dynamic_batch.py``)
``varlen``         padded dict batches of long-tailed lengths: the user's fixed batch / a length-grouped sampler /
                   DynamicBatchSize with a token budget (``varlen.py``)
``loss``           a Llama from its config at a 32k vocabulary without the loss swap / ``"chunked"`` / ``"liger"``
                   (CUDA with liger-kernel): peak reserved, tokens/s, loss against the unswapped run's
                   (``loss_memory.py``)
``monitor``        no monitor / Lightning ThroughputMonitor / ThroughputLatencyMonitor (``monitor_overhead.py``)
``optimizers``     AdamW / fused AdamW / AdamW8bit / PagedAdamW8bit (``swaps.py``)
``attention``      eager / the model's own SDPA / ``AttentionSwap("sdpa")`` / flash-attn, bf16 (``swaps.py``)
``planner``        ``estimate_memory`` / ``measure_memory`` against allocated and reserved peaks
                   (``planner_accuracy.py``)
=================  ============================================================================================

Each part gets a share of what is left of the budget (by weight, in the order above; time a part leaves unused
goes to the parts after it). A part first calibrates (times one short run at each size it will use), then picks its
steps and rounds to fit its share and records the sizes it chose. Every row is appended to ``DIR/<part>.jsonl`` and
``DIR/<part>.md`` as soon as it is measured; a row that would end after the part's share is not started and is
listed as cut, with the reason, in ``DIR/suite.json``. ``DIR/summary.md`` (printed last) gives one line per part,
and ``DIR/suite-results.tar.gz``, refreshed after every part, holds every file.

``--smoke`` runs every part's code at tiny sizes on the CPU (CUDA hidden): the test suite runs it so the suite
cannot rot between GPU runs. Its figures say nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

#: part -> its weight in the budget; the order is the priority order, the order parts run in.
PARTS: dict[str, float] = {
    "gpu-tests": 0.18,
    "pack": 0.18,
    "dynamic-batch": 0.20,
    "varlen": 0.12,
    "loss": 0.05,
    "monitor": 0.07,
    "optimizers": 0.08,
    "attention": 0.09,
    "planner": 0.08,
}
TITLES = {
    "gpu-tests": "GPU tests",
    "pack": "The pack on the demo GPT",
    "dynamic-batch": "DynamicBatchSize where memory binds",
    "varlen": "Variable-length fine-tune batches",
    "loss": "The loss swap on a Llama, 32k vocabulary",
    "monitor": "Monitor overhead",
    "optimizers": "Optimizers on the demo GPT",
    "attention": "Attention on the demo GPT",
    "planner": "Memory planner accuracy",
}
#: seconds kept back from the budget for the summary and the archive
RESERVE_S = 5.0
ARCHIVE = "suite-results.tar.gz"


def _gpu_tests(rows: Any, *, smoke: bool) -> str:
    # the smoke run checks the plumbing on one test file; the real run collects every test marked gpu
    command = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rs", "-p", "no:cacheprovider"]
    if smoke:
        command.append("tests/test_flops.py")
    timeout = max(rows.left(), 10.0)
    start = time.perf_counter()
    try:
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        output, returncode = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as err:
        output = err.stdout.decode() if isinstance(err.stdout, bytes) else str(err.stdout or "")
        output, returncode = output + f"\n[stopped after the part's {timeout:.0f} s share]\n", None
    (rows.stem.parent / "gpu-tests.log").write_text(output)
    lines = output.strip().splitlines()
    summary = lines[-1] if lines else ""
    rows.table("pytest command", "exit code", "summary", "seconds")
    rows.add(
        "pytest",
        {"pytest_command": " ".join(command[1:]), "returncode": returncode, "summary": summary,
         "seconds": time.perf_counter() - start, "log": "gpu-tests.log", "timeout_s": timeout},
        [f"`python {' '.join(command[1:])}`", returncode, f"`{summary}`", f"{time.perf_counter() - start:.1f}"],
    )  # fmt: skip
    rows.text("Full output: `gpu-tests.log`.")
    return summary


def _runner(part: str) -> Callable[..., str]:
    if part == "gpu-tests":
        return _gpu_tests
    module = {
        "pack": "pack",
        "dynamic-batch": "dynamic_batch",
        "varlen": "varlen",
        "loss": "loss_memory",
        "monitor": "monitor_overhead",
        "optimizers": "swaps",
        "attention": "swaps",
        "planner": "planner_accuracy",
    }[part]
    imported = __import__(module)
    names = {"pack": "suite_part", "optimizers": "optimizers_part", "attention": "attention_part"}
    return getattr(imported, names.get(part, "part"))


#: part -> what runs it, ``fn(rows, smoke=...) -> headline``; a test may replace entries
RUNNERS: dict[str, Callable[..., str]] = {}


def _select(only: str | None) -> list[str]:
    if not only:
        return list(PARTS)
    chosen = [name.strip() for name in only.split(",")]
    for name in chosen:
        if name not in PARTS:
            raise ValueError(f"`--only` must name parts from {list(PARTS)}, got {name!r}")
    return [part for part in PARTS if part in chosen]


def shares(left: float, parts: list[str]) -> dict[str, float]:
    """Each part's share of ``left`` seconds if every part before it used all of its own (a part that ends early
    leaves its rest to the parts after it: the suite recomputes the shares before every part)."""
    total = sum(PARTS[p] for p in parts)
    return {p: left * PARTS[p] / total for p in parts}


def _write_status(out: Path, status: dict[str, Any]) -> None:
    from lightning_tune.bench.files import write_atomically

    write_atomically(out / "suite.json", (json.dumps(status, indent=2, default=str) + "\n").encode())


def _archive(out: Path) -> None:
    """One archive of every file the run wrote (a GPU machine may hand back only a few files)."""
    import tarfile

    partial = out / (ARCHIVE + ".partial")
    with tarfile.open(partial, "w:gz") as tar:
        for path in sorted(out.iterdir()):
            if path.is_file() and not path.name.startswith(ARCHIVE):
                tar.add(path, arcname=f"{out.name}/{path.name}")
    partial.replace(out / ARCHIVE)


def _summary(status: dict[str, Any]) -> str:
    lines = [
        f"# Benchmark suite — {status['device']}",
        "",
        f"{status['date']}, commit `{status['commit'][:12]}`, source {status['source']}, budget {status['budget_s']} s"
        f"{' (smoke: figures say nothing)' if status['smoke'] else ''}. Command: `{status['command']}`",
        "",
        "| Part | Status | Seconds (share) | Rows kept | Rows cut | Headline |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for part, entry in status["parts"].items():
        lines.append(
            f"| {part} | {entry['status']} | {entry.get('seconds', '-')} ({entry.get('share_s', '-')}) "
            f"| {entry.get('rows', 0)} | {len(entry.get('cut', []))} "
            f"| {entry.get('headline') or entry.get('error', '')} |"
        )
    return "\n".join([*lines, ""])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for every file of the run")
    parser.add_argument("--only", default=None, help=f"comma-separated parts: {', '.join(PARTS)}")
    parser.add_argument("--budget-s", type=float, default=420.0, help="seconds the whole run may take (default 420)")
    parser.add_argument("--smoke", action="store_true", help="every part at tiny sizes on the CPU (CUDA hidden)")
    args = parser.parse_args(argv)
    try:
        parts = _select(args.only)
    except ValueError as err:
        parser.error(str(err))
    if args.budget_s <= RESERVE_S:
        parser.error(f"`--budget-s` must be more than {RESERVE_S:.0f}, got {args.budget_s:g}")
    if args.smoke:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before torch initialises CUDA
    import warnings

    import _results
    import torch
    from _results import Rows, device_name, run_header

    from lightning_tune.bench.files import write_atomically

    deadline = _results.now() + args.budget_s - RESERVE_S
    if args.smoke:  # tiny ops on a shared CPU: one thread avoids waiting on oversubscribed workers
        torch.set_num_threads(1)

    warnings.filterwarnings("ignore", module="lightning")
    args.out.mkdir(parents=True, exist_ok=True)
    device = device_name()
    status: dict[str, Any] = {
        **run_header("suite", device),
        "smoke": args.smoke,
        "budget_s": args.budget_s,
        "parts": {part: {"status": "pending"} for part in parts},
    }
    failed = False
    for index, part in enumerate(parts):
        share = shares(deadline - _results.now(), parts[index:])[part]
        status["parts"][part] = {"status": "running", "started": time.strftime("%H:%M:%S"), "share_s": round(share)}
        _write_status(args.out, status)
        start = _results.now()
        rows = Rows(args.out / part, run_header(part, device), TITLES[part], deadline=start + share)
        entry: dict[str, Any] = {"share_s": round(share)}
        try:
            entry["headline"] = (RUNNERS.get(part) or _runner(part))(rows, smoke=args.smoke)
            entry["status"] = "cut" if rows.cuts else "ok"
        except Exception as err:  # one part's failure must not cost the others their figures
            failed = True
            text = traceback.format_exc()
            rows.text(f"Failed:\n\n```\n{text}```")
            entry.update(status="error", error=repr(err), traceback=text)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        seconds = _results.now() - start
        entry.update(seconds=round(seconds, 1), rows=len(rows.rows), cut=rows.cuts, sizes=rows.sizes)
        record = {**rows.header, "smoke": args.smoke, "part_seconds": seconds, **entry, "rows": rows.rows}
        write_atomically(args.out / f"{part}.json", (json.dumps(record, indent=2, default=str) + "\n").encode())
        status["parts"][part] = {k: v for k, v in entry.items() if k != "traceback"}
        _write_status(args.out, status)
        _archive(args.out)
        print(f"[suite] {part}: {entry['status']} in {seconds:.1f} s (share {share:.0f} s)", flush=True)
    summary = _summary(status)
    (args.out / "summary.md").write_text(summary)
    _archive(args.out)
    print(summary, flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
