"""Read the pack's TensorBoard scalars back, draw them into one PNG and summarise them (``lightning-tune report``).

matplotlib and TensorBoard's event reader are imported only when these functions run.

Example:
    >>> table = summarise({"version_0": {"perf/train/samples_per_sec": [(10, 1000.0), (20, 1200.0)]}})
    >>> print(table)
                 samples/s
    run         last  median
    version_0  1,200   1,100
"""

from __future__ import annotations

import io
import itertools
import math
import operator
import os
import re
import statistics
import struct
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias

from lightning_tune import keys
from lightning_tune._validation import check_instance, check_int
from lightning_tune.bench.files import write_atomically
from lightning_tune.bench.table import align

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure


#: Points of one scalar, ``(step, value)`` sorted by step.
Series: TypeAlias = list[tuple[int, float]]
#: Run name (path relative to the log directory, ``"."`` for the directory itself) -> scalar key -> points.
Runs: TypeAlias = dict[str, dict[str, Series]]

#: Resolution of the PNG; the figure is 16 inches wide, so 100 dpi gives a 1600-pixel-wide image.
DEFAULT_DPI = 100
#: Resolutions :func:`render_report` accepts: 400 dpi is a 6400-pixel-wide image already, and far higher ones
#: need gigabytes of memory to draw.
MIN_DPI, MAX_DPI = 10, 400

_EVENT_FILE_PREFIX = "events.out.tfevents."
_FIG_WIDTH_IN = 16.0
_PANEL_HEIGHT_IN = 3.8
_MARKER_MAX_POINTS = 30  # series with this many points or fewer also get markers, so single points show
_GUIDE_COLOUR = "0.3"

_QS = ("p50", "p95", "p99")
_STEP_MS = tuple(keys.STEP_MS.format(q=q[1:]) for q in _QS)
_VAL_MS = tuple(keys.BATCH_MS.format(stage="val", q=q[1:]) for q in _QS)
_LR_GROUP = keys.pattern(keys.LR_GROUP)
_VRAM = (keys.VRAM_USED_FRAC, keys.VRAM_ALLOCATED_GIB, keys.VRAM_RESERVED_GIB, keys.VRAM_PEAK_GIB)
_PLOTTED = frozenset(  # the keys some panel draws (besides tune/lr/pg{i} and the losses)
    (keys.SAMPLES_PER_SEC, keys.TOKENS_PER_SEC, *_STEP_MS, keys.STEP_MS_MAX, *_VAL_MS, keys.MFU, keys.DATA_WAIT_FRAC)
    + (keys.GPU_UTIL_PCT, keys.LR, keys.PLATEAU_REDUCTIONS, keys.BATCH_SIZE, keys.EFFECTIVE_BATCH_SIZE, *_VRAM)
    + (keys.MICRO_BATCH_TOKENS, keys.PADDING_FRAC, keys.OOM_RECOVERIES, keys.PREDICTED_VRAM_FRAC)
)
#: Below this share of the time spent waiting for data, and without MFU or GPU readings, the utilisation panel
#: would be a flat line at 0 %: it is left out.
_MIN_DATA_WAIT = 0.01
_STYLES = ("-", "--", "-.", ":")  # the series of a panel, in turn
_OOM_MARKER, _PLATEAU_MARKER = "x", "v"  # events, marked on a line: an out-of-memory recovery, an LR reduction
_MARKERS = (_OOM_MARKER, _PLATEAU_MARKER)


class ReportError(ValueError):
    """The logs cannot be reported on (missing directory, no event files, nothing to plot) or the output is bad."""


class ReportWarning(UserWarning):
    """Some event files (or names of them) were left out of the report: not regular files, or not readable."""


