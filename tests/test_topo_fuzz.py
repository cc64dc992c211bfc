"""Fuzz campaign over every topology importer and the topology JSON.

Why: the importers read files written elsewhere; whatever the bytes, the outcome must be a
valid :class:`Topology` (that passes its own validation and round-trips through JSON) or a
:class:`TopologyError` with a one-line message, never another exception, a hang or a
topology that cannot be written back. Inputs are real samples from ``tests/fixtures`` with a
few mutations each (token swaps and deletions, huge numbers, NaN/inf strings, non-UTF-8
bytes, duplicated or dropped lines) and random edits of a valid ``Topology.to_json()``.

The campaign is a fixed count: each test runs exactly ``EXAMPLES`` cases (hypothesis,
derandomized, no per-case deadline) and asserts that it did; a case that hangs is stopped by
the test's timeout.
"""

from __future__ import annotations

import json
import os
import re
import tempfile

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from topo_inputs import fixture

from treeattn.topo import Topology, TopologyError

EXAMPLES = 150
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
TARGETS = {
    "nvidia-smi": ["nvsmi-8xa100-sxm40g-10nic.txt", "nvsmi-4xrtx3090-nv4-pairs-aikitoria-pr18.txt"],
    "rocm-smi": ["rocmsmi-4xmi210-archer2.txt", "rocmsmi-8xmi300-did74a2-xgmi-msswift.txt"],
    "nccl-xml": ["nccl-topo-ibmcloud-gx3d-8xh100-vsi.xml", "rccl-topo-8xmi250-gcd.xml"],
}
WEIRD = ["NaN", "nan", "inf", "-inf", "Infinity", "1e308", "1e-324", "9" * 400, "-1", "0",
         "NV999", "NV18", "NV0", "NV4", " X ", "X", "SYS", "PIX", "XGMI", "PCIE", "GPU0",
         "GPU1", "NIC0", "\u00b2", "\u0663", "", '"', "<", "/>", "busid", 'count="99"']


def check_outcome(load, cases: list) -> None:
    """Run ``load``; accept a valid, round-tripping topology or a one-line TopologyError.
    Counts the case in ``cases``."""
    cases.append(1)
    try:
        t = load()
    except TopologyError as exc:
        message = str(exc)
        assert message and "\n" not in message, repr(message)
    else:
        again = Topology.from_json(t.to_json())  # validates and round-trips
        assert again == t and again.num_gpus == t.num_gpus


def load_bytes(data: bytes, suffix: str, fmt: str) -> Topology:
    fd, path = tempfile.mkstemp(suffix=suffix)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        return Topology.load(path, fmt=fmt)
    finally:
        os.unlink(path)


def mutate(data: st.DataObject, text: str) -> bytes:
    """A few random token/line/byte edits of ``text``."""
    parts = re.split(r"(\s+)", text)
    words = [i for i, p in enumerate(parts) if p and not p.isspace()]
    for _ in range(data.draw(st.integers(1, 4), label="edits")):
        op = data.draw(st.sampled_from(["swap", "delete", "replace", "line", "drop"]))
        i, j = (data.draw(st.sampled_from(words)) for _ in range(2))
        if op == "swap":
            parts[i], parts[j] = parts[j], parts[i]
        elif op == "delete":
            parts[i] = ""
        elif op == "replace":
            parts[i] = data.draw(st.sampled_from(WEIRD) | st.text(max_size=6))
        elif op == "line":  # duplicate the rest of the line holding token i
            parts[i] = parts[i] + "\n" + "".join(parts[i:i + 20]).split("\n")[0]
        else:
            parts[i:j] = [""] * len(parts[i:j])
    out = "".join(parts).encode("utf-8", "surrogatepass")
    if data.draw(st.booleans(), label="raw bytes"):
        at = data.draw(st.integers(0, len(out)))
        out = out[:at] + data.draw(st.binary(min_size=1, max_size=4)) + out[at:]
    return out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fmt", sorted(TARGETS))
def test_mutated_tool_output(fmt):
    cases: list = []

    @FUZZ
    @given(data=st.data())
    def campaign(data):
        name = data.draw(st.sampled_from(TARGETS[fmt]), label="sample")
        raw = mutate(data, fixture(name))
        use = data.draw(st.sampled_from([fmt, "auto"]), label="format")
        check_outcome(lambda: load_bytes(raw, os.path.splitext(name)[1], use), cases)

    campaign()
    assert len(cases) == EXAMPLES


JSON_SPECS = ["local:ranks=3", "dgx-h100", "mi300x", "pcie-4090:gpus=4,nodes=2"]
JSON_VALUES = (st.sampled_from([float("nan"), float("inf"), 1e308, 5e-324, 10**400, -1, 0,
                                True, None, "", "gpu", [], {}, 2**63, 1e-9, 25e9]) |
               st.integers() | st.floats() | st.text(max_size=5))


@pytest.mark.timeout(60)
def test_edited_topology_json():
    cases: list = []

    @FUZZ
    @given(data=st.data())
    def campaign(data):
        edit_topology_json(data, cases)

    campaign()
    assert len(cases) == EXAMPLES


def edit_topology_json(data: st.DataObject, cases: list) -> None:
    """A few field edits of a builder's topology JSON, then maybe one text edit."""
    doc = json.loads(Topology.from_spec(data.draw(st.sampled_from(JSON_SPECS))).to_json())
    for _ in range(data.draw(st.integers(1, 3), label="edits")):
        where = doc[data.draw(st.sampled_from(["nodes", "links"]))]
        item = where[data.draw(st.integers(0, len(where) - 1))]
        key = data.draw(st.sampled_from(sorted(item) + ["kind", "rank", "extra"]))
        op = data.draw(st.sampled_from(["set", "delete", "duplicate"]))
        if op == "set":
            item[key] = data.draw(JSON_VALUES)
        elif op == "delete":
            item.pop(key, None)
        else:
            where.append(dict(item))
    text = json.dumps(doc)  # may hold NaN/Infinity/huge integers on purpose
    if data.draw(st.booleans(), label="text edit"):
        at = data.draw(st.integers(0, len(text)))
        text = text[:at] + data.draw(st.sampled_from(WEIRD)) + text[at + 1:]
    check_outcome(lambda: Topology.from_json(text), cases)
