"""The one-paragraph explanation of why a plan wins."""

from __future__ import annotations


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:,.1f} µs" if seconds < 1e-2 else f"{seconds * 1e3:,.2f} ms"


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return f"{n} B"


def explain_plan(plan) -> str:
    """Why ``plan.winner`` beats the rest, in one paragraph of plain sentences."""
    w, win, pred = plan.workload, plan.winner, plan.prediction
    topo = plan.topology
    cp = pred.critical_path or {}
    parts = [
        f"On {topo.num_gpus} GPUs over {len(topo.hosts)} host(s), {win.name} is predicted to "
        f"take {_us(win.latency_s)} per attention layer for {w.describe()} "
        f"({_us(plan.token_latency_s())} per token over {w.model.n_layers} layers, "
        f"{pred.method})."
    ]
    if cp:
        parts.append(
            f"Its critical path is {_us(cp['compute_s'])} of local compute and merges, "
            f"{_us(cp['overhead_s'])} of per-message software overhead and "
            f"{_us(cp['wire_s'])} on the wire."
        )
    tree = plan.tree
    if tree is not None:
        parts.append(f"The tree has depth {tree.depth} and root {tree.root}; each rank sends "
                     f"a {_bytes(w.partial_bytes)} partial, never its KV shard.")
    others = [c for c in plan.candidates if c is not win]
    if others:
        runner = others[0]
        gap = runner.latency_s / win.latency_s - 1
        parts.append(f"The runner-up, {runner.name}, is {gap:.1%} slower ({_us(runner.latency_s)}, "
                     f"{runner.method}).")
    ring = plan.best("ring")
    if ring is not None and ring is not win:
        ring_bytes = (topo.num_gpus - 1) * w.kv_bytes(w.seq_len)
        parts.append(f"Ring Attention would take {_us(ring.latency_s)} "
                     f"({ring.latency_s / win.latency_s:.1f}× longer) because it moves "
                     f"{_bytes(ring_bytes)} of KV blocks per layer against "
                     f"{_bytes(pred.comm_bytes)} here.")
    simulated = sum(c.result is not None for c in plan.candidates)
    parts.append(f"{len(plan.candidates)} candidates were scored in closed form and "
                 f"{simulated} simulated; the rest cannot beat the winner because their "
                 f"closed form, a lower bound, is already slower.")
    return " ".join(parts)