def read_scalars(logdir: str | os.PathLike[str]) -> Runs:
    """Read every scalar of every TensorBoard run under a log directory (what a run is: ``docs/cli.md``).

    One :class:`ReportWarning` names the event files left out.

    Args:
        logdir: The log directory, e.g. ``lightning_logs``.

    Returns:
        Run name -> scalar key -> ``(step, value)`` points sorted by step; runs in natural order (``version_10`` last).

    Raises:
        TypeError: If ``logdir`` is not a path.
        ReportError: If ``logdir`` is empty, missing or not a directory, holds no event files, none of them can be
            read, or no run has a ``perf/`` or ``tune/`` scalar.
    """
    root = _as_path("logdir", logdir)
    if not root.exists():
        raise ReportError(f"`logdir` {str(root)!r} does not exist; TensorBoard logs are usually under ./lightning_logs")
    if not root.is_dir():
        raise ReportError(f"`logdir` must be a directory of TensorBoard logs, got the file {str(root)!r}")
    runs, skipped = _read_runs(root)
    if skipped and not any(runs.values()):
        raise ReportError(f"no scalars could be read under {str(root)!r}: {_listed(skipped)}")
    if not runs:
        raise ReportError(
            f"no TensorBoard event files ({_EVENT_FILE_PREFIX}*) in {str(root)!r} or its subdirectories; "
            "TensorBoard logs are usually under ./lightning_logs"
        )
    if skipped:
        warnings.warn(ReportWarning(f"left out of the report, under {str(root)!r}: {_listed(skipped)}"), stacklevel=2)
    names = sorted({key for scalars in runs.values() for key in scalars})
    if not any(key.startswith(keys.PREFIXES) for key in names):
        shown = ", ".join(names[:10]) + (f" and {len(names) - 10} more" if len(names) > 10 else "")
        found = f"found only: {shown}" if names else "found no scalars at all"
        raise ReportError(
            f"no perf/ or tune/ scalars in the {len(runs)} run(s) under {str(root)!r} ({found}); "
            "they are logged by the lightning_tune callbacks"
        )
    return runs


def _listed(skipped: list[str], shown: int = 3) -> str:
    more = f"; and {len(skipped) - shown:,} more" if len(skipped) > shown else ""
    return "; ".join(skipped[:shown]) + more


def _as_path(name: str, value: Any) -> Path:
    if isinstance(value, bool) or not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"`{name}` must be a path (str or os.PathLike), got {value!r} ({type(value).__name__})")
    text = os.fspath(value)
    if not isinstance(text, str) or not text.strip():  # Path("") would silently be the current directory
        raise ReportError(f"`{name}` must be a non-empty path (use '.' for the current directory), got {text!r}")
    return Path(value)


def _natural_key(text: str) -> list[tuple[int, int | str]]:
    return [(0, int(part)) if part.isdigit() else (1, part) for part in re.split(r"(\d+)", text) if part]


def _read_runs(root: Path) -> tuple[Runs, list[str]]:
    """Every run's scalars, in natural order, and a line for each event file (or rest of one) left out."""
    found: dict[Path, list[Path]] = {}
    seen: set[str] = set()
    skipped = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):  # a run may be a link to elsewhere
        real = os.path.realpath(dirpath)
        if real in seen:  # a link back up the tree: read each directory once
            dirnames.clear()
            continue
        seen.add(real)
        directory = Path(dirpath)
        for name in sorted(f for f in filenames if f.startswith(_EVENT_FILE_PREFIX)):
            if (directory / name).is_file():  # a named pipe would block the read; a device would never end
                found.setdefault(directory, []).append(directory / name)
            else:
                skipped.append(f"{_shown_path(directory / name, root)} (not a regular file)")
    runs: Runs = {}
    for directory in sorted(found, key=lambda d: _natural_key(d.relative_to(root).as_posix())):
        series: dict[str, Series] = {}
        for file in found[directory]:  # in name order: the order they were written
            points, stopped = _read_event_file(file)
            if stopped is not None:
                skipped.append(f"{_shown_path(file, root)} ({stopped})")
            for tag, step, value in points:
                series.setdefault(tag, []).append((step, value))
        runs[directory.relative_to(root).as_posix()] = {
            t: sorted(series[t], key=lambda p: p[0]) for t in sorted(series)
        }
    return runs, skipped


def _shown_path(path: Path, root: Path) -> str:
    text = path.relative_to(root).as_posix()
    return repr(text if len(text) <= 120 else f"{text[:50]}...{text[-50:]}")


def _read_event_file(path: Path) -> tuple[list[tuple[str, int, float]], str | None]:
    """The scalar points of one event file, and why it could not be read to the end (``None``: it could).

    TFRecord framing: a little-endian uint64 length, its masked CRC-32C, the serialised ``Event``, the data's CRC.
    The header's checksum is checked (it tells another kind of file at its first bytes); the data is checked by
    parsing it. A last record that runs past the end is one being written, and ends the file as TensorBoard ends it.
    """
    from google.protobuf.message import DecodeError
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c

    try:
        data = path.read_bytes()
    except OSError as err:
        return [], f"cannot be read: {err.strerror or err}"
    points: list[tuple[str, int, float]] = []
    offset = 0
    while offset + 12 <= len(data):
        (length,), (crc,) = struct.unpack_from("<Q", data, offset), struct.unpack_from("<I", data, offset + 8)
        if masked_crc32c(data[offset : offset + 8]) != crc:
            return points, "not a TensorBoard event file" if offset == 0 else f"a damaged record at byte {offset:,}"
        if offset + 16 + length > len(data):
            break
        try:
            event = Event.FromString(data[offset + 12 : offset + 12 + length])
        except DecodeError:
            return points, f"a record at byte {offset:,} is not a TensorBoard event"
        points += [
            (v.tag, int(event.step), float(v.simple_value)) for v in event.summary.value if v.HasField("simple_value")
        ]
        offset += 16 + length
    return points, None


