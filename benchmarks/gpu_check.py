"""The GPU check: every CUDA path of treeattn, run once on a GPU machine, with a summary.

Stages, each a child process under its own time limit, so one failure never hides the rest:

1. ``tests``: the CUDA tests (compiled Triton kernels against the torch reference and the
   naive oracle; the CUDA-graph decode step) under pytest;
2. ``kernels``: ``benchmarks/kernels.py`` on the GPU (K+V GB/s against the HBM peak);
3. ``generate``: SmolLM2 decoded with ``treeattn generate --device cuda --dtype bf16 --nproc 1
   --verify``, and again on the CPU in fp32; the first greedy tokens are compared;
4. ``decode_step``: host time against GPU time of one decode step, and the CUDA graph of it;
5. ``runtime``: ``treeattn run --nproc 1 --device cuda``, the executor on NCCL.

Writes ``benchmarks/results/gpu-check-<tag>.json`` and ``.md``. ``benchmarks/gpu_check.sh``
prepares the machine and calls this.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from treeattn import atomic  # noqa: E402  (run from a checkout, not an install)

RESULTS = ROOT / "benchmarks" / "results"
PROMPT = "Tell me about the history of Paris in three sentences."
AGREE_TOKENS = 8


def run_stage(name: str, cmd: list[str], timeout_s: float) -> dict:
    """Run ``cmd`` from the repository root; its output goes to our stdout as it comes."""
    print(f"\n=== {name}: {' '.join(cmd)} (limit {timeout_s:.0f} s)", flush=True)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
        rc, out, err = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as exc:
        rc = "timeout"
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        err = exc.stderr.decode() if isinstance(exc.stderr, bytes) else (exc.stderr or "")
    seconds = time.perf_counter() - t0
    sys.stdout.write(out[-8000:])
    sys.stdout.write(err[-4000:])
    print(f"=== {name}: rc={rc} in {seconds:.1f} s", flush=True)
    return {"stage": name, "rc": rc, "seconds": seconds, "stdout": out, "stderr": err[-4000:]}


def _json_of(stage: dict) -> dict | None:
    try:
        return json.loads(stage["stdout"])
    except (json.JSONDecodeError, TypeError):
        return None


def generate_stage(model: str, summary: dict) -> dict:
    common = [sys.executable, "-m", "treeattn", "generate", "--model", model, "--nproc", "1",
              "--prompt", PROMPT, "--chat", "--max-new-tokens", "32", "--json"]  # fmt: skip
    gpu = run_stage("generate-cuda-bf16", common + ["--device", "cuda", "--dtype", "bf16",
                                                    "--verify"], 150)
    cpu = run_stage("generate-cpu-fp32", common + ["--device", "cpu", "--dtype", "fp32"], 150)
    summary["stages"] += [gpu, cpu]
    g, c = _json_of(gpu), _json_of(cpu)
    out = {"cuda_bf16": g, "cpu_fp32": c}
    if g and c:
        pairs = zip(g["tokens"], c["tokens"])
        first = next((i for i, (a, b) in enumerate(pairs) if a != b), None)
        if first is None and len(g["tokens"]) != len(c["tokens"]):
            first = min(len(g["tokens"]), len(c["tokens"]))  # one stopped (EOS) earlier
        out.update(first_difference=first,
                   agree_first_8=first is None or first >= AGREE_TOKENS,
                   cuda_tokens_per_s=g.get("tokens_per_s"), cpu_tokens_per_s=c.get("tokens_per_s"))
    return out


def markdown(summary: dict) -> str:
    lines = ["# GPU check", "", f"{summary['gpu']}; {summary['versions']}", "",
             "| stage | exit | seconds |", "|---|---|---:|"]  # fmt: skip
    lines += [f"| {s['stage']} | {s['rc']} | {s['seconds']:.1f} |" for s in summary["stages"]]
    gen = summary.get("generate") or {}
    if gen.get("cuda_bf16") and gen.get("cpu_fp32"):
        g, c = gen["cuda_bf16"], gen["cpu_fp32"]
        lines += ["", "## SmolLM2 decoding, greedy", "",
                  f"- CUDA bf16: {g['tokens_per_s']:.1f} tokens/s, identical to its own "
                  f"single-process check: {g.get('identical_to_single_process')}",
                  f"- CPU fp32: {c['tokens_per_s']:.1f} tokens/s",
                  f"- first {AGREE_TOKENS} tokens agree: {gen['agree_first_8']} (first difference "
                  f"at token {gen['first_difference']})",
                  f"- CUDA text: {g['text']!r}", f"- CPU text: {c['text']!r}"]  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="the SmolLM2 GGUF, or 'debug'")
    parser.add_argument("--tag", default="h200")
    parser.add_argument("--skip", nargs="*", default=[], help="stages to leave out")
    args = parser.parse_args(argv)
    import torch
    import triton

    py = sys.executable
    summary = {"gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU",
               "versions": f"torch {torch.__version__}, triton {triton.__version__}, "
                           f"python {sys.version.split()[0]}", "stages": []}  # fmt: skip
    stages = {
        "tests": lambda: run_stage("tests", [
            py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--timeout", "180", "-rfEs",
            "tests/test_kernels_cuda.py", "tests/test_llm_static_decode.py"], 200),
        "kernels": lambda: run_stage("kernels", [
            py, "benchmarks/kernels.py", "--no-cpu", "--tag", args.tag], 200),
        "generate": None,
        "decode_step": lambda: run_stage("decode_step", [
            py, "benchmarks/decode_step.py", "--model", args.model, "--tag", args.tag], 150),
        "runtime": lambda: run_stage("runtime", [
            py, "-m", "treeattn", "run", "--nproc", "1", "--device", "cuda", "--dtype",
            "bfloat16", "--heads", "32", "--kv-heads", "8", "--head-dim", "128", "--seq-len",
            "1M", "--algorithm", "tree", "--steps", "20", "--json"], 90),
    }  # fmt: skip
    for name, stage in stages.items():
        if name in args.skip:
            continue
        if name == "generate":
            summary["generate"] = generate_stage(args.model, summary)
        else:
            summary["stages"].append(stage())
        write_summary(summary, args.tag)  # after every stage: a later hang loses nothing
    print(markdown(summary))
    return 0


def write_summary(summary: dict, tag: str) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    for stage in summary["stages"]:
        stage["stdout"] = stage["stdout"][-6000:]
    atomic.write_text(RESULTS / f"gpu-check-{tag}.json", json.dumps(summary, indent=2) + "\n")
    atomic.write_text(RESULTS / f"gpu-check-{tag}.md", markdown(summary))


if __name__ == "__main__":
    sys.exit(main())
