"""Atomic outputs: a file or a folder is either the old one or the whole new one, never half.

Every file the tool writes goes through here. A write goes to a temporary file in the same
folder (so the final ``os.replace`` is a rename inside one file system, which POSIX makes
atomic), is flushed and fsynced, and only then replaces the target. When anything fails (a
full disk, a file-size limit, an exception in the code producing the content, Ctrl-C) the
temporary is removed and the previous output is left exactly as it was.

A folder of outputs (a sweep's tables and plots) is built whole in a sibling temporary folder
and then swapped in, so an interrupted sweep never leaves new tables beside old plots.

What is already at the path is never destroyed. A special file (a FIFO, a character
device such as ``/dev/null``) is written in place, never renamed over: the rename would put
a regular file where the device node was, which as root silently breaks the system. A FIFO
with no reader, a block device or a socket is refused rather than waited on. A read-only
file is refused, even as root where the permission bits do not stop a write: the user made
it read-only to keep it. A symbolic link (dangling, or one of a loop, too) is refused: whether
the link or what it points to was meant is a guess, and either guess can clobber a file the
user did not name. An empty path is refused. Two outputs of one command that name the same
file (by path, through a link, or as two hard links) are refused before any work starts
(:func:`check_distinct`).

Failures become :class:`OutputError`, a :class:`~treeattn.errors.UserError`, so the CLI
prints one ``error: cannot write PATH: REASON`` line instead of a traceback.

This module is a shared leaf like :mod:`treeattn.errors`; ``topo`` still imports nothing of
ours: the commands hand ``topo`` a temporary path from :func:`atomic_path`.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

from treeattn.errors import UserError


class OutputError(UserError):
    """An output could not be written; the previous output (if any) is untouched."""


def _reason(exc: OSError) -> str:
    return exc.strerror or str(exc) or type(exc).__name__


def _output(path: str | os.PathLike, what: str = "") -> Path:
    """``path`` as a :class:`Path`, refused if empty or a symbolic link."""
    shown = os.fspath(path)
    if not str(shown).strip():
        raise OutputError(f"cannot write {what}{shown!r}: an empty path")
    if os.path.islink(shown):  # lstat: a dangling link and a loop are links too
        raise OutputError(f"cannot write {what}{shown!r}: it is a symbolic link; give the "
                          "path of the file itself")
    return Path(shown)


def _written_in_place(target: Path) -> bool:
    """Whether ``target`` is a special file that is written through, never renamed over."""
    try:
        mode = os.stat(target).st_mode
    except OSError:
        return False
    return stat.S_ISCHR(mode) or stat.S_ISFIFO(mode)


def check_output_path(path: str | os.PathLike, *, folder: bool = False) -> Path:
    """Fail early, before any work, if ``path`` cannot be written.

    The parent folder must exist and be writable, and the path itself must not be a folder
    (for a file) or a file (for a folder). An existing target must be a regular file with a
    write permission bit set (checked on the bits, so root is refused too), or a character
    device or FIFO (written in place). An empty path and a symbolic link are refused. Returns
    the path as a :class:`Path`.
    """
    shown = str(path)
    target = _output(path, "folder " if folder else "")
    parent = target.parent if str(target.parent) else Path(".")
    if not parent.is_dir():
        raise OutputError(f"cannot write {shown!r}: no such directory {str(parent)!r}")
    if folder and target.exists() and not target.is_dir():
        raise OutputError(f"cannot write folder {shown!r}: a file of that name exists")
    if not folder and target.is_dir():
        raise OutputError(f"cannot write {shown!r}: it is a directory")
    try:
        st = os.stat(target)
    except OSError:
        st = None
    if st is not None and not folder:
        if stat.S_ISCHR(st.st_mode) or stat.S_ISFIFO(st.st_mode):
            if not os.access(target, os.W_OK):
                raise OutputError(f"cannot write {shown!r}: permission denied")
            return target  # written in place; its folder need not be writable
        if not stat.S_ISREG(st.st_mode):
            raise OutputError(f"cannot write {shown!r}: it is not a regular file (a block "
                              "device or socket), and it will not be replaced")
        if not st.st_mode & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH):
            raise OutputError(f"cannot write {shown!r}: it is read-only (mode "
                              f"{stat.S_IMODE(st.st_mode):o}); it will not be replaced")
        if not os.access(target, os.W_OK):
            raise OutputError(f"cannot write {shown!r}: permission denied")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputError(f"cannot write {shown!r}: permission denied on {str(parent)!r}")
    return target


def check_distinct(*paths: str | os.PathLike | None) -> None:
    """Refuse two outputs of one command that name the same file (``-o x --trace x``), by
    their resolved paths and, for files that exist, their device and inode (hard links), so
    that neither silently overwrites the other; ``None`` skipped, an empty path refused."""
    seen: dict[object, str] = {}
    for path in paths:
        if path is None:
            continue
        _output(path)
        keys = [os.path.realpath(path)]
        with contextlib.suppress(OSError):
            st = os.stat(path)
            keys.append((st.st_dev, st.st_ino))
        for key in keys:
            if key in seen:
                raise OutputError(f"two outputs name the same file: {seen[key]!r} and "
                                  f"{str(path)!r}; give each its own path")
        for key in keys:
            seen[key] = str(path)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success fsync it and rename it into place.

    For writers that insist on a file name (``matplotlib.savefig``, ``Topology.draw``).
    """
    target = check_output_path(path)
    if _written_in_place(target):
        try:
            yield target  # a device or FIFO: written through, never replaced
        except OSError as exc:
            raise OutputError(f"cannot write {str(path)!r}: {_reason(exc)}") from None
        return
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
    """Write ``data`` to ``path`` atomically (temp file, fsync, rename); a character device
    or a FIFO with a reader is written in place (a FIFO without one is refused, not waited
    on)."""
    target = check_output_path(path)
    if _written_in_place(target):
        _write_through(target, str(path), data)
        return
    with atomic_path(target) as tmp:
        with open(tmp, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())


def _write_through(target: Path, shown: str, data: bytes) -> None:
    try:  # O_NONBLOCK: opening a FIFO nobody reads fails (ENXIO) instead of blocking
        fd = os.open(target, os.O_WRONLY | os.O_NONBLOCK)
    except OSError as exc:
        why = "a FIFO with no reader" if exc.errno == errno.ENXIO else _reason(exc)
        raise OutputError(f"cannot write {shown!r}: {why}") from None
    try:
        os.set_blocking(fd, True)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    except OSError as exc:
        raise OutputError(f"cannot write {shown!r}: {_reason(exc)}") from None
    finally:
        os.close(fd)


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