@dataclass(frozen=True)
class _Column:
    group: str  # upper header line, shared by neighbouring columns
    header: str
    key: str
    reduce: Callable[[list[float]], float]
    fmt: Callable[[float], str]


def _rate(value: float) -> str:
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"


def _ms(value: float) -> str:
    return f"{value:.0f}" if abs(value) >= 100 else f"{value:.1f}" if abs(value) >= 10 else f"{value:.2f}"


_last = operator.itemgetter(-1)
_STEP_GROUP = "step ms (median)"
_GAP = 2  # spaces between columns
_COLUMNS: tuple[_Column, ...] = (
    _Column("samples/s", "last", keys.SAMPLES_PER_SEC, _last, _rate),
    _Column("samples/s", "median", keys.SAMPLES_PER_SEC, statistics.median, _rate),
    _Column("tokens/s", "last", keys.TOKENS_PER_SEC, _last, _rate),
    _Column("tokens/s", "median", keys.TOKENS_PER_SEC, statistics.median, _rate),
    *(_Column(_STEP_GROUP, q, key, statistics.median, _ms) for q, key in zip(_QS, _STEP_MS, strict=True)),
    _Column("VRAM frac", "peak", keys.VRAM_USED_FRAC, max, "{:.2f}".format),
    _Column("VRAM frac", "predicted", keys.PREDICTED_VRAM_FRAC, _last, "{:.2f}".format),
    _Column("LR", "final", keys.LR, _last, "{:.2e}".format),
    _Column("LR", "reductions", keys.PLATEAU_REDUCTIONS, _last, "{:.0f}".format),
    _Column("batch size", "last", keys.BATCH_SIZE, _last, "{:.0f}".format),
    _Column("batch size", "effective", keys.EFFECTIVE_BATCH_SIZE, _last, "{:.0f}".format),
    _Column("batch size", "OOM recoveries", keys.OOM_RECOVERIES, _last, "{:.0f}".format),
    _Column("token budget", "last", keys.MICRO_BATCH_TOKENS, _last, "{:,.0f}".format),
    _Column("padding %", "median", keys.PADDING_FRAC, statistics.median, lambda v: f"{100 * v:.1f}"),
)


def summarise(runs: Mapping[str, Mapping[str, Sequence[tuple[int, float]]]]) -> str:
    """Summarise runs as a text table, one row per run and only the columns some run has data for (``docs/cli.md``).

    Args:
        runs: Run name -> scalar key -> ``(step, value)`` points, as :func:`read_scalars` returns.

    Returns:
        The table (no trailing newline), or a one-line note when no run has any of these scalars.

    Raises:
        TypeError: If ``runs`` is not a mapping of run names to mappings of keys to ``(step, value)`` points.
    """
    data = _normalise_runs(runs)
    columns = [c for c in _COLUMNS if any(_finite(scalars.get(c.key, ())) for scalars in data.values())]
    if not columns:
        return "no run has throughput, step-time, memory, learning-rate or batch-size scalars to summarise"
    rows = [["run", *(c.header for c in columns)]]
    for name, scalars in data.items():
        values = [_finite(scalars.get(column.key, ())) for column in columns]
        rows.append([name, *(c.fmt(c.reduce(v)) if v else "-" for c, v in zip(columns, values, strict=True))])
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    # Group headers ("samples/s" over "last" and "median"): widen a group's last column when the label is longer.
    groups = " " * widths[0]
    first = 1  # columns counted after "run"
    for label, group in itertools.groupby(columns, key=lambda c: c.group):
        last = first + len(list(group)) - 1
        span = sum(widths[first : last + 1]) + _GAP * (last - first)
        widths[last] += max(0, len(label) - span)
        groups += " " * _GAP + label.center(max(span, len(label)))
        first = last + 1
    return "\n".join([groups.rstrip(), *align(rows, left=1, widths=widths)])


