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
``eval``           validation samples/s of a Llama at a 32k vocabulary: the loader's batch / the largest fixed batch
                   that fits / DynamicBatchSize's evaluation sizing, without and with ``LossSwap(eval=True)``
                   (``eval.py``)
=================  ============================================================================================

``--budget-s`` bounds the whole process from its start, imports included. Each part gets a share of what is left
(by weight, in the order above; time a part leaves unused goes to the parts after it). A part first calibrates (a
short run at the sizes it will use, under a watchdog at its share), then plans its rows with their warm-up steps,
searches and compile counted and a margin; what the share cannot hold is dropped before anything runs, extra rows
first, then scenario rows, never a baseline, and baselines run first (``_results.Rows.run_plan``). A watchdog stops
a row that passes its deadline; it is recorded as cut with what it measured. Every row is appended to
``DIR/<part>.jsonl`` and ``DIR/<part>.md`` as soon as it is measured; ``DIR/suite.json`` lists each part's plan and
cuts, ``DIR/summary.md`` (printed last) one line a part and the real wall time, and ``DIR/suite-results.tar.gz``,
refreshed after every part, holds every file.

``--smoke`` runs every part's code at tiny sizes on the CPU (CUDA hidden): the test suite runs it so the suite
cannot rot between GPU runs. Its figures say nothing. ``--rehearse H100`` (or ``H200``) runs every part's plan on
the CPU against a stand-in clock, each calibration and row priced on that device (``_results.DEVICES``) instead of
run, and prints the plan: rows, seconds, what would be cut.
"""

from __future__ import annotations

import time

STARTED = time.perf_counter()  # the budget counts from here, the imports below included

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

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
    "eval": 0.03,
}
TITLES = {
    "gpu-tests": "GPU tests",
    "pack": "The pack on the demo GPT",
    "dynamic-batch": "DynamicBatchSize where memory binds",
    "varlen": "Variable-length fine-tune batches",
    "loss": "The loss swap on a Llama, 128k vocabulary",
    "monitor": "Monitor overhead",
    "optimizers": "Optimizers on the demo GPT",
    "attention": "Attention on the demo GPT",
    "planner": "Memory planner accuracy",
    "eval": "Evaluation batches sized to memory",
}
#: seconds kept back from the budget for the summary and the archive
RESERVE_S = 5.0
ARCHIVE = "suite-results.tar.gz"
#: what the GPU tests are planned to take on a real device (the H200's took 52 s)
GPU_TESTS_S = 60.0


def gpu_test_files() -> list[str]:
    """The test files that hold a test marked ``gpu``, relative to the checkout."""
    marked = re.compile(r"(pytest\.mark\.gpu\b|mark\.gpu\b)")
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py") if marked.search(p.read_text()))


def _pytest(rows: Any, command: list[str]) -> dict[str, Any]:
    """Run ``command``, each line (one a test, as it ends) to the console and ``gpu-tests.log``; stopped at the row's
    deadline. Returns the exit code (``None`` when stopped) and pytest's last line."""
    from _results import now

    log = rows.stem.parent / "gpu-tests.log"
    start, returncode, last = now(), None, ""
    with (
        log.open("w") as out,
        subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as child,
    ):
        try:
            assert child.stdout is not None
            for line in child.stdout:
                out.write(line)
                print(line, end="", flush=True)
                last = line.strip() or last
            returncode = child.wait()
        finally:
            if child.poll() is None:
                child.kill()
                out.write(f"\n[stopped at the part's deadline, after {now() - start:.0f} s]\n")
            rows.add(
                "pytest",
                {"pytest_command": " ".join(command[1:]), "returncode": returncode, "summary": last,
                 "seconds": now() - start, "log": log.name},
                [f"`python {' '.join(command[1:3])} ...`", returncode, f"`{last}`", f"{now() - start:.1f}"],
            )  # fmt: skip
    return {"returncode": returncode, "summary": last}


