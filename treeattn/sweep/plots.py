"""The sweep's figures, written as PNG with matplotlib's Agg canvas (never the global backend).

Every function takes the sweep's rows (dicts as written to ``results.json``) and a path, and
returns the path. Rows carry ``topology``, ``gpus``, ``seq_len``, ``algorithm``, ``latency_s``,
``speedup_vs_ring``, ``peak_memory_bytes``, ``model_dim`` and, for measured sweeps,
``measured_s`` and ``predicted_s``.
"""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path

import matplotlib
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

ALGO_STYLE = {
    "tree": ("#2ca02c", "o", "-"),
    "butterfly": ("#17becf", "v", "--"),
    "allgather": ("#bcbd22", "^", "--"),
    "hier": ("#393b79", "h", "-"),
    "allreduce3": ("#9467bd", "s", "-."),
    "allreduce2": ("#8c564b", "s", ":"),
    "oneshot": ("#ff7f0e", "P", "-."),
    "helix": ("#1f77b4", "X", "-."),
    "dcp": ("#e377c2", "*", ":"),
    "ring-passq": ("#7f7f7f", "D", ":"),
    "ring": ("#d62728", "D", "-"),
    "pick": ("#000000", "o", "-"),
}


def _figure(ncols: int = 1, nrows: int = 1, size=(6.0, 4.2)) -> tuple[Figure, list]:
    fig = Figure(figsize=(size[0] * ncols, size[1] * nrows), dpi=110)
    FigureCanvasAgg(fig)
    axes = [fig.add_subplot(nrows, ncols, i + 1) for i in range(nrows * ncols)]
    return fig, axes


def _style(ax, xlabel: str, ylabel: str, title: str, xbase: int = 10,
           legend_title: str | None = None, ylog: bool = True) -> None:
    """Log-log (or log-linear) axes, labels, grid and legend."""
    ax.set_xscale("log", base=xbase)
    if ylog:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, title=legend_title)


def _save(fig: Figure, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path)
    return path


def _finish(fig: Figure, ax, path: Path, *labels: str, **options) -> Path:
    """Style the single axes of ``fig`` (see :func:`_style`) and write the PNG."""
    _style(ax, *labels, **options)
    return _save(fig, path)


def _tokens(n: float) -> str:
    """A token count the way the CLI takes it: binary k and M (``80k`` = 81920)."""
    for unit, scale in (("M", 1 << 20), ("k", 1 << 10)):
        if n >= scale:
            value = n / scale
            return f"{value:.0f}{unit}" if value == int(value) else f"{value:.1f}{unit}"
    return f"{int(n)}"


STRAWMAN = "ring"  # Ring Attention's pass-KV: decades slower at decode, drawn apart


def latency_vs_seq_len(rows: list[dict], path: Path) -> Path:
    """Per-layer decode latency vs context length, a column per topology (its largest GPU
    count). The top panel plots every algorithm but ring pass-KV as its time over the fastest
    at that point (1× is the fastest), so that the choice between them can be read; the
    bottom panel gives the fastest's absolute time with ring pass-KV's, log-log, because ring
    pass-KV runs decades above the rest and would squash them into one band."""
    by_topo: dict[str, list[dict]] = defaultdict(list)
    for row in rows:
        by_topo[row["topology"]].append(row)
    ncols = len(by_topo)
    fig, axes = _figure(ncols=ncols, nrows=2, size=(6.0, 3.9))
    for col, (topo, topo_rows) in enumerate(by_topo.items()):
        top, bottom = axes[col], axes[ncols + col]
        gpus = max(r["gpus"] for r in topo_rows)
        points = [r for r in topo_rows if r["gpus"] == gpus and r["algorithm"] != "pick"]
        fastest: dict[int, float] = {}
        for r in points:
            if r["algorithm"] != STRAWMAN:
                seq = r["seq_len"]
                fastest[seq] = min(fastest.get(seq, math.inf), r["latency_s"])
        worst = 1.0
        for algo, (color, marker, style) in ALGO_STYLE.items():
            if algo in ("pick", STRAWMAN):
                continue
            pts = sorted((r["seq_len"], r["latency_s"] / fastest[r["seq_len"]])
                         for r in points if r["algorithm"] == algo)
            if pts:
                xs, ys = zip(*pts)
                worst = max(worst, *ys)
                top.plot(xs, ys, color=color, marker=marker, ls=style, label=algo)
        _style(top, "context length (tokens)", "time / fastest at that point (×)",
               f"{topo} ({gpus} GPUs): the nine to choose from")
        _ratio_ticks(top, worst)
        ring = sorted((r["seq_len"], r["latency_s"]) for r in points
                      if r["algorithm"] == STRAWMAN)
        best = sorted(fastest.items())
        if best:
            xs, ys = zip(*best)
            bottom.plot(xs, [y * 1e6 for y in ys], color="#000000", marker="o",
                        label="fastest of the nine")
        if ring:
            xs, ys = zip(*ring)
            color, marker, style = ALGO_STYLE[STRAWMAN]
            bottom.plot(xs, [y * 1e6 for y in ys], color=color, marker=marker, ls=style,
                        label="ring pass-KV")
        _style(bottom, "context length (tokens)", "predicted latency per layer (µs)",
               f"{topo}: absolute time, with ring pass-KV")
        for ax in (top, bottom):
            _token_ticks(ax, sorted(fastest))
    return _save(fig, path)


