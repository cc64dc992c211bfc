"""Attention time per token through Hugging Face transformers: treeattn.hf on 2 ranks against
transformers' own SDPA in one process, at a long context, with the same tokens.

Model: SmolLM2-135M's shape (30 layers, 9 query / 3 KV heads of 64; random seeded weights,
fp32), so no download is needed and only attention and shapes matter. The cache is filled
with the same seeded random K/V of ``--context`` tokens in both runs (a 32k prefill through
SDPA on CPU would take far longer than the decode being measured), then ``generate`` decodes
``--tokens`` greedy tokens:

- **transformers, one process**: a ``DynamicCache`` and SDPA, registered under another name
  only to time each call (the function is transformers' ``sdpa_attention_forward``);
- **treeattn.hf, N ranks** (local launcher, gloo): ``attn_implementation="treeattn"`` and a
  ``ShardedCache`` (contiguous layout); time from ``ShardedAttention.elapsed_s`` on rank 0;
- **treeattn generate, N ranks**: treeattn's own engine (``treeattn generate --json``) on
  SmolLM2-135M itself (the default GGUF: the same shape) with ``--context-tokens`` of
  document, the same algorithm: what the HF path's overhead is measured against (its own
  attention and decode time per token). Skipped when the GGUF is not downloaded.

Both with one torch thread per process; the ranks make their executor (a collective set-up)
before the timed decode. Attention time per token is the sum over layers of
one decode step's attention calls, averaged over the decode steps (the first token, which
comes from the step that fills nothing, is a decode step too here). The host is shared with
other jobs, so each side's median over ``--reps`` repetitions is reported.
Run: ``.venv/bin/python benchmarks/hf_attention.py [--context 32768 --tokens 8 --reps 3]``.
Writes ``benchmarks/results/hf_attention.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results_io import write_results  # noqa: E402

SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
             num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=65536,
             tie_word_embeddings=True)


NOTE = ("Both sides decode the same tokens from the same cache. The one-process side is "
        "transformers' SDPA as transformers calls it for a grouped-query decode step (it packs "
        "or repeats the KV heads), and treeattn's side is its own CPU kernel over each half, "
        "so the ratio is not the 2 ranks alone. The host was shared with other jobs.\n")


def build_model(attn: str):
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(**SHAPE)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn).eval()


def layer_kv(layer: int, context: int):
    """The same K/V of every layer on every process: (1, 3, context, 64) each."""
    g = torch.Generator().manual_seed(1000 + layer)
    k = torch.randn(1, 3, context, 64, generator=g)
    v = torch.randn(1, 3, context, 64, generator=g)
    return k, v


def prompt_ids(context: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(5)
    return torch.randint(0, SHAPE["vocab_size"], (1, context + 1), generator=g)


def timed_sdpa():
    """Register transformers' SDPA under 'sdpa_timed', counting its time; returns the box."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    box = {"s": 0.0, "calls": 0}

    def fn(*args, **kwargs):
        t0 = time.perf_counter()
        out = sdpa_attention_forward(*args, **kwargs)
        box["s"] += time.perf_counter() - t0
        box["calls"] += 1
        return out

    AttentionInterface.register("sdpa_timed", fn)
    AttentionMaskInterface.register("sdpa_timed", sdpa_mask)
    return box


def one_process(context: int, tokens: int) -> dict:
    from transformers import DynamicCache

    torch.set_num_threads(1)
    box = timed_sdpa()
    model = build_model("sdpa_timed")
    cache = DynamicCache(config=model.config)
    for layer in range(SHAPE["num_hidden_layers"]):
        cache.update(*layer_kv(layer, context), layer)
    with torch.no_grad():
        out = model.generate(prompt_ids(context), cache=cache, max_new_tokens=tokens,
                             do_sample=False, min_new_tokens=tokens)
    steps = box["calls"] / SHAPE["num_hidden_layers"]
    return {"tokens": out[0, context + 1:].tolist(), "attention_s_per_token": box["s"] / steps}


def rank_job(ctx, context: int, tokens: int, algorithm: str) -> dict:
    import treeattn.hf

    model = build_model("treeattn")
    cache = treeattn.hf.ShardedCache(model.config, algorithm, reserve=tokens)
    for layer in range(SHAPE["num_hidden_layers"]):
        cache.layers[layer].update(*layer_kv(layer, context))  # keeps this rank's positions
    attn = cache.attention  # made collectively on the first call: do that before timing
    attn.scale = model.model.layers[0].self_attn.scaling
    attn(torch.zeros(1, 9, 64), *cache.layers[0].shard())
    attn.calls, attn.elapsed_s = 0, 0.0
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(prompt_ids(context), cache=cache, max_new_tokens=tokens,
                             do_sample=False, min_new_tokens=tokens)
    wall = time.perf_counter() - t0
    steps = attn.calls / SHAPE["num_hidden_layers"]
    return {"tokens": out[0, context + 1:].tolist(),
            "attention_s_per_token": attn.elapsed_s / steps,
            "decode_s_per_token": wall / steps, "local_tokens": cache.layers[0].local}


