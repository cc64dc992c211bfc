"""One error base, and the library API's argument checks.

Every exception class treeattn defines derives from :class:`treeattn.TreeattnError` (found by
reading the source, so a new one cannot slip past), and the library calls refuse bad
arguments with a typed error before doing any work.
"""

from __future__ import annotations

import ast
import importlib
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
