"""Distributed generation against single-process generation, and the command's bad input.

Reference: :func:`generate_local` decodes in one process over the whole cache. The sharded
runs (global reference -> shard -> compare) must pick the very same greedy tokens, with
logits close: fp32 throughout, and the only difference is the order in which the partials of
each layer's attention are merged, so a loose 1e-4 absolute bound on O(1..10) logits is ample
while any wrong shard, position or merge would move them by far more.
"""

from __future__ import annotations

import json

import pytest
import torch

from treeattn.cli import main
from treeattn.llm.formats.weights import load_model
from treeattn.llm.generate import generate_local
from treeattn.llm.generate_dist import (
    GenerateRequest,
    generate_distributed,
    make_schedule,
    split_lengths,
)
from treeattn.llm.local_cache import LocalCache

LOGIT_ATOL, LOGIT_RTOL = 1e-4, 1e-4
torch.set_num_threads(1)


def _run_distributed(spec, model, prompt, world, algorithm, new_tokens, eos=None,
                     context_tokens=0, segment=(), loaded=None, prefill="pass-kv"):
    lengths = split_lengths(context_tokens + len(prompt), world)
    schedule = make_schedule(algorithm, world, model.config, lengths)
    request = GenerateRequest(spec, tuple(prompt), new_tokens, schedule, eos, context_tokens,
                              tuple(segment), prefill=prefill)
    return generate_distributed(request, world, timeout_s=120, loaded=loaded)


def _assert_same(dist_gen, ref):
    assert dist_gen.tokens == ref.tokens
    for got, want in zip(dist_gen.logits, ref.logits, strict=True):
        torch.testing.assert_close(got, want, atol=LOGIT_ATOL, rtol=LOGIT_RTOL)


@pytest.mark.parametrize("world,algorithm", [(2, "tree"), (3, "tree"), (3, "ring")])
def test_debug_model_sharded_matches_single_process(world, algorithm):
    model = load_model("debug").model
    prompt = [(37 * i + 11) % 256 for i in range(23)]  # 23 tokens: uneven shards at world 3
    ref = generate_local(model, prompt, 8)
    result = _run_distributed("debug", model, prompt, world, algorithm, 8)
    _assert_same(result["generation"], ref)
    # every prompt token and every decoded token (but the last) is in exactly one shard
    assert sum(result["lengths"]) == len(prompt) + len(ref.tokens) - 1
    assert result["bytes_sent"] > 0
    steps = result["generation"].attention_steps
    assert len(steps) == len(ref.tokens) - 1 and all(s > 0 for s in steps)


def test_debug_model_long_context_sharded_matches_single_process():
    from treeattn.llm.generate_context import document_segment

    loaded = load_model("debug")
    segment = document_segment(loaded.tokenizer)[:50]
    prompt = [65, 66, 67]
    ref = generate_local(loaded.model, prompt, 5, context_tokens=333, segment=segment)
    result = _run_distributed("debug", loaded.model, prompt, 2, "tree", 5,
                              context_tokens=333, segment=segment)
    _assert_same(result["generation"], ref)


class _BlockOnly:
    """A backend that attends within the current chunk only (one copy, block-diagonal)."""

    def __init__(self):
        self.k, self.v = [], []

    def attend(self, layer, q, k, v, start):
        from treeattn.llm.local_cache import causal_attention

        self.k.append(k)
        self.v.append(v)
        return causal_attention(q, k, v, 0)


