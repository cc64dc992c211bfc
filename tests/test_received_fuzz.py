"""The fuzz campaign over received files: plan files, profiles, nccl-tests outputs, GGUF
headers and output paths, as ``test_topo_fuzz.py`` is for topology files.

Each case mutates a valid input (a field replaced by a hostile value, a key dropped, text
truncated, bytes flipped, a Unicode digit slipped in) and feeds it to the reader. The
contract: the reader returns a value its consumers can use, or raises the package's input
error with a one-line message naming the file; never another exception, never a hang. The first
refused plans and profiles also go through the CLI: one ``error:`` line, exit 2.

Exactly :data:`CASES` cases per kind (1,400 in all), each campaign asserting its count; a
case that hangs is stopped by the file's timeout. ``TREEATTN_FUZZ_SEED`` picks the seed
(default: fixed, so a failure reproduces); the seed is in every failure message.
"""

from __future__ import annotations

import copy
import json
import os
import random
import stat
import struct
from pathlib import Path

import pytest

from treeattn import atomic
from treeattn.cli import main
from treeattn.errors import UserError
from treeattn.inputs import load_json
from treeattn.sim import SimError

pytestmark = pytest.mark.timeout(300)
SEED = int(os.environ.get("TREEATTN_FUZZ_SEED", "31"))
HOSTILE = Path(__file__).parent / "fixtures" / "hostile"
CASES = {"plan": 450, "profile": 350, "nccl": 350, "gguf": 150, "output": 100}
REFUSED = (UserError, SimError)
VALUES = ["12", True, False, None, -1, 0, 2**63, -(2**70), 1e308, -1e308, 0.5, 3.0, [], {},
          [1, 2], {"a": 1}, "", "x" * 300, "²", "partial", 1 << 30, [[[[[]]]]], "NaN"]


def _paths(node, prefix=()):
    yield prefix
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(node, list):
        for i, v in enumerate(node[:12]):
            yield from _paths(v, (*prefix, i))


def _mutate_tree(rng: random.Random, data):
    """One structural mutation of a parsed JSON document."""
    data = copy.deepcopy(data)
    paths = [p for p in _paths(data) if p]
    path = rng.choice(paths)
    parent = data
    for key in path[:-1]:
        parent = parent[key]
    last = path[-1]
    op = rng.random()
    if op < 0.55:
        parent[last] = rng.choice(VALUES)
    elif op < 0.7 and isinstance(parent, dict):
        del parent[last]
    elif op < 0.8 and isinstance(parent[last], (int, float)) and not isinstance(
            parent[last], bool):
        parent[last] = parent[last] * rng.choice([-1, 2, 10**6, 0, 1.5])
    elif op < 0.9 and isinstance(parent, list):
        parent.insert(last, copy.deepcopy(parent[last]))
    else:
        parent[last] = [parent[last]]
    return data


def _mutate_text(rng: random.Random, text: str) -> str:
    op = rng.random()
    if op < 0.25:
        return text[: rng.randrange(len(text))]
    if op < 0.5:
        i = rng.randrange(len(text))
        return text[:i] + rng.choice(["²", "\x00", "]", "{", "9" * 400, "1e999", "-",
                                      "Infinity", '"', "\\"]) + text[i + 1:]
    if op < 0.7:
        digits = [i for i, c in enumerate(text) if c.isdigit()]
        if digits:
            i = rng.choice(digits)
            return text[:i] + rng.choice(["²", "٣", "9" * 30, "e9"]) + text[i + 1:]
    return json.dumps(_mutate_tree(rng, json.loads(text)))


def _contract(kind: str, seed_case: str, fn):
    """Run ``fn``; it may return or raise a one-line input error. Returns the refusal."""
    try:
        fn()
    except REFUSED as exc:
        text = str(exc)
        assert text.strip() and "\n" not in text.strip(), f"{kind} {seed_case}: {text!r}"
        return text
    except Exception as exc:  # noqa: BLE001 - the point: nothing else may escape
        raise AssertionError(f"{kind} {seed_case}: {type(exc).__name__}: {exc}") from exc
    return None


def _campaign(kind: str, case_fn) -> None:
    """Run exactly ``CASES[kind]`` cases of ``case_fn(rng, where)``."""
    rng = random.Random(f"{SEED}-{kind}")
    for case in range(CASES[kind]):
        case_fn(rng, f"seed {SEED} case {case}")


