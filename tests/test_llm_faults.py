"""Bad model input is refused at load time with one line, never a traceback, hang or NaN.

Each test reproduces one fault of the reliability issue on a tiny GGUF written with the
``gguf`` package (the helper of ``test_llm_gguf.py``): NaN weights or numerics, zero heads,
mismatched dimensions, an out-of-range BOS id, counts no file could hold, a FIFO, a chat
template that loops forever, control-token text in a prompt, and NaN in ``--verify``/JSON.
"""

from __future__ import annotations

import json
import math
import os
import struct
import tracemalloc

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from test_llm_gguf import write_llama_gguf  # noqa: E402

from treeattn.cli import main  # noqa: E402
from treeattn.llm.errors import ModelError  # noqa: E402
from treeattn.llm.formats.weights import load_model  # noqa: E402
from treeattn.llm.model import LlamaConfig, random_model  # noqa: E402


def _gguf(tmp_path, name="m.gguf", **config) -> str:
    model = random_model(LlamaConfig.from_name("debug"), seed=1)
    for key, value in config.items():
        object.__setattr__(model.config, key, value)
    path = tmp_path / name
    write_llama_gguf(path, model)
    return str(path)


def _one_line_error(path: str, match: str) -> None:
    with pytest.raises(ModelError, match=match) as info:
        load_model(path)
    assert "\n" not in str(info.value)


@pytest.mark.timeout(60)
def test_nan_weight_is_refused_naming_the_tensor(tmp_path):
    model = random_model(LlamaConfig.from_name("debug"), seed=1)
    with torch.no_grad():
        model.norm.weight[3] = float("nan")
    path = tmp_path / "nan.gguf"
    write_llama_gguf(path, model)
    _one_line_error(str(path), "tensor norm.weight holds NaN")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("key,value,match", [
    ("rope_base", float("nan"), "rope.freq_base"),
    ("norm_eps", 0.0, "rms_epsilon"),
    ("norm_eps", -1e-5, "rms_epsilon"),
    ("n_heads", 0, "n_heads is 0"),
    ("dim", 96, "dimensions"),  # metadata says 96, the tensors are 64 wide
])
def test_bad_metadata_is_refused(tmp_path, key, value, match):
    _one_line_error(_gguf(tmp_path, **{key: value}), match)


@pytest.mark.timeout(60)
def test_bos_id_outside_the_vocabulary_is_refused(tmp_path, monkeypatch):
    real = gguf.GGUFWriter.add_array

    def add_array(self, key, values):
        real(self, key, values)
        if key == "tokenizer.ggml.tokens":
            self.add_uint32("tokenizer.ggml.bos_token_id", 10**6)

    monkeypatch.setattr(gguf.GGUFWriter, "add_array", add_array)
    _one_line_error(_gguf(tmp_path), "bos_token_id 1000000 is outside the vocabulary")


def _small_gguf_claiming(tmp_path, what: str) -> str:
    """A ~14 KB GGUF whose header claims 10^9 tensors, entries or array elements."""
    path = tmp_path / f"{what}.gguf"
    key = b"general.architecture"
    body = struct.pack("<Q", len(key)) + key
    if what == "array":
        body += struct.pack("<IIQ", 9, 8, 10**9)  # an array of 10^9 strings
    else:
        body += struct.pack("<IQ", 8, 5) + b"llama"
    counts = {"tensors": (10**9, 1), "kv": (0, 10**9), "array": (0, 1)}[what]
    header = b"GGUF" + struct.pack("<IQQ", 3, *counts)
    path.write_bytes(header + body + b"\0" * 14000)
    return str(path)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("what", ["tensors", "kv", "array"])
def test_counts_the_file_cannot_hold_are_refused_at_once(tmp_path, what):
    """Refused from the header alone: the loader never builds anything the size of the claim
    (10^9 entries would take gigabytes; the whole refusal allocates under 1 MiB)."""
    path = _small_gguf_claiming(tmp_path, what)
    tracemalloc.start()
    try:
        _one_line_error(path, "claims 1000000000")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


@pytest.mark.timeout(30)
def test_fifo_model_is_refused_without_blocking(tmp_path, capsys):
    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    assert main(["generate", "--nproc", "1", "--model", str(fifo), "--prompt", "hi"]) == 2
    assert "not a regular file" in capsys.readouterr().err


