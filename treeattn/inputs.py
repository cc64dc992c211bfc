"""Reading files someone else made: bounded, regular-file-only reads and checked JSON fields.

Plan files, calibration profiles and nccl-tests tables arrive from other people. Whatever
they hold, reading them must end in the value or in one line naming the file, the field and
what was expected (:class:`InputError`, a :class:`~treeattn.errors.UserError`: exit 2), never
a traceback, a hang or a silently wrong number:

* :func:`read_regular` refuses anything but a regular file *before* reading (a FIFO would
  block forever, ``/dev/zero`` never ends) and reads at most ``limit`` bytes.
* :func:`load_json` bounds the nesting depth with one linear scan before parsing (Python's
  parser recurses: ``[[[[...`` ends in a ``RecursionError``), and refuses ``NaN``,
  ``Infinity``, numbers that overflow to infinity and integers beyond 64 bits.
* :class:`Fields` reads one object's fields by a stated schema: a number only where a number
  belongs (``"12"`` and ``true`` are not numbers), finite and within a stated range, required
  keys present, and the field's dotted path in every message.

A shared leaf like :mod:`treeattn.atomic`: ``topo`` keeps its own readers and imports
nothing of ours.
"""

from __future__ import annotations

import json
import math
import os
import stat
from pathlib import Path

from treeattn.errors import UserError

MAX_DEPTH = 32  # nesting of arrays and objects; every file we read needs fewer than 8
MAX_INT = 2**63  # integers from a file must fit a C int64


class InputError(UserError):
    """A received file that cannot be used: names the file, the field and what was expected."""