def _cli_refuses(argv: list[str], capsys, where: str) -> None:
    capsys.readouterr()
    code = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error:"), f"{where}: {err}"


# -- plan files --------------------------------------------------------------------------

def test_fuzz_plan_files(tmp_path, capsys):
    from treeattn.sim.files.plan_file import plan_from_json, read_plan

    base = (HOSTILE / "plans" / "ok-tree.json").read_text()
    path = tmp_path / "plan.json"

    def case(rng, where):
        text = _mutate_text(rng, base)
        path.write_text(text, encoding="utf-8", errors="surrogatepass")
        refusal = _contract("plan", where, lambda: plan_from_json(load_json(text, "p"), "p"))
        again = _contract("plan", where, lambda: read_plan(path))
        assert (refusal is None) == (again is None), where
        if again is not None:
            assert str(path) in again, f"{where}: {again}"
            if len(refused) < 3:
                refused.append((tmp_path / f"refused-{len(refused)}.json", text, where))

    refused: list = []
    _campaign("plan", case)
    for kept, text, where in refused:  # through the CLI too
        kept.write_text(text, encoding="utf-8", errors="surrogatepass")
        _cli_refuses(["run", "--nproc", "2", "--plan", str(kept)], capsys, where)


# -- profiles ----------------------------------------------------------------------------

def test_fuzz_profiles(tmp_path, capsys):
    from treeattn.sim.files.profiles import load_profile, plan_overrides
    from treeattn.testbed.host.profiles import (
        backend_from_profile,
        hardware_from_profile,
        profile_bound,
        topology_from_profile,
    )
    from treeattn.topo import Topology

    cpu = (HOSTILE / "profiles" / "ok-cpu.json").read_text()
    h100 = (HOSTILE / "profiles" / "ok-h100.json").read_text()
    local, dgx = Topology.from_spec("local:ranks=2"), Topology.from_spec("dgx-h100")
    path = tmp_path / "profile.json"

    def use(profile: dict, gpu: bool) -> None:
        plan_overrides(path, dgx if gpu else local)
        backend_from_profile(profile)
        if not gpu:
            hardware_from_profile(profile)
            topology_from_profile(profile, 2)
            for side in ("lo", "hi"):
                hardware_from_profile(profile_bound(profile, side))

    def case(rng, where):
        gpu = rng.random() < 0.3
        text = _mutate_text(rng, h100 if gpu else cpu)
        path.write_text(text, encoding="utf-8", errors="surrogatepass")
        refusal = _contract("profile", where, lambda: use(load_profile(path), gpu))
        if refusal is not None:
            assert str(path) in refusal, f"{where}: {refusal}"
            if len(refused) < 3:
                refused.append((tmp_path / f"refused-{len(refused)}.json", text, gpu, where))

    refused: list = []
    _campaign("profile", case)
    for kept, text, gpu, where in refused:  # through the CLI too
        kept.write_text(text, encoding="utf-8", errors="surrogatepass")
        _cli_refuses(["predict", "--topology", "dgx-h100" if gpu else "local:ranks=2",
                      "--model", "debug", "--seq-len", "64", "--profile", str(kept)],
                     capsys, where)


# -- nccl-tests outputs ------------------------------------------------------------------

def test_fuzz_nccl_tests_outputs():
    from treeattn.sim.nccl.fit import _rows
    from treeattn.sim.nccl.nccltests import parse_nccl_sections

    base = (Path(__file__).parent / "fixtures" / "nccl-tests"
            / "h100-2node-all-reduce-perf-8B-16G-issue309.txt").read_text().splitlines()
    tokens = ["²", "٣", "9" * 2000, "N/A", "-1", "1e999", "nan", "inf", "0", "#", "12.5",
              "# Collective test starting: all_gather_perf", "#  Rank 99 on x device 0",
              "0:", "1e-400"]

    def case(rng, where):
        lines = list(base)
        for _ in range(rng.randint(1, 4)):
            i = rng.randrange(len(lines))
            op = rng.random()
            if op < 0.5:
                fields = lines[i].split() or [""]
                fields[rng.randrange(len(fields))] = rng.choice(tokens)
                lines[i] = " ".join(fields)
            elif op < 0.7:
                lines.insert(i, rng.choice(tokens))
            elif op < 0.85:
                lines.insert(i, lines[rng.randrange(len(lines))])
            else:
                del lines[i]
        text = "\n".join(lines)
        _contract("nccl", where, lambda: _rows(parse_nccl_sections(text, op="all_reduce",
                                                                   source="t.txt")))

    _campaign("nccl", case)