def _finite(points: Sequence[tuple[int, float]]) -> list[float]:
    return [v for _, v in points if math.isfinite(v)]


def _normalise_runs(runs: Any) -> dict[str, dict[str, Series]]:
    if not isinstance(runs, Mapping):
        raise TypeError(
            f"`runs` must be a mapping of run name -> scalar key -> (step, value) points, got {type(runs).__name__}"
        )
    out: dict[str, dict[str, Series]] = {}
    for name, scalars in runs.items():
        if not isinstance(name, str) or not isinstance(scalars, Mapping):
            raise TypeError(
                f"`runs` must map run names (str) to mappings of scalar key -> points, got {name!r}: "
                f"{type(scalars).__name__}"
            )
        out[name] = {}
        for key, points in scalars.items():
            try:
                out[name][str(key)] = sorted(((int(s), float(v)) for s, v in points), key=lambda p: p[0])
            except (TypeError, ValueError) as err:
                raise TypeError(
                    f"`runs[{name!r}][{key!r}]` must be a sequence of (step, value) number pairs: {err}"
                ) from None
    return out


@dataclass
class _Canvas:
    """The runs being drawn and the colour of each."""

    runs: dict[str, dict[str, Series]]
    colours: dict[str, Any] = field(default_factory=dict)

    def values(self, *names: str) -> list[float]:
        """The finite values of these keys, of every run."""
        return [v for scalars in self.runs.values() for key in names for v in _finite(scalars.get(key, ()))]

    def has(self, *names: str) -> bool:
        return bool(self.values(*names))

    def loss_keys(self) -> list[str]:
        """The losses the module logged (``train_loss``, ``val_loss``, ...): keys outside perf/ and tune/."""
        found = {k for scalars in self.runs.values() for k in scalars if _is_loss(k) and _finite(scalars[k])}
        return sorted(found, key=_natural_key)

    def micro_batch_in_samples(self, run: str) -> bool:
        """Whether ``tune/batch_size`` is the run's decided micro-batch (no token budget decides it)."""
        return not _finite(self.runs[run].get(keys.MICRO_BATCH_TOKENS, ()))

    def lr_group_keys(self) -> list[str]:
        groups = {k for scalars in self.runs.values() for k in scalars if _LR_GROUP.match(k)}
        return sorted(groups, key=_natural_key)

    def line(self, ax: Axes, run: str, key: str, *, style: str = "-", scale: float = 1.0, steps: bool = False) -> bool:
        """Draw one run's ``key``, a value that is not finite as a gap; whether it had a finite value to draw."""
        points = self.runs[run].get(key, [])
        if not _finite(points):
            return False
        x, y = [s for s, _ in points], [v * scale if math.isfinite(v) else math.nan for _, v in points]
        kwargs: dict[str, Any] = {"color": self.colours[run], "linestyle": style, "linewidth": 1.6}
        if len(x) <= _MARKER_MAX_POINTS:  # markers on logged points only, not on the carried end point below
            kwargs.update(marker="o", markersize=3.5, markevery=list(range(len(x))))
        if steps:  # a value holds until the next one: carry the last one to the run's last logged step
            end = max(series[-1][0] for series in self.runs[run].values() if series)
            if end > x[-1]:
                x, y = [*x, end], [*y, y[-1]]
            ax.step(x, y, where="post", **kwargs)
        else:
            ax.plot(x, y, **kwargs)
        return True

    def lines(self, ax: Axes, key: str, *, style: str = "-", scale: float = 1.0, steps: bool = False) -> bool:
        """Draw ``key`` of every run (see :meth:`line`); whether some run had it to draw."""
        return any([self.line(ax, run, key, style=style, scale=scale, steps=steps) for run in self.runs])

    def events(self, ax: Axes, count: str, on: Callable[[str], str], marker: str) -> int:
        """Mark each rise of counter ``count`` (at the next logged step) on each run's ``on(run)`` line; the rises."""
        total = 0
        for run, scalars in self.runs.items():
            line, before = [(s, v) for s, v in scalars.get(on(run), ()) if math.isfinite(v)], 0.0
            for step, value in [(s, v) for s, v in scalars.get(count, ()) if math.isfinite(v)]:
                if value > before and line:
                    held = [v for s, v in line if s <= step] or [line[0][1]]
                    ax.plot([step], [held[-1]], marker, color=self.colours[run], markersize=11, markeredgewidth=2.2)
                    total += int(value - before)
                before = max(before, value)
        return total


