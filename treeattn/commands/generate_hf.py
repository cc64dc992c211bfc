"""``treeattn generate --engine hf``: the same generation through Hugging Face transformers.

The model and tokenizer are transformers' own (``from_pretrained``, with ``gguf_file=`` for a
GGUF such as the default SmolLM2), loaded once here; the ranks get its config and weights in a
temporary folder (a GGUF-quantised model cannot ``save_pretrained``). Each rank decodes with
transformers' ``generate``, ``attn_implementation="treeattn"`` and a
:class:`treeattn.hf.ShardedCache` running ``--algorithm`` or ``--plan``
(:mod:`treeattn.hf`). The prompt is prefilled sharded (:func:`treeattn.hf.sharded_prefill`:
each rank runs the model on its own chunks, attention is a pass-KV ring), so it is never
whole on one rank; ``generate`` then starts from the last prompt token. ``--verify`` runs
transformers' own single-process ``generate`` here and compares tokens and logits. Sampling
(``--temperature``, ``--top-k``, ``--top-p``, ``--seed``) seeds every rank alike and gives
them rank 0's scores (:class:`treeattn.hf.RankZeroScores`). Local ranks only (``--nproc``).
"""

from __future__ import annotations

import argparse
import functools
import math
import sys
import tempfile
import time
from pathlib import Path

from treeattn import testbed
from treeattn.errors import UserError


def _check(args: argparse.Namespace) -> int:
    from treeattn.commands.generate_cluster import torchrun_mode

    if torchrun_mode(args):
        raise UserError("--engine hf runs local ranks (--nproc); under torchrun use "
                        "treeattn.hf in your own script (docs/hf.md)")
    if args.max_new_tokens <= 0:
        raise UserError(f"--max-new-tokens must be positive, got {args.max_new_tokens}")
    if args.context_tokens < 0:
        raise UserError(f"--context-tokens must not be negative, got {args.context_tokens}")
    world = 2 if args.nproc is None else args.nproc
    if world < 1:
        raise UserError(f"--nproc must be at least 1, got {world}")
    return world


def reference_attention(config) -> str | None:
    """The attention transformers' own reference runs with: the model's eager attention where
    it soft-caps its logits (SDPA does not), else transformers' default for the model (SDPA
    where the model supports it, its eager attention otherwise, as for attention sinks)."""
    from treeattn.hf.support import text_config

    return "eager" if getattr(text_config(config), "attn_logit_softcapping", None) else None


def load_hf(spec: str | None):
    """``(model, tokenizer, source)`` through transformers, for a GGUF file or an HF folder."""
    import torch
    import transformers

    from treeattn.llm.formats.weights import resolve_model

    transformers.utils.logging.set_verbosity_error()  # the command prints its own lines
    transformers.utils.logging.disable_progress_bar()
    path = resolve_model(spec)
    if path == "debug":
        raise UserError("--engine hf needs a transformers model: a .gguf file, a Hugging Face "
                        "directory, or the default smollm2-135m-instruct")
    from treeattn.hf import check_served

    p = Path(path)
    kw = {} if p.is_dir() else {"gguf_file": p.name}
    where = str(p if p.is_dir() else p.parent)
    try:
        config = transformers.AutoConfig.from_pretrained(where, **kw)
    except Exception as exc:  # noqa: BLE001 - transformers' reason, on one line
        raise UserError(f"transformers cannot read the config of {path}: "
                        f"{_one_line(exc)}") from exc
    check_served(config)  # refused by name before any rank starts
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            where, dtype=torch.float32, attn_implementation=reference_attention(config),
            **kw).eval()
        tokenizer = transformers.AutoTokenizer.from_pretrained(where, **kw)
    except Exception as exc:  # noqa: BLE001
        raise UserError(f"transformers cannot load {path}: {_one_line(exc)}") from exc
    return model, tokenizer, path


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


def sampling_kwargs(sampling) -> dict:
    """``generate``'s sampling arguments for a checked :class:`Sampling` (greedy: none)."""
    if sampling.greedy:
        return {"do_sample": False}
    return {"do_sample": True, "temperature": sampling.temperature, "top_k": sampling.top_k,
            "top_p": sampling.top_p}