def _gpu_tests(rows: Any, *, smoke: bool) -> str:
    """``pytest -m gpu`` on the files that hold GPU tests, in a subprocess. No test collected, a collection or import
    error, a failed test or pytest stopped is an error of the part, never ``ok``."""
    from _results import BASELINE, Row

    files = gpu_test_files()
    pytest = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:xdist"]  # one process: a line a test
    command = [*pytest, "-m", "gpu", "-v", "-rs", *files]
    rows.text(f"`pytest -m gpu` on the {len(files)} files that hold GPU tests: {', '.join(files)}. One line per test.")
    rows.table("pytest command", "exit code", "summary", "seconds")
    seconds = rows.device.gpu_tests_s if rows.device else GPU_TESTS_S
    result = rows.run_plan([Row("pytest -m gpu", seconds, lambda: _pytest(rows, command), BASELINE)]).get(
        "pytest -m gpu"
    )
    rows.text("Full output: `gpu-tests.log`.")
    if result is None:
        return "not run" if rows.device is None else "rehearsed"
    counts = {
        k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed)", result["summary"])
    }
    if result["returncode"] != 0 or not counts:
        raise RuntimeError(f"pytest exited {result['returncode']}: {result['summary'] or 'no output'}")
    return result["summary"]


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
        "eval": "eval",
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
    mode = " (smoke: figures say nothing)" if status["smoke"] else ""
    if status["rehearse"]:
        mode = f" (rehearsal on the CPU, priced on {status['rehearse']}: nothing was measured)"
    lines = [
        f"# Benchmark suite — {status['device']}",
        "",
        f"{status['date']}, commit `{status['commit'][:12]}`, source {status['source']}, budget {status['budget_s']} s"
        f"{mode}. Command: `{status['command']}`",
        "",
        "| Part | Status | Seconds (share) | Planned rows run | Rows cut | Headline |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for part, entry in status["parts"].items():
        lines.append(
            f"| {part} | {entry['status']} | {entry.get('seconds', '-')} ({entry.get('share_s', '-')}) "
            f"| {len(entry.get('ran', []))} | {len(entry.get('cut', []))} "
            f"| {entry.get('headline') or entry.get('error', '')} |"
        )
    lines += ["", f"Wall time {status['wall_s']:.1f} s of the {status['budget_s']:g} s budget, "
              f"{status['import_s']:.1f} s of it importing before the first part."]  # fmt: skip
    if status["rehearse"]:
        cut = [f"{p}: {c['what']} ({c['reason']})" for p, e in status["parts"].items() for c in e.get("cut", [])]
        lines += ["", "Would be cut: " + ("; ".join(cut) if cut else "nothing") + "."]
    return "\n".join([*lines, ""])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for every file of the run")
    parser.add_argument("--only", default=None, help=f"comma-separated parts: {', '.join(PARTS)}")
    parser.add_argument("--budget-s", type=float, default=420.0, help="seconds the whole run may take (default 420)")
    parser.add_argument("--smoke", action="store_true", help="every part at tiny sizes on the CPU (CUDA hidden)")
    parser.add_argument(
        "--rehearse", default=None, metavar="DEVICE", help="plan every part on the CPU, priced on DEVICE (H100, H200)"
    )
    args = parser.parse_args(argv)
    try:
        parts = _select(args.only)
    except ValueError as err:
        parser.error(str(err))
    if args.budget_s <= RESERVE_S:
        parser.error(f"`--budget-s` must be more than {RESERVE_S:.0f}, got {args.budget_s:g}")
    if args.smoke or args.rehearse:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before torch initialises CUDA
    import warnings

    import _results
    import torch
    from _results import DEVICES, Rows, StandInClock, device_name, now, run_header

    from lightning_tune.bench.files import write_atomically

    device = None
    if args.rehearse:
        if args.rehearse not in DEVICES or args.smoke:
            parser.error(f"`--rehearse` must be one of {sorted(DEVICES)} (without --smoke), got {args.rehearse!r}")
        device = DEVICES[args.rehearse]
        clock = StandInClock()
        _results.use_clock(clock)
        clock.advance(device.import_s)  # what the imports would take there
        begin = 0.0
    else:  # the process's start, or now on a stand-in clock (a test's)
        begin = STARTED if _results._clock is time.perf_counter else now()
    deadline = begin + args.budget_s - RESERVE_S
    import_s = now() - begin
    if args.smoke:  # tiny ops on a shared CPU: one thread avoids waiting on oversubscribed workers
        torch.set_num_threads(1)

    warnings.filterwarnings("ignore", module="lightning")
    args.out.mkdir(parents=True, exist_ok=True)
    name = device.name if device else device_name()
    status: dict[str, Any] = {
        **run_header("suite", name),
        "smoke": args.smoke,
        "rehearse": args.rehearse,
        "budget_s": args.budget_s,
        "import_s": import_s,
        "parts": {part: {"status": "pending"} for part in parts},
    }
    failed = False
    for index, part in enumerate(parts):
        share = shares(deadline - now(), parts[index:])[part]
        status["parts"][part] = {"status": "running", "started": time.strftime("%H:%M:%S"), "share_s": round(share)}
        _write_status(args.out, status)
        start = now()
        rows = Rows(args.out / part, run_header(part, name), TITLES[part], deadline=start + share,
                    hard_deadline=deadline, device=device)  # fmt: skip
        entry: dict[str, Any] = {"share_s": round(share)}
        try:
            entry["headline"] = (RUNNERS.get(part) or _runner(part))(rows, smoke=args.smoke)
            entry["status"] = "cut" if rows.cuts else "ok"
            if device is not None:
                entry["headline"] = f"rehearsed: {len(rows.done)} planned rows run, {len(rows.cuts)} cut"
        except _results.RowOverrun as err:  # a calibration stopped at the part's deadline
            rows.cut("the rest of the part", f"calibration stopped by the watchdog: {err}")
            entry.update(status="cut", headline=f"stopped: {err}")
        except Exception as err:  # one part's failure must not cost the others their figures
            failed = True
            text = traceback.format_exc()
            rows.text(f"Failed:\n\n```\n{text}```")
            entry.update(status="error", error=repr(err), traceback=text)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        seconds = now() - start
        entry.update(
            seconds=round(seconds, 1),
            rows=len(rows.rows),
            ran=rows.done,
            cut=rows.cuts,
            sizes=rows.sizes,
            plan=rows.plan,
        )
        record = {**rows.header, "smoke": args.smoke, "part_seconds": seconds, **entry, "rows": rows.rows}
        write_atomically(args.out / f"{part}.json", (json.dumps(record, indent=2, default=str) + "\n").encode())
        status["parts"][part] = {k: v for k, v in entry.items() if k != "traceback"}
        status["wall_s"] = now() - begin
        _write_status(args.out, status)
        _archive(args.out)
        print(f"[suite] {part}: {entry['status']} in {seconds:.1f} s (share {share:.0f} s)", flush=True)
    status["wall_s"] = now() - begin
    _write_status(args.out, status)
    summary = _summary(status)
    (args.out / "summary.md").write_text(summary)
    _archive(args.out)
    print(summary, flush=True)
    if device is not None:
        _results.use_clock(time.perf_counter)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
