"""Sampling, dtypes and the generate command's bad input.

* The sampler: greedy at temperature 0, top-k/top-p cuts, a seed that fixes the draw.
* The command: the same ``--seed`` gives the same tokens on 1 and 2 ranks, and the ranks
  agree; another seed gives other tokens (the debug model's random logits are flat enough).
* ``--dtype bf16`` on the CPU: the blocks run in bf16, the embedding/head stay fp32, and the
  real model's first greedy tokens are the fp32 ones.
* Bad input is one ``error:`` line and exit status 2.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from treeattn.cli import main
from treeattn.llm.errors import ModelError
from treeattn.llm.options import Sampler, Sampling, body_dtype, filter_logits, place_model

torch.set_num_threads(1)
DEBUG = ["--model", "debug", "--prompt", "hello world", "--max-new-tokens", "8"]


def _logits(seed: int = 0, vocab: int = 64) -> torch.Tensor:
    return torch.randn(1, vocab, generator=torch.Generator().manual_seed(seed))  # (1, V)


def _draws(sampling: Sampling, n: int = 20) -> list[int]:
    sampler = Sampler(sampling)
    return [sampler(_logits(i)) for i in range(n)]


@pytest.mark.timeout(60)
def test_greedy_is_argmax_and_cuts_to_one_token_are_greedy():
    greedy = [int(torch.argmax(_logits(i))) for i in range(20)]
    assert _draws(Sampling()) == greedy
    assert _draws(Sampling(1.0, top_k=1, seed=3)) == greedy
    assert _draws(Sampling(1.0, top_p=1e-6, seed=3)) == greedy
    with pytest.raises(ModelError, match="at least 0.001"):  # too small to stay finite
        Sampling(1e-30, seed=3).check()


@pytest.mark.timeout(60)
def test_the_seed_fixes_the_draw():
    assert _draws(Sampling(1.0, seed=5)) == _draws(Sampling(1.0, seed=5))
    assert _draws(Sampling(1.0, seed=5)) != _draws(Sampling(1.0, seed=6))


@pytest.mark.timeout(60)
def test_top_k_and_top_p_keep_the_right_tokens():
    row = torch.tensor([0.0, 3.0, 2.0, 1.0])  # probabilities ~ 0.03, 0.64, 0.24, 0.09
    assert torch.isfinite(filter_logits(row, 2, 1.0)).tolist() == [False, True, True, False]
    assert torch.isfinite(filter_logits(row, 0, 0.7)).tolist() == [False, True, True, False]
    assert torch.isfinite(filter_logits(row, 0, 0.5)).tolist() == [False, True, False, False]
    drawn = set(_draws(Sampling(1.0, top_k=3, seed=1), 50))
    assert all(t in torch.topk(_logits(i)[0], 3).indices.tolist()
               for i, t in enumerate(_draws(Sampling(1.0, top_k=3, seed=1), 50)))
    assert len(drawn) > 3  # it does sample


@pytest.mark.timeout(60)
@pytest.mark.parametrize("bad", [
    Sampling(-0.1), Sampling(math.nan), Sampling(math.inf), Sampling(1.0, top_k=-1),
    Sampling(1.0, top_p=0.0), Sampling(1.0, top_p=1.5), Sampling(1.0, top_p=math.nan),
])
def test_bad_sampling_is_refused(bad):
    with pytest.raises(ModelError):
        bad.check()


@pytest.mark.timeout(60)
def test_nan_logits_are_refused_when_sampling():
    with pytest.raises(ModelError, match="NaN"):
        Sampler(Sampling(1.0, seed=0))(torch.full((1, 8), math.nan))


def _record(capsys, *args) -> dict:
    assert main(["generate", *DEBUG, *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.timeout(240)
def test_seeded_generation_is_the_same_on_one_and_two_ranks(capsys):
    sample = ["--temperature", "1.0", "--top-p", "0.95", "--seed", "11"]
    two = _record(capsys, "--nproc", "2", *sample, "--verify")
    one = _record(capsys, "--nproc", "1", *sample)
    other = _record(capsys, "--nproc", "1", *sample[:-1], "12")
    assert two["ranks_agree"] is True and two["seed"] == 11
    assert two["identical_to_single_process"] is True  # the reference drew with seed 11 too
    assert two["tokens"] == one["tokens"]
    assert other["tokens"] != two["tokens"]
    drawn = _record(capsys, "--nproc", "1", "--temperature", "1.0")  # no seed: one is drawn
    assert isinstance(drawn["seed"], int)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("dtype,nproc", [("bf16", "2"), ("fp16", "1")])
def test_half_dtypes_verify(dtype, nproc, capsys):
    record = _record(capsys, "--nproc", nproc, "--dtype", dtype, "--device", "cpu", "--verify")
    assert record["dtype"] == dtype and record["ranks_agree"] in (True, None)
    assert len(record["tokens"]) == 8 and all(0 <= t < 256 for t in record["tokens"])
    assert record["identical_to_single_process"] is True  # seen exact on this model


@pytest.mark.timeout(60)
def test_bf16_on_cpu_gives_the_fp32_greedy_tokens():
    """A bf16 body decodes the fp32 greedy tokens (the debug model: 12 distinct-enough
    tokens, seen exact), and a tied LM head stays fp32 and stays tied (a tiny tied model)."""
    from dataclasses import replace

    from treeattn.llm.formats.weights import load_model
    from treeattn.llm.generate import generate_local
    from treeattn.llm.model import LlamaConfig, random_model

    model = load_model("debug").model
    prompt = list(b"What is the capital of France?")
    fp32 = generate_local(model, prompt, 12)
    place_model(model, "cpu", torch.bfloat16)
    assert body_dtype(model) == torch.bfloat16
    bf16 = generate_local(model, prompt, 12)
    assert bf16.tokens == fp32.tokens and len(set(fp32.tokens)) > 6
    tied = random_model(replace(LlamaConfig.from_name("debug"), tie_embeddings=True), seed=1)
    place_model(tied, "cpu", torch.bfloat16)
    assert body_dtype(tied) == torch.bfloat16
    assert tied.output.weight.dtype == torch.float32  # head (tied embedding) stays fp32
    assert tied.output.weight is tied.tok_embeddings.weight


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args,message", [
    (["--temperature", "-1"], "--temperature must be a finite number >= 0"),
    (["--temperature", "nan"], "--temperature must be a finite number >= 0"),
    (["--temperature", "1e-300"], "--temperature must be 0 (greedy) or at least"),
    (["--top-p", "0"], "--top-p must be in (0, 1]"),
    (["--top-p", "1.01"], "--top-p must be in (0, 1]"),
    (["--top-k", "-3"], "--top-k must be >= 0"),
    (["--top-k", "many"], "argument --top-k: invalid int value"),
    (["--dtype", "fp8"], "argument --dtype: invalid choice"),
    (["--device", "tpu"], "argument --device: invalid choice"),
])
def test_bad_input_is_one_error_line(args, message, capsys):
    try:
        status = main(["generate", "--nproc", "2", *DEBUG, *args])
    except SystemExit as exc:  # argparse's own errors
        status = exc.code
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err


@pytest.mark.timeout(60)
def test_device_cuda_without_cuda_is_one_error_line(capsys):
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    assert main(["generate", "--nproc", "2", *DEBUG, "--device", "cuda"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: --device cuda was asked for, but CUDA is not available"]
