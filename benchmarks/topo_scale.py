"""How fast the topology model builds and routes large clusters.

Measures, on ``dgx-h100:nodes=128`` (1024 GPUs):

- building and validating the topology;
- all-pairs routes through the public ``Topology.route`` (1024 x 1024 = 1,048,576 routes),
  cold (segments computed) and warm (segments cached);
- the vectorised ``latency_matrix`` / ``bandwidth_matrix``, checked against ``path_latency``
  and ``path_bandwidth`` on sampled pairs.

and, unless ``--quick``, on ``dgx-h100:nodes=2048`` (16384 GPUs): build, and float32 latency +
bandwidth matrices (2 x 1 GiB). Ratios (per-pair routing vs matrices) come from the same run;
the target for all-pairs routing of 1024 GPUs is 2 s. CPU seconds of the process are recorded
beside wall seconds, since a shared machine inflates the latter. Writes ``benchmarks/results/
topo_scale.json`` and ``.md``. Run: ``.venv/bin/python benchmarks/topo_scale.py [--quick]``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import networkx as nx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from treeattn.topo import Topology  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
TARGET_ALL_PAIRS_S = 2.0


def machine_info() -> dict:
    return {
        "python": platform.python_version(), "numpy": np.__version__,
        "networkx": nx.__version__, "platform": platform.platform(),
        "cpu": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }  # fmt: skip


CPU_S: dict[str, float] = {}  # CPU seconds of the process per step (robust on a shared box)


def timed(fn, label: str):
    """Run ``fn``; return its result and wall seconds, and keep its CPU seconds in CPU_S."""
    c0, t0 = time.process_time(), time.perf_counter()
    out = fn()
    wall = time.perf_counter() - t0
    CPU_S[label] = time.process_time() - c0
    return out, wall


def all_pairs_routes(t: Topology) -> int:
    edges = 0
    p = t.num_gpus
    for a in range(p):
        for b in range(p):
            edges += len(t.route(a, b))
    return edges


def check_matrices(t: Topology, lat: np.ndarray, bw: np.ndarray, samples: int = 2000) -> None:
    rng = np.random.default_rng(0)
    for a, b in rng.integers(0, t.num_gpus, size=(samples, 2)):
        a, b = int(a), int(b)
        assert abs(lat[a, b] - t.path_latency(a, b)) <= 1e-6 * max(lat[a, b], 1e-9)
        assert abs(bw[a, b] - t.path_bandwidth(a, b)) <= 1e-6 * max(bw[a, b], 1.0)


def bench_1024() -> dict:
    t, build_s = timed(lambda: Topology.from_spec("dgx-h100:nodes=128"), "build_1024")
    edges, cold_s = timed(lambda: all_pairs_routes(t), "routes_cold_1024")
    _, warm_s = timed(lambda: all_pairs_routes(t), "routes_warm_1024")
    fresh = Topology.from_spec("dgx-h100:nodes=128")
    (lat, bw), matrix_s = timed(
        lambda: (fresh.latency_matrix(), fresh.bandwidth_matrix()), "matrices_1024"
    )
    check_matrices(t, lat, bw)
    routes = t.num_gpus**2
    return {
        "spec": "dgx-h100:nodes=128", "gpus": t.num_gpus,
        "nodes": t.graph.number_of_nodes(), "edges": t.graph.number_of_edges(),
        "build_s": build_s, "all_pairs_routes_cold_s": cold_s, "all_pairs_routes_warm_s": warm_s,
        "routes": routes, "route_edges": edges, "routes_per_s_cold": routes / cold_s,
        "matrices_s": matrix_s, "routes_cold_over_matrices": cold_s / matrix_s,
        "all_pairs_vs_target": cold_s / TARGET_ALL_PAIRS_S,
    }  # fmt: skip


def bench_16384() -> dict:
    t, build_s = timed(lambda: Topology.from_spec("dgx-h100:nodes=2048"), "build_16384")
    (lat, bw), matrix_s = timed(lambda: t.pair_matrices(dtype=np.float32), "matrices_16384")
    check_matrices(t, lat, bw, samples=500)
    _, host_pair_s = timed(lambda: t.host_pair_matrix("node0", "node2047"), "host_pair_16384")
    return {
        "spec": "dgx-h100:nodes=2048", "gpus": t.num_gpus,
        "nodes": t.graph.number_of_nodes(), "edges": t.graph.number_of_edges(),
        "build_s": build_s, "matrices_float32_s": matrix_s,
        "matrices_bytes": int(lat.nbytes + bw.nbytes), "host_pair_matrix_s": host_pair_s,
        "total_s": build_s + matrix_s,
    }  # fmt: skip


def markdown(result: dict) -> str:
    small, cpu = result["dgx_h100_128"], result["cpu_s"]
    lines = [
        "# Topology scale benchmark", "",
        f"Machine: {result['machine']['platform']}, {result['machine']['cpu_count']} CPUs, "
        f"Python {result['machine']['python']}, numpy {result['machine']['numpy']}, "
        f"networkx {result['machine']['networkx']}, load average "
        f"{result['machine']['load_average']}.", "",
        "| cluster | GPUs | step | wall s | CPU s | note |", "|---|---|---|---|---|---|",
        f"| dgx-h100:nodes=128 | 1024 | build + validate | {small['build_s']:.2f} | "
        f"{cpu['build_1024']:.2f} | {small['nodes']} nodes, {small['edges']} edges |",
        f"| | | all-pairs `route` (cold) | {small['all_pairs_routes_cold_s']:.2f} | "
        f"{cpu['routes_cold_1024']:.2f} | {small['routes_per_s_cold'] / 1e6:.2f} M routes/s; "
        f"{small['all_pairs_vs_target']:.2f} x the 2 s target |",
        f"| | | all-pairs `route` (warm) | {small['all_pairs_routes_warm_s']:.2f} | "
        f"{cpu['routes_warm_1024']:.2f} | |",
        f"| | | latency + bandwidth matrices | {small['matrices_s']:.2f} | "
        f"{cpu['matrices_1024']:.2f} | per-pair routing is "
        f"{small['routes_cold_over_matrices']:.1f} x slower |",
    ]
    big = result.get("dgx_h100_2048")
    if big:
        lines += [
            f"| dgx-h100:nodes=2048 | 16384 | build + validate | {big['build_s']:.2f} | "
            f"{cpu['build_16384']:.2f} | {big['nodes']} nodes, {big['edges']} edges |",
            f"| | | float32 matrices | {big['matrices_float32_s']:.2f} | "
            f"{cpu['matrices_16384']:.2f} | {big['matrices_bytes'] / 2**30:.1f} GiB |",
            f"| | | one host-pair block (8 x 8) | {big['host_pair_matrix_s']:.3f} | "
            f"{cpu['host_pair_16384']:.3f} | |",
        ]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="skip the 16384-GPU cluster")
    args = parser.parse_args()
    result = {"machine": machine_info(), "dgx_h100_128": bench_1024()}
    if not args.quick:
        result["dgx_h100_2048"] = bench_16384()
    result["cpu_s"] = dict(CPU_S)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "topo_scale.json").write_text(json.dumps(result, indent=1) + "\n")
    (RESULTS / "topo_scale.md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