def _token_ticks(ax, lengths: list[int]) -> None:
    """Ticks at the context lengths drawn, labelled as the CLI takes them (16k, 1M)."""
    if lengths:
        ax.xaxis.set_major_locator(FixedLocator(lengths))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: _tokens(v)))


def _ratio_ticks(ax, worst: float) -> None:
    """Readable ticks (1×, 1.25×, 1.5×, 2×, ...) on a log ratio axis from 1 to ``worst``."""
    ticks = [t for t in (1, 1.25, 1.5, 2, 3, 4, 6, 8, 12, 16, 24, 32) if t <= worst * 1.1]
    ax.set_ylim(0.97, max(1.1, worst * 1.08))
    ax.yaxis.set_major_locator(FixedLocator(ticks))
    ax.yaxis.set_minor_locator(NullLocator())
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}×"))


def speedup_vs_gpus(rows: list[dict], path: Path, topology: str | None = None) -> Path:
    """treeattn's best own schedule (tree, butterfly or all-gather of partials) against the
    strongest baseline at each point, vs the number of GPUs, a line per context length.
    Above 1× treeattn's schedule is the pick; below, a baseline is, by that factor.

    Why not the pick itself: where a baseline wins, the pick's ratio is 1× by definition and
    the plot would hide by how much treeattn's own schedules lose."""
    own = [r for r in rows if str(r.get("system", "")).startswith("treeattn")
           and (topology is None or r["topology"] == topology)]
    model = own[0]["model"] if own else ""
    best: dict[tuple[int, int], float] = {}
    for r in own:
        if r["model"] == model and r["speedup_vs_best_baseline"] is not None:
            key = (r["gpus"], r["seq_len"])
            best[key] = max(best.get(key, 0.0), r["speedup_vs_best_baseline"])
    fig, (ax,) = _figure(size=(6.4, 4.4))
    lengths = sorted({seq_len for _, seq_len in best})
    cmap = matplotlib.colormaps["viridis"]
    for i, seq_len in enumerate(lengths):
        pts = sorted((gpus, ratio) for (gpus, n), ratio in best.items() if n == seq_len)
        color = cmap(i / max(1, len(lengths) - 1))
        xs, ys = zip(*pts)
        ax.plot(xs, ys, marker="o", color=color, label=f"{_tokens(seq_len)} tokens")
    ax.axhline(1.0, color="grey", lw=1, ls=":")
    title = topology or ", ".join(sorted({r["topology"] for r in own}))
    return _finish(fig, ax, path, "number of GPUs",
                   "speedup over the strongest baseline (×; < 1: it wins)",
                   f"treeattn's best vs the strongest baseline: {title}, {model}",
                   xbase=2, legend_title="context", ylog=False)


def memory_vs_hidden(rows: list[dict], path: Path) -> Path:
    """Peak memory per GPU, tree vs ring, vs hidden size (rows of ``grid.memory_rows``:
    one topology, one context length, models that differ only in their head count)."""
    fig, (ax,) = _figure(size=(6.4, 4.4))
    for algo, ls in (("tree", "-"), ("ring", "--")):
        pts = sorted((r["model_dim"], r["peak_memory_bytes"]) for r in rows
                     if r["algorithm"] == algo)
        if pts:
            xs, ys = zip(*pts)
            ax.plot(xs, [y / 2**30 for y in ys], marker="o", ls=ls, color=ALGO_STYLE[algo][0],
                    label=algo)
    if rows:
        first = rows[0]
        ax.text(0.02, 0.02, f"{first['spec']}, {_tokens(first['seq_len'])} tokens, "
                "MHA, head dim 128, bf16", transform=ax.transAxes, fontsize=8)
    return _finish(fig, ax, path, "model hidden size (Hq × head dim)",
                   "predicted peak memory per GPU, one layer (GiB)",
                   "Peak memory: Ring holds KV blocks in flight, Tree only partials", xbase=2)