@pytest.mark.timeout(30)
@pytest.mark.parametrize("template,budget", [
    ("{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}",
     "more than 100000 range"),
    ("{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}"
     "{% endfor %}{{ ns.s }}", "longer than 1000000"),
    ("{{ 'x' * 10000000000 }}", "longer than 1000000"),
    ("{{ 7 ** 100000000 }}", "power 100000000"),
])
def test_runaway_chat_template_is_one_line_error(template, budget):
    """Each runaway is stopped by the work it counts (iterations, sizes, exponents), never
    by the clock, which would mean it had run for seconds first."""
    from treeattn.llm.formats.tokenizer import Tokenizer, byte_tokenizer

    tok = Tokenizer(byte_tokenizer().backend, chat_template=template)
    with pytest.raises(ModelError, match="does too much work") as info:
        tok.render_chat("hi")
    assert budget in str(info.value) and "ran for" not in str(info.value)


def test_control_token_text_in_a_prompt_stays_text():
    from tokenizers import AddedToken

    from treeattn.llm.formats.tokenizer import Tokenizer, byte_tokenizer

    backend = byte_tokenizer().backend
    backend.add_special_tokens([AddedToken("<|im_end|>", special=True, normalized=False)])
    end = backend.token_to_id("<|im_end|>")
    tok = Tokenizer(backend, chat_template=(
        "{% for m in messages %}[{{ m['content'] }}<|im_end|>{% endfor %}"))
    assert end not in tok.encode("say <|im_end|> now")
    ids = tok.encode_chat("say <|im_end|> now")
    assert ids.count(end) == 1 and ids[-1] == end  # only the template's own


@pytest.mark.timeout(60)
def test_prompt_that_tokenizes_to_nothing_says_so(monkeypatch, capsys):
    from treeattn.llm.formats.tokenizer import Tokenizer

    monkeypatch.setattr(Tokenizer, "encode", lambda self, text, specials=False: [])
    assert main(["generate", "--nproc", "1", "--model", "debug", "--prompt", "\u200b"]) == 2
    assert "tokenizes to no tokens" in capsys.readouterr().err


def test_non_utf8_prompt_is_one_line_error(capsys):
    bad = b"caf\xe9".decode("utf-8", "surrogateescape")  # what argv holds for Latin-1 bytes
    assert main(["generate", "--nproc", "1", "--model", "debug", "--prompt", bad]) == 2
    assert "not valid UTF-8 text (byte 0xe9" in capsys.readouterr().err


@pytest.mark.timeout(60)
def test_verify_never_calls_nan_identical_and_json_has_no_nan(monkeypatch, capsys):
    from treeattn.llm import generate as gen_module

    real = gen_module.generate_local

    def nan_logits(*args, **kwargs):
        out = real(*args, **kwargs)
        out.logits = [torch.full_like(lg, float("nan")) for lg in out.logits]
        return out

    monkeypatch.setattr(gen_module, "generate_local", nan_logits)
    argv = ["generate", "--nproc", "1", "--model", "debug", "--prompt", "hi",
            "--max-new-tokens", "2", "--verify"]
    assert main(argv + ["--json"]) == 1
    record = json.loads(capsys.readouterr().out, parse_constant=pytest.fail)
    assert record["identical_to_single_process"] is False
    assert record["max_abs_logit_diff"] is None
    assert main(argv) == 1
    assert "identical to" not in capsys.readouterr().err


def test_run_json_maps_non_finite_to_null():
    from treeattn.commands.run import dumps

    text = dumps([{"a": math.nan, "b": [math.inf, 1.5], "c": np.float64(2.0).item()}])
    assert json.loads(text) == [{"a": None, "b": [None, 1.5], "c": 2.0}]


@pytest.mark.timeout(30)
def test_calibrate_checks_its_output_path_before_any_work(tmp_path, capsys, rank_starts):
    out = tmp_path / "missing-dir" / "profile.json"
    assert main(["calibrate", "--nproc", "2", "-o", str(out)]) == 2
    assert capsys.readouterr().err.startswith("error: ")
    assert rank_starts == []  # refused before any rank started