def render_report(
    runs: Mapping[str, Mapping[str, Sequence[tuple[int, float]]]],
    output: str | os.PathLike[str],
    *,
    title: str | None = None,
    dpi: int = DEFAULT_DPI,
) -> list[str]:
    """Draw the runs' ``perf/`` and ``tune/`` scalars over training steps into one PNG (the panels: ``docs/cli.md``).

    Args:
        runs: Run name -> scalar key -> ``(step, value)`` points, as :func:`read_scalars` returns.
        output: Path of the PNG to write; must end in ``.png``.
        title: Figure title, drawn as written (``$`` starts no mathtext); ``None`` gives ``"lightning_tune report"``.
        dpi: Resolution; the figure is 16 inches wide, so the default 100 gives 1600 pixels.

    Returns:
        The titles of the panels drawn, in drawing order (a subset of :data:`PANEL_TITLES`).

    Raises:
        TypeError: If an argument has the wrong type.
        ValueError: If ``dpi`` is outside [``MIN_DPI``, ``MAX_DPI``] (10 to 400).
        ReportError: If ``output`` does not end in ``.png`` or is a directory, no run has anything to plot, or the
            file cannot be written.
    """
    data = _normalise_runs(runs)
    path = check_output(output)
    check_instance("title", title, str, "a string", allow_none=True)
    check_int("dpi", dpi, minimum=MIN_DPI)
    if dpi > MAX_DPI:
        raise ValueError(f"`dpi` must be an integer from {MIN_DPI} to {MAX_DPI}, got {dpi!r}")

    canvas = _Canvas(data)
    panels = [(name, draw) for name, shown, draw in _PANELS if shown(canvas)]
    if not panels:
        found = sorted({k for scalars in data.values() for k in scalars})
        shown = ", ".join(found[:10]) + (f" and {len(found) - 10} more" if len(found) > 10 else "")
        raise ReportError(
            "nothing to plot: no run has a perf/ or tune/ scalar that the report draws"
            + (f" (found only: {shown})" if found else " (no scalars at all)")
        )
    _write_png_atomically(_figure(canvas, panels, "lightning_tune report" if title is None else title, dpi), path)
    return [name for name, _ in panels]


def default_title(logdir: str | os.PathLike[str]) -> str:
    """``"lightning_tune report: <name of the log directory>"``."""
    return f"lightning_tune report: {Path(logdir).resolve().name or str(logdir)}"


def check_output(output: Any) -> Path:
    """``output`` as a Path, or a ReportError saying why no PNG can be written there."""
    path = _as_path("output", output)
    if path.suffix.lower() != ".png":
        raise ReportError(f"`output` must be a path ending in .png, got {str(output)!r}")
    if path.is_dir():
        raise ReportError(f"`output` must be a .png file path, got the directory {str(output)!r}")
    return path


def _figure(canvas: _Canvas, panels: list[tuple[str, Callable[[Axes, _Canvas], None]]], title: str, dpi: int) -> Figure:
    import matplotlib
    from matplotlib.figure import Figure
    from matplotlib.layout_engine import ConstrainedLayoutEngine
    from matplotlib.lines import Line2D
    from matplotlib.ticker import EngFormatter, MaxNLocator

    drawn_runs = [
        run
        for run, scalars in canvas.runs.items()
        if any((k in _PLOTTED or _LR_GROUP.match(k) or _is_loss(k)) and _finite(p) for k, p in scalars.items())
    ]
    palette = matplotlib.color_sequences["tab10" if len(drawn_runs) <= 10 else "tab20"]
    canvas.colours = {run: palette[i % len(palette)] for i, run in enumerate(drawn_runs)}

    labels = [_run_label(run) for run in drawn_runs]
    legend_cols = max(1, min(len(labels), 8, int(15.0 / (0.8 + 0.085 * max(len(label) for label in labels)))))
    legend_rows = math.ceil(len(labels) / legend_cols)
    header_in = 0.95 + 0.27 * legend_rows
    ncols = 1 if len(panels) == 1 else 2
    nrows = math.ceil(len(panels) / ncols)
    body_in = _PANEL_HEIGHT_IN * nrows
    layout = ConstrainedLayoutEngine(h_pad=0.06, w_pad=0.06, hspace=0.07, wspace=0.03)
    fig = Figure(figsize=(_FIG_WIDTH_IN, header_in + body_in), dpi=dpi, layout=layout)
    # The title and the run legend get a strip of their own: a figure legend placed "outside" overlaps the suptitle.
    strips = fig.add_gridspec(2, 1, height_ratios=[header_in, body_in], hspace=0.0)
    head, body = fig.add_subfigure(strips[0]), fig.add_subfigure(strips[1])
    for index, (name, draw) in enumerate(panels):
        ax = body.add_subplot(nrows, ncols, index + 1)
        ax.set_title(name, fontsize=13, fontweight="bold", loc="left")
        ax.set_xlabel("training step")
        ax.grid(True, alpha=0.35)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.xaxis.set_major_formatter(EngFormatter(sep=""))
        draw(ax, canvas)
    head.text(0.5, 1 - 0.32 / header_in, _plain(title), fontsize=16, fontweight="bold", ha="center", va="center")
    handles = [Line2D([], [], color=canvas.colours[run], linewidth=3) for run in drawn_runs]
    head.legend(
        handles,
        labels,
        loc="upper center",
        bbox_to_anchor=(0.5, 1 - 0.52 / header_in),
        ncols=legend_cols,
        title="runs (the line colour in every panel)",
        title_fontsize=10,
        frameon=False,
        fontsize=11,
    )
    return fig


