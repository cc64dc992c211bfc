"""Host time against GPU time of one decode step, and what a CUDA graph of the step saves.

A decode step of a small model at batch 1 is a few hundred small kernels. Whether the host
(Python issuing them) or the GPU (running them) sets the pace decides whether a GPU step can
get faster at all. For each context length this measures, in one process:

- ``eager_ms``: a step of the eager path ``generate`` uses (LocalCache), synced, median;
- ``static_ms``: the same step over the fixed-size cache (:mod:`treeattn.llm.static_decode`),
  eager, synced, median: what the graph captures;
- ``host_issue_ms``: wall time for Python to issue that step without waiting for the GPU; the
  GPU runs behind the host, so this is the host's share. ``host_cpu_ms`` is the same as thread
  CPU time;
- ``gpu_ms``: one replay of the captured graph, timed with CUDA events over many replays: the
  GPU's time for the step with no host in the way;
- ``graph_ms``: a graphed step as generation sees it (fill the inputs, replay, sync), median.

The tokens of eager, static and graphed greedy decoding are compared, and the graphed logits
must equal the static ones bit for bit. Contexts past the prompt are filled with zeros: the
timing depends on how many K/V bytes a step reads, not on their values.

    python benchmarks/decode_step.py --model PATH.gguf --tag h200
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from treeattn.llm.formats.weights import load_model  # noqa: E402
from treeattn.llm.generate import generate_local  # noqa: E402
from treeattn.llm.options import dtype_of, place_model  # noqa: E402
from treeattn.llm.static_decode import StaticDecoder, generate_static  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
PROMPT = [(37 * i + 11) % 1000 + 1 for i in range(100)]
CONTEXTS = [128, 4096, 32768]
STEPS = 50


def _median_ms(samples: list[float]) -> float:
    return 1e3 * statistics.median(samples)


def time_point(model, context: int, steps: int) -> dict:
    """Per-step figures with ``context`` tokens already in the cache."""
    sync = torch.cuda.synchronize
    decoder = StaticDecoder(model, context + steps + 1)
    issue, cpu, static = [], [], []
    for i in range(steps):
        sync()
        t0, c0 = time.perf_counter(), time.thread_time()
        decoder.step(17, context + i)
        issue.append(time.perf_counter() - t0)
        cpu.append(time.thread_time() - c0)
        sync()
        static.append(time.perf_counter() - t0)
    graphed = StaticDecoder(model, context + steps + 1, graph=True)
    graphed.step(17, context)  # capture
    wall = []
    for i in range(steps):
        t0 = time.perf_counter()
        graphed.step(17, context + i)
        sync()
        wall.append(time.perf_counter() - t0)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        graphed.graph.replay()
    end.record()
    sync()
    return {"context": context, "static_ms": _median_ms(static),
            "host_issue_ms": _median_ms(issue), "host_cpu_ms": _median_ms(cpu),
            "gpu_ms": start.elapsed_time(end) / steps, "graph_ms": _median_ms(wall)}  # fmt: skip


def eager_step_ms(model, new_tokens: int) -> float:
    """Median synced step of the LocalCache path (``generate --nproc 1``), from its timings."""
    gen = generate_local(model, PROMPT, new_tokens)
    torch.cuda.synchronize()
    return 1e3 * gen.decode_s / max(1, gen.steps)


def agreement(model, new_tokens: int) -> dict:
    eager = generate_local(model, PROMPT, new_tokens)
    static = generate_static(model, PROMPT, new_tokens)
    graphed = generate_static(model, PROMPT, new_tokens, graph=True)
    bitwise = all(torch.equal(a, b) for a, b in zip(graphed.logits, static.logits, strict=True))
    worst = max((a.cpu() - b.cpu()).abs().max().item()
                for a, b in zip(static.logits, eager.logits, strict=True))  # fmt: skip
    return {"tokens": len(eager.tokens),
            "graph_equals_eager_tokens": graphed.tokens == eager.tokens,
            "static_equals_eager_tokens": static.tokens == eager.tokens,
            "graph_logits_bitwise_static": bitwise, "max_abs_logit_diff_static_vs_eager": worst,
            "graph_tokens_per_s": graphed.tokens_per_s}  # fmt: skip


def markdown(result: dict) -> str:
    lines = ["# One decode step: host against GPU, and a CUDA graph of the step", "",
             f"Model {result['model']} in {result['dtype']} on {result['gpu']}, batch 1. "
             "Medians over the steps; `gpu ms` is a graph replay timed with CUDA events.", "",
             "| context | eager step ms | static step ms | host issue ms | host CPU ms | "
             "GPU ms | graphed step ms | host / GPU | speedup of the graph |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for p in result["points"]:
        lines.append(f"| {p['context']} | {p.get('eager_ms', float('nan')):.3f} | "
                     f"{p['static_ms']:.3f} | {p['host_issue_ms']:.3f} | {p['host_cpu_ms']:.3f} | "
                     f"{p['gpu_ms']:.3f} | {p['graph_ms']:.3f} | "
                     f"{p['host_issue_ms'] / p['gpu_ms']:.1f}x | "
                     f"{p['static_ms'] / p['graph_ms']:.2f}x |")
    a = result["agreement"]
    lines += ["", f"Greedy, {a['tokens']} tokens: graphed = eager tokens: "
              f"{a['graph_equals_eager_tokens']}; static = eager: {a['static_equals_eager_tokens']}"
              f"; graphed logits bit-identical to static: {a['graph_logits_bitwise_static']}; "
              f"worst |Δlogit| static vs eager {a['max_abs_logit_diff_static_vs_eager']:.2e}; "
              f"graphed {a['graph_tokens_per_s']:.0f} tokens/s."]  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model spec (default: SmolLM2)")
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--contexts", type=int, nargs="+", default=CONTEXTS)
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--tag", default="gpu")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: decode_step.py needs a CUDA GPU", file=sys.stderr)
        return 2
    loaded = load_model(args.model)
    model = place_model(loaded.model, torch.device("cuda"), dtype_of(args.dtype))
    result = {"model": args.model or "smollm2-135m-instruct", "dtype": args.dtype,
              "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "agreement": agreement(model, 32), "points": []}  # fmt: skip
    eager = eager_step_ms(model, args.steps)
    for context in args.contexts:
        point = time_point(model, context, args.steps)
        if context == args.contexts[0]:
            point["eager_ms"] = eager  # LocalCache grows from the prompt: one short context
        result["points"].append(point)
        print(json.dumps(point), flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"decode-step-{args.tag}.json").write_text(json.dumps(result, indent=2) + "\n")
    (RESULTS / f"decode-step-{args.tag}.md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
