"""Sharded prefill for transformers models: the prompt never whole on one rank.

:func:`sharded_prefill` fills a :class:`~treeattn.hf.cache.ShardedCache` with all but the
last token of the prompt, each rank running the model on its own zig-zag pair of prompt
chunks only (:class:`treeattn.sim.prefill.layout.PrefillLayout`: balanced causal work), with
``position_ids`` the chunks' global positions, so RoPE is as in one process. Every layer's
attention is the pass-KV ring of :func:`treeattn.runtime.prefill.ring.ring_attention`; while
the blocks go round, each rank keeps the positions its cache layout names (contiguous or
interleaved), so at the end it holds exactly its shard of every layer and nothing else.

The last prompt token is left for ``model.generate``: given the same ``input_ids`` and the
filled cache, transformers runs only the positions the cache does not hold yet, so its first
forward is one decode step through the sharded attention, and its logits are the first
token's. Exact: the ring's partials are merged by log-sum-exp, as one process's softmax.

A rank whose compute chunks are empty (fewer prefilled positions than ranks) runs no model
forward; it still passes every layer's ring blocks on and keeps its positions.

A left-padded batch is prefilled one sequence at a time over its real tokens (their
positions differ per sequence), into the per-sequence lengths the decode steps then use.
Refused by name: padding that is not on the left, and a cache that already holds tokens.
"""

from __future__ import annotations

import torch

from treeattn.hf.cache import ShardedCache, ShardedLayer
from treeattn.hf.claims import release
from treeattn.hf.support import HFIntegrationError, model_type
from treeattn.hf.window import WindowLayer
from treeattn.runtime.prefill.ring import ring_attention
from treeattn.sim.prefill.layout import PrefillLayout