def read_regular(path: str | os.PathLike, what: str, limit: int) -> bytes:
    """The bytes of ``path``, a regular file of at most ``limit`` bytes, else InputError.

    The file is opened non-blocking and checked with ``fstat`` on that descriptor, so a FIFO
    or a device is refused without waiting and a file swapped in after a check is still seen.
    """
    shown = str(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        raise InputError(f"cannot read {what} {shown}: {exc.strerror or exc}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = "a directory" if stat.S_ISDIR(st.st_mode) else "a FIFO, device or socket"
            raise InputError(f"{what} {shown}: expected a regular file, got {kind}")
        if st.st_size > limit:
            raise InputError(f"{what} {shown}: {st.st_size} bytes, expected at most {limit}")
        with os.fdopen(os.dup(fd), "rb") as handle:
            data = handle.read(limit + 1)
    except OSError as exc:
        raise InputError(f"cannot read {what} {shown}: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    if len(data) > limit:
        raise InputError(f"{what} {shown}: larger than {limit} bytes")
    return data


def json_depth(text: str) -> int:
    """The deepest nesting of arrays/objects in ``text``, brackets in strings not counted;
    one linear pass (it runs before the recursive parser).

    >>> json_depth('{"a": [1, {"b": "]]]"}]}')
    3
    """
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


def _finite_float(token: str) -> float:
    value = float(token)
    if not math.isfinite(value):
        raise ValueError(f"number {token[:40]} overflows to infinity")
    return value


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _bounded_int(token: str) -> int:
    if len(token.lstrip("-")) > 19 or abs(int(token)) >= MAX_INT:
        raise ValueError(f"integer of {len(token.lstrip('-'))} digits is beyond 64 bits")
    return int(token)


def load_json(text: str | bytes, source: str, max_depth: int = MAX_DEPTH):
    """Parse ``text`` (JSON) from ``source``; InputError on bad JSON, deep nesting, NaN,
    Infinity, overflowing floats or integers beyond 64 bits."""
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InputError(f"{source}: expected UTF-8 JSON, got a byte 0x{text[exc.start]:02x} "
                             f"at offset {exc.start}") from None
    depth = json_depth(text)
    if depth > max_depth:
        raise InputError(f"{source}: JSON nested {depth} deep, expected at most {max_depth}")
    try:
        return json.loads(text, parse_constant=_no_constant, parse_float=_finite_float,
                          parse_int=_bounded_int)
    except (ValueError, RecursionError) as exc:
        why = str(exc).splitlines()[0][:160]
        raise InputError(f"cannot read {source}: not valid JSON ({why})") from None


def read_json(path: str | os.PathLike, what: str, limit: int, max_depth: int = MAX_DEPTH):
    """:func:`read_regular` then :func:`load_json`."""
    return load_json(read_regular(path, what, limit), f"{what} {Path(path)}", max_depth)


def shown(value, width: int = 40) -> str:
    """A short repr of a value for messages (a 10 MB string stays one line)."""
    text = json.dumps(value) if isinstance(value, (str, bool, type(None))) else repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def kind_of(value) -> str:
    """The JSON name of a value's type, for messages."""
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return f"the number {shown(value)}"
    if isinstance(value, str):
        return f"the string {shown(value)}"
    if value is None:
        return "null"
    return "a list" if isinstance(value, list) else "an object"


class Fields:
    """Checked access to one JSON object's fields: ``Fields(obj, "profile x.json", "p2p")``.

    Every getter names ``source`` and the field's dotted path, says what was expected, and
    raises :class:`InputError`.
    """

    def __init__(self, data, source: str, path: str = "") -> None:
        self.source, self.path = source, path
        if not isinstance(data, dict):
            self.fail(path or "the document", "an object", data)
        self.data = data

    def where(self, key: str | int) -> str:
        if isinstance(key, int):
            return f"{self.path}[{key}]"
        return f"{self.path}.{key}" if self.path else str(key)

    def fail(self, field: str, expected: str, value=None, *, got: str | None = None):
        raise InputError(f"{self.source}: field {field}: expected {expected}, got "
                         f"{got or kind_of(value)}")

    def has(self, key: str) -> bool:
        return key in self.data

    def raw(self, key: str, required: bool = True, default=None):
        if key not in self.data:
            if required:
                self.fail(self.where(key), "a value", got="nothing (it is missing)")
            return default
        return self.data[key]

    def number(self, key: str, lo: float, hi: float, *, required: bool = True,
               default: float | None = None, lo_open: bool = False) -> float | None:
        """A JSON number (not a string, not a boolean), finite, in ``[lo, hi]`` (``(lo, hi]``
        with ``lo_open``)."""
        if key not in self.data and not required:
            return default
        return check_number(self.raw(key), self.source, self.where(key), lo, hi, lo_open)

    def integer(self, key: str, lo: int, hi: int, *, required: bool = True,
                default: int | None = None) -> int | None:
        if key not in self.data and not required:
            return default
        return check_integer(self.raw(key), self.source, self.where(key), lo, hi)

    def string(self, key: str, choices=None, *, required: bool = True, default=None,
               max_len: int = 200) -> str | None:
        if key not in self.data and not required:
            return default
        value = self.raw(key)
        if not isinstance(value, str) or len(value) > max_len:
            self.fail(self.where(key), f"a string of at most {max_len} characters", value)
        if choices is not None and value not in choices:
            self.fail(self.where(key), "one of " + ", ".join(map(str, choices)), value)
        return value

    def boolean(self, key: str, *, required: bool = True, default: bool | None = None):
        if key not in self.data and not required:
            return default
        value = self.raw(key)
        if not isinstance(value, bool):
            self.fail(self.where(key), "true or false", value)
        return value

    def obj(self, key: str, *, required: bool = True) -> Fields | None:
        if key not in self.data and not required:
            return None
        return Fields(self.raw(key), self.source, self.where(key))

    def array(self, key: str, max_len: int, *, required: bool = True, min_len: int = 0):
        if key not in self.data and not required:
            return None
        value = self.raw(key)
        if not isinstance(value, list) or not min_len <= len(value) <= max_len:
            self.fail(self.where(key), f"a list of {min_len} to {max_len} items", value)
        return value

    def numbers(self, key: str, lo: float, hi: float, max_len: int, *, required: bool = True,
                integer: bool = False, min_len: int = 0) -> list | None:
        """A list of numbers (integers with ``integer``), each in ``[lo, hi]``."""
        items = self.array(key, max_len, required=required, min_len=min_len)
        if items is None:
            return None
        check = check_integer if integer else check_number
        return [check(v, self.source, f"{self.where(key)}[{i}]", lo, hi)
                for i, v in enumerate(items)]


def check_number(value, source: str, field: str, lo: float, hi: float,
                 lo_open: bool = False) -> float:
    """``value`` as a float if it is a JSON number in range, else InputError naming it."""
    expected = f"a number in {'(' if lo_open else '['}{lo:g}, {hi:g}]"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InputError(f"{source}: field {field}: expected {expected}, got {kind_of(value)}")
    number = float(value)
    if not math.isfinite(number) or number < lo or number > hi or (lo_open and number == lo):
        raise InputError(f"{source}: field {field}: expected {expected}, got {shown(value)}")
    return number


def check_integer(value, source: str, field: str, lo: int, hi: int) -> int:
    """``value`` if it is a JSON integer in ``[lo, hi]`` (``3.0`` is not), else InputError."""
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        got = kind_of(value) if isinstance(value, bool) or not isinstance(value, int) \
            else shown(value)
        raise InputError(f"{source}: field {field}: expected an integer in [{lo}, {hi}], "
                         f"got {got}")
    return value