def _is_loss(key: str) -> bool:
    return not key.startswith(keys.PREFIXES) and "loss" in key.rsplit("/", 1)[-1].lower()


def _run_label(run: str) -> str:
    return "(log directory itself)" if run == "." else _plain(run)


def _plain(text: str) -> str:
    """``text`` drawn as written: matplotlib reads text between two ``$`` as mathtext, and fails on bad TeX."""
    return text.replace("$", r"\$")


def _style_handles(entries: Sequence[tuple[str, str]]) -> list[Any]:
    """Grey legend handles of ``(line style or event marker, label)`` entries: colours stand for runs."""
    from matplotlib.lines import Line2D

    grey: dict[str, Any] = {"color": _GUIDE_COLOUR, "linewidth": 1.6}
    return [
        Line2D([], [], **(grey | ({"linestyle": "none", "marker": s} if s in _MARKERS else {"linestyle": s})))
        for s, _ in entries
    ]


def _style_legend(ax: Axes, entries: Sequence[tuple[str, str]]) -> None:
    """A legend of line styles (the series), above the plot on the title's line, so that it never hides data."""
    ax.legend(
        _style_handles(entries),
        [label for _, label in entries],
        loc="lower right",
        bbox_to_anchor=(1.0, 1.0),
        ncols=min(len(entries), 4),
        fontsize=9,
        frameon=False,
        borderaxespad=0.1,
        handlelength=2.8,
    )


def _draw_throughput(ax: Axes, canvas: _Canvas) -> None:
    from matplotlib.ticker import EngFormatter

    has_samples, has_tokens = canvas.has(keys.SAMPLES_PER_SEC), canvas.has(keys.TOKENS_PER_SEC)
    ax.set_ylabel("samples/s" if has_samples else "tokens/s")
    canvas.lines(ax, keys.SAMPLES_PER_SEC if has_samples else keys.TOKENS_PER_SEC)
    ax.set_ylim(bottom=0)
    ax.yaxis.set_major_formatter(EngFormatter(sep=""))
    if has_samples and has_tokens:
        right = ax.twinx()
        canvas.lines(right, keys.TOKENS_PER_SEC, style="--")
        right.set_ylabel("tokens/s")
        right.set_ylim(bottom=0)
        right.yaxis.set_major_formatter(EngFormatter(sep=""))
        _style_legend(right, [("-", "samples/s (left axis)"), ("--", "tokens/s (right axis)")])


def _draw_lines(
    ax: Axes, canvas: _Canvas, series: Sequence[tuple[str, str, str]], ylabel: str, zero: bool = True
) -> None:
    """Draw each ``(key, style, label)`` of every run, from ``zero``, with a style legend when several were drawn."""
    entries = [(style, label) for key, style, label in series if canvas.lines(ax, key, style=style)]
    ax.set_ylabel(ylabel)
    if zero:
        ax.set_ylim(bottom=0)
    if len(entries) > 1:
        _style_legend(ax, entries)


def _draw_step_time(ax: Axes, canvas: _Canvas) -> None:
    series = (*zip(_STEP_MS, _STYLES, _QS, strict=False), (keys.STEP_MS_MAX, ":", "max"))
    _draw_lines(ax, canvas, series, "step time (ms)")


def _draw_val_latency(ax: Axes, canvas: _Canvas) -> None:
    _draw_lines(ax, canvas, tuple(zip(_VAL_MS, _STYLES, _QS, strict=False)), "validation batch time (ms)")
    ax.set_xlabel("training step (at each validation run)")


