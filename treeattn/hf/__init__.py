"""The Hugging Face transformers integration (the ``[hf]`` extra), imported lazily.

``import treeattn.hf`` registers the ``"treeattn"`` attention implementation and its mask
function with transformers; then, on every rank of a ``torch.distributed`` group::

    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="treeattn")
    cache = treeattn.hf.ShardedCache(model.config, "auto")
    treeattn.hf.sharded_prefill(model, ids, cache)  # optional: else a replicated prefill
    model.generate(ids, cache=cache, max_new_tokens=32)

See ``docs/hf.md``: which layers are sharded, how prefill runs, and what is refused by name.
"""

from treeattn.hf.attention import ATTENTION_NAME, RankZeroScores, register, treeattn_attention
from treeattn.hf.cache import LAYOUTS, ShardedCache, ShardedLayer, owner_of
from treeattn.hf.prefill import sharded_prefill
from treeattn.hf.support import HFIntegrationError, check_served, layer_kinds
from treeattn.hf.window import WindowLayer

register()

__all__ = ["ATTENTION_NAME", "LAYOUTS", "HFIntegrationError", "RankZeroScores", "ShardedCache",
           "ShardedLayer", "WindowLayer", "check_served", "layer_kinds", "owner_of", "register",
           "sharded_prefill", "treeattn_attention"]
