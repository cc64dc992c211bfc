"""Human summaries of a topology: :func:`describe` and the rows of ``treeattn topo show``."""

from __future__ import annotations

from collections import Counter


def summary_rows(t) -> list[tuple[str, str]]:
    """``(field, value)`` rows: size, models, links and the route extremes."""
    kinds = Counter(d["kind"] for _, d in t.graph.nodes(data=True) if not d.get("logical"))
    models = Counter(t.gpu_model(g) for g in t.gpus)
    rows = [
        ("name", t.name),
        ("GPUs", f"{t.num_gpus} ({', '.join(f'{n}x {m}' for m, n in models.items())})"),
        ("hosts", str(len(t.hosts))),
        ("nodes", ", ".join(f"{n} {k}" for k, n in sorted(kinds.items()))),
        ("links", ", ".join(f"{n} {k}" for k, n in t.links().items())),
    ]
    if t.num_gpus > 1:
        rows += _route_rows(t)
    return rows


def _route_rows(t) -> list[tuple[str, str]]:
    first = t.gpus[0]
    same = [g for g in t.gpus[1:] if t.host_of(g) == t.host_of(first)]
    other = [g for g in t.gpus[1:] if t.host_of(g) != t.host_of(first)]
    rows = []
    for label, group in (("same host", same), ("other host", other)):
        if not group:
            continue
        bws = [t.path_bandwidth(first, g) / 1e9 for g in group]
        lats = [t.path_latency(first, g) * 1e6 for g in group]
        rows.append((f"GPU 0 -> {label}", f"{span(bws, '.1f')} GB/s, {span(lats, '.2f')} us"))
    return rows


def span(values: list[float], fmt: str) -> str:
    """``"lo-hi"`` of ``values`` in ``fmt``, or one figure when they agree.

    >>> span([450.0, 450.0], ".1f"), span([10, 25], "g")
    ('450.0', '10-25')
    """
    lo, hi = format(min(values), fmt), format(max(values), fmt)
    return lo if lo == hi else f"{lo}-{hi}"


def describe(t) -> str:
    """Multi-line text summary.

    >>> from treeattn.topo import Topology
    >>> print(describe(Topology.from_spec("local:ranks=2")).splitlines()[1])
    GPUs: 2 (2x cpu)
    """
    return "\n".join(f"{k}: {v}" for k, v in summary_rows(t))
