"""One error base, and the library API's argument checks.

Every exception class treeattn defines derives from :class:`treeattn.TreeattnError` (found by
reading the source, so a new one cannot slip past), and the library calls refuse bad
arguments with a typed error before doing any work.
"""

from __future__ import annotations

import ast
import importlib
import math
from pathlib import Path

import pytest

import treeattn

PACKAGE_ROOT = Path(treeattn.__file__).parent
# Exceptions that are not errors of treeattn: a jinja budget (jinja's own type, so the
# sandbox's callers see a template error) and the run command's private exit-1 signal.
NOT_OURS = {("treeattn.llm.formats.chat_template", "TemplateBudget"),
            ("treeattn.commands.run", "_RunFailed")}


def exception_classes() -> list[tuple[str, str]]:
    """(module, class) of every class whose bases name an exception, read with ``ast``."""
    found = []
    for path in sorted(PACKAGE_ROOT.rglob("*.py")):
        parts = path.relative_to(PACKAGE_ROOT.parent).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef):
                continue
            names = [b.id if isinstance(b, ast.Name) else getattr(b, "attr", "")
                     for b in node.bases]
            if any(n.endswith(("Error", "Failure", "Exception", "Refused", "Lost", "Timeout"))
                   for n in names):
                found.append((module, node.name))
    return found


def test_every_error_class_derives_from_the_one_base():
    classes = exception_classes()
    # the package errors the issue names, counted by hand, are all among those found
    assert {c for _, c in classes} >= {"TopologyError", "SimError", "ScheduleError",
                                       "KernelError", "RuntimeFailure", "ModelError",
                                       "UserError", "HFIntegrationError",
                                       "ShardedAttentionError"}
    outside = []
    for module, name in classes:
        if (module, name) in NOT_OURS:
            continue
        if module.startswith("treeattn.hf"):
            pytest.importorskip("transformers")
        cls = getattr(importlib.import_module(module), name)
        if not issubclass(cls, treeattn.TreeattnError):
            outside.append(f"{module}.{name}")
    assert not outside


def test_value_errors_stay_value_errors():
    from treeattn.kernels import KernelError
    from treeattn.topo import TopologyError

    for cls in (TopologyError, treeattn.SimError, KernelError):
        assert issubclass(cls, ValueError) and issubclass(cls, treeattn.TreeattnError)


def test_plan_errors_are_caught_by_the_base():
    with pytest.raises(treeattn.TreeattnError):
        treeattn.plan("local:ranks=2", q_heads=3, kv_heads=2, head_dim=4, seq_len=8)
    assert "TreeattnError" in treeattn.__all__ and "SimError" in treeattn.__all__


# -- treeattn.merge_partials ----------------------------------------------------------------


def _merge(lse_rows, lse_base="e"):
    import torch

    lse = torch.tensor(lse_rows, dtype=torch.float32).view(len(lse_rows), 1, 1)  # (n, 1, 1)
    o = torch.tensor([[[[2.0, -1.0]]]] * len(lse_rows))  # (n, 1, 1, 2)
    return treeattn.merge_partials(o, lse, lse_base=lse_base)


def test_merge_partials_names_its_base():
    import torch

    with pytest.raises(TypeError, match="lse_base"):
        treeattn.merge_partials(torch.zeros(2, 1, 1, 2), torch.zeros(2, 1, 1))
    with pytest.raises(treeattn.TreeattnError, match="lse_base"):
        _merge([0.0, 0.0], lse_base="10")
    # two equal natural-log partials: lse = log(2), by hand
    assert float(_merge([0.0, 0.0])[1]) == pytest.approx(math.log(2.0))
    assert float(_merge([0.0, 0.0], lse_base="2")[1]) == pytest.approx(math.log(2.0))


@pytest.mark.parametrize("o, lse", [([[[[1.0]]]], [[[0.0]]]), ("o", "lse"), (None, None)])
def test_merge_partials_refuses_what_is_not_a_tensor(o, lse):
    with pytest.raises(treeattn.TreeattnError, match="torch.Tensor"):
        treeattn.merge_partials(o, lse, lse_base="e")


@pytest.mark.parametrize("rows", [[0.0, math.nan], [math.nan, -math.inf], [math.nan]])
def test_a_nan_lse_never_vanishes(rows):
    o, lse = _merge(rows)
    assert math.isnan(float(lse)) and bool(o.isnan().all())


@pytest.mark.parametrize("rows", [[0.0, math.inf], [math.inf, math.inf], [-math.inf, math.inf]])
def test_an_infinite_lse_follows_ieee(rows):
    # log(inf + x) = inf; the weights inf / inf are undefined, so o is NaN
    o, lse = _merge(rows)
    assert float(lse) == math.inf and bool(o.isnan().all())


