"""Load a topology from a spec string, a JSON file or a tool's output (format auto-detected).

Formats: ``nvidia-smi`` (``nvidia-smi topo -m``), ``rocm-smi`` (``rocm-smi --showtopo``),
``nccl-xml`` (``NCCL_TOPO_DUMP_FILE`` / RCCL topology XML) and ``json`` (:meth:`to_json`).
Any of them takes ``FILE:nodes=N[,nic_gbps=G,rails=R,leaf=K]`` to replicate its host over a
rail fabric (:mod:`treeattn.topo.replicate`); options are checked before the file is read.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from treeattn.topo.errors import TopologyError

FORMATS = ("auto", "nvidia-smi", "rocm-smi", "nccl-xml", "json")
MAX_FILE_BYTES = 16 * 1024 * 1024


def load(cls, source, fmt: str = "auto", gpu: str | None = None):
    """See :meth:`treeattn.topo.Topology.load`."""
    if fmt not in FORMATS:
        raise TopologyError(f"unknown format {fmt!r} (known: {', '.join(FORMATS)})")
    path = Path(source)
    text_source = str(source)
    split = _file_with_options(path, text_source, fmt)
    if split is not None:
        from treeattn.topo.replicate import parse_options, replicate

        file, opts_text = split
        opts = parse_options(opts_text, Path(file).name)  # before reading: nodes=1e9 fails fast
        base = load(cls, file, fmt=fmt, gpu=gpu)
        return cls(replicate(base.graph, opts, Path(file).name), name=Path(text_source).name)
    if not path.exists() and fmt == "auto" and _looks_like_spec(text_source):
        return cls.from_spec(text_source)
    text = read_text(path)
    return parse_text(cls, text, path.name, fmt=fmt, gpu=gpu)


def _file_with_options(path: Path, source: str, fmt: str) -> tuple[str, str] | None:
    """``(file, options)`` when ``source`` is ``FILE:key=value,...`` naming a file (an existing
    path, or one that cannot be a built-in spec), else ``None``."""
    if path.exists():
        return None
    from treeattn.topo.replicate import split_source

    split = split_source(source)
    if split is None:
        return None
    file = split[0]
    if fmt == "auto" and _looks_like_spec(file) and not Path(file).exists():
        return None  # a built-in spec such as dgx-h100:nodes=2
    return split


def expected_gpus(source, fmt: str = "auto") -> int | None:
    """The GPU count of a spec or JSON topology, read cheaply *before* building any graph.

    Callers with a size limit (``topo show --json``) refuse early with it. ``None`` when the
    count is not known up front (tool outputs: their importers cap it themselves).

    >>> expected_gpus("dgx-h100:nodes=625"), expected_gpus("local:ranks=3")
    (5000, 3)
    """
    path = Path(source)
    split = _file_with_options(path, str(source), fmt)
    if split is not None:
        from treeattn.topo.replicate import parse_options

        opts = parse_options(split[1], Path(split[0]).name)
        per_host = expected_gpus(split[0], fmt)
        return None if per_host is None else per_host * opts["nodes"]
    if not path.exists() and fmt == "auto" and _looks_like_spec(str(source)):
        from treeattn.topo.builders import spec_gpus

        return spec_gpus(str(source))
    if fmt == "json" or (fmt == "auto" and path.suffix == ".json"):
        import json

        try:
            data = json.loads(read_text(path))
        except ValueError:
            return None  # the real load names the problem
        nodes = data.get("nodes") if isinstance(data, dict) else None
        if isinstance(nodes, list):
            return sum(1 for n in nodes if isinstance(n, dict) and n.get("kind") == "gpu")
    return None


def _looks_like_spec(s: str) -> bool:
    return "/" not in s and not s.endswith((".json", ".txt", ".xml", ".log"))


def read_text(path: Path) -> str:
    """The text of ``path``; :class:`TopologyError` if missing, empty, binary or huge.

    The file is ``os.stat``-ed first and must be a regular file, so a FIFO or a device never
    blocks the open; it is then opened non-blocking and read up to the size cap only.
    """
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise TopologyError(f"no such file or topology spec: {str(path)!r}") from None
    except (OSError, ValueError) as exc:
        raise TopologyError(f"cannot read {str(path)!r}: {exc}") from None
    if not stat.S_ISREG(st.st_mode):
        raise TopologyError(f"not a regular file: {str(path)!r}")
    if st.st_size > MAX_FILE_BYTES:
        raise TopologyError(f"{path.name}: file too large for a topology "
                            f"({st.st_size} bytes, limit {MAX_FILE_BYTES})")
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):  # swapped after the stat
                raise TopologyError(f"not a regular file: {str(path)!r}")
            data = f.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise TopologyError(f"{path.name}: cannot read: {exc.strerror}") from None
    if len(data) > MAX_FILE_BYTES:
        raise TopologyError(f"{path.name}: file too large for a topology")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise TopologyError(f"{path.name}: not a UTF-8 text file") from None
    text = text.replace("\r\n", "\n").replace("\r", "\n")  # as Path.read_text did
    if "\0" in text:
        raise TopologyError(f"{path.name}: not a text file (NUL bytes)")
    if not text.strip():
        raise TopologyError(f"{path.name}: file is empty")
    return text


def detect_format(text: str) -> str:
    """Guess the format of a tool output.

    >>> detect_format('<system version="1"><cpu/></system>')
    'nccl-xml'
    """
    head = text.lstrip("\ufeff \t\r\n")
    if head.startswith("{"):
        return "json"
    if head.startswith("<"):
        return "nccl-xml"
    if "Link Type between two GPUs" in text or "Weight between two GPUs" in text:
        return "rocm-smi"
    for line in text.splitlines():
        fields = line.split()
        if fields and fields[0].startswith("GPU") and "GPU0" in line:
            return "nvidia-smi"
    raise TopologyError("unrecognised topology format (not JSON, NCCL XML, nvidia-smi or rocm-smi)")


def parse_text(cls, text: str, name: str, fmt: str = "auto", gpu: str | None = None):
    """Parse tool output or JSON text into a ``cls`` (a :class:`Topology`)."""
    if fmt == "auto":
        fmt = detect_format(text)
    if fmt == "json":
        return cls.from_json(text, name=name)
    if fmt == "nvidia-smi":
        from treeattn.topo.importers.nvsmi import parse_nvidia_smi as parse
    elif fmt == "rocm-smi":
        from treeattn.topo.importers.rocmsmi import parse_rocm_smi as parse
    else:
        from treeattn.topo.importers.ncclxml import parse_nccl_xml as parse
    return cls(parse(text, gpu=gpu), name=name)
