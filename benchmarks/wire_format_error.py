"""How far a bf16 partial wire format moves the merged attention output from fp32's.

With ``partial_dtype="bf16"`` every sender rounds the ``o`` it moves to bf16 (lse stays fp32)
and keeps the rounded copy (:mod:`treeattn.schedule.ir`). Each rounding changes an element by
at most ``u = 2^-8`` of itself (round to nearest, 8 significant bits), and a merge is a convex
combination of the partials it folds (weights ``exp(lse_i - lse)`` summing to one), so a merged
``o`` never exceeds the largest ``|o_i|`` of the partials under it. An output that went
through ``k`` roundings on its longest path from a shard therefore stays within

    |o_bf16 - o_fp32| <= k · 2^-8 · max_i |o_i|        (elementwise, up to fp32 arithmetic)

with ``k = 1`` for the one-shot gather and ``allgather``, 2 for Helix (its all-to-all, then
the gather of the merged head shards), ``log2 p`` for the butterfly and ``depth + 1`` for a
tree (its up pass, then the root's broadcast).

This benchmark runs each schedule on the numpy reference executor
(:func:`treeattn.schedule.reference.execute`, the IR's semantics; it rounds exactly as torch
does) in fp32 and in bf16 over random shards, and reports the error normwise
(``max |o_bf16 − o_fp32| / max |o_fp32|``) and against the bound (the largest ratio of an
element's error to its bound, which must stay at most 1). Shapes: 32 query heads of dim 128
(Llama 3.1 8B), batch 1, 64 tokens per rank, ``q`` scaled so the scores have a standard
deviation of 3 (a peaked softmax, as trained models have), three seeds.

Run: ``.venv/bin/python benchmarks/wire_format_error.py``. Writes
``benchmarks/results/wire_format_error.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from results_io import write_results  # noqa: E402  (benchmarks/, beside this script)

from treeattn.schedule.algorithms import build_schedule  # noqa: E402
from treeattn.schedule.payloads import shard_bounds  # noqa: E402
from treeattn.schedule.reference import execute, partial  # noqa: E402
from treeattn.schedule.workload import DecodeWorkload, ModelConfig  # noqa: E402
from treeattn.topo import Topology  # noqa: E402

HEADS, DIM, PER_RANK = 32, 128, 64
UNIT = 2.0 ** -8  # bf16's unit roundoff
SCORE_STD = 3.0
MODEL = ModelConfig("wire-bench", 1, HEADS, HEADS, DIM, HEADS * DIM, 1, 1, dtype="float32")


def roundings(algorithm: str, world: int) -> int:
    """``k``: the roundings on an output's longest path from a shard (module docstring)."""
    depth = math.ceil(math.log2(world))
    return {"oneshot": 1, "allgather": 1, "helix": 2, "butterfly": depth,
            "tree": depth + 1}[algorithm]


def one_case(algorithm: str, world: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    tokens = world * PER_RANK
    q = rng.normal(size=(HEADS, DIM)) * SCORE_STD  # (H, D): scores of std 3 after 1/sqrt(D)
    k = rng.normal(size=(tokens, HEADS, DIM))  # (T, H, D)
    v = rng.normal(size=(tokens, HEADS, DIM))  # (T, H, D)
    shards = [(k[a:b], v[a:b]) for a, b in shard_bounds(tokens, world)]
    topo = Topology.from_spec(f"local:ranks={world}")
    params = {"shape": "binomial"} if algorithm == "tree" else {}
    outs = {}
    for dtype in ("fp32", "bf16"):
        workload = DecodeWorkload(MODEL, tokens, partial_dtype=dtype)
        schedule = build_schedule(algorithm, topo, workload, **params)
        outs[dtype] = [o for o, _ in execute(schedule, q, shards)]  # (H, D) per rank
    largest = np.max(np.abs([partial(q, *shard)[0] for shard in shards]), axis=0)  # (H, D)
    bound = roundings(algorithm, world) * UNIT * largest
    errors = [np.abs(b - a) for a, b in zip(outs["fp32"], outs["bf16"], strict=True)]
    scale = max(float(np.abs(a).max()) for a in outs["fp32"])
    return {"algorithm": algorithm, "world": world, "seed": seed,
            "roundings": roundings(algorithm, world),
            "relative_error": max(float(e.max()) for e in errors) / scale,
            "bound_ratio": max(float((e / bound).max()) for e in errors),
            "ranks_identical": all(np.array_equal(o, outs["bf16"][0]) for o in outs["bf16"])}


def markdown(rows: list[dict]) -> str:
    lines = ["# Merge error of a bf16 partial wire format against fp32", "",
             "Numpy reference executor, 32 heads × 128, 64 tokens per rank, score std 3, "
             "three seeds (worst shown). `k`: roundings on the longest path; relative error "
             "= max |o_bf16 − o_fp32| / max |o_fp32|; bound ratio = the largest elementwise "
             "error over `k · 2^-8 · max_i |o_i|` (at most 1 by the bound); identical: every "
             "rank's bf16 output bit-identical to rank 0's.", "",
             "| algorithm | ranks | k | relative error | bound ratio | identical |",
             "|---|---:|---:|---:|---:|---|"]
    keys = sorted({(r["algorithm"], r["world"]) for r in rows}, key=lambda x: (x[0], x[1]))
    for algorithm, world in keys:
        group = [r for r in rows if (r["algorithm"], r["world"]) == (algorithm, world)]
        lines.append(f"| {algorithm} | {world} | {group[0]['roundings']} | "
                     f"{max(r['relative_error'] for r in group):.2e} | "
                     f"{max(r['bound_ratio'] for r in group):.2f} | "
                     f"{'yes' if all(r['ranks_identical'] for r in group) else 'no'} |")
    lines += ["", "`allgather` (point-to-point sends) merges its arrivals in each rank's own "
              "order, so its ranks agree only to floating-point rounding (in fp32 too); "
              "`oneshot`'s collective gather folds in group order, and it, the tree, the "
              "butterfly at powers of two and Helix give every rank the same bits.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[8, 32, 128])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--out", default="wire_format_error")
    args = parser.parse_args(argv)
    rows = [one_case(a, w, s) for a in ("oneshot", "allgather", "helix", "butterfly", "tree")
            for w in args.worlds for s in range(args.seeds)]
    write_results(args.out, {"meta": {"heads": HEADS, "head_dim": DIM,
                                      "tokens_per_rank": PER_RANK, "score_std": SCORE_STD,
                                      "unit_roundoff": UNIT}, "rows": rows}, markdown(rows))
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
