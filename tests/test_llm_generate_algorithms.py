"""Real decoding with every collective-based algorithm: the same greedy tokens and logits as
one process, at world 2 and 3 (uneven shards, and heads that do not divide by 3)."""

from __future__ import annotations

import pytest
from test_llm_generate import _assert_same, _run_distributed

from treeattn.llm.formats.weights import load_model
from treeattn.llm.generate import generate_local

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("world,algorithm", [(2, "oneshot"), (3, "helix"), (3, "dcp"),
                                             (3, "allreduce2"), (2, "allreduce3"),
                                             (3, "ring-passq")])
def test_collective_algorithms_decode_like_one_process(world, algorithm):
    model = load_model("debug").model
    prompt = [(29 * i + 5) % 256 for i in range(19)]
    ref = generate_local(model, prompt, 6)
    result = _run_distributed("debug", model, prompt, world, algorithm, 6)
    _assert_same(result["generation"], ref)
    assert result["bytes_sent"] > 0