def measured_vs_predicted(rows: list[dict], path: Path, band: float = 0.25) -> Path:
    """Measured against predicted step time, with the y = x line and a ±band error band."""
    fig, (ax,) = _figure(size=(5.6, 5.0))
    measured = [r for r in rows if r.get("measured_s")]
    for algo, (color, marker, _) in ALGO_STYLE.items():
        pts = [(r["predicted_s"], r["measured_s"]) for r in measured if r["algorithm"] == algo]
        if pts:
            xs, ys = zip(*pts)
            ax.scatter([x * 1e3 for x in xs], [y * 1e3 for y in ys], color=color,
                       marker=marker, label=algo, zorder=3)
    values = [v * 1e3 for r in measured for v in (r["predicted_s"], r["measured_s"])]
    lo, hi = (min(values) / 1.5, max(values) * 1.5) if values else (1e-3, 1.0)
    line = [lo, hi]
    ax.plot(line, line, color="black", lw=1, label="y = x")
    ax.fill_between(line, [v * (1 - band) for v in line], [v * (1 + band) for v in line],
                    color="grey", alpha=0.2, label=f"±{band:.0%}")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    return _finish(fig, ax, path, "predicted step time (ms)", "measured step time (ms)",
                   "Prediction vs measurement")


def tree_over_topology(topology, parent: list[int], path: Path, title: str = "") -> Path:
    """The chosen reduction tree's edges (child → parent) drawn over the cluster graph."""
    from matplotlib.lines import Line2D

    from treeattn.topo.draw import LINK_COLOR, MARKER, layout

    hosts = topology.hosts[:4]
    pos = layout(topology, hosts)
    fig, (ax,) = _figure(size=(max(8.0, 1.1 * len(pos) ** 0.5 * 3), 6.5))
    g = topology.graph
    for u, v, d in g.edges(data=True):
        if u in pos and v in pos and not d.get("logical"):
            (x1, y1), (x2, y2) = pos[u], pos[v]
            ax.plot([x1, x2], [y1, y2], color=LINK_COLOR.get(d["kind"], "#999999"), lw=0.6,
                    alpha=0.25, zorder=1)
    for name, (x, y) in pos.items():
        kind = g.nodes[name]["kind"]
        if kind != "gpu":
            ax.scatter([x], [y], s=70, marker=MARKER.get(kind, "o"), color="#dddddd",
                       edgecolors="#777777", linewidths=0.6, zorder=2)
    shown = {r: topology.gpus[r] for r in range(topology.num_gpus)
             if topology.gpus[r] in pos}
    for rank, name in shown.items():
        x, y = pos[name]
        root = parent[rank] < 0
        ax.scatter([x], [y], s=320 if root else 200, marker="s", zorder=3,
                   color="#ffd700" if root else "#9fd39f", edgecolors="black")
        ax.annotate(str(rank), (x, y), ha="center", va="center", fontsize=7, zorder=4)
    for child, par in enumerate(parent):
        if par < 0 or child not in shown or par not in shown:
            continue
        (x1, y1), (x2, y2) = pos[shown[child]], pos[shown[par]]
        bend = 0.25 if abs(y1 - y2) < 1e-9 else 0.0
        ax.annotate("", xy=(x2, y2), xytext=(x1, y1), zorder=2,
                    arrowprops=dict(arrowstyle="-|>", color="#2ca02c", lw=1.8,
                                    connectionstyle=f"arc3,rad={bend}"))
    kinds = sorted({d["kind"] for _, _, d in g.edges(data=True)})
    handles = [Line2D([0], [0], color="#2ca02c", lw=2, label="tree edge (child → parent)"),
               Line2D([0], [0], marker="s", ls="", markerfacecolor="#ffd700",
                      markeredgecolor="black", label="root")]
    handles += [Line2D([0], [0], color=LINK_COLOR.get(k, "#999999"), lw=1.5, alpha=0.5,
                       label=f"{k} link") for k in kinds]
    ax.legend(handles=handles, fontsize=7, loc="upper right")
    depth = _depth(parent)
    ax.set_title(title or f"reduction tree on {topology.name}: root {parent.index(-1)}, "
                 f"depth {depth}")
    ax.set_axis_off()
    ax.margins(0.08)
    return _save(fig, path)


def _depth(parent: list[int]) -> int:
    def up(r: int) -> int:
        steps = 0
        while parent[r] >= 0 and steps <= len(parent):
            r, steps = parent[r], steps + 1
        return steps

    return max((up(r) for r in range(len(parent))), default=0) if parent else 0


def geometric_mean(values: list[float]) -> float:
    values = [v for v in values if v > 0]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")
