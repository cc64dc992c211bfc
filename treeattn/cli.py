"""The `treeattn` command: parse arguments, call the packages, print the results.

Bad input of any kind ends in one ``error: ...`` line on stderr and exit status 2. A bug
still gives a traceback, so it is not mistaken for a user's mistake.

The planner (``topo``, ``predict``, ``plan``) needs only the base dependencies; the commands
that run for real need an extra (``treeattn[runtime]``: torch and triton; ``treeattn[llm]``:
also the model file formats). Without it they print one line naming the extra, exit status 2.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

import treeattn
from treeattn import testbed
from treeattn.commands import COMMAND_MODULES, COMMAND_OWNERS
from treeattn.errors import TreeattnError

EXIT_BAD_INPUT = 2

# Optional third-party packages -> the extra that installs them.
EXTRAS = {"torch": "runtime", "triton": "runtime",
          "gguf": "llm", "tokenizers": "llm", "safetensors": "llm", "jinja2": "llm"}
LLM_COMMANDS = ("generate",)  # need treeattn[llm] even where only torch is missing


def missing_extra(exc: ModuleNotFoundError, command: str | None) -> str | None:
    """The one-line message for an optional dependency that is not installed, else None.

    >>> missing_extra(ModuleNotFoundError(name="torch"), "run")
    "this command needs torch: pip install 'treeattn[runtime]'"
    >>> missing_extra(ModuleNotFoundError(name="torch"), "generate")
    "this command needs torch: pip install 'treeattn[llm]'"
    >>> missing_extra(ModuleNotFoundError(name="yaml"), "run") is None
    True
    """
    extra = EXTRAS.get(exc.name or "")
    if extra is None:
        return None
    if command in LLM_COMMANDS:
        extra = "llm"
    return f"this command needs {exc.name}: pip install 'treeattn[{extra}]'"


class _Parser(argparse.ArgumentParser):
    """argparse that keeps its usage errors to one line and exit status 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write(f"error: {self.prog}: {message}\n")
        raise SystemExit(EXIT_BAD_INPUT)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The full parser, or, when ``command`` names a known sub-command, one with only the
    module that registers it (so running it imports nothing else)."""
    parser = _Parser(
        prog="treeattn",
        description="Topology-aware Tree Attention: model, predict, run and check.",
    )
    parser.add_argument("--version", action="version", version=f"treeattn {treeattn.__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    modules = (COMMAND_OWNERS[command],) if command in COMMAND_OWNERS else COMMAND_MODULES
    for module_name in modules:
        importlib.import_module(module_name).register(subparsers)
    return parser


def _fail(message: str) -> int:
    sys.stderr.write(f"error: {message}\n")
    return EXIT_BAD_INPUT


def main(argv: list[str] | None = None) -> int:
    return _leave(_main(argv))


def _leave(code: int) -> int:
    """End a torchrun rank without running C++ destructors at interpreter exit.

    Its work is done and its process group destroyed by then, but torch's static
    destructors can still abort the process ("terminate called without an active
    exception", seen in CI), which turns a finished rank into a crash with exit status -6.
    So once the output is flushed, a rank leaves with ``os._exit``, as the launcher's own
    ranks do. Any other use of ``main`` (the console command, tests) returns normally.
    """
    if "torch.distributed" not in sys.modules:  # never joined a group: nothing to skip
        return code
    from treeattn.runtime.group import in_torchrun_env

    if in_torchrun_env():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _main(argv: list[str] | None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    command = argv[0] if argv else None
    try:
        parser = build_parser(command)
    except ModuleNotFoundError as exc:
        if (message := missing_extra(exc, command)) is None:
            raise
        return _fail(message)
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_BAD_INPUT
    testbed.plug_in_profiles()  # profiles of this host's CPU ranks: the test bed reads them
    try:
        return int(args.func(args) or 0)
    except ModuleNotFoundError as exc:
        if (message := missing_extra(exc, args.command)) is None:
            raise
        return _fail(message)
    except TreeattnError as exc:
        return _fail(str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__)
    except OSError as exc:  # a path the user named: missing, a directory, too long, ...
        if exc.filename is None:
            raise
        return _fail(f"{exc.strerror or exc}: {str(exc.filename)[:200]}")
    except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM while ranks run (see launch.py)
        sys.stderr.write(f"error: {str(exc) or 'interrupted'}\n")
        return 130


if __name__ == "__main__":
    sys.exit(main())
