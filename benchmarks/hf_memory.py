"""Per-rank cache memory of a Gemma 3 through ``treeattn.hf`` at a long context, per layer kind.

Gemma 3 interleaves five sliding-window layers with one full-attention layer. Through
:class:`treeattn.hf.ShardedCache`, the full layers are sharded along the sequence (each rank
holds about ``1/world`` of the context) and the window layers keep their last
``sliding_window - 1`` tokens whole on every rank, bounded whatever the context. This runs
:func:`treeattn.hf.sharded_prefill` of a long prompt on ``world`` local CPU ranks (gloo, one
thread each) with a small random Gemma 3 text model in Gemma 3's layer pattern, then one
decode step, and reads each rank's bytes per kind (``ShardedCache.memory_bytes``). Beside
them: transformers' own ``DynamicCache`` of the same model in one process (full layers whole,
window layers bounded the same way), measured by running the model.

Run: ``.venv/bin/python benchmarks/hf_memory.py [--context 4096] [--worlds 2 4]``.
Writes ``benchmarks/results/hf_memory.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from results_io import write_results  # noqa: E402
from treeattn.runtime.measure.calibrate import machine_info  # noqa: E402

from treeattn.runtime.launch import LaunchOptions, launch  # noqa: E402

MIB = 2**20
WINDOW = 128
LAYERS = 6  # Gemma 3's pattern: five sliding-window layers, then a full one


def gemma3_config():
    import transformers

    types = ["sliding_attention"] * 5 + ["full_attention"]
    return transformers.Gemma3TextConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=WINDOW,
        layer_types=types, max_position_embeddings=1 << 20)


def _model():
    import torch
    import transformers

    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(
        gemma3_config(), attn_implementation="treeattn").eval()


def _ids(context: int):
    import torch

    # no id 0, the pad token: generate would mask it
    return torch.randint(1, 256, (1, context), generator=torch.Generator().manual_seed(1))


def _rank(ctx, context: int) -> dict:
    import torch

    import treeattn.hf

    model = _model()
    ids = _ids(context)
    cache = treeattn.hf.ShardedCache(model.config, "tree", reserve=1)
    treeattn.hf.sharded_prefill(model, ids, cache)
    with torch.no_grad():
        model.generate(ids, cache=cache, max_new_tokens=1, do_sample=False)
    return {"rank": ctx.rank, "bytes": cache.memory_bytes(),
            "full_tokens": [n for n, k in zip(cache.local_lengths, cache.kinds) if k == "full"],
            "window_tokens": [n for n, k in zip(cache.local_lengths, cache.kinds)
                              if k == "window"]}


def _gather(ctx, context: int) -> list[dict]:
    from treeattn.runtime.group import all_gather_objects

    return all_gather_objects(ctx, _rank(ctx, context))


def one_process(context: int) -> dict:
    """transformers' own DynamicCache of the same model after the same prompt and step."""
    import torch
    import transformers

    import treeattn.hf  # noqa: F401 - registers "treeattn" for the model's config

    model = _model()
    model.set_attn_implementation("sdpa")
    cache = transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        model.generate(_ids(context), cache=cache, max_new_tokens=1,
                       do_sample=False)
    out = {"full": 0, "window": 0}
    for layer, kind in zip(cache.layers, ("window",) * 5 + ("full",)):
        out[kind] += sum(t.numel() * t.element_size() for t in (layer.keys, layer.values))
    return out


def markdown(points: list[dict], whole: dict, context: int, info: dict) -> str:
    lines = [
        "# Gemma 3 through treeattn.hf: cache bytes per rank, per layer kind",
        "",
        f"A random Gemma 3 text model in Gemma 3's layer pattern ({LAYERS} layers: five "
        f"sliding-window layers of {WINDOW} tokens, one full-attention layer; 2 KV heads of "
        f"16, fp32), sharded prefill of {context} tokens and one decode step, on CPU ranks "
        f"(gloo). Machine: {info.get('cpu', 'unknown')}.",
        "",
        "| world | rank | full layers (MiB) | full tokens held | window layers (MiB) | "
        "window tokens held |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for point in points:
        for r in point["ranks"]:
            lines.append(f"| {point['world']} | {r['rank']} | {r['bytes']['full'] / MIB:.3f} "
                         f"| {r['full_tokens'][0]} | {r['bytes']['window'] / MIB:.3f} | "
                         f"{r['window_tokens'][0]} |")
    lines += ["", f"transformers' own DynamicCache in one process: full layers "
              f"{whole['full'] / MIB:.3f} MiB, window layers {whole['window'] / MIB:.3f} MiB.",
              "", "The full layers' bytes fall as 1/world; the window layers' stay at "
              f"{WINDOW - 1} tokens per layer on every rank, as in one process.", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    args = parser.parse_args()
    points = []
    for world in args.worlds:
        ranks = launch(functools.partial(_gather, context=args.context), world,
                       LaunchOptions(timeout_s=600, threads=1))
        points.append({"world": world, "context": args.context, "ranks": ranks})
    whole = one_process(args.context)
    info = machine_info()
    out = write_results("hf_memory", {"points": points, "one_process": whole,
                                      "window": WINDOW, "layers": LAYERS, "machine": info},
                        markdown(points, whole, args.context, info))
    print(f"wrote {out / 'hf_memory.md'}")


if __name__ == "__main__":
    main()
