"""Argument types shared by the sub-commands, and the rule that every flag a command is given
either takes effect in its mode or is refused (kept free of heavy imports)."""

from __future__ import annotations

import argparse
from collections.abc import Collection, Mapping

from treeattn.errors import UserError

SUFFIX = {"k": 1024, "m": 1024 * 1024}
# A thousand times the longest context any model is trained for (about a billion tokens):
# a count past it is a typo, and a 400-digit one would overflow the float arithmetic.
MAX_TOKENS = 1 << 40
MAX_COUNT = 1 << 20  # GPUs, ranks, sequences in a batch: far past any cluster or batch


def parse_tokens(text: str) -> int:
    """``"4096"``, ``"16k"`` or ``"1M"`` (binary multiples) to a token count.

    >>> parse_tokens("16k"), parse_tokens("1M"), parse_tokens("300")
    (16384, 1048576, 300)
    """
    raw = text.strip().lower()
    scale = SUFFIX.get(raw[-1:], 1)
    digits = raw[:-1] if raw[-1:] in SUFFIX else raw
    if len(digits) > 20:  # int() of a huge string is slow and its value useless
        raise argparse.ArgumentTypeError(f"not a token count: {text[:40]!r}...")
    try:
        value = int(digits) * scale
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not a token count: {text[:40]!r}") from exc
    if value > MAX_TOKENS:
        raise argparse.ArgumentTypeError(f"{value:,} tokens is past the bound of "
                                         f"{MAX_TOKENS:,}")
    return value


def positive_int(text: str) -> int:
    """A count of GPUs, ranks or sequences: an integer in ``[1, MAX_COUNT]``.

    >>> positive_int("8")
    8
    """
    try:
        value = int(text) if len(text) <= 20 else None
    except ValueError:
        value = None
    if value is None or not 1 <= value <= MAX_COUNT:
        raise argparse.ArgumentTypeError(f"expected an integer from 1 to {MAX_COUNT:,}, got "
                                         f"{text[:40]!r}")
    return value


BYTE_SUFFIX = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


def parse_bytes(text: str) -> int:
    """``"4096"``, ``"64M"``, ``"1G"`` (binary multiples; a trailing ``B``/``iB`` is allowed)
    to a positive byte count.

    >>> parse_bytes("64M"), parse_bytes("1GiB"), parse_bytes("512")
    (67108864, 1073741824, 512)
    """
    raw = text.strip().lower().removesuffix("ib").removesuffix("b")
    scale = BYTE_SUFFIX.get(raw[-1:], 1)
    digits = raw[:-1] if raw[-1:] in BYTE_SUFFIX else raw
    try:
        value = int(digits) * scale
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not a byte count: {text!r}") from exc
    if value <= 0:
        raise argparse.ArgumentTypeError(f"a byte count must be positive, got {text!r}")
    return value


# Every flag either takes effect or is refused. A command's parser records its flags and their
# defaults (record_flags); each mode of the command lists the flags it reads, and any other
# flag given a value other than its default is refused with one line (refuse_unread). A flag
# added to a parser is so refused in every mode until a mode says it reads it.
FLAGS_DEST = "parser_flags"


def record_flags(parser: argparse.ArgumentParser) -> None:
    """Store ``parser``'s optional flags (dest -> (flag as shown, default)) in every
    namespace it parses, for :func:`refuse_unread`. Call it after the last ``add_argument``."""
    flags = {a.dest: (max(a.option_strings, key=len), a.default) for a in parser._actions
             if a.option_strings and a.default is not argparse.SUPPRESS}
    parser.set_defaults(**{FLAGS_DEST: flags})


def given_flags(args: argparse.Namespace) -> dict[str, str]:
    """dest -> flag of every recorded flag whose value differs from its default (a flag given
    its default value is the same as one left out)."""
    flags = getattr(args, FLAGS_DEST, {})
    return {dest: flag for dest, (flag, default) in flags.items()
            if getattr(args, dest, default) != default}


def refuse_unread(args: argparse.Namespace, mode: str, reads: Collection[str],
                  why: Mapping[str, str] | None = None) -> None:
    """Raise UserError naming every flag given to ``mode`` that it does not read (``reads``:
    dests), with ``why`` a flag does not apply where one is known."""
    unread = [(dest, flag) for dest, flag in given_flags(args).items() if dest not in reads]
    if not unread:
        return
    names = ", ".join(flag for _, flag in unread)
    reasons = "; ".join(dict.fromkeys(why[dest] for dest, _ in unread if why and dest in why))
    raise UserError(f"{mode} does not use {names}" + (f" ({reasons})" if reasons else "")
                    + (": drop it" if len(unread) == 1 else ": drop them"))


def add_nccl_env_flag(parser: argparse.ArgumentParser) -> None:
    """``--nccl-env NAME=VALUE`` (repeatable): an NCCL variable the priced library runs with
    (checked by :func:`treeattn.sim.nccl.env.parse_nccl_env`)."""
    parser.add_argument("--nccl-env", action="append", default=[], metavar="NAME=VALUE",
                        help="an NCCL variable the library runs with, as far as the cost "
                             "model reads it (repeatable): NCCL_ALLOC_P2P_NET_LL_BUFFERS=1 "
                             "(or NCCL_NET_SHARED_BUFFERS=0) lets small send/recv across "
                             "hosts use LL (default: Simple)")
