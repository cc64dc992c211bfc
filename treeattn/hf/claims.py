"""Which cache update an attention call belongs to, and the rule that each update of a
:class:`~treeattn.hf.cache.ShardedCache` layer is attended exactly once through treeattn.

transformers calls the attention function right after a layer's cache ``update``, with the
K/V that update returned. A model whose layer attends without treeattn (loaded without
``attn_implementation="treeattn"``, or computing attention itself), or twice per update, would
otherwise decode wrong tokens silently; here it is refused by name.
"""

from __future__ import annotations

from treeattn.hf.support import HFIntegrationError


class _Claim:
    """The cache layer updated last and the K its ``update`` returned: transformers calls the
    attention function right after that update, with those K/V (see hf/attention.py). Each
    update must be attended exactly once through treeattn: the next update of the same cache,
    or a second attention call on the same K, refuses a model that does otherwise."""

    layer = None  # a ShardedLayer or WindowLayer
    key = None
    calls = 0


_CLAIM = _Claim()


def note_update(layer, key) -> None:
    """Called by every K/V update of a ShardedCache layer: the previous update of the same
    cache must have been attended through treeattn."""
    prev = _CLAIM.layer
    if prev is not None and prev.cache is layer.cache and _CLAIM.calls == 0:
        _CLAIM.layer = None
        raise HFIntegrationError(
            f"{layer.cache.name}: layer {prev.index} updated the ShardedCache but did not "
            "attend through treeattn (load the model with attn_implementation=\"treeattn\"; "
            "a layer that computes its attention itself is not served)")
    _CLAIM.layer, _CLAIM.key, _CLAIM.calls = layer, key, 0


def claim(module, key):
    """The cache layer whose update returned ``key`` (attention's first call after it), or
    None: a forward without a ShardedCache. Refuses a second call on the same update."""
    layer = _CLAIM.layer
    if layer is None:
        return None
    if _CLAIM.calls == 0:
        index = getattr(module, "layer_idx", None)
        if index is not None and index != layer.index:
            raise HFIntegrationError(f"{layer.cache.name}: layer {index} attends right after "
                                     f"the cache update of layer {layer.index}")
        _CLAIM.calls = 1
        return layer
    if key is _CLAIM.key:
        raise HFIntegrationError(f"{layer.cache.name}: layer {layer.index} calls attention "
                                 "more than once per cache update, which treeattn does not "
                                 "serve")
    _CLAIM.layer = None  # a later forward without the cache
    return None


def release(cache) -> None:
    """Forget the claim of ``cache`` (a failed or reset forward)."""
    if _CLAIM.layer is not None and _CLAIM.layer.cache is cache:
        _CLAIM.layer = None
