"""nccl-tests tables and GGUF headers someone sent: sections kept apart by op, counts checked
against the topology and the file, conflicting or absurd rows refused in one line."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from treeattn.cli import main
from treeattn.sim import SimError
from treeattn.sim.nccl.nccltests import parse_nccl_sections, parse_nccl_tests

pytestmark = pytest.mark.timeout(120)
FIXTURES = Path(__file__).parent / "fixtures" / "nccl-tests"
ONE_NODE = FIXTURES / "h100-1node-all-reduce-perf-large-issue290.txt"


def _ranks(hosts: list[str]) -> str:
    return "".join(f"#  Rank {r} Group 0 Pid 1 on {h} device {r % 8} [0x18] NVIDIA H100\n"
                   for r, h in enumerate(hosts))


ROW = "{size:>12} {count:>12} float sum -1 {t:>8} 1.00 1.75 0 {t:>8} 1.00 1.75 0\n"


def _rows(times: dict[int, float]) -> str:
    return "".join(ROW.format(size=n, count=n // 4, t=t) for n, t in times.items())


def test_sections_of_two_ops_are_kept_apart():
    text = ("# nThread 1 nGpus 8\n" + _ranks(["a"] * 8)
            + "# Collective test starting: all_reduce_perf\n" + _rows({1024: 20.0, 2048: 22.0})
            + "# Collective test starting: all_gather_perf\n" + _rows({1024: 15.0}))
    tables = parse_nccl_sections(text, source="two.txt")
    assert [(t.op, len(t.rows)) for t in tables] == [("all_reduce", 2), ("all_gather", 1)]
    with pytest.raises(SimError, match="holds 2 sections"):
        parse_nccl_tests(text, source="two.txt")


def _calibrate(tmp_path, capsys, text: str, topology: str = "dgx-h100"):
    path = tmp_path / "all_reduce_perf.txt"
    path.write_text(text)
    code = main(["calibrate", "--nccl-tests", str(path), "--topology", topology])
    return code, capsys.readouterr().err.strip().splitlines()


def test_host_count_is_checked_against_the_topology(tmp_path, capsys):
    text = "# nThread 1 nGpus 1\n" + _ranks([f"node{i}" for i in range(8)]) + _rows({1024: 20})
    code, err = _calibrate(tmp_path, capsys, text)
    assert code == 2 and len(err) == 1 and "field hosts: expected the topology's 1" in err[0]


def test_duplicate_sizes_with_conflicting_times_are_refused(tmp_path, capsys):
    head = "# nThread 1 nGpus 8\n" + _ranks(["a"] * 8)
    text = head + _rows({1024: 20.0, 2048: 22.0}) + _rows({1024: 95.0})
    code, err = _calibrate(tmp_path, capsys, text)
    assert code == 2 and len(err) == 1 and "expected one time per size" in err[0], err
    consistent = head + _rows({1024: 20.0, 2048: 22.0}) + _rows({1024: 21.0})
    code, err = _calibrate(tmp_path, capsys, consistent)
    assert code == 0, err


@pytest.mark.parametrize("size", ["9" * 3000, "1²", "١٢٣", "12e3"])
def test_absurd_or_unicode_sizes_are_one_line_errors(size):
    text = "# nThread 1 nGpus 2\n" + ROW.format(size=size, count=1, t=1.0)
    with pytest.raises(SimError) as info:
        parse_nccl_tests(text, op="all_reduce", source="sizes.txt")
    assert "sizes.txt line 2" in str(info.value) and "\n" not in str(info.value)


def test_a_long_file_is_refused_in_one_pass():
    row = ROW.format(size=1024, count=256, t=1.0)
    with pytest.raises(SimError, match="more than 4096 rows"):
        parse_nccl_tests("# nThread 1 nGpus 2\n" + row * 100_000, op="all_reduce")


# -- GGUF -------------------------------------------------------------------------------------

def _gguf(kv: dict[str, int], tensors: list[tuple[str, tuple[int, ...]]]) -> bytes:
    """A minimal little-endian GGUF v3: uint32 metadata and F32 tensors (data zeroed)."""
    def string(s: str) -> bytes:
        return struct.pack("<Q", len(s)) + s.encode()
    out = [b"GGUF", struct.pack("<IQQ", 3, len(tensors), len(kv) + 1),
           string("general.architecture"), struct.pack("<I", 8), string("llama")]
    for key, value in kv.items():
        out += [string(key), struct.pack("<II", 4, value)]
    offset = 0
    for name, shape in tensors:
        out += [string(name), struct.pack("<I", len(shape)),
                *(struct.pack("<Q", d) for d in shape), struct.pack("<IQ", 0, offset)]
        n = 4
        for d in shape:
            n *= d
        offset += (n + 31) // 32 * 32
    header = b"".join(out)
    header += bytes(-len(header) % 32)
    return header + bytes(offset)


def test_a_gguf_claiming_a_billion_blocks_is_refused_at_once(tmp_path):
    from treeattn.llm.errors import ModelError
    from treeattn.llm.formats.weights import load_model

    kv = {"llama.block_count": 10**9, "llama.embedding_length": 16,
          "llama.feed_forward_length": 32, "llama.attention.head_count": 2}
    tensors = [("token_embd.weight", (16, 8)), ("output_norm.weight", (16,)),
               ("blk.0.attn_norm.weight", (16,))]
    path = tmp_path / "liar.gguf"
    path.write_bytes(_gguf(kv, tensors))
    with pytest.raises(ModelError, match="field llama.block_count: expected the 1 blocks"):
        load_model(str(path))
    path.write_bytes(_gguf({**kv, "llama.block_count": 1, "llama.embedding_length": 64},
                           tensors))
    with pytest.raises(ModelError, match="field llama.embedding_length: expected 16"):
        load_model(str(path))


def test_a_cluster_too_big_to_plan_is_refused_with_the_estimate():
    from treeattn.sim.planning.plan_size import MAX_PLAN_GPUS, check_planning_size

    with pytest.raises(SimError, match=r"65,520 GPUs, expected at most 16,384 .* simulated"):
        check_planning_size(65520, "topology 'gb200-nvl72:racks=910'")
    assert "note: planning" in check_planning_size(MAX_PLAN_GPUS, "t")
    assert check_planning_size(64, "t") is None


def test_the_planner_refuses_a_huge_cluster_before_building_it(capsys, monkeypatch):
    """``predict``/``plan`` on 65,520 GPUs: refused with the count before any graph is made
    (building that cluster alone takes about half a minute); ``topo show`` of a large one
    says it will take a while."""
    import treeattn.topo.fabric as fabric

    def no_build(*args, **kwargs):
        raise AssertionError("the cluster was built before the size check")

    monkeypatch.setattr(fabric, "build_cluster", no_build)
    monkeypatch.setattr("treeattn.topo.builders_nvidia.build_cluster", no_build)
    for command in ("predict", "plan"):
        rc = main([command, "--topology", "gb200-nvl72:racks=910", "--model", "llama-3.1-8b",
                   "--seq-len", "1M"])
        err = capsys.readouterr().err
        assert rc == 2 and err.count("\n") == 1, err
        assert "65,520 GPUs, more than the 16,384 the planner takes" in err
    monkeypatch.undo()
    notes = []
    with fabric.build_limits(note=notes.append):
        fabric.check_gpus("t", "nodes", 2048, 8)
        fabric.check_gpus("t", "nodes", 1024, 8)
    assert notes == ["note: building 16,384 GPUs; this takes about 8 s"]