def _rank(ctx, folder: str, algorithm, max_new_tokens: int, sampling):
    """One rank: rebuild the model from the folder, decode with a ShardedCache."""
    import torch
    import transformers

    import treeattn.hf
    from treeattn.runtime.errors import RuntimeFailure
    from treeattn.runtime.group import all_gather_objects

    config = transformers.AutoConfig.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="treeattn")
    model.load_state_dict(torch.load(Path(folder, "weights.pt")), strict=False)
    model.tie_weights()
    model.eval()
    ids = torch.load(Path(folder, "ids.pt"))
    cache = treeattn.hf.ShardedCache(model.config, algorithm, reserve=max_new_tokens,
                                     timeout_s=ctx.timeout_s)  # --timeout, every wait
    sharded = set(cache.kinds) <= {"full", "none"}  # else the replicated prefill
    try:
        t0 = time.perf_counter()
        prefilled = treeattn.hf.sharded_prefill(model, ids, cache) if sharded else 0
        prefill_s = time.perf_counter() - t0
        if not sampling.greedy:
            torch.manual_seed(sampling.seed)  # every rank alike; RankZeroScores: same scores
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, cache=cache, max_new_tokens=max_new_tokens,
                                 logits_processor=[treeattn.hf.RankZeroScores()],
                                 output_logits=True, return_dict_in_generate=True,
                                 **sampling_kwargs(sampling))
        decode_s = time.perf_counter() - t0
    except (treeattn.hf.HFIntegrationError, RuntimeFailure):
        raise
    except Exception as exc:  # noqa: BLE001 - transformers failed: named, on one line
        raise treeattn.hf.HFIntegrationError(
            f"{cache.name}: transformers failed on rank {ctx.rank}: {_one_line(exc)}") from exc
    tokens = out.sequences[0, ids.shape[1]:].tolist()
    agree = all(t == tokens for t in all_gather_objects(ctx, tokens))
    attention = cache.attention
    return {"tokens": tokens, "logits": torch.stack(out.logits), "decode_s": decode_s,
            "attention_s": attention.elapsed_s, "attention_calls": attention.calls,
            "ranks_agree": agree, "prefill_s": prefill_s, "prefilled": prefilled,
            "sharded_prefill": sharded, "memory_bytes": cache.memory_bytes(),
            "layer_kinds": cache.kinds}


