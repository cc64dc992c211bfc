"""Two runs on one host at once, and ranks given different plans: reliability, measured.

1. **Concurrent runs.** ``--tries`` times, two ``treeattn run --nproc 2 --json`` started at
   the same moment by the same user, then two ``treeattn generate --nproc 2 --verify
   --json`` (the debug model). A try succeeds when both exit 0 with the right answer: every
   row's partials within 1e-4 of the exact reference, or the generation identical to one
   process. Collisions this would show: the store's port, the shared-memory segment, the
   launch folder, the compiled-kernel cache.
2. **Ranks that disagree.** Two ranks joined as torchrun joins them (``RANK``,
   ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), each running ``treeattn run --plan``
   on its own plan file (the same topology, different sequence lengths). Both must exit 1
   with one ``error:`` line naming the ranks that disagree, within ``--timeout`` + 2 s.

Run: ``.venv/bin/python benchmarks/concurrent_runs.py [--tries 20]``. Writes
``benchmarks/results/concurrent_runs.{json,md}``. The suite runs one try of each
(``tests/test_runtime_concurrent.py``, ``tests/test_runtime_agreement.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results_io import write_results  # noqa: E402

CLI = [sys.executable, "-m", "treeattn.cli"]
RUN = [*CLI, "run", "--nproc", "2", "--seq-len", "2048", "--heads", "4", "--kv-heads", "2",
       "--head-dim", "16", "--steps", "3", "--warmup", "1", "--timeout", "60", "--json"]
GENERATE = [*CLI, "generate", "--nproc", "2", "--model", "debug", "--prompt", "hello world",
            "--max-new-tokens", "4", "--verify", "--timeout", "60", "--json"]


def _run_ok(out: str) -> bool:
    rows = json.loads(out)["rows"]
    return bool(rows) and all(r["max_abs_diff"] is not None and r["max_abs_diff"] < 1e-4
                              for r in rows)


def _generate_ok(out: str) -> bool:
    record = json.loads(out)
    return record["identical_to_single_process"] is True and len(record["tokens"]) == 4


def concurrent_tries(argv: list[str], ok, tries: int, label: str) -> dict:
    """``tries`` times, two copies of ``argv`` at once; how many tries had both right."""
    good, failures, walls = 0, [], []
    for i in range(tries):
        begin = time.monotonic()
        procs = [subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True) for _ in range(2)]
        outputs = [p.communicate(timeout=300) for p in procs]
        walls.append(time.monotonic() - begin)
        both = True
        for p, (out, err) in zip(procs, outputs, strict=True):
            try:
                right = p.returncode == 0 and ok(out)
            except (ValueError, KeyError):
                right = False
            if not right:
                both = False
                failures.append({"try": i, "code": p.returncode, "stderr": err[-500:]})
        good += both
        print(f"{label}: try {i + 1}/{tries}: {'ok' if both else 'FAILED'} "
              f"({walls[-1]:.1f} s)", file=sys.stderr, flush=True)
    return {"command": " ".join(argv[2:]), "tries": tries, "both_right": good,
            "wall_s_max": max(walls), "failures": failures}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def disagreeing_ranks(tries: int, timeout_s: float) -> dict:
    """Two torchrun-style ranks on different plan files: time until both have exited."""
    with tempfile.TemporaryDirectory() as folder:
        plans = []
        for seq_len in (96, 128):
            path = Path(folder) / f"plan-{seq_len}.json"
            subprocess.run([*CLI, "plan", "--topology", "local:ranks=2", "--model", "debug",
                            "--seq-len", str(seq_len), "-o", str(path)], check=True,
                           capture_output=True, timeout=120)
            plans.append(path)
        elapsed, messages, named = [], [], 0
        for _ in range(tries):
            port = _free_port()
            begin = time.monotonic()
            procs = []
            for rank in (0, 1):
                env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                           LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
                procs.append(subprocess.Popen(
                    [*CLI, "run", "--plan", str(plans[rank]), "--timeout", str(timeout_s),
                     "--steps", "2", "--warmup", "0"],
                    env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
            outputs = [p.communicate(timeout=timeout_s + 60) for p in procs]
            elapsed.append(time.monotonic() - begin)
            lines = [err.strip().splitlines()[-1] if err.strip() else "" for _, err in outputs]
            messages.append(lines)
            named += all(p.returncode == 1 and line.startswith("error:") and "disagree" in line
                         for p, line in zip(procs, lines, strict=True))
    return {"tries": tries, "timeout_s": timeout_s, "named": named,
            "elapsed_s_max": max(elapsed), "elapsed_s": elapsed, "messages": messages[0]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tries", type=int, default=20)
    parser.add_argument("--timeout", type=float, default=10.0)
    args = parser.parse_args()
    runs = concurrent_tries(RUN, _run_ok, args.tries, "run")
    generates = concurrent_tries(GENERATE, _generate_ok, args.tries, "generate")
    disagree = disagreeing_ranks(min(args.tries, 5), args.timeout)
    payload = {"machine": f"{platform.machine()}, {os.cpu_count()} cores",
               "date": time.strftime("%Y-%m-%d"), "runs": runs, "generates": generates,
               "disagreeing_ranks": disagree}
    md = ["# Two runs at once, and ranks that disagree", "",
          f"Machine: {payload['machine']}; {payload['date']}.", "",
          "| what | tries | right | slowest |", "|---|---:|---:|---:|",
          f"| two `run --nproc 2` at once | {runs['tries']} | {runs['both_right']} | "
          f"{runs['wall_s_max']:.1f} s |",
          f"| two `generate --nproc 2 --verify` at once | {generates['tries']} | "
          f"{generates['both_right']} | {generates['wall_s_max']:.1f} s |",
          f"| two ranks on different plan files (torchrun env), `--timeout "
          f"{args.timeout:g}` | {disagree['tries']} | {disagree['named']} named | "
          f"{disagree['elapsed_s_max']:.1f} s |", "",
          "Rank 0's and rank 1's last lines, first try:", ""]
    md += [f"- `{line}`" for line in disagree["messages"]]
    write_results("concurrent_runs", payload, "\n".join(md) + "\n")
    print("\n".join(md))
    ok = (runs["both_right"] == runs["tries"] and generates["both_right"] == generates["tries"]
          and disagree["named"] == disagree["tries"]
          and disagree["elapsed_s_max"] <= args.timeout + 2)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