def test_empty_partials_weigh_nothing():
    o, lse = _merge([-math.inf, 1.5])
    assert float(lse) == pytest.approx(1.5) and o.flatten().tolist() == [2.0, -1.0]
    o, lse = _merge([-math.inf, -math.inf])
    assert float(lse) == -math.inf and o.flatten().tolist() == [0.0, 0.0]


# -- treeattn.plan ----------------------------------------------------------------------------
SHAPE = dict(q_heads=8, kv_heads=2, head_dim=64, seq_len=4096)


@pytest.mark.parametrize("bad, match", [
    (dict(seq_len="32k"), "seq_len must be an integer"),
    (dict(seq_len=math.nan), "seq_len must be an integer"),
    (dict(seq_len=math.inf), "seq_len must be an integer"),
    (dict(seq_len=None), "seq_len must be an integer"),
    (dict(seq_len=True), "seq_len must be an integer"),
    (dict(seq_len=4096.0), "seq_len must be an integer"),
    (dict(seq_len=0), "seq_len must be between"),
    (dict(seq_len=10**400), "401 digits"),
    (dict(batch=10**30), "batch must be between"),
    (dict(tp="2"), "tp must be an integer"),
    (dict(q_heads=10**30, kv_heads=1), "q_heads must be between"),
    (dict(head_dim=10**9), "head_dim must be between"),
    (dict(n_layers=-1), "n_layers must be between"),
    (dict(dtype=["x"]), "unknown dtype"),
    (dict(layout=[1]), "layout must be"),
    (dict(profile=3), "profile must be"),
    (dict(profile=""), "profile must be"),
    (dict(profile={}), "profile must be"),
    (dict(algorithms=3), "algorithms must be a tuple"),
    (dict(algorithms="tree"), "algorithms must be a tuple"),
    (dict(algorithms=()), "none given"),
    (dict(algorithms=[["tree"]]), "unknown algorithm"),
])
def test_plan_refuses_bad_arguments_by_name(bad, match):
    with pytest.raises(treeattn.SimError, match=match):
        treeattn.plan("local:ranks=2", **{**SHAPE, **bad})


@pytest.mark.parametrize("topology", [3, None, "", "  "])
def test_plan_refuses_what_is_not_a_topology(topology):
    with pytest.raises(treeattn.SimError, match="topology must be"):
        treeattn.plan(topology, **SHAPE)


@pytest.mark.parametrize("model", [3, ["llama-3.1-8b"], "no-such-model"])
def test_plan_refuses_what_is_not_a_model(model):
    with pytest.raises(treeattn.SimError, match="model"):
        treeattn.plan("local:ranks=2", model, seq_len=4096)


def test_plan_refuses_a_huge_spec_before_building_it(monkeypatch):
    from treeattn.topo.graphbuild import GraphBuilder

    monkeypatch.setattr(GraphBuilder, "node", _never("building the topology"))
    # 4,096 nodes of 8 GPUs: twice the planner's bound, refused from the spec's numbers alone
    with pytest.raises(treeattn.TreeattnError, match="32,768 GPUs, more than the 16,384"):
        treeattn.plan("dgx-h100:nodes=4096", **SHAPE)


def test_plan_refuses_a_huge_topology_before_planning(monkeypatch):
    from treeattn.sim import public
    from treeattn.sim.planning import plan_size
    from treeattn.topo import Topology

    topology = Topology.from_spec("dgx-h100:nodes=2")  # 16 GPUs, against a bound of 8
    monkeypatch.setattr(plan_size, "MAX_PLAN_GPUS", 8)
    monkeypatch.setattr(public, "plan_workload", _never("planning"))
    with pytest.raises(treeattn.SimError, match="16 GPUs, expected at most 8"):
        treeattn.plan(topology, **SHAPE)


def _never(what: str):
    def refuse(*args, **kwargs):
        raise AssertionError(f"{what} started")

    return refuse


def test_plan_accepts_numpy_integers():
    np = pytest.importorskip("numpy")
    chosen = treeattn.plan("local:ranks=2", q_heads=np.int64(8), kv_heads=2, head_dim=64,
                           seq_len=np.int64(4096), batch=np.int32(1))
    assert chosen.workload.seq_len == 4096 and type(chosen.workload.seq_len) is int


# -- prose beside the tables -------------------------------------------------------------------
def test_predict_wraps_its_prose_to_the_terminal(monkeypatch, capsys):
    from treeattn.cli import main

    monkeypatch.setenv("COLUMNS", "80")
    # 8 ranks cannot split debug's 4 heads: the two head-split baselines are not priced
    assert main(["predict", "--topology", "local:ranks=8", "--model", "debug",
                 "--seq-len", "512"]) == 0
    out = capsys.readouterr().out
    prose = out[out.index("Not priced"):].splitlines()
    assert len(prose) >= 4 and all(len(line) <= 80 for line in prose), prose
    assert " ".join(prose).count("Not priced:") == 2