def _draw_lr(ax: Axes, canvas: _Canvas) -> None:
    names = [keys.LR, *canvas.lr_group_keys()]
    entries = [
        (_STYLES[i % len(_STYLES)], f"param group {i}")
        for i, key in enumerate(names)
        if canvas.lines(ax, key, style=_STYLES[i % len(_STYLES)])
    ]
    lrs = canvas.values(*names)
    values = [v for v in lrs if v > 0]
    if values and max(values) > 10 * min(values):
        for line in ax.get_lines():  # LR 0 (a warm-up's first step) has no place on a log axis: leave it out
            ys = [float(v) for v in line.get_ydata()]  # type: ignore[union-attr, arg-type]
            line.set_ydata([v if v > 0 else math.nan for v in ys])
        ax.set_yscale("log")
        ax.set_ylabel(
            "learning rate (log scale, 0 left out)" if len(values) < len(lrs) else "learning rate (log scale)"
        )
    else:
        ax.set_ylabel("learning rate")
        ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 4))
    if reduced := canvas.events(ax, keys.PLATEAU_REDUCTIONS, lambda run: keys.LR, _PLATEAU_MARKER):
        entries.append((_PLATEAU_MARKER, f"reduced on plateau ({reduced})"))
    if len(entries) > 1:
        _style_legend(ax, entries)


def _draw_loss(ax: Axes, canvas: _Canvas) -> None:
    series = [(key, _STYLES[i % len(_STYLES)], _plain(key)) for i, key in enumerate(canvas.loss_keys())]
    _draw_lines(ax, canvas, series, "loss", zero=False)


def _samples_decided(canvas: _Canvas) -> bool:
    return canvas.has(keys.EFFECTIVE_BATCH_SIZE) or any(
        canvas.micro_batch_in_samples(run) and _finite(scalars.get(keys.BATCH_SIZE, ()))
        for run, scalars in canvas.runs.items()
    )


def _draw_batch_size(ax: Axes, canvas: _Canvas) -> None:
    """What DynamicBatchSize decided in samples: the micro-batch (where no token budget decides it) and the step's."""
    from matplotlib.ticker import MaxNLocator

    entries = []
    for key, style, label in (
        (keys.BATCH_SIZE, "-", "micro-batch"),
        (keys.EFFECTIVE_BATCH_SIZE, "--", "per optimizer step (effective)"),
    ):
        runs = [r for r in canvas.runs if key != keys.BATCH_SIZE or canvas.micro_batch_in_samples(r)]
        if any([canvas.line(ax, run, key, style=style, steps=True) for run in runs]):  # every run, not the first
            entries.append((style, label))

    def drawn_size(run: str) -> str:  # the line an out-of-memory recovery is marked on
        return keys.BATCH_SIZE if canvas.micro_batch_in_samples(run) else keys.EFFECTIVE_BATCH_SIZE

    if recovered := canvas.events(ax, keys.OOM_RECOVERIES, drawn_size, _OOM_MARKER):
        entries.append((_OOM_MARKER, f"out-of-memory recovery ({recovered})"))
    ax.set_ylabel("samples per batch")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True, steps=[1, 2, 4, 8, 10]))  # batch-friendly ticks
    ax.set_ylim(bottom=0)
    ax.margins(y=0.15)
    _style_legend(ax, entries)  # even one entry: which of the two batch sizes it is


def _draw_memory(ax: Axes, canvas: _Canvas) -> None:
    from matplotlib.lines import Line2D

    if not canvas.has(keys.VRAM_USED_FRAC, keys.PREDICTED_VRAM_FRAC):  # no fraction of the device known: plot GiB
        gib = ((keys.VRAM_ALLOCATED_GIB, "-", "allocated"), (keys.VRAM_RESERVED_GIB, "--", "reserved"))
        _draw_lines(ax, canvas, (*gib, (keys.VRAM_PEAK_GIB, ":", "peak allocated")), "GPU memory (GiB)")
        return
    fractions = (
        (keys.VRAM_USED_FRAC, "-", "used (all processes)"),
        (keys.PREDICTED_VRAM_FRAC, "--", "predicted peak of the chosen batch (of what PyTorch can get)"),
    )
    entries = [(style, label) for key, style, label in fractions if canvas.lines(ax, key, style=style)]
    top = max([1.0, *canvas.values(keys.VRAM_USED_FRAC, keys.PREDICTED_VRAM_FRAC)])
    ax.axhline(1.0, color=_GUIDE_COLOUR, linestyle=":", linewidth=1.4)
    ax.set_ylim(0, top * 1.08)
    ax.set_ylabel("device memory (fraction)")
    handles = [*_style_handles(entries), Line2D([], [], color=_GUIDE_COLOUR, linestyle=":", linewidth=1.4)]
    labels = [label for _, label in entries] + ["device total (1.0)"]
    for run in canvas.runs:
        peaks = _finite(canvas.runs[run].get(keys.VRAM_PEAK_GIB, ()))
        if peaks:
            handles.append(Line2D([], [], color=canvas.colours[run], linewidth=1.6))
            labels.append(f"{_run_label(run)}: peak allocated {max(peaks):.1f} GiB")
    ax.legend(handles, labels, fontsize=9, framealpha=0.85, loc="best")


