"""Decoding over a fixed-size cache (the CUDA-graph path) gives the tokens of the growing cache.

The eager static path runs on CPU here, against ``generate_local`` (the LocalCache path every
other test trusts). The CUDA-graph capture and replay need a GPU; those tests run on one
(``benchmarks/gpu_check.sh``) and are skipped, with the reason, elsewhere.
"""

from __future__ import annotations

import pytest
import torch

from treeattn.llm.errors import ModelError
from treeattn.llm.formats.weights import load_model
from treeattn.llm.generate import generate_local
from treeattn.llm.options import place_model
from treeattn.llm.static_decode import StaticCache, StaticDecoder, generate_static

torch.set_num_threads(1)
PROMPT = [(37 * i + 11) % 256 for i in range(19)]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def model():
    return load_model("debug").model


def test_static_cache_decodes_the_tokens_of_the_growing_cache(model):
    want = generate_local(model, PROMPT, 10)
    got = generate_static(model, PROMPT, 10)
    assert got.tokens == want.tokens and got.steps == len(got.tokens) - 1
    for a, b in zip(got.logits, want.logits, strict=True):
        # only the split of the cache differs (full buffer with kv_len against a slice)
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_static_steps_write_at_the_device_position(model):
    decoder = StaticDecoder(model, capacity=len(PROMPT) + 4)
    decoder.prefill(PROMPT)
    untouched = decoder.cache.k[0][:, :, len(PROMPT) + 1 :].clone()
    decoder.step(5, len(PROMPT))
    assert int(decoder.cache.position) == len(PROMPT)
    assert int(decoder.cache.kv_len[0]) == len(PROMPT) + 1
    assert decoder.cache.k[0][:, :, len(PROMPT)].abs().sum() > 0  # the new key landed there
    assert torch.equal(decoder.cache.k[0][:, :, len(PROMPT) + 1 :], untouched)  # nothing after


def test_a_one_token_prefill_chunk_lands_at_its_own_position(model):
    # A prompt one token longer than a whole number of prefill chunks ends on a one-token
    # chunk; it must be stored at its host-side position, not at the decode step's slot.
    from treeattn.llm.local_cache import LocalCache, prefill

    prompt = PROMPT[:9]
    want = prefill(model, prompt, LocalCache(model.config.n_layers), chunk=4)
    cache = StaticCache(model, capacity=12)
    got = prefill(model, prompt, cache, chunk=4)  # chunks of 4, 4 and 1 tokens
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert cache.k[0][:, :, 8].abs().sum() > 0


def test_positions_outside_the_cache_are_refused(model):
    cache = StaticCache(model, capacity=8)
    with pytest.raises(ModelError, match="outside the cache's 8 slots"):
        cache.set_position(8)
    decoder = StaticDecoder(model, capacity=4)
    with pytest.raises(ModelError, match="do not fit the cache's 4 slots"):
        decoder.prefill(PROMPT)


def test_a_graph_needs_a_cuda_model(model):
    with pytest.raises(ModelError, match="needs the model on a CUDA device"):
        StaticDecoder(model, capacity=32, graph=True)
    with pytest.raises(ModelError, match="non-empty prompt"):
        generate_static(model, [], 4)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graph_replays_the_eager_step_exactly(dtype):
    gpu = place_model(load_model("debug").model, torch.device("cuda"), dtype)
    eager = generate_static(gpu, PROMPT, 12)
    graphed = generate_static(gpu, PROMPT, 12, graph=True)
    assert graphed.tokens == eager.tokens
    for a, b in zip(graphed.logits, eager.logits, strict=True):
        assert torch.equal(a, b)  # the same kernels on the same buffers: bit for bit


@needs_cuda
def test_cuda_static_decoding_matches_the_cpu_model():
    cpu = load_model("debug").model
    want = generate_local(cpu, PROMPT, 8)
    gpu = place_model(load_model("debug").model, torch.device("cuda"), torch.float32)
    got = generate_static(gpu, PROMPT, 8, graph=True)
    assert got.tokens == want.tokens
    for a, b in zip(got.logits, want.logits, strict=True):
        torch.testing.assert_close(a.cpu(), b, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("extra,message", [
    (["--nproc", "2"], "use --nproc 1 and no --context-tokens"),
    (["--nproc", "1", "--device", "cpu"], "needs the model on a CUDA device"),
])
def test_cuda_graph_option_refuses_what_it_cannot_run(extra, message, capsys):
    from treeattn.cli import main

    rc = main(["generate", "--model", "debug", "--prompt", "hi", "--cuda-graph", *extra])
    assert rc == 2
    assert message in capsys.readouterr().err


@needs_cuda
def test_generate_cli_with_a_cuda_graph_matches_eager(capsys):
    import json

    from treeattn.cli import main

    rc = main(["generate", "--model", "debug", "--prompt", "hello there", "--nproc", "1",
               "--device", "cuda", "--cuda-graph", "--verify", "--json", "--max-new-tokens", "8"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["identical_to_single_process"] is True
    assert out["algorithm"] == "local, CUDA graph" and 1 <= len(out["tokens"]) <= 8
