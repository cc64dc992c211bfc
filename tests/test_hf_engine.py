"""The transformers integration end to end: SmolLM2 from the default GGUF, the
``generate --engine hf`` command, the torchrun example and world 1, each against
transformers' single-process ``generate`` of the same model (the reference and the tiny
models are :mod:`test_hf`'s)."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_hf import LOGIT_ATOL, NEW_TOKENS, _generate, tiny_config, tiny_model  # noqa: E402

from treeattn.runtime.launch import LaunchOptions, launch  # noqa: E402

pytestmark = pytest.mark.timeout(600)


SMOLLM_ALGORITHMS = ("tree", "butterfly", "oneshot", "helix", "dcp")


def _smollm_job(ctx, directory: str):
    """Sharded prefill and generate of the GGUF's weights (saved once by the fixture) with
    every partial-merging algorithm; rank 0's (algorithm, ids, logits)."""
    import treeattn.hf

    config = transformers.AutoConfig.from_pretrained(directory)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="treeattn")
    model.load_state_dict(torch.load(Path(directory, "weights.pt")), strict=False)
    model.tie_weights()
    model.eval()
    ids = torch.load(Path(directory, "ids.pt"))
    out = []
    for algorithm in SMOLLM_ALGORITHMS:
        cache = treeattn.hf.ShardedCache(model.config, algorithm, reserve=NEW_TOKENS)
        treeattn.hf.sharded_prefill(model, ids, cache)
        out.append((algorithm, *_generate(model, ids, cache=cache)))
    return out


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    """SmolLM2 read by transformers from the default GGUF (``gguf_file=``; fetched into the
    cache when absent), its weights saved for the ranks (a GGUF-quantised model cannot
    ``save_pretrained``), and transformers' single-process greedy generation of one prompt."""
    pytest.importorskip("gguf")
    pytest.importorskip("accelerate")
    from treeattn.llm.formats.fetch import fetch_default_model

    path = fetch_default_model(quiet=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32,
        attn_implementation="sdpa").eval()
    directory = tmp_path_factory.mktemp("smollm2")
    model.config.save_pretrained(directory)
    torch.save(model.state_dict(), directory / "weights.pt")
    ids = torch.tensor([[1, 504, 3458, 282, 4649, 314, 253, 1915, 30, 378, 5345, 314]])
    torch.save(ids, directory / "ids.pt")
    return str(directory), _generate(model, ids)


def test_smollm2_gguf_like_one_process(smollm2):
    """SmolLM2-135M-Instruct, 32 greedy tokens on 2 ranks (uneven shards at world 3 are the
    tiny Qwen2's above): identical to transformers in one process, for tree, butterfly,
    oneshot, helix and dcp. Its real weights give logits up to about 20,
    not O(1), after 30 layers of fp32 rounding in each merge order (and the reference's own
    BLAS threads, which earlier tests in this process may have changed), so the logits'
    bound is LOGIT_ATOL plus 1e-5 of the largest logit: about 3e-4, where a wrong shard,
    position or merge moves them by O(1)."""
    directory, (want_ids, want_logits) = smollm2
    runs = launch(functools.partial(_smollm_job, directory=directory), 2,
                  LaunchOptions(timeout_s=300, threads=1))
    assert [r[0] for r in runs] == list(SMOLLM_ALGORITHMS)
    bound = LOGIT_ATOL + 1e-5 * float(want_logits.abs().max())
    for algorithm, got_ids, got_logits in runs:
        assert torch.equal(got_ids, want_ids), algorithm
        assert float((got_logits - want_logits).abs().max()) < bound, algorithm


