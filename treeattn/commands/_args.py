"""Argument types shared by the sub-commands (kept free of heavy imports)."""

from __future__ import annotations

import argparse

SUFFIX = {"k": 1024, "m": 1024 * 1024}


def parse_tokens(text: str) -> int:
    """``"4096"``, ``"16k"`` or ``"1M"`` (binary multiples) to a token count.

    >>> parse_tokens("16k"), parse_tokens("1M"), parse_tokens("300")
    (16384, 1048576, 300)
    """
    raw = text.strip().lower()
    scale = SUFFIX.get(raw[-1:], 1)
    digits = raw[:-1] if raw[-1:] in SUFFIX else raw
    try:
        return int(digits) * scale
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not a token count: {text!r}") from exc


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


def add_nccl_env_flag(parser: argparse.ArgumentParser) -> None:
    """``--nccl-env NAME=VALUE`` (repeatable): an NCCL variable the priced library runs with
    (checked by :func:`treeattn.sim.nccl.env.parse_nccl_env`)."""
    parser.add_argument("--nccl-env", action="append", default=[], metavar="NAME=VALUE",
                        help="an NCCL variable the library runs with, as far as the cost "
                             "model reads it (repeatable): NCCL_ALLOC_P2P_NET_LL_BUFFERS=1 "
                             "lets small send/recv across hosts use LL (default: Simple)")
