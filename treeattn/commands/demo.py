"""`treeattn demo`: the main job on built-in defaults, as run by `make demo`.

Each command module may offer a ``demo_section(console)``; the demo runs them in the order of
``COMMAND_MODULES`` (topologies, predictions, real runs, real generation) and stops at the
first failure with a non-zero exit.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from rich.console import Console

from treeattn.commands import COMMAND_MODULES


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("demo", help="run the main job on built-in defaults")
    parser.add_argument(
        "--quick", action="store_true", help="skip the real runs (topology and predictions only)"
    )
    parser.set_defaults(func=handle)


def handle(args: argparse.Namespace) -> int:
    # Piped output (make demo under CI, a log file) would otherwise be cut to 80 columns.
    console = Console() if sys.stdout.isatty() else Console(width=132)
    for module_name in COMMAND_MODULES:
        if module_name.endswith(".demo"):
            continue
        section = getattr(importlib.import_module(module_name), "demo_section", None)
        if section is None:
            continue
        if args.quick and getattr(section, "is_real_run", False):
            continue
        status = section(console)
        if status:
            return int(status)
    return 0
