"""Atomic outputs: a file or a folder is either the old one or the whole new one, never half.

Every file the tool writes goes through here. A write goes to a temporary file in the same
folder (so the final ``os.replace`` is a rename inside one file system, which POSIX makes
atomic), is flushed and fsynced, and only then replaces the target. When anything fails (a
full disk, a file-size limit, an exception in the code producing the content, Ctrl-C) the
temporary is removed and the previous output is left exactly as it was.

A folder of outputs (a sweep's tables and plots) is built whole in a sibling temporary folder
and then swapped in, so an interrupted sweep never leaves new tables beside old plots.

Failures become :class:`OutputError`, a :class:`~treeattn.errors.UserError`, so the CLI
prints one ``error: cannot write PATH: REASON`` line instead of a traceback.

This module is a shared leaf like :mod:`treeattn.errors`; ``topo`` still imports nothing of
ours: the commands hand ``topo`` a temporary path from :func:`atomic_path`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from treeattn.errors import UserError


class OutputError(UserError):
    """An output could not be written; the previous output (if any) is untouched."""


def _reason(exc: OSError) -> str:
    return exc.strerror or str(exc) or type(exc).__name__


def check_output_path(path: str | os.PathLike, *, folder: bool = False) -> Path:
    """Fail early, before any work, if ``path`` cannot be written.

    The parent folder must exist and be writable, and the path itself must not be a folder
    (for a file) or a file (for a folder). Returns the path as a :class:`Path`.
    """
    target = Path(path)
    parent = target.parent if str(target.parent) else Path(".")
    if not parent.is_dir():
        raise OutputError(f"cannot write {str(target)!r}: no such directory {str(parent)!r}")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputError(f"cannot write {str(target)!r}: permission denied on {str(parent)!r}")
    if folder and target.exists() and not target.is_dir():
        raise OutputError(f"cannot write folder {str(target)!r}: a file of that name exists")
    if not folder and target.is_dir():
        raise OutputError(f"cannot write {str(target)!r}: it is a directory")
    return target


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success fsync it and rename it into place.

    For writers that insist on a file name (``matplotlib.savefig``, ``Topology.draw``).
    """
    target = check_output_path(path)
    try:
        fd, tmp_name = tempfile.mkstemp(
            dir=target.parent, prefix=f".{target.name}.", suffix=f".tmp{target.suffix}"
        )
    except OSError as exc:
        raise OutputError(f"cannot write {str(target)!r}: {_reason(exc)}") from None
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        _fsync_file(tmp)
        os.replace(tmp, target)
    except OSError as exc:
        raise OutputError(f"cannot write {str(target)!r}: {_reason(exc)}") from None
    finally:
        tmp.unlink(missing_ok=True)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (temp file, fsync, rename)."""
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())


def write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically."""
    write_bytes(path, text.encode("utf-8"))


@contextlib.contextmanager
def atomic_folder(path: str | os.PathLike) -> Iterator[Path]:
    """Yield an empty temporary folder beside ``path``; on success swap it in for ``path``.

    The previous folder (if any) is renamed aside, the new one renamed into place, then the
    old one removed, so at every instant ``path`` is either the whole old or the whole new
    output. On failure the temporary folder is removed and ``path`` is untouched.
    """
    target = check_output_path(path, folder=True)
    try:
        tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp"))
    except OSError as exc:
        raise OutputError(f"cannot write folder {str(target)!r}: {_reason(exc)}") from None
    try:
        yield tmp
        for child in tmp.rglob("*"):
            if child.is_file():
                _fsync_file(child)
        _swap_in(tmp, target)
    except OSError as exc:
        raise OutputError(f"cannot write folder {str(target)!r}: {_reason(exc)}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _swap_in(new: Path, target: Path) -> None:
    if not target.exists():
        os.replace(new, target)
        return
    old = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.", suffix=".old"))
    old.rmdir()  # only its unique name is wanted
    os.replace(target, old)
    try:
        os.replace(new, target)
    except OSError:
        os.replace(old, target)  # put the previous output back
        raise
    shutil.rmtree(old, ignore_errors=True)