def _draw_token_budget(ax: Axes, canvas: _Canvas) -> None:
    from matplotlib.ticker import EngFormatter

    canvas.lines(ax, keys.MICRO_BATCH_TOKENS, steps=True)
    ax.set_ylabel("padded tokens per micro-batch")
    ax.set_ylim(bottom=0)
    ax.margins(y=0.15)
    ax.yaxis.set_major_formatter(EngFormatter(sep=""))


def _draw_padding(ax: Axes, canvas: _Canvas) -> None:
    canvas.lines(ax, keys.PADDING_FRAC, scale=100.0)
    top = max(canvas.values(keys.PADDING_FRAC))
    ax.set_ylim(0, max(5.0, min(100.0, 100 * top * 1.15)))
    ax.set_ylabel("padding (% of tokens)")


def _has_utilisation(canvas: _Canvas) -> bool:
    return (
        canvas.has(keys.MFU, keys.GPU_UTIL_PCT)
        or max(canvas.values(keys.DATA_WAIT_FRAC), default=0.0) >= _MIN_DATA_WAIT
    )


def _draw_utilisation(ax: Axes, canvas: _Canvas) -> None:
    series = (
        (keys.MFU, "-", "MFU", 100.0),
        (keys.DATA_WAIT_FRAC, "--", "waiting for data", 100.0),
        (keys.GPU_UTIL_PCT, ":", "GPU busy (NVML)", 1.0),
    )
    entries = [(style, label) for key, style, label, scale in series if canvas.lines(ax, key, style=style, scale=scale)]
    if canvas.has(keys.MFU, keys.GPU_UTIL_PCT):
        top = max([100.0, *canvas.values(keys.GPU_UTIL_PCT)])
    else:  # only the data wait: scaled to it, not to 100 %
        top = 100 * max(canvas.values(keys.DATA_WAIT_FRAC))
    ax.set_ylim(0, top * 1.05)
    ax.set_ylabel("% of peak FLOP/s (MFU) or of time")
    _style_legend(ax, entries)


_PANELS: tuple[tuple[str, Callable[[_Canvas], bool], Callable[[Axes, _Canvas], None]], ...] = (
    ("Throughput", lambda c: c.has(keys.SAMPLES_PER_SEC, keys.TOKENS_PER_SEC), _draw_throughput),
    ("Step time", lambda c: c.has(*_STEP_MS, keys.STEP_MS_MAX), _draw_step_time),
    ("Loss", lambda c: bool(c.loss_keys()), _draw_loss),
    ("Learning rate", lambda c: c.has(keys.LR, *c.lr_group_keys()), _draw_lr),
    ("Batch size", _samples_decided, _draw_batch_size),
    ("Token budget", lambda c: c.has(keys.MICRO_BATCH_TOKENS), _draw_token_budget),
    ("Padding", lambda c: c.has(keys.PADDING_FRAC), _draw_padding),
    ("GPU memory", lambda c: c.has(*_VRAM, keys.PREDICTED_VRAM_FRAC), _draw_memory),
    ("Utilisation", _has_utilisation, _draw_utilisation),
    ("Validation latency", lambda c: c.has(*_VAL_MS), _draw_val_latency),
)

#: Titles of the panels :func:`render_report` can draw, in drawing order.
PANEL_TITLES: tuple[str, ...] = tuple(name for name, _, _ in _PANELS)


def _write_png_atomically(fig: Figure, path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ReportError(f"could not create the directory {str(path.parent)!r} for `output`: {err}") from err
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    try:
        write_atomically(path, buffer.getvalue())
    except OSError as err:
        raise ReportError(f"could not write {str(path)!r}: {err}") from err