def test_repeated_document_equals_encoding_each_copy_at_its_position():
    """context_kv's rotation shortcut = encoding copy c on its own at positions c*S..."""
    from treeattn.llm.generate_context import context_kv, segment_kv

    model = load_model("debug").model
    segment = [(13 * i + 7) % 256 for i in range(40)]
    ks, vs = segment_kv(model, segment)
    s = len(segment)
    for copy in (1, 5):
        direct = _BlockOnly()
        with torch.no_grad():
            model(torch.tensor([segment]), copy * s, direct)
        got_k, got_v = context_kv(ks, vs, model.inv_freq, copy * s, copy * s + s)
        for layer in range(model.config.n_layers):
            torch.testing.assert_close(got_k[layer], direct.k[layer], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(got_v[layer], direct.v[layer], atol=1e-5, rtol=1e-5)


def test_split_lengths_cover_everything():
    for n in range(0, 20):
        for world in range(1, 6):
            lengths = split_lengths(n, world)
            assert sum(lengths) == n and max(lengths) - min(lengths) <= 1


def test_generate_command_json_verify(capsys):
    status = main(["generate", "--nproc", "2", "--model", "debug", "--prompt", "hello world",
                   "--max-new-tokens", "4", "--verify", "--json", "--algorithm", "ring",
                   "--context-tokens", "200"])
    record = json.loads(capsys.readouterr().out)
    assert status == 0
    assert record["identical_to_single_process"] is True
    assert record["world"] == 2 and record["algorithm"] == "ring"
    assert record["context_tokens"] == 200 and record["prompt_tokens"] == len("hello world")
    assert len(record["tokens"]) == 4 and isinstance(record["text"], str)
    for key in ("tokens_per_s", "attention_s_per_token"):
        assert record[key] > 0


def test_generate_command_single_rank_streams_text(capsys):
    status = main(["generate", "--nproc", "1", "--model", "debug", "--prompt", "abc",
                   "--max-new-tokens", "3"])
    captured = capsys.readouterr()
    assert status == 0
    assert "3 tokens on 1 rank(s)" in captured.err


def _write_unsupported_hf_dir(path):
    (path / "config.json").write_text(json.dumps({"model_type": "mistral"}))
    return str(path)


@pytest.mark.parametrize("argv,message", [
    (["--model", "/nonexistent/model.gguf"], "model not found"),
    (["--model", "HF_BAD"], "unsupported architecture"),
    (["--model", "debug", "--prompt", ""], "prompt is empty"),
    (["--model", "debug", "--prompt", "   "], "prompt is empty"),
    (["--model", "debug", "--max-new-tokens", "0"], "must be positive"),
    (["--model", "debug", "--max-new-tokens", "-3"], "must be positive"),
    (["--model", "debug", "--nproc", "0"], "--nproc"),
    (["--model", "CORRUPT"], "not a valid GGUF"),
])
def test_bad_input_is_one_line_and_exit_2(argv, message, tmp_path, capsys):
    argv = list(argv)
    if "HF_BAD" in argv:
        argv[argv.index("HF_BAD")] = _write_unsupported_hf_dir(tmp_path)
    if "CORRUPT" in argv:
        bad = tmp_path / "bad.gguf"
        bad.write_bytes(b"GGUF" + b"\xff" * 64)
        argv[argv.index("CORRUPT")] = str(bad)
    if "--prompt" not in argv:
        argv += ["--prompt", "hi"]
    status = main(["generate", *argv])
    err = capsys.readouterr().err.strip()
    assert status == 2
    assert err.startswith("error:") and message in err and "\n" not in err


def test_local_cache_grows_past_its_first_capacity():
    cache = LocalCache(1)
    k = torch.randn(1, 2, 20, 8)
    cache.store(0, k[:, :, :3], k[:, :, :3], 0)
    cache.store(0, k[:, :, 3:], k[:, :, 3:], 3)
    assert cache.length == 20
    torch.testing.assert_close(cache.k[0][:, :, :20], k)


@pytest.mark.timeout(300)
def test_demo_generation_section_runs(capsys, monkeypatch):
    """The suite's one end-to-end run of the real default model, the generation part of
    `make demo`: SmolLM2-135M-Instruct fetched and read (weights, tokenizer, chat template),
    its greedy answer on 2 ranks identical to one process, and a sensible one; then the
    transformers part (its own run is tested in tests/test_hf.py; here only that the demo
    hands it `generate --engine hf --verify`). Everywhere else the models are tiny."""
    from rich.console import Console

    import treeattn.commands.generate as generate_command
    import treeattn.commands.generate_hf as generate_hf

    handed, outcomes = [], []
    monkeypatch.setattr(generate_hf, "demo_hf",
                        lambda console, args, read_plan: handed.append(args) or 0)
    run_generation = generate_command.run_generation
    monkeypatch.setattr(generate_command, "run_generation", lambda args, stream: outcomes.append(
        run_generation(args, stream)) or outcomes[-1])
    console = Console(record=True, width=120)
    assert generate_command.demo_section(console) == 0
    assert "identical" in console.export_text()
    (outcome,) = outcomes
    assert outcome.identical and len(set(outcome.tokens)) > 2
    assert "Paris" in outcome.text  # a sensible answer: the weights and tokenizer read right
    (args,) = handed
    assert args.engine == "hf" and args.verify and args.nproc == 2
