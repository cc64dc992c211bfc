"""PNG pictures of a topology: hosts side by side, GPUs coloured by host, links by kind.

Each host is drawn as layers (NVSwitch, GPUs, NICs, PCIe switches, CPUs, bottom to top) with
the network switches above all hosts. Large clusters show their first :data:`MAX_HOSTS` hosts.
Uses matplotlib's Agg canvas directly, so it never touches the global backend.
"""

from __future__ import annotations

import re
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

MAX_HOSTS = 4
LEVEL = {"nvswitch": 0.0, "gpu": 1.0, "nic": 1.9, "pcie_switch": 2.8, "cpu": 3.7}
FABRIC_LEVEL = {"leaf": 5.0, "spine": 6.0}
MARKER = {"gpu": "s", "nvswitch": "D", "pcie_switch": "^", "cpu": "o", "nic": "v",
          "net_switch": "h"}
LINK_COLOR = {"nvlink": "#76b900", "xgmi": "#ed1c24", "pcie": "#1f77b4", "upi": "#9467bd",
              "ib": "#ff7f0e", "loopback": "#7f7f7f"}


def _natural(name: str) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def layout(t, hosts: list[str]) -> dict[str, tuple[float, float]]:
    """x, y positions of the nodes of ``hosts`` and of the switches they connect to."""
    g, pos, x0 = t.graph, {}, 0.0
    shown = set(hosts)
    for host in hosts:
        levels: dict[float, list[str]] = {}
        for n, d in g.nodes(data=True):
            if d["host"] == host and not d.get("logical"):
                levels.setdefault(LEVEL.get(d["kind"], 2.0), []).append(n)
        width = max(len(v) for v in levels.values())
        for y, names in levels.items():
            step = width / len(names)
            for k, n in enumerate(sorted(names, key=_natural)):
                pos[n] = (x0 + step * (k + 0.5), y)
        x0 += width + 1.5
    fabric = sorted((n for n, d in g.nodes(data=True) if d["kind"] == "net_switch" and any(
        g.nodes[m]["host"] in shown or m in pos for m in g.predecessors(n))), key=_natural)
    spines = sorted({m for n in fabric for m in g.successors(n)
                     if g.nodes[m]["kind"] == "net_switch" and m not in fabric}, key=_natural)
    for row, y in ((fabric, FABRIC_LEVEL["leaf"]), (spines, FABRIC_LEVEL["spine"])):
        for k, n in enumerate(row):
            pos[n] = ((k + 0.5) * max(x0 - 1.5, 1.0) / len(row), y)
    return pos


def draw(t, path: Path, max_hosts: int = MAX_HOSTS) -> Path:
    """Write a PNG of ``t`` to ``path`` and return it."""
    hosts = t.hosts[:max_hosts]
    pos = layout(t, hosts)
    width = max(x for x, _ in pos.values()) + 1.0
    fig = Figure(figsize=(min(24, max(8, width * 0.9)), 7), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    _draw_links(ax, t, pos)
    _draw_nodes(ax, t, pos, hosts)
    title = f"{t.name}: {t.num_gpus} GPUs on {len(t.hosts)} host(s)"
    if len(hosts) < len(t.hosts):
        title += f" (showing {len(hosts)})"
    ax.set_title(title)
    ax.set_axis_off()
    ax.margins(0.06)
    _legend(ax, t, hosts)
    fig.tight_layout()
    fig.savefig(path)
    return path


def _draw_links(ax, t, pos) -> None:
    done = set()
    for u, v, d in t.graph.edges(data=True):
        if u not in pos or v not in pos or d.get("logical") or (v, u) in done:
            continue
        done.add((u, v))
        (x1, y1), (x2, y2) = pos[u], pos[v]
        lw = 0.6 + min(3.0, d["bandwidth"] / 50e9)
        ax.plot([x1, x2], [y1, y2], color=LINK_COLOR[d["kind"]], lw=lw, alpha=0.55, zorder=1)


def _draw_nodes(ax, t, pos, hosts) -> None:
    cmap = ax.figure.colormaps["tab10"] if hasattr(ax.figure, "colormaps") else None
    colors = _host_colors(hosts, cmap)
    small = len(pos) <= 120
    for n, (x, y) in pos.items():
        d = t.graph.nodes[n]
        color = colors.get(d["host"], "#cccccc") if d["kind"] == "gpu" else "#dddddd"
        size = 220 if d["kind"] in ("gpu", "cpu") else 140
        ax.scatter([x], [y], s=size, marker=MARKER[d["kind"]], color=color, edgecolors="black",
                   linewidths=0.7, zorder=3)
        if small:
            label = {"gpu": str(d.get("rank")), "net_switch": n}.get(d["kind"], n.split("/")[-1])
            ax.annotate(label, (x, y), xytext=(0, -13 if d["kind"] != "gpu" else 0),
                        textcoords="offset points", ha="center", va="center", fontsize=6,
                        zorder=4)


def _host_colors(hosts: list[str], cmap) -> dict[str, tuple]:
    import matplotlib

    cmap = cmap or matplotlib.colormaps["tab10"]
    return {h: cmap(i % 10) for i, h in enumerate(hosts)}


def _legend(ax, t, hosts) -> None:
    kinds = sorted({d["kind"] for _, _, d in t.graph.edges(data=True)})
    handles = [Line2D([0], [0], color=LINK_COLOR[k], lw=2.5, label=k) for k in kinds]
    colors = _host_colors(hosts, None)
    handles += [Line2D([0], [0], marker="s", ls="", markerfacecolor=colors[h],
                       markeredgecolor="black", label=f"GPU on {h}") for h in hosts[:8]]
    node_kinds = sorted({d["kind"] for _, d in t.graph.nodes(data=True)} - {"gpu"})
    handles += [Line2D([0], [0], marker=MARKER[k], ls="", markerfacecolor="#dddddd",
                       markeredgecolor="black", label=k) for k in node_kinds]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8,
              frameon=False)
