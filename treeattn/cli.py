"""The `treeattn` command: parse arguments, call the packages, print the results.

Bad input of any kind ends in one ``error: ...`` line on stderr and exit status 2. A bug
still gives a traceback, so it is not mistaken for a user's mistake.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from treeattn.commands import COMMAND_MODULES, COMMAND_OWNERS
from treeattn.errors import UserError

EXIT_BAD_INPUT = 2


def _user_error_types() -> tuple[type[BaseException], ...]:
    """Every exception type that means "the input was bad".

    Only packages already imported are asked: an error can only come from one of those.
    """
    found: list[type[BaseException]] = [UserError]
    for module_name, class_name in (
        ("treeattn.topo", "TopologyError"),
        ("treeattn.sim", "SimError"),
        ("treeattn.kernels", "KernelError"),
        ("treeattn.runtime", "RuntimeFailure"),
        ("treeattn.runtime", "ModelError"),
    ):
        error_type = getattr(sys.modules.get(module_name), class_name, None)
        if isinstance(error_type, type) and issubclass(error_type, BaseException):
            found.append(error_type)
    return tuple(found)


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
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    modules = (COMMAND_OWNERS[command],) if command in COMMAND_OWNERS else COMMAND_MODULES
    for module_name in modules:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name == module_name:
                continue  # command not built yet
            raise
        module.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(argv[0] if argv else None)
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_BAD_INPUT
    try:
        return int(args.func(args) or 0)
    except _user_error_types() as exc:
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        sys.stderr.write(f"error: {message}\n")
        return EXIT_BAD_INPUT
    except (FileNotFoundError, IsADirectoryError, PermissionError) as exc:
        sys.stderr.write(f"error: {exc.strerror or exc}: {exc.filename}\n")
        return EXIT_BAD_INPUT
    except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM while ranks run (see launch.py)
        sys.stderr.write(f"error: {str(exc) or 'interrupted'}\n")
        return 130


if __name__ == "__main__":
    sys.exit(main())
