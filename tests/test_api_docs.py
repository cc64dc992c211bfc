"""The runnable example of ``docs/api.md``, run as the page says: under torchrun, 2 CPU ranks."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from treeattn.runtime.launch import free_port

DOC = Path(__file__).resolve().parents[1] / "docs" / "api.md"
pytestmark = pytest.mark.timeout(300)


def python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def test_the_api_example_runs_under_torchrun(tmp_path):
    (block,) = python_blocks(DOC.read_text())
    script = tmp_path / "example.py"
    script.write_text(block)
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo",
               PYTHONPATH=str(DOC.parents[1]))
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
                          str(script)], capture_output=True, text=True, env=env, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "max error" in out.stdout