def _heads(config) -> tuple[int, int, int]:
    """(query heads, KV heads, head dim) of a transformers config."""
    text = getattr(config, "get_text_config", lambda: config)()
    hq = int(text.num_attention_heads)
    hkv = int(getattr(text, "num_key_value_heads", None) or hq)
    d = int(getattr(text, "head_dim", None) or text.hidden_size // hq)
    return hq, hkv, d


def _ring(model, ids: torch.Tensor, cache: ShardedCache, seq: int | None) -> None:
    """One sharded prefill of ``ids`` (B', n) into ``cache``: sequence ``seq``, or the whole
    batch (None). Each rank runs the model on its own chunks; a rank without any only passes
    the ring's blocks on."""
    ctx = cache.attention.ctx
    batch, prompt = ids.shape
    layout = PrefillLayout(ctx.world, 0, prompt)
    mine = layout.positions(ctx.rank, queries=True)
    cache.begin_ring(layout, prompt, seq)
    if mine:
        positions = torch.tensor(mine, dtype=torch.long, device=ids.device)  # (T,)
        model(input_ids=ids[:, positions],  # (B', T): this rank's chunks only
              position_ids=positions[None].expand(batch, -1), cache=cache,
              use_cache=True, logits_to_keep=1)
        return
    hq, hkv, d = _heads(model.config)
    dtype = getattr(model, "dtype", None) or next(model.parameters()).dtype  # the K/V's
    q = torch.empty(batch, hq, 0, d, dtype=dtype, device=ids.device)
    own = torch.empty(2, batch, hkv, 0, d, dtype=dtype, device=ids.device)
    for layer in cache.layers:
        if isinstance(layer, ShardedLayer):
            ring_attention(ctx, layout, q, own, layer.keep_ring_block)
        elif isinstance(layer, WindowLayer):
            layer.gather(own)


@torch.no_grad()
def sharded_prefill(model, input_ids: torch.Tensor, cache: ShardedCache,
                    attention_mask: torch.Tensor | None = None) -> int:
    """Prefill ``input_ids`` (B, L) but its last column into ``cache`` across the group.

    Every rank calls it with the same arguments (collective); then
    ``model.generate(input_ids, cache=cache, attention_mask=attention_mask, ...)`` continues
    from the cache. A left-padded batch (``attention_mask`` with zeros before each
    sequence's real tokens) is prefilled one sequence at a time, each over its real tokens
    at positions 0, 1, ... as transformers numbers them from the mask. Returns the positions
    prefilled (L - 1). The model must use ``attn_implementation="treeattn"``.
    """
    if input_ids.dim() != 2:
        raise HFIntegrationError(f"input_ids must be (batch, length), got "
                                 f"{tuple(input_ids.shape)}")
    if cache.get_seq_length():
        raise HFIntegrationError(f"the cache already holds {cache.get_seq_length()} positions")
    implementation = getattr(model.config, "_attn_implementation", None)
    if implementation != "treeattn":
        raise HFIntegrationError(f"the model attends with {implementation!r}: load it with "
                                 "attn_implementation=\"treeattn\"")
    if model_type(model.config) != cache.name or len(cache.layers) != _layers(model.config):
        raise HFIntegrationError(f"the ShardedCache was made for {cache.name} with "
                                 f"{len(cache.layers)} layers, and the model is "
                                 f"{model_type(model.config)} with {_layers(model.config)}")
    if "recurrent" in cache.kinds:
        raise HFIntegrationError(
            f"{cache.name}: sharded_prefill does not run recurrent (Mamba, linear-attention, "
            "conv) layers, whose state passes from token to token: prefill replicated "
            "(generate on the empty ShardedCache), which shards the full layers' K/V as well")
    batch, length = input_ids.shape
    if attention_mask is not None and tuple(attention_mask.shape) != (batch, length):
        raise HFIntegrationError(f"attention_mask {tuple(attention_mask.shape)} does not "
                                 f"match input_ids {(batch, length)}")
    padded = attention_mask is not None and not bool(attention_mask.all())
    if padded:
        real = attention_mask.bool()
        if not bool(real[:, -1].all()) or bool((real[:, 1:] < real[:, :-1]).any()):
            raise HFIntegrationError("sharded prefill takes left padding only: each "
                                     "sequence's real tokens must end the row")
        prompts = [int(r.sum()) - 1 for r in real]  # the last real token is generate's
    else:
        prompts = [length - 1] * batch
    if length < 2 or not any(prompts):
        return 0
    try:
        if padded:
            for b in range(batch):
                if prompts[b]:
                    row = input_ids[b, real[b]][None, :-1]  # (1, n_b): its real tokens
                    _ring(model, row, cache, b)
        else:
            _ring(model, input_ids[:, :-1], cache, None)
        cache.end_ring(prompts, length - 1)
    except BaseException:
        cache.reset()  # half a prefill is no cache
        raise
    _expect_in_generate(model, cache, input_ids, attention_mask if padded else None)
    return length - 1


def _layers(config) -> int:
    text = getattr(config, "get_text_config", lambda **_: config)(decoder=True)
    return int(text.num_hidden_layers)


def _expect_in_generate(model, cache: ShardedCache, ids: torch.Tensor, mask) -> None:
    """Make ``model.generate`` on ``cache`` check that it continues the ids (and mask) that
    were prefilled: the first step's ``prepare_inputs_for_generation`` compares them (each
    rank alike), before any token is returned."""
    cache.prefilled = (ids.detach().clone(), None if mask is None else mask.detach().clone())
    if getattr(model, "_treeattn_checks_prefill", False):
        return
    prepare = model.prepare_inputs_for_generation

    def checked(input_ids, *args, **kwargs):
        given = kwargs.get("cache", kwargs.get("past_key_values"))
        expected = getattr(given, "prefilled", None)
        if expected is not None:
            given.prefilled = None
            _compare(given, expected, input_ids, kwargs.get("attention_mask"))
        return prepare(input_ids, *args, **kwargs)

    model.prepare_inputs_for_generation = checked
    model._treeattn_checks_prefill = True


def _compare(cache: ShardedCache, expected, input_ids, mask) -> None:
    ids, want_mask = expected
    n = ids.shape[1] - 1
    if input_ids.shape[0] != ids.shape[0] or input_ids.shape[1] < ids.shape[1] \
            or not torch.equal(input_ids[:, :n].to(ids.device), ids[:, :n]):
        release(cache)
        raise HFIntegrationError(f"{cache.name}: generate was given ids "
                                 f"{tuple(input_ids.shape)} that do not begin with the "
                                 f"{n} prefilled positions of {tuple(ids.shape)}: pass "
                                 "generate the ids sharded_prefill had")
    given = None if mask is None or bool(mask.all()) else mask[:, : ids.shape[1]]
    if (given is None) != (want_mask is None) or (
            given is not None and not torch.equal(given.to(want_mask.device).bool(),
                                                  want_mask.bool())):
        raise HFIntegrationError(f"{cache.name}: generate's attention_mask differs from the "
                                 "one sharded_prefill had (without one, generate masks the "
                                 "ids equal to pad_token_id): pass both the same mask")
