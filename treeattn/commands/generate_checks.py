"""What ``treeattn generate`` checks before anything is loaded: the flags each mode reads
(any other flag given a value is refused by name), the prompt, and the combinations of
options no run can honour. Every refusal is one :class:`~treeattn.errors.UserError` line."""

from __future__ import annotations

import argparse

from treeattn.commands._args import refuse_unread
from treeattn.commands.generate_cluster import check_placement, sampling_of, world_size
from treeattn.errors import UserError

# Why the runtime refuses all-gather-KV: the sharded cache bounds what a rank holds.
PREFILL_REFUSED = {
    "all-gather-kv": "all-gather-KV puts a whole layer's K/V of the context on every rank, "
                     "which the sharded cache exists to avoid",
}
# The flags (argparse dests) each mode reads; any other flag given a value is refused
# (treeattn.commands._args.refuse_unread), with the reason where one helps.
RANKS_READS = frozenset({
    "nproc", "prompt", "chat", "max_new_tokens", "algorithm", "plan", "model", "verify",
    "json", "engine", "cuda_graph", "context_tokens", "prefill", "timeout", "topology",
    "profile", "dtype", "device", "temperature", "top_k", "top_p", "seed"})
ONE_RANK_READS = RANKS_READS - {"algorithm", "plan", "prefill", "timeout", "topology",
                                "profile"}
NOT_ONE_RANK = {
    "algorithm": "one rank has no partials to merge", "plan": "one rank has nothing to merge",
    "prefill": "one rank prefills its whole cache itself",
    "timeout": "one rank waits on no peer",
    "topology": "--topology plans the merge of several ranks",
    "profile": "--profile prices the merge of several ranks",
}
HF_READS = frozenset({
    "nproc", "prompt", "chat", "max_new_tokens", "algorithm", "plan", "model", "verify",
    "json", "engine", "timeout", "device", "temperature", "top_k", "top_p", "seed",
    "context_tokens"})
NOT_HF = {
    "cuda_graph": "it captures treeattn's own decode step",
    "profile": "it runs --algorithm or --plan as given",
    "prefill": "it prefills the prompt with a pass-KV ring",
    "dtype": "it runs transformers' model in fp32",
    "topology": "it runs --algorithm or --plan as given",
}


def check_args(args: argparse.Namespace) -> int:
    """Check every option before anything is loaded; returns the world size."""
    from treeattn.runtime.launch import check_timeout

    world = world_size(args)
    if world == 1:
        refuse_unread(args, "generate on one rank", ONE_RANK_READS, NOT_ONE_RANK)
    check_timeout(args.timeout)
    check_placement(args)
    sampling_of(args)
    check_prompt(args.prompt)
    if args.max_new_tokens <= 0:
        raise UserError(f"--max-new-tokens must be positive, got {args.max_new_tokens}")
    if args.context_tokens < 0:
        raise UserError(f"--context-tokens must not be negative, got {args.context_tokens}")
    if args.cuda_graph and (world != 1 or args.context_tokens):
        raise UserError("--cuda-graph decodes in one process from a prompt: use --nproc 1 "
                        "and no --context-tokens")
    if args.context_tokens and args.context_tokens < world:
        raise UserError(f"--context-tokens {args.context_tokens} is below the world size "
                        f"{world}")
    if args.prefill in PREFILL_REFUSED and world > 1:
        raise UserError(f"--prefill {args.prefill} cannot fill this layout: "
                        f"{PREFILL_REFUSED[args.prefill]}; the runtime runs pass-kv and pass-q")
    if args.profile is not None and (args.plan or args.algorithm != "auto"):
        raise UserError("--profile prices the planner's choice: use it with --algorithm auto "
                        "(a --plan file was priced when it was made)")
    check_plan_flags(args)
    return world


def check_prompt(prompt: str) -> None:
    """Raise UserError for an empty or blank prompt, or one that is not UTF-8 text."""
    if not prompt or not prompt.strip():
        raise UserError("the prompt is empty")
    check_utf8(prompt)


def check_plan_flags(args: argparse.Namespace) -> None:
    """A --plan file fixes the merge: refuse the flags that would choose another one."""
    if args.plan and args.algorithm != "tree":
        raise UserError(f"--plan runs its file's schedule; --algorithm {args.algorithm} picks "
                        "another: give one of them")
    if args.plan and args.topology:
        raise UserError("--plan runs its file's schedule, made for the topology it names; "
                        "--topology plans another: give one of them")


def check_hf_flags(args: argparse.Namespace) -> None:
    """Refuse the flags ``--engine hf`` does not use, before transformers is imported."""
    from treeattn.runtime.launch import check_timeout

    if args.nproc == 1:  # one rank merges nothing: the merge's flags are refused as on ours
        refuse_unread(args, "generate --engine hf on one rank", HF_READS - set(NOT_ONE_RANK),
                      NOT_HF | NOT_ONE_RANK)
    else:
        refuse_unread(args, "generate --engine hf", HF_READS, NOT_HF)
    check_timeout(args.timeout)
    if args.device == "cuda":
        raise UserError("generate --engine hf runs its ranks on the CPU: drop --device cuda")
    check_prompt(args.prompt)
    check_plan_flags(args)


def check_utf8(prompt: str) -> None:
    """Raise UserError for a prompt that is not valid UTF-8 text.

    Bytes that are not UTF-8 reach Python as lone surrogates (argv's surrogateescape); the
    tokenizer cannot encode them.
    """
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = prompt[exc.start]
        shown = f"byte 0x{ord(bad) - 0xDC00:02x}" if 0xDC80 <= ord(bad) <= 0xDCFF else repr(bad)
        raise UserError(f"the prompt is not valid UTF-8 text ({shown} at character "
                        f"{exc.start})") from None