def context_ids(tokenizer, n: int):
    """(1, n) ids of a long repeated document (treeattn's own --context-tokens text), put
    before the prompt: a long context through transformers."""
    import torch

    from treeattn.llm.generate_context import DOCUMENT

    piece = tokenizer(DOCUMENT, add_special_tokens=False)["input_ids"]
    if not piece:
        raise UserError("the tokenizer encodes the context document to no tokens")
    return torch.tensor([(piece * (n // len(piece) + 1))[:n]])


def run_hf(args: argparse.Namespace, read_plan=None) -> dict:
    """Generate through transformers on ``--nproc`` ranks; the record ``--json`` prints.
    ``read_plan(path, world)``: the plan file's schedule (``generate.planned_schedule``,
    handed in by the command so that this module does not import it back)."""
    import torch

    from treeattn.commands.generate_cluster import sampling_of
    from treeattn.runtime.launch import LaunchOptions, launch

    testbed.plug_in()  # CPU ranks of one host: the shared-memory transport
    world = _check(args)
    sampling = sampling_of(args)
    model, tokenizer, source = load_hf(args.model)
    if args.chat:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}],
                                            add_generation_prompt=True, return_tensors="pt")
        ids = ids if isinstance(ids, torch.Tensor) else ids["input_ids"]
    else:
        ids = tokenizer(args.prompt, return_tensors="pt")["input_ids"]
    if ids.shape[1] == 0:
        raise UserError(f"the prompt {args.prompt[:40]!r} tokenizes to no tokens")
    if args.context_tokens:
        ids = torch.cat([context_ids(tokenizer, args.context_tokens), ids], dim=1)
    algorithm = args.algorithm
    if args.plan:
        algorithm = read_plan(args.plan, world)
    with tempfile.TemporaryDirectory(prefix="treeattn-hf-") as folder:
        model.config.save_pretrained(folder)
        torch.save(model.state_dict(), Path(folder, "weights.pt"))
        torch.save(ids, Path(folder, "ids.pt"))
        result = launch(functools.partial(_rank, folder=folder, algorithm=algorithm,
                                          max_new_tokens=args.max_new_tokens,
                                          sampling=sampling), world,
                        LaunchOptions(timeout_s=args.timeout, threads=1))
    tokens = result["tokens"]
    # every token comes from a decode step: the first from the last prompt token's
    steps = max(1, len(tokens))
    layers = model.config.get_text_config().num_hidden_layers
    record = {"engine": "hf", "text": tokenizer.decode(tokens, skip_special_tokens=True),
              "tokens": tokens, "world": world, "model": source,
              "algorithm": algorithm if isinstance(algorithm, str) else algorithm.algorithm,
              "prompt_tokens": int(ids.shape[1]) - args.context_tokens,
              "decode_s": result["decode_s"],
              "attention_s_per_token": result["attention_s"] / steps,
              "attention_calls": result["attention_calls"], "layers": layers,
              "ranks_agree": result["ranks_agree"],
              "prefill": "sharded (pass-KV ring)" if result["sharded_prefill"] else
              "replicated (the model has sliding-window or recurrent layers)",
              "context_tokens": args.context_tokens, "layer_kinds": result["layer_kinds"],
              "memory_bytes_per_rank": result["memory_bytes"],
              "prefill_s": result["prefill_s"], "prefilled_tokens": result["prefilled"],
              "decode_s_per_token": result["decode_s"] / steps}
    if not sampling.greedy:
        record.update(temperature=sampling.temperature, top_k=sampling.top_k,
                      top_p=sampling.top_p, seed=sampling.seed)
    if args.verify:
        if not sampling.greedy:
            torch.manual_seed(sampling.seed)
        with torch.no_grad():
            ref = model.generate(ids, max_new_tokens=args.max_new_tokens,
                                 output_logits=True, return_dict_in_generate=True,
                                 **sampling_kwargs(sampling))
        want = ref.sequences[0, ids.shape[1]:].tolist()
        n = min(len(ref.logits), len(result["logits"]))
        diff = max(float((ref.logits[i] - result["logits"][i]).abs().max()) for i in range(n))
        record["identical_to_single_process"] = want == tokens and math.isfinite(diff)
        record["max_abs_logit_diff"] = diff if math.isfinite(diff) else None
    return record


def handle_hf(args: argparse.Namespace, read_plan) -> int:
    from treeattn.commands.run import dumps
    from treeattn.sim.files.export import tagged

    record = run_hf(args, read_plan)
    if args.json:
        print(dumps(tagged("generation", record)))
    else:
        print(record["text"])
        line = (f"{len(record['tokens'])} tokens on {record['world']} ranks through "
                f"transformers, {record['algorithm']}: attention "
                f"{record['attention_s_per_token'] * 1e3:.2f} ms per token (all layers), "
                f"{record['prefill'].split(' (')[0]} prefill of {record['prompt_tokens']} "
                f"prompt + {record['context_tokens']} context tokens")
        sys.stderr.write(line + "\n")
        if "identical_to_single_process" in record:
            verdict = ("identical to" if record["identical_to_single_process"]
                       else "DIFFERENT from")
            mode = "sampled" if "seed" in record else "greedy"
            sys.stderr.write(f"{mode} tokens {verdict} transformers' single-process generate "
                             f"(max |logit diff| {record['max_abs_logit_diff']})\n")
    ok = record.get("identical_to_single_process", True) and record["ranks_agree"]
    return 0 if ok else 1


def demo_hf(console, args: argparse.Namespace, read_plan) -> int:
    """``make demo``'s transformers part: ``args`` (a parsed ``generate --engine hf
    --verify``) run once and summed up; skipped when transformers is not installed."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        console.print("transformers is not installed: the --engine hf part is skipped "
                      "(pip install 'treeattn[hf]')")
        return 0
    console.rule("[bold]The same through Hugging Face transformers (--engine hf), 2 ranks")
    record = run_hf(args, read_plan)
    console.print(record["text"])
    console.print(f"{len(record['tokens'])} tokens through transformers' generate with "
                  f"attn_implementation=\"treeattn\": sharded prefill of "
                  f"{record['prefilled_tokens']} prompt tokens in {record['prefill_s']:.2f} s, "
                  f"attention {record['attention_s_per_token'] * 1e3:.2f} ms per token")
    same = record["identical_to_single_process"] and record["ranks_agree"]
    console.print(("greedy tokens identical to" if same else "tokens DIFFERENT from")
                  + " transformers' own single-process generate (max |logit diff| "
                  f"{record['max_abs_logit_diff']:.2g})")
    return 0 if same else 1
