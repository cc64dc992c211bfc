"""The planner's answer in words: why the pick wins, by how much, and against what."""

from __future__ import annotations

from treeattn.schedule.algorithms import SOURCES


def us(seconds: float) -> str:
    return f"{seconds * 1e6:,.1f} µs" if seconds < 1e-2 else f"{seconds * 1e3:,.2f} ms"


def size_text(n: float) -> str:
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
        f"take {us(win.latency_s)} per attention layer for {w.describe()} "
        f"({us(plan.token_latency_s())} per token over {w.model.n_layers} layers, "
        f"{pred.method})."
    ]
    if cp:
        parts.append(
            f"Its critical path is {us(cp['compute_s'])} of local compute and merges, "
            f"{us(cp['overhead_s'])} of per-message software overhead and "
            f"{us(cp['wire_s'])} on the wire."
        )
    tree = plan.tree
    if tree is not None:
        parts.append(f"The tree has depth {tree.depth} and root {tree.root}; each rank sends "
                     f"a {size_text(w.partial_bytes)} partial, never its KV shard.")
    others = [c for c in plan.candidates if c is not win]
    if others:
        runner = others[0]
        gap = runner.latency_s / win.latency_s - 1
        parts.append(f"The runner-up, {runner.name}, is {gap:.1%} slower ({us(runner.latency_s)}, "
                     f"{runner.method}).")
    baseline = plan.best_baseline()
    if baseline is win:
        parts.append(f"A baseline wins here: {win.name} is what {SOURCES[win.algorithm]} runs, "
                     "and nothing of treeattn's own beats it on this cluster and size.")
    elif baseline is not None:
        parts.append(f"The strongest baseline, {baseline.name} ({SOURCES[baseline.algorithm]}), "
                     f"takes {us(baseline.latency_s)}: "
                     f"{baseline.latency_s / win.latency_s:.2f}× the winner.")
    parts.append(f"Outputs are compared {w.layout}: head-sharded algorithms pay for gathering "
                 "their heads back." if w.layout == "replicated" else
                 f"Outputs are compared {w.layout} (a tensor-parallel projection follows).")
    ring = plan.best("ring")
    if ring is not None and ring is not win:
        ring_bytes = (topo.num_gpus - 1) * w.kv_bytes(w.seq_len)
        parts.append(f"Ring Attention's pass-KV would take {us(ring.latency_s)} "
                     f"({ring.latency_s / win.latency_s:.1f}× longer) because it moves "
                     f"{size_text(ring_bytes)} of KV blocks per layer against "
                     f"{size_text(pred.comm_bytes)} here.")
    for reason in plan.refused.values():
        parts.append(f"Not priced: {reason}.")
    simulated = sum(c.result is not None for c in plan.candidates)
    parts.append(f"{len(plan.candidates)} candidates were scored in closed form and "
                 f"{simulated} simulated; the rest cannot beat the winner because their "
                 f"closed form, a lower bound, is already slower.")
    return " ".join(parts)
