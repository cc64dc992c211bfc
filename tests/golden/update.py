"""Golden predictions for the standard configurations, diffed by ``tests/test_sim_golden.py``.

A change to any cost model, generator or planner rule that moves a prediction shows up as a
diff of ``tests/golden/predictions.json`` in review. After checking that the change is
intended, regenerate the file with::

    .venv/bin/python tests/golden/update.py --update
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from treeattn.sim import ALGORITHM_NAMES, DecodeWorkload, plan_workload

GOLDEN = Path(__file__).resolve().parent / "predictions.json"
CONFIGS = (
    ("dgx-h100:nodes=1", "llama-3.1-8b"),
    ("dgx-h100:nodes=2", "llama-3.1-70b"),
    ("mi300x", "llama-3.1-8b"),
    ("pcie-4090:gpus=8", "llama-3.2-1b"),
    ("pcie-4090:gpus=4,nodes=2", "smollm2-135m"),
    ("local:ranks=4,latency=1e-05,bandwidth=2000000000.0", "debug"),
)
SEQ_LENS = (32768, 131072)


def predictions() -> list[dict]:
    """The rows of the golden file, computed now."""
    from treeattn.topo import Topology

    rows = []
    for spec, model in CONFIGS:
        topo = Topology.from_spec(spec)
        for seq_len in SEQ_LENS:
            chosen = plan_workload(topo, DecodeWorkload(model, seq_len), simulate_each=True)
            for algorithm in ALGORITHM_NAMES:
                cand = chosen.best(algorithm)
                if cand is None:  # cannot run this layout: the reason is the row
                    rows.append({"topology": spec, "model": model, "seq_len": seq_len,
                                 "algorithm": algorithm,
                                 "refused": chosen.refused.get(algorithm, "not a candidate")})
                    continue
                rows.append({"topology": spec, "model": model, "seq_len": seq_len,
                             "algorithm": algorithm, "plan": cand.name,
                             "latency_s": float(cand.latency_s), "method": cand.method})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--update", action="store_true", help=f"rewrite {GOLDEN}")
    args = parser.parse_args(argv)
    rows = predictions()
    if args.update:
        GOLDEN.parent.mkdir(parents=True, exist_ok=True)
        GOLDEN.write_text(json.dumps(rows, indent=1) + "\n")
        print(f"wrote {len(rows)} predictions to {GOLDEN}")
    else:
        json.dump(rows, sys.stdout, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
