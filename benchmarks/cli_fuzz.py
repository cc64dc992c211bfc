"""A fuzz campaign over the command line: generated hostile arguments for ``plan``,
``predict``, ``predict --token``, ``predict --prefill``, ``plan --gpus``, ``comm`` and
``generate``, each run in-process through :func:`treeattn.cli.main`.

Each case starts from a valid command of one surface and changes it once: a flag's value
replaced by a hostile one (zero, negative, 400 digits, NaN, infinity, a Unicode digit, an
empty string, a path to a directory, a FIFO-like device or nothing), a flag of another mode
added, a required flag dropped, or a flag given twice. The contract, per case: exit 0 with
output (stdout, or a file written), or exit 2 with exactly one ``error:`` line on stderr.
Anything else is counted by class: ``traceback`` (an exception escaped ``main``), ``silent``
(exit 0, nothing printed or written), ``bad-error`` (exit 2 but not one ``error:`` line),
``crash`` (another exit status), ``clobber`` (an output replaced the symlink loop it was
pointed at) and, here only, ``hang`` (a case past :data:`HANG_S`).

``tests/test_cli_fuzz.py`` runs a small campaign of the same generator in the suite; this
script runs a larger one, on larger clusters (3-node ones among them), and writes
``results/cli_fuzz.{json,md}``: outcomes by surface.

    python benchmarks/cli_fuzz.py [--cases-per-surface 150] [--seed 44]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import random
import signal
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

HANG_S = 120.0  # a case past this is a hang (the slowest accepted planner run is ~a minute)
OUTCOMES = ("ok", "refused", "traceback", "silent", "bad-error", "crash", "hang", "clobber")
GOOD = ("ok", "refused")

# Valid starting points, one per surface. SMALL: the suite's (fast); LARGE: the benchmark's.
SMALL = {"topology": "pcie-4090:gpus=4", "model": "llama-3.2-1b", "gpus": "4"}
LARGE_TOPOLOGIES = ("dgx-h100:nodes=3", "gb200-nvl72:racks=3", "mi300x:nodes=3",
                    "pcie-4090:nodes=3", "dgx-h100", "local:ranks=3")


def bases(topology: str, model: str, gpus: str) -> dict[str, list[str]]:
    common = ["--topology", topology, "--model", model, "--seq-len", "8k"]
    return {
        "plan": ["plan", *common],
        "predict": ["predict", *common],
        "predict --token": ["predict", "--token", *common],
        "predict --prefill": ["predict", "--prefill", *common],
        "plan --gpus": ["plan", "--gpus", gpus, *common],
        "comm": ["comm", "--topology", topology, "--op", "all_reduce", "--max-bytes", "1M"],
        "generate": ["generate", "--model", "debug", "--prompt", "hi", "--nproc", "1",
                     "--max-new-tokens", "1"],
    }


HOSTILE = ["0", "-1", "-0", "1e300", "nan", "inf", "-inf", "9" * 400, "", " ", "1.5", "0x10",
           "\u0663", "\u00b2", "1_000", "2" * 20 + "k", str(2**63), "-" + "9" * 30, "1e-300",
           "x" * 3000, "\U0001f4a5", "--json", "-", "16k", "1M", "3", "65537", "none", "auto",
           "/dev/zero", "/nonexistent/file.json", "."]
TOPOLOGIES = ["dgx-h100:nodes=0", "dgx-h100:nodes=99999", "local:ranks=1", "nope",
              "dgx-h100:nodes=1.5", "pcie-4090:gpus=3", "local:ranks=0", "dgx-h100:nodes=",
              ":", "local:ranks=3"]
BIG_TOPOLOGIES = ["dgx-h100:nodes=3", "gb200-nvl72:racks=3", "mi300x:nodes=3",
                  "dgx-h100:nodes=256", "dgx-h100:nodes=4096"]  # the benchmark's only
SLOW = ("1M", "16k")  # accepted by a context or token count, and then minutes of real work
MODELS = ["debug", "deepseek-v3", "llama-3.1-405b", "gpt-5", "", "LLAMA-3.1-8B"]
# flags a mutation may add to a surface: another mode's, or a value for a switch
EXTRA = {
    "plan": ["--gpus", "--tp", "--dcp", "--layout", "--trace", "--output", "--emit", "--batch",
             "--weights-dtype", "--kv-dtype", "--transport", "--profile", "--json", "--wide"],
    "predict": ["--token", "--prefill", "--context-tokens", "--tp", "--dcp", "--layout",
                "--trace", "--batch", "--weights-dtype", "--kv-dtype", "--transport",
                "--profile", "--json", "--wide"],
    "comm": ["--min-bytes", "--max-bytes", "--profile", "--transport", "--json", "--wide",
             "--rccl-msccl"],
    "generate": ["--chat", "--verify", "--json", "--cuda-graph", "--temperature", "--top-k",
                 "--top-p", "--seed", "--timeout", "--context-tokens", "--prefill", "--dtype",
                 "--device", "--algorithm", "--plan", "--topology", "--profile",
                 "--max-new-tokens", "--prompt"],
}
SWITCHES = {"--token", "--prefill", "--json", "--wide", "--rccl-msccl", "--chat", "--verify",
            "--cuda-graph"}
VALID = {"--gpus": "4", "--tp": "2", "--dcp": "2", "--layout": "head_sharded",
         "--emit": "vllm", "--batch": "2", "--weights-dtype": "fp8", "--kv-dtype": "fp8",
         "--transport": "nccl", "--context-tokens": "1k", "--min-bytes": "1k",
         "--max-bytes": "4k", "--temperature": "0.5", "--top-k": "3", "--top-p": "0.9",
         "--seed": "1", "--timeout": "30", "--dtype": "bf16", "--device": "cpu",
         "--algorithm": "ring", "--max-new-tokens": "2", "--prompt": "hello"}
PATH_FLAGS = ("--trace", "--output", "--plan", "--profile")


def _command(surface: str) -> str:
    return surface.split()[0]


def _value_flags(argv: list[str]) -> list[int]:
    """Indices of the values that follow a flag in ``argv``."""
    return [i + 1 for i, a in enumerate(argv[:-1])
            if a.startswith("--") and not argv[i + 1].startswith("--")]


def _hostile_for(flag: str, rng: random.Random, scratch: Path, large: bool) -> str:
    if flag == "--topology":
        return rng.choice(TOPOLOGIES + HOSTILE[:8] + (BIG_TOPOLOGIES if large else []))
    if flag == "--model":
        return rng.choice(MODELS + ["/dev/null", str(scratch), "/nonexistent"])
    if flag in PATH_FLAGS:
        return rng.choice(["", str(scratch), "/dev/null", "/nonexistent/x.json",
                           str(scratch / "loop"), str(scratch / "out.json"), "-"])
    return rng.choice(HOSTILE if large else [v for v in HOSTILE if v not in SLOW])


def mutate(base: list[str], surface: str, rng: random.Random, scratch: Path,
           fixed: tuple[str, ...] = (), large: bool = False) -> list[str]:
    """One hostile change of a valid command line; the flags in ``fixed`` are kept, and
    ``large`` adds clusters of hundreds to tens of thousands of GPUs."""
    argv = list(base)
    kind = rng.choice(("value", "value", "add", "add", "drop", "twice"))
    values = [i for i in _value_flags(argv) if argv[i - 1] not in fixed]
    if kind == "value" and values:
        i = rng.choice(values)
        argv[i] = _hostile_for(argv[i - 1], rng, scratch, large)
    elif kind in ("add", "value"):
        flag = rng.choice(EXTRA[_command(surface)])
        if flag in SWITCHES:
            argv.append(flag)
        elif rng.random() < 0.5 and flag in VALID:
            argv += [flag, VALID[flag]]
        else:
            argv += [flag, _hostile_for(flag, rng, scratch, large)]
    elif kind == "drop" and values:
        i = rng.choice(values)
        del argv[i - 1:i + 1]
    else:
        i = rng.choice(values) if values else 2
        argv += [argv[i - 1], _hostile_for(argv[i - 1], rng, scratch, large)]
    if _command(surface) == "generate" and "--verify" in argv and "--cuda-graph" in argv:
        argv.remove("--verify")  # keep generate to the cheap local path
    return argv


def cases(per_surface: int, seed: int, scratch: Path, large: bool = False):
    """``(surface, argv)`` pairs: ``per_surface`` mutated command lines per surface. The
    small campaign keeps generate's --model debug and --nproc 1, so that an accepted case
    decodes a tiny model in this process rather than fetching one or spawning ranks."""
    rng = random.Random(seed)
    out = []
    for surface in bases(**SMALL):
        for _ in range(per_surface):
            if large:
                topology = rng.choice(LARGE_TOPOLOGIES)
                gpus = rng.choice(("4", "8", "16", "24", "216"))
                base = bases(topology, rng.choice(("llama-3.1-8b", "llama-3.1-70b")), gpus)
            else:
                base = bases(**SMALL)
            fixed = () if large or surface != "generate" else ("--model", "--nproc")
            out.append((surface, mutate(base[surface], surface, rng, scratch, fixed, large)))
    return out


def prepare(scratch: Path) -> None:
    """The paths the hostile values name: a symlink loop, and nothing at out.json."""
    loop = scratch / "loop"
    if not loop.is_symlink():
        if loop.exists():
            loop.unlink()
        loop.symlink_to(loop)
    (scratch / "out.json").unlink(missing_ok=True)


class _Hang(Exception):
    pass


def _alarm(signum, frame):
    raise _Hang()


def run_case(argv: list[str], scratch: Path, hang_s: float | None = None) -> dict:
    """Run one command line in-process; its outcome class (see the module docstring)."""
    from treeattn.cli import main

    prepare(scratch)
    before = {p.name for p in scratch.iterdir()}
    out, err = io.StringIO(), io.StringIO()
    t0 = time.perf_counter()
    code, escaped = None, None
    if hang_s:
        signal.signal(signal.SIGALRM, _alarm)
        signal.setitimer(signal.ITIMER_REAL, hang_s)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 2
    except _Hang:
        escaped = "hang"
    except Exception as exc:  # noqa: BLE001 - the class is what is counted
        escaped = type(exc).__name__
    finally:
        if hang_s:
            signal.setitimer(signal.ITIMER_REAL, 0)
    seconds = time.perf_counter() - t0
    written = {p.name for p in scratch.iterdir()} - before
    lines = err.getvalue().strip().splitlines()
    if not (scratch / "loop").is_symlink():
        outcome = "clobber"  # an output replaced the symlink loop it was pointed at
    elif escaped == "hang":
        outcome = "hang"
    elif escaped is not None or "Traceback (most recent call last)" in err.getvalue():
        outcome = "traceback"
    elif code == 0:
        # generate streams its text to stdout and its figures to stderr
        outcome = "ok" if out.getvalue().strip() or lines or written else "silent"
    elif code == 2:
        outcome = "refused" if len(lines) == 1 and lines[0].startswith("error: ") \
            else "bad-error"
    else:
        outcome = "crash"
    return {"argv": argv, "outcome": outcome, "code": code, "exception": escaped,
            "stderr": lines[-3:], "seconds": round(seconds, 3)}


def campaign(per_surface: int, seed: int, large: bool = False,
             hang_s: float | None = None) -> list[dict]:
    """Every case of one campaign, run, with its surface."""
    with tempfile.TemporaryDirectory(prefix="treeattn-cli-fuzz-") as folder:
        scratch = Path(folder)
        results = []
        with contextlib.chdir(scratch):  # a relative output path lands in the scratch folder
            for surface, argv in cases(per_surface, seed, scratch, large):
                results.append({"surface": surface, **run_case(argv, scratch, hang_s)})
        return results


def summary(results: list[dict]) -> dict[str, dict[str, int]]:
    """surface -> outcome -> count (every outcome listed, zeros included)."""
    table: dict[str, Counter] = {}
    for r in results:
        table.setdefault(r["surface"], Counter())[r["outcome"]] += 1
    return {s: {o: c.get(o, 0) for o in OUTCOMES} for s, c in table.items()}


def markdown(counts: dict[str, dict[str, int]], seed: int, seconds: float) -> str:
    head = "| surface | cases | " + " | ".join(OUTCOMES) + " |"
    rule = "|---|---:|" + "---:|" * len(OUTCOMES)
    rows = [f"| {s} | {sum(c.values())} | " + " | ".join(str(c[o]) for o in OUTCOMES) + " |"
            for s, c in counts.items()]
    total = {o: sum(c[o] for c in counts.values()) for o in OUTCOMES}
    rows.append(f"| **all** | {sum(total.values())} | "
                + " | ".join(str(total[o]) for o in OUTCOMES) + " |")
    return "\n".join([
        "# CLI fuzz campaign", "",
        f"Generated hostile command lines (seed {seed}), run in-process through "
        f"`treeattn.cli.main` in {seconds:.0f} s. A case is good when it ends in exit 0 with "
        "output (`ok`) or exit 2 with one `error:` line (`refused`); every other column "
        f"must be 0. A hang is a case past {HANG_S:.0f} s.", "",
        head, rule, *rows, ""])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases-per-surface", type=int, default=150)
    parser.add_argument("--seed", type=int, default=44)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from results_io import write_results

    t0 = time.perf_counter()
    results = campaign(args.cases_per_surface, args.seed, large=True, hang_s=HANG_S)
    seconds = time.perf_counter() - t0
    counts = summary(results)
    bad = [r for r in results if r["outcome"] not in GOOD]
    payload = {"seed": args.seed, "cases": len(results), "seconds": round(seconds, 1),
               "outcomes_by_surface": counts, "bad_cases": bad,
               "slowest": sorted(results, key=lambda r: -r["seconds"])[:5]}
    folder = write_results("cli_fuzz", payload, markdown(counts, args.seed, seconds))
    print(markdown(counts, args.seed, seconds))
    print(f"wrote {folder}/cli_fuzz.json and .md")
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())