@pytest.mark.parametrize("args,message", [
    (["--model", "debug"], "--engine hf needs a transformers model"),
    (["--nproc", "0"], "--nproc must be at least 1"),
    (["--temperature", "-1"], "--temperature must be a finite number >= 0"),
    (["--context-tokens", "-5"], "--context-tokens"),
    (["--cuda-graph"], "does not use --cuda-graph"),
    (["--nproc", "1", "--algorithm", "ring"], "one rank has no partials to merge"),
    (["--nproc", "1", "--timeout", "5"], "one rank waits on no peer"),
])
def test_generate_engine_hf_refuses_with_one_line(args, message, capsys):
    from treeattn.cli import main

    assert main(["generate", "--engine", "hf", "--prompt", "hi", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0]


def test_the_torchrun_example_decodes_like_one_process():
    """``docs/examples/hf_torchrun.py`` under torchrun itself (``--standalone``: its own free
    port), world 2: sharded prefill, then transformers' generate, tokens checked on rank 0."""
    import subprocess
    import sys

    script = Path(__file__).resolve().parents[1] / "docs" / "examples" / "hf_torchrun.py"
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                             "--nproc-per-node", "2", str(script), "--tiny", "--check",
                             "--max-new-tokens", "8", "--algorithm", "butterfly"],
                            capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "identical to transformers in one process: True" in result.stderr


def test_generate_engine_hf_on_a_model_folder(tmp_path, capsys):
    """The CLI path end to end on a saved tiny model and word tokenizer: sharded prefill,
    transformers' generate on 2 ranks, ``--verify`` against transformers in one process."""
    import json

    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    from treeattn.cli import main

    vocab = {f"w{i}": i for i in range(tiny_config("llama").vocab_size)}
    words = Tokenizer(WordLevel(vocab, unk_token="w0"))
    words.pre_tokenizer = Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=words, unk_token="w0").save_pretrained(
        tmp_path)
    tiny_model("llama").save_pretrained(tmp_path)
    prompt = " ".join(f"w{i}" for i in (5, 17, 3, 99, 42, 8, 61, 23, 7))
    assert main(["generate", "--engine", "hf", "--model", str(tmp_path), "--nproc", "2",
                 "--prompt", prompt, "--max-new-tokens", "6", "--algorithm", "butterfly",
                 "--context-tokens", "30", "--verify", "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["identical_to_single_process"] is True and len(record["tokens"]) == 6
    assert record["prefilled_tokens"] == 38 and record["prefill"].startswith("sharded")
    assert record["memory_bytes_per_rank"]["full"] == 2 * 19 * 2 * 2 * 16 * 4  # 19 of 38
    # the same through make demo's summary (treeattn.commands.generate_hf.demo_hf)
    import argparse

    from rich.console import Console

    from treeattn.commands.generate import planned_schedule, register
    from treeattn.commands.generate_hf import demo_hf

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["generate", "--engine", "hf", "--model", str(tmp_path),
                              "--nproc", "2", "--prompt", prompt, "--max-new-tokens", "4",
                              "--verify"])
    console = Console(record=True, width=120)
    assert demo_hf(console, args, planned_schedule) == 0
    assert "greedy tokens identical to transformers' own single-process generate" in \
        console.export_text()


def _world1_job(ctx):
    """A group of one: sharded prefill and generate, the cache holding everything."""
    import treeattn.hf

    model = tiny_model("llama")
    ids = torch.randint(0, 160, (1, 9), generator=torch.Generator().manual_seed(1))
    want_ids, want_logits = _generate(model, ids)
    model.set_attn_implementation("treeattn")
    cache = treeattn.hf.ShardedCache(model.config, "tree", reserve=NEW_TOKENS)
    assert treeattn.hf.sharded_prefill(model, ids, cache) == 8
    got_ids, got_logits = _generate(model, ids, cache=cache)
    assert torch.equal(got_ids, want_ids)
    assert float((got_logits - want_logits).abs().max()) < LOGIT_ATOL
    return cache.local_lengths


def test_world_1_is_one_process():
    assert launch(_world1_job, 1, LaunchOptions(timeout_s=120, threads=1)) == [40, 40]


def test_generate_engine_hf_names_what_it_cannot_serve(tmp_path, capsys):
    """A model type treeattn does not serve, and a config transformers cannot read: one
    error line each, before any rank starts."""
    from treeattn.cli import main

    bloom = tmp_path / "bloom"
    transformers.BloomConfig(n_layer=1, hidden_size=16, n_head=2,
                             vocab_size=32).save_pretrained(bloom)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    for folder, message in ((bloom, "bloom is not served by treeattn: ALiBi"),
                            (broken, "transformers cannot read the config of")):
        assert main(["generate", "--engine", "hf", "--model", str(folder), "--prompt",
                     "hi"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err