# -- GGUF headers ------------------------------------------------------------------------

def test_fuzz_gguf_headers(tmp_path):
    from tests.test_received_tables import _gguf
    from treeattn.llm.errors import ModelError
    from treeattn.llm.formats.weights import load_model

    kv = {"llama.block_count": 1, "llama.embedding_length": 16,
          "llama.feed_forward_length": 32, "llama.attention.head_count": 2}
    tensors = [("token_embd.weight", (16, 8)), ("output_norm.weight", (16,)),
               ("blk.0.attn_norm.weight", (16,))]
    base = bytearray(_gguf(kv, tensors))
    header = len(base) - 4 * (16 * 8 + 16 + 16)
    path = tmp_path / "m.gguf"

    def case(rng, where):
        data = bytearray(base)
        for _ in range(rng.randint(1, 6)):
            i = rng.randrange(header)
            if rng.random() < 0.5:
                data[i] = rng.randrange(256)
            else:  # a count or an offset that lies: a big little-endian integer
                j = min(i, header - 8)
                data[j:j + 8] = struct.pack("<Q", rng.choice([2**32, 10**9, 2**63, 7, 0]))
        if rng.random() < 0.2:
            data = data[: rng.randrange(len(data))]
        path.write_bytes(bytes(data))
        try:
            load_model(str(path))
        except ModelError as exc:
            assert "\n" not in str(exc), f"{where}: {exc!r}"
        except Exception as exc:  # noqa: BLE001
            raise AssertionError(f"gguf {where}: {type(exc).__name__}: {exc}") from exc

    _campaign("gguf", case)


# -- output paths ------------------------------------------------------------------------

def test_fuzz_output_paths(tmp_path):
    def target(rng, where, root: Path) -> tuple[Path, str]:
        kind = rng.choice(["new", "regular", "readonly", "fifo", "device", "dir", "symlink",
                           "dangling", "loop", "missing-parent", "socket-like"])
        path = root / f"out-{rng.randrange(10**9)}"
        if kind == "regular":
            path.write_text("old")
        elif kind == "readonly":
            path.write_text("old")
            path.chmod(0o444)
        elif kind == "fifo":
            os.mkfifo(path)
        elif kind in ("device", "socket-like"):
            try:
                os.mknod(path, 0o666 | (stat.S_IFCHR if kind == "device" else stat.S_IFBLK),
                         os.makedev(1, 3 if kind == "device" else 7))
            except OSError:
                kind = "new"
        elif kind == "dir":
            path.mkdir()
        elif kind == "symlink":
            real = root / f"real-{rng.randrange(10**9)}"
            real.write_text("old")
            path.symlink_to(real)
        elif kind == "dangling":
            path.symlink_to(root / "nowhere" / "x")
        elif kind == "loop":
            path.symlink_to(root / "loop-back")
            (root / "loop-back").symlink_to(path)
        elif kind == "missing-parent":
            path = root / "missing" / "x.json"
        return path, kind

    def case(rng, where):
        root = tmp_path / f"c{rng.randrange(10**9)}"
        root.mkdir()
        path, kind = target(rng, where, root)
        before = os.lstat(path) if os.path.lexists(path) else None
        before_target = os.readlink(path) if os.path.islink(path) else None
        try:
            atomic.write_text(path, "new")
            outcome = "written"
        except atomic.OutputError as exc:
            assert "\n" not in str(exc), where
            outcome = "refused"
        except Exception as exc:  # noqa: BLE001
            raise AssertionError(f"output {where} ({kind}): {type(exc).__name__}: {exc}") from exc
        if before is not None and not stat.S_ISREG(before.st_mode):
            after = os.lstat(path)  # a link stays the link it was, anything else its kind
            assert stat.S_IFMT(after.st_mode) == stat.S_IFMT(before.st_mode), (where, kind)
        if kind == "readonly":
            assert outcome == "refused" and path.read_text() == "old", where
        if kind == "regular" or kind == "new":
            assert outcome == "written" and path.read_text() == "new", (where, kind)
        if kind in ("symlink", "dangling", "loop"):
            assert outcome == "refused" and os.readlink(path) == str(before_target), where
        if kind == "symlink":
            assert path.read_text() == "old", where
        if kind in ("fifo", "socket-like", "dir", "missing-parent"):
            assert outcome == "refused", (where, kind)

    _campaign("output", case)
