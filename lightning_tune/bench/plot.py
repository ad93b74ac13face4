"""The throughput/latency trade-off of a sweep as a picture: samples/s against p95 latency, one point per batch size.

Larger batches buy throughput with latency: the curve shows where that stops paying. matplotlib is imported lazily.
"""

from __future__ import annotations

import io
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning_tune.bench.budget import Recommendation
from lightning_tune.bench.files import write_atomically
from lightning_tune.bench.result import BenchResult


def check_png_path(path: Any) -> Path:
    """Check, before any setting runs, that the plot can be written to ``path``: a ``.png`` file, not a directory.

    Raises:
        TypeError: If ``path`` is not a path.
        ValueError: If it does not end in ``.png`` or is a directory.

    Example:
        >>> check_png_path("sweep.png").name
        'sweep.png'
    """
    if isinstance(path, bool) or not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"`plot` must be a path ending in .png, got {path!r} ({type(path).__name__})")
    out = Path(path)
    if out.suffix.lower() != ".png":
        raise ValueError(f"`plot` must be a path ending in .png, got {str(path)!r}")
    if out.is_dir():
        raise ValueError(f"`plot` must be a .png file path, got the directory {str(path)!r}")
    return out


def plot_tradeoff(
    results: Sequence[BenchResult],
    path: str | os.PathLike[str],
    *,
    mode: str = "train",
    title: str | None = None,
    subtitle: str | None = None,
    dpi: int = 100,
    recommendation: Recommendation | None = None,
) -> list[tuple[int, float, float]]:
    """Draw samples/s against p95 latency across batch sizes into a PNG, the picture ``docs/bench.md`` describes.

    With a ``recommendation`` the budget and the chosen point are drawn, and the x axis is p99 when the budget is on
    p99 alone. ``mode`` (``"train"`` or ``"predict"``) names the latency on the axis; the figure is 8 x 5.5 inches at
    ``dpi``. Returns the points drawn, ``(batch_size, latency_ms, samples_per_sec)``, in batch-size order.

    Raises:
        ValueError: If no result has both figures (every setting ran out of memory).
        OSError: If the file cannot be written.
    """
    out = check_png_path(path)
    fig, points = _figure(results, mode=mode, title=title, subtitle=subtitle, dpi=dpi, recommendation=recommendation)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    write_atomically(out, buffer.getvalue())
    return points


def _figure(
    results: Sequence[BenchResult],
    *,
    mode: str,
    title: str | None,
    subtitle: str | None,
    dpi: int,
    recommendation: Recommendation | None,
) -> tuple[Any, list[tuple[int, float, float]]]:
    """The figure of :func:`plot_tradeoff` and the points on it."""
    q = 99 if recommendation is not None and 95 not in recommendation.budgets_ms else 95
    ordered = sorted(results, key=lambda r: r.batch_size)
    points = [
        (r.batch_size, latency, r.samples_per_sec)
        for r in ordered
        if r.status == "ok" and (latency := getattr(r, f"p{q}_ms")) is not None and r.samples_per_sec is not None
    ]
    if not points:
        raise ValueError(f"nothing to plot: no batch size has both a p{q} latency and a throughput")
    failed = [str(r.batch_size) for r in ordered if r.status == "oom"]

    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    kind = "step" if mode == "train" else "request"
    fig = Figure(figsize=(8.0, 5.5), dpi=dpi, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    xs = [latency for _, latency, _ in points]
    ys = [rate for _, _, rate in points]
    ax.plot(xs, ys, marker="o", linewidth=1.8, markersize=7, color="tab:blue")
    for batch_size, x, y in points:
        ax.annotate(f"bs {batch_size}", (x, y), textcoords="offset points", xytext=(6, 6), fontsize=10)
    if recommendation is not None:  # the budget as a dashed line, the chosen point ringed, another budget in the key
        budget = recommendation.budgets_ms[q]
        if budget <= 2 * max(xs):
            ax.axvline(budget, color="tab:red", linestyle="--", linewidth=1.5, label=f"p{q} budget {budget:g} ms")
        else:  # a line that far right would squeeze every point against the left edge
            ax.plot([], [], " ", label=f"p{q} budget {budget:g} ms (right of the plot)")
        for other, ms in recommendation.budgets_ms.items():
            if other != q:
                ax.plot([], [], " ", label=f"and p{other} {kind} latency <= {ms:g} ms")
        chosen = next(((x, y) for size, x, y in points if size == recommendation.batch_size), None)
        if chosen is not None:
            mark = "" if recommendation.firm else " (uncertain)"
            ax.scatter(
                *chosen,
                s=320,
                facecolors="none",
                edgecolors="tab:green",
                linewidths=2.5,
                zorder=3,
                label=f"recommended: bs {recommendation.batch_size}{mark}",
            )
        ax.legend(loc="best", fontsize=9)
    ax.set_xlabel(f"p{q} {kind} latency (ms)")
    ax.set_ylabel("throughput (samples/s)")
    fig.suptitle(title if title is not None else f"Throughput against p{q} {kind} latency", fontweight="bold")
    if subtitle:
        ax.set_title(subtitle, fontsize=10)
    ax.grid(True, alpha=0.35)
    ax.margins(x=0.12, y=0.12)
    if failed:
        ax.text(
            0.99,
            0.02,
            f"out of memory: batch size {', '.join(failed)}",
            transform=ax.transAxes,
            ha="right",
            va="bottom",
            fontsize=10,
            color="tab:red",
        )
    return fig, points
