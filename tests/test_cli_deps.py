"""The planner runs without torch; the real-run commands name the extra they need.

The base install (numpy, networkx, simpy, rich, matplotlib) must give ``treeattn --help``,
``topo``, ``predict`` and ``plan``. Each check runs in a fresh interpreter, since this test
process has long imported torch. "Without torch" is a directory first on ``PYTHONPATH`` whose
``torch`` and ``triton`` packages fail to import the way a missing package does.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import treeattn
from treeattn.cli import main, missing_extra

ROOT = Path(__file__).resolve().parents[1]
PLAN = ["plan", "--topology", "mi300x", "--model", "llama-3.1-8b", "--seq-len", "32k"]
PREDICT = ["predict", "--topology", "dgx-h100:nodes=2", "--model", "llama-3.1-8b",
           "--seq-len", "16k"]
HEAVY = ("torch", "triton", "gguf", "tokenizers", "safetensors")


def _python(*args: str, fake_missing: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    if fake_missing is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(fake_missing), str(ROOT)])
    return subprocess.run([sys.executable, *args], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=240)


@pytest.fixture
def no_torch(tmp_path: Path) -> Path:
    """A directory that, first on the path, makes ``import torch`` fail as if not installed."""
    for name in ("torch", "triton"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(
            f"raise ModuleNotFoundError(\"No module named '{name}'\", name={name!r})\n")
    return tmp_path


@pytest.mark.parametrize("argv", [["--help"], ["--version"], PLAN, PREDICT,
                                  ["topo", "show", "dgx-h100"]],
                         ids=["help", "version", "plan", "predict", "topo"])
def test_planner_commands_never_import_torch(argv):
    code = (
        "import sys\n"
        "from treeattn.cli import main\n"
        "try:\n"
        f"    status = main({argv!r})\n"
        "except SystemExit as exit:\n"
        "    status = exit.code\n"
        f"heavy = sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r})\n"
        "print('HEAVY', heavy, 'STATUS', status)\n"
    )
    result = _python("-c", code)
    assert result.returncode == 0, result.stderr
    assert "HEAVY [] STATUS 0" in result.stdout


def test_plan_runs_without_torch(no_torch):
    result = _python("-m", "treeattn.cli", *PLAN, fake_missing=no_torch)
    assert result.returncode == 0, result.stderr
    assert "per token" in result.stdout


@pytest.mark.parametrize("argv, extra", [
    (["run", "--seq-len", "64", "--nproc", "2"], "runtime"),
    (["calibrate", "--nproc", "2"], "runtime"),
    (["generate", "--model", "debug", "--prompt", "hi", "--nproc", "2"], "llm"),
])
def test_runtime_commands_without_torch_name_the_extra(no_torch, argv, extra):
    result = _python("-m", "treeattn.cli", *argv, fake_missing=no_torch)
    assert result.returncode == 2
    assert result.stderr == f"error: this command needs torch: pip install 'treeattn[{extra}]'\n"


def test_missing_extra_maps_each_package():
    def message(name, command):
        return missing_extra(ModuleNotFoundError(name=name), command)

    assert message("triton", "run") == "this command needs triton: pip install 'treeattn[runtime]'"
    assert message("torch", "sweep").endswith("'treeattn[runtime]'")
    assert message("gguf", "generate") == "this command needs gguf: pip install 'treeattn[llm]'"
    assert message("safetensors", "generate").endswith("'treeattn[llm]'")
    assert message("numpy", "run") is None  # a base dependency missing is a broken install
    assert message("torch._C", "run") is None  # a broken torch is not a missing one


def test_run_choices_match_the_runtime():
    """`run` keeps torch-free copies of its choices; they must be the runtime's."""
    from treeattn.commands import run
    from treeattn.runtime import plans

    assert run.ALGORITHMS == plans.ALGORITHMS
    assert run.DTYPES == tuple(plans.DTYPES)


def test_version(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out == f"treeattn {treeattn.__version__}\n"
    assert treeattn.__version__ == "0.1.0"


def test_license_is_apache_2_as_declared():
    text = (ROOT / "LICENSE").read_text()
    assert text.startswith("Copyright 2026 the treeattn authors\n")
    assert "Apache License\n                           Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text and "APPENDIX" in text
    assert 'license = "Apache-2.0"' in (ROOT / "pyproject.toml").read_text()
