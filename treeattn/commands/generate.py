"""`treeattn generate`: text generation with the KV cache sharded across ranks.

    treeattn generate --nproc 2 --prompt "What is the capital of France?" --chat --verify
    torchrun --nproc-per-node 8 -m treeattn generate --prompt "..." --dtype bf16 \
        --topology dgx-h100 --algorithm auto --temperature 0.7 --top-p 0.9 --seed 1

``--nproc N`` spawns N local ranks; under torchrun every process is one rank
(:mod:`treeattn.commands.generate_cluster`, with the dtype, device, topology and sampling
options). Greedy by default.

The text streams to stdout as it is produced; the figures (tokens/s, attention time per
token) follow on stderr, or everything comes as one JSON object with ``--json``.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass

from rich.console import Console

from treeattn import testbed
from treeattn.commands._args import parse_tokens, record_flags
from treeattn.commands.generate_checks import check_args, check_hf_flags
from treeattn.commands.generate_cluster import (
    add_cluster_options,
    placed,
    rank_of_this_process,
    run_torchrun,
    sampling_of,
    topology_for,
    torchrun_mode,
)
from treeattn.commands.run import dumps, guarded
from treeattn.commands.tables import say
from treeattn.errors import UserError
from treeattn.schedule.algorithms import CLI_CHOICES

ALGORITHMS = CLI_CHOICES
PREFILL_CHOICES = ("pass-kv", "pass-q", "all-gather-kv")  # treeattn.sim.prefill.pricing's
DEMO_PROMPT = "What is the capital of France?"
# Per wait on a peer. Longer than run's 30 s: the first wait also covers the ranks loading
# the model at different speeds. A hung rank is still named within it (the launcher's
# heartbeat watchdog), and a dead one at once.
DEFAULT_TIMEOUT_S = 60.0
def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "generate", help="generate text with a real model on a sharded KV cache",
        description="Decoding with the KV cache split across N local ranks, or across a "
                    "torchrun group; every layer's decode attention runs the plan's schedule "
                    "(tree by default). Greedy unless --temperature is above 0.")
    parser.add_argument("--nproc", type=int, default=None,
                        help="local ranks to spawn (default 2; under torchrun: its world)")
    parser.add_argument("--prompt", required=True, help="the prompt text")
    parser.add_argument("--chat", action="store_true",
                        help="wrap the prompt in the model's chat template")
    parser.add_argument("--max-new-tokens", type=int, default=32,
                        help="tokens to generate at most (default 32)")
    parser.add_argument("--algorithm", choices=ALGORITHMS, default="tree",
                        help="how each layer's partials are reduced (default tree; auto: the "
                             "simulator's planner picks)")
    parser.add_argument("--plan", metavar="PLAN.json", default=None,
                        help="run every layer's merge with exactly this plan file's schedule "
                             "(from `treeattn plan -o`); its world must be this run's")
    parser.add_argument("--model", default=None,
                        help="a .gguf file, a Hugging Face directory, 'debug', or the default "
                             "smollm2-135m-instruct (fetched on first use)")
    parser.add_argument("--verify", action="store_true",
                        help="also decode in one process and compare the tokens (exact for "
                             "greedy decoding)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--engine", choices=("treeattn", "hf"), default="treeattn",
                        help="treeattn's own model code (default), or Hugging Face "
                             "transformers' generate with the treeattn.hf integration")
    parser.add_argument("--cuda-graph", action="store_true",
                        help="with --nproc 1 on CUDA: capture the decode step once and replay "
                             "it as one CUDA graph per token (a small model's step is bound by "
                             "the host launching its kernels; --verify compares with eager)")
    parser.add_argument("--context-tokens", type=parse_tokens, default=0, metavar="L",
                        help="first fill the cache with L tokens of a repeated document")
    parser.add_argument("--prefill", choices=PREFILL_CHOICES, default="pass-kv",
                        help="how the ranks prefill the context into their shards (default "
                             "pass-kv: a ring of K/V blocks, zig-zag balanced; pass-q: a ring "
                             "of query blocks, cheaper after a long --context-tokens; "
                             "`treeattn predict --prefill` prices all three)")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                        help="seconds any rank waits on a peer before giving up; a lost or "
                             f"hung rank is named within about this long "
                             f"(default {DEFAULT_TIMEOUT_S:g})")
    add_cluster_options(parser)
    parser.set_defaults(func=guarded(handle))
    record_flags(parser)


@dataclass
class Outcome:
    """One generation and its check, ready to print."""

    text: str
    tokens: list[int]
    generation: object  # treeattn.llm.generate.Generation
    world: int
    algorithm: str
    prompt_tokens: int
    context_tokens: int
    model: str
    identical: bool | None = None
    max_logit_diff: float | None = None
    sampling: object = None  # treeattn.llm.options.Sampling
    dtype: str = "fp32"
    ranks_agree: bool | None = None


def run_generation(args: argparse.Namespace, stream: bool) -> Outcome | None:
    """Load, generate (local or distributed) and optionally verify; the command's core.

    Under torchrun every rank calls it; only rank 0 gets an Outcome, the others None.
    """
    from treeattn.llm.formats.weights import load_model, resolve_model
    from treeattn.llm.generate import check_request, generate_local
    from treeattn.llm.options import Sampler

    world = check_args(args)
    sampling = sampling_of(args)
    topology = topology_for(args, world)
    spec = resolve_model(args.model)
    loaded = load_model(spec)
    tok, model = loaded.tokenizer, loaded.model
    prompt = tok.encode_chat(args.prompt) if args.chat else tok.encode(args.prompt)
    if not prompt:
        raise UserError(f"the prompt {args.prompt[:40]!r} tokenizes to no tokens")
    check_request(model, prompt, args.max_new_tokens, args.context_tokens)
    check_memory(args, model, len(prompt), world)
    segment = _segment(tok, args.context_tokens, model)
    stream = stream and rank_of_this_process() == 0
    printer = _printer(tok) if stream else None
    ranks_agree = None
    if world == 1 and args.cuda_graph:
        gen = _graphed(placed(loaded, args), prompt, args, tok.eos_id, printer, sampling)
        algorithm = "local, CUDA graph"
    elif world == 1:
        gen = generate_local(placed(loaded, args), prompt, args.max_new_tokens, tok.eos_id,
                             printer, args.context_tokens, segment, Sampler(sampling))
        algorithm = "local"
    else:
        is_root, result, algorithm = _distributed(args, loaded, prompt, segment, stream,
                                                  world, sampling, topology)
        if not is_root:
            return None
        gen, ranks_agree = result["generation"], result["ranks_agree"]
    if stream:
        sys.stdout.write("\n")
        sys.stdout.flush()
    out = Outcome(tok.decode(gen.tokens), gen.tokens, gen, world, algorithm, len(prompt),
                  args.context_tokens, loaded.source, sampling=sampling, dtype=args.dtype,
                  ranks_agree=ranks_agree)
    if args.verify:
        ref = gen if world == 1 and not args.cuda_graph else generate_local(
            placed(loaded, args), prompt, args.max_new_tokens, tok.eos_id, None,
            args.context_tokens, segment, Sampler(sampling))
        steps = min(len(ref.logits), len(gen.logits))
        diff = max(float((ref.logits[i].cpu() - gen.logits[i].cpu()).abs().max())
                   for i in range(steps))
        # a NaN difference compares as "not larger" everywhere: never call that identical
        out.identical = ref.tokens == gen.tokens and math.isfinite(diff)
        out.max_logit_diff = diff if math.isfinite(diff) else None
    return out


def _graphed(model, prompt: list[int], args: argparse.Namespace, eos_id, printer, sampling):
    """One process, each decode step replayed from a captured CUDA graph."""
    from treeattn.llm.local_cache import model_device
    from treeattn.llm.options import Sampler
    from treeattn.llm.static_decode import generate_static

    if model_device(model).type != "cuda":
        raise UserError("--cuda-graph needs the model on a CUDA device (--device cuda)")
    return generate_static(model, prompt, args.max_new_tokens, graph=True, eos_id=eos_id,
                           on_token=printer, choose=Sampler(sampling))


def check_memory(args: argparse.Namespace, model, prompt_tokens: int, world: int) -> None:
    """Refuse, before any rank starts, a generation whose KV caches cannot fit in memory.

    Each rank holds the weights, its shard and, while it prefills, a few ring blocks and its
    queries' activations (:func:`treeattn.llm.prefill.prefill_bytes`): never the whole
    cache. This process holds the weights, plus a whole local prefill and decode with
    ``--verify`` or one rank. On CUDA the ranks' part is per GPU. Under torchrun this process
    is one rank (and the reference with ``--verify``). The weights are counted as loaded
    (fp32) and the cache in ``--dtype``.
    """
    from treeattn.llm.options import dtype_of
    from treeattn.llm.prefill import prefill_bytes
    from treeattn.runtime.plans import check_fits, uses_cuda

    cfg = model.config
    element = dtype_of(args.dtype).itemsize
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    tokens = args.context_tokens + prompt_tokens + args.max_new_tokens
    cache = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * tokens * element
    here = weights + (2 * cache if args.verify or world == 1 else 0)
    what = f"generating {tokens} tokens ({args.context_tokens} context) on {world} rank(s)"
    if world == 1:
        check_fits(here, what)
        return
    parts = prefill_bytes(cfg, args.context_tokens, prompt_tokens, world, element,
                          args.max_new_tokens, args.prefill)
    rank = weights + sum(parts.values())
    what += (f" (per rank: {_mib(parts['shard'])} shard, {_mib(parts['blocks'])} "
             f"{args.prefill} blocks)")
    if torchrun_mode(args):
        check_fits(rank + here - weights, what, cuda=uses_cuda(args.device))
    elif uses_cuda(args.device):
        check_fits(rank, what, cuda=True)
        check_fits(here + world * weights, what)
    else:
        check_fits(here + world * rank, what)


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def _segment(tok, context_tokens: int, model) -> list[int] | None:
    if not context_tokens:
        return None
    from treeattn.llm.generate_context import document_segment

    if context_tokens > model.config.max_seq_len:
        say(f"note: {context_tokens} context tokens exceed the model's trained context of "
            f"{model.config.max_seq_len}; the timing is real, the text need not make sense",
            sys.stderr)
    return document_segment(tok)


def _distributed(args, loaded, prompt, segment, stream, world, sampling, topology):
    """Run on ``world`` ranks (spawned, or this torchrun group); returns
    ``(is rank 0, rank 0's result dict, the algorithm's name)``."""
    from treeattn.llm.generate_dist import (
        GenerateRequest,
        generate_distributed,
        make_schedule,
        split_lengths,
    )
    from treeattn.llm.options import dtype_of

    model, eos_id = loaded.model, loaded.tokenizer.eos_id
    cached = args.context_tokens + len(prompt)
    if args.plan:
        schedule = planned_schedule(args.plan, world, model.config, args.dtype)
    else:
        topology, models = planning_models(args, world, topology)
        schedule = make_schedule(args.algorithm, world, model.config,
                                 split_lengths(cached, world), dtype_of(args.dtype), topology,
                                 models)
    request = GenerateRequest(loaded.source, tuple(prompt), args.max_new_tokens, schedule, eos_id,
                              args.context_tokens, tuple(segment or ()), stream, args.dtype,
                              sampling, args.prefill)
    shape = schedule.params.get("shape")
    name = f"{schedule.algorithm}({shape})" if shape else schedule.algorithm
    if torchrun_mode(args):
        is_root, result = run_torchrun(request, args, loaded)
        return is_root, result, name
    testbed.plug_in()  # CPU ranks of one host: the shared-memory transport
    result = generate_distributed(request, world, timeout_s=args.timeout, loaded=loaded,
                                  device=args.device)
    return True, result, name


def planning_models(args, world: int, topology):
    """``(topology, (hardware, backend))`` the planner prices ``--algorithm auto`` with: the
    calibrated ones of ``--profile`` (the profile's local topology unless ``--topology``
    names the cluster), else ``topology`` and the datasheet defaults."""
    if args.profile is None:
        return topology, (None, None)
    from treeattn.runtime.measure.check import predictor
    from treeattn.testbed.calibration.calibrate import read_profile

    planned, hardware, backend = predictor(read_profile(args.profile), world, args.topology)
    return planned, (hardware, backend)


def planned_schedule(path: str, world: int, config=None, dtype: str | None = None):
    """The schedule of a plan file (``treeattn plan -o``), for a group of ``world`` ranks,
    checked in full first (:func:`treeattn.sim.files.plan_file.read_plan`).

    The schedule's steps are what run; message sizes follow this model's shapes. So the plan
    must have been made for this attention shape (query heads, KV heads, head dim of
    ``config``): another shape is refused with what differs. A plan priced for another
    cache dtype still runs correctly and gets a warning (its prices assumed other sizes).
    """
    from treeattn.llm.options import dtype_of
    from treeattn.sim.files.plan_file import read_plan

    checked = read_plan(path)
    schedule = checked.schedule
    if schedule.world != world:
        raise UserError(f"plan {path} is for {schedule.world} ranks; this run has {world}")
    if config is not None:
        m = checked.model
        planned = (m.n_heads, m.n_kv_heads, m.head_dim)
        here = (config.n_heads, config.n_kv_heads, config.head_dim)
        if planned != here:
            raise UserError(f"plan {path}: field model: expected a model of this run's shape "
                            f"({here[0]} query heads, {here[1]} KV heads, head dim {here[2]}), "
                            f"got {m.name} ({planned[0]}, {planned[1]}, {planned[2]})")
    if dtype is not None:
        size = dtype_of(dtype).itemsize
        if size != checked.model.dtype_bytes:
            say(f"warning: plan {path} was priced for a {checked.model.dtype} cache; this "
                f"run's is {dtype}", sys.stderr)
    return schedule


def _printer(tok):
    from treeattn.llm.generate_dist import _streamer

    return _streamer(tok)


def _fmt(x: float, unit: str, scale: float = 1.0) -> str:
    return "n/a" if math.isnan(x) else f"{x * scale:.2f} {unit}"


def to_json(out: Outcome) -> dict:
    g = out.generation
    record = {
        "text": out.text, "tokens": out.tokens,
        "tokens_per_s": None if math.isnan(g.tokens_per_s) else g.tokens_per_s,
        "world": out.world, "algorithm": out.algorithm, "model": out.model,
        "prompt_tokens": out.prompt_tokens, "context_tokens": out.context_tokens,
        "prefill_s": g.prefill_s, "decode_s": g.decode_s,
        "attention_s_per_token": None if math.isnan(g.attention_per_token_s)
        else g.attention_per_token_s,
        "dtype": out.dtype, "ranks_agree": out.ranks_agree,
    }
    if out.sampling is not None:
        s = out.sampling
        record.update(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, seed=s.seed)
    if out.identical is not None:
        record["identical_to_single_process"] = out.identical
        record["max_abs_logit_diff"] = out.max_logit_diff
    from treeattn.sim.files.export import tagged

    return tagged("generation", record)


def summary_lines(out: Outcome) -> list[str]:
    g = out.generation
    lines = [
        f"{len(out.tokens)} tokens on {out.world} rank(s), {out.algorithm}: "
        f"{_fmt(g.tokens_per_s, 'tokens/s')}, attention {_fmt(g.attention_per_token_s, 'ms', 1e3)}"
        f" per token (all layers), prefill {g.prefill_s:.2f} s "
        f"({out.prompt_tokens} prompt + {out.context_tokens} context tokens)",
    ]
    if out.identical is not None:
        verdict = "identical to" if out.identical else "DIFFERENT from"
        diff = (f"{out.max_logit_diff:.2e}" if out.max_logit_diff is not None
                else "not finite: the logits hold NaN or infinity")
        mode = "greedy" if out.sampling is None or out.sampling.greedy else "sampled"
        lines.append(f"{mode} tokens {verdict} single-process decoding "
                     f"(max |logit diff| {diff})")
    if out.ranks_agree is False:
        lines.append("the ranks ended with DIFFERENT tokens")
    return lines


def handle(args: argparse.Namespace) -> int:
    if args.engine == "hf":
        check_hf_flags(args)
        from treeattn.commands.generate_hf import handle_hf

        return handle_hf(args, planned_schedule)
    out = run_generation(args, stream=not args.json)
    if out is None:  # a torchrun rank other than 0: rank 0 prints
        return 0
    if args.json:
        print(dumps(to_json(out)))
    else:
        for line in summary_lines(out):
            sys.stderr.write(line + "\n")
    return 0 if out.identical in (None, True) and out.ranks_agree in (None, True) else 1


def demo_section(console: Console) -> int:
    """A short real SmolLM2 generation on 2 ranks, checked against one process."""
    console.rule("[bold]Real generation: SmolLM2-135M-Instruct, KV cache on 2 ranks")
    # Parsed by the command's own parser, so the demo gets every option's default.
    parser = argparse.ArgumentParser(prog="treeattn")
    register(parser.add_subparsers())
    args = parser.parse_args(["generate", "--nproc", "2", "--prompt", DEMO_PROMPT, "--chat",
                              "--max-new-tokens", "24", "--algorithm", "tree", "--verify"])
    console.print(f"prompt: {DEMO_PROMPT!r} (chat template), greedy, tree merge of every layer")
    out = run_generation(args, stream=True)
    for line in summary_lines(out):
        console.print(line)
    if not out.identical:
        return 1
    return _demo_hf(console)


def _demo_hf(console: Console) -> int:
    """The same prompt through Hugging Face transformers (``--engine hf``), when installed."""
    from treeattn.commands.generate_hf import demo_hf

    parser = argparse.ArgumentParser(prog="treeattn")
    register(parser.add_subparsers())
    args = parser.parse_args(["generate", "--engine", "hf", "--nproc", "2", "--prompt",
                              DEMO_PROMPT, "--chat", "--max-new-tokens", "24", "--algorithm",
                              "tree", "--verify"])
    return demo_hf(console, args, planned_schedule)


demo_section.is_real_run = True