def treeattn_generate(context: int, tokens: int, nproc: int, algorithm: str) -> dict | None:
    """treeattn's own engine at the same shape and context (None without the GGUF)."""
    import json
    import subprocess

    from treeattn.llm.formats.fetch import SMOLLM2_FILE, cache_dir

    if not (cache_dir() / SMOLLM2_FILE).exists():
        return None
    out = subprocess.run([sys.executable, "-m", "treeattn.cli", "generate", "--nproc",
                          str(nproc), "--context-tokens", str(context), "--prompt", "Hello",
                          "--max-new-tokens", str(tokens + 1), "--algorithm", algorithm,
                          "--json"], capture_output=True, text=True, timeout=1800, check=True)
    record = json.loads(out.stdout)
    return {"attention_s_per_token": record["attention_s_per_token"],
            "decode_s_per_token": 1.0 / record["tokens_per_s"]}


def main() -> int:
    from treeattn import testbed
    from treeattn.runtime.launch import LaunchOptions, launch

    testbed.plug_in()  # CPU ranks of one host: the transport `treeattn run` uses

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--algorithm", default="tree")
    args = parser.parse_args()
    ref, ours, own = [], [], []
    for _ in range(args.reps):
        ref.append(one_process(args.context, args.tokens))
        ours.append(launch(functools.partial(rank_job, context=args.context,
                                             tokens=args.tokens, algorithm=args.algorithm),
                           args.nproc, LaunchOptions(timeout_s=300, threads=1)))
        native = treeattn_generate(args.context, args.tokens, args.nproc, args.algorithm)
        if native is not None:
            own.append(native)
    ref_ms = statistics.median(r["attention_s_per_token"] for r in ref) * 1e3
    our_ms = statistics.median(r["attention_s_per_token"] for r in ours) * 1e3
    our_step = statistics.median(r["decode_s_per_token"] for r in ours) * 1e3
    own_ms = statistics.median(r["attention_s_per_token"] for r in own) * 1e3 if own else None
    own_step = statistics.median(r["decode_s_per_token"] for r in own) * 1e3 if own else None
    same = all(r["tokens"] == ref[0]["tokens"] for r in ref + ours)
    payload = {"context": args.context, "tokens": args.tokens, "reps": args.reps,
               "nproc": args.nproc, "algorithm": args.algorithm, "threads_per_process": 1,
               "model_shape": SHAPE, "transformers_ms_per_token": ref_ms,
               "treeattn_hf_ms_per_token": our_ms, "speedup": ref_ms / our_ms,
               "identical_tokens": same, "treeattn_hf_decode_ms_per_token": our_step,
               "treeattn_generate_ms_per_token": own_ms,
               "treeattn_generate_decode_ms_per_token": own_step,
               "runs": {"transformers": ref, "treeattn_hf": ours, "treeattn_generate": own},
               "host": "shared 2-core CPU host (other jobs running)"}
    import transformers

    payload["transformers_version"] = transformers.__version__
    md = (f"# Attention per token through transformers, {args.context:,} cached tokens\n\n"
          f"SmolLM2-135M shape (random weights, fp32), {args.tokens} greedy tokens, median of "
          f"{args.reps}; one torch thread per process; shared 2-core host.\n\n"
          "| run | attention ms/token (30 layers) | whole decode step, ms |\n|---|---|---|\n"
          f"| transformers SDPA, one process | {ref_ms:.2f} | - |\n"
          f"| treeattn.hf, {args.nproc} ranks, {args.algorithm} | {our_ms:.2f} | "
          f"{our_step:.2f} |\n"
          + (f"| treeattn generate, {args.nproc} ranks, {args.algorithm} (SmolLM2 GGUF) | "
             f"{own_ms:.2f} | {own_step:.2f} |\n" if own else "")
          + f"\nSpeed-up over transformers {ref_ms / our_ms:.2f}x; tokens identical: {same}. "
          + (f"The HF path against treeattn's own engine: attention {our_ms / own_ms:.2f}x, "
             f"whole decode step {our_step / own_step:.2f}x.\n\n" if own else "\n\n")
          + NOTE + "\n"
          "Command: `.venv/bin/python benchmarks/hf_attention.py "
          f"--context {args.context} --tokens {args.tokens} --reps {args.reps}`\n")
    write_results("hf_attention", payload, md)
    print(md)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
