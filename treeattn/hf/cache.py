"""``ShardedCache``: a transformers ``Cache`` whose full-attention layers' K/V are split
along the sequence across the ranks of a ``torch.distributed`` group.

Layers that do not grow with the context are not split (:mod:`treeattn.hf.support` reads each
layer's kind): a sliding-window or chunked layer is transformers' own bounded layer, whole on
every rank (:class:`WindowLayer`); a recurrent layer keeps transformers' own state.

Each rank keeps, per layer, only the positions its layout names:

- ``"contiguous"``: the prompt split into contiguous blocks in rank order (the first
  ``L % world`` ranks one token longer), and every generated token on the last rank, so each
  shard stays one run of positions;
- ``"interleaved"``: position ``p`` on rank ``(p // interleave_size) % world``, the layout of
  vLLM's ``--cp-kv-cache-interleave-size`` (1: token round-robin), for prompt and generated
  tokens alike, so the shards stay balanced however long the generation.

The cache reports the *global* sequence length (``get_seq_length``, ``get_mask_sizes``), so
transformers computes positions, RoPE and masks as for one process. Attention does not depend
on the order of the keys, so the shards need not be contiguous.

Prefill, two ways. Sharded (:func:`treeattn.hf.sharded_prefill`, then ``generate``): each
rank runs the model on its own prompt chunks, the layer's ``update`` returns those chunks'
K/V, the attention is a pass-KV ring, and the layer keeps the ring's pieces its layout names
(``keep_ring_block``); the prompt is never whole on one rank (a left-padded batch: one ring
per sequence). Replicated (``generate`` on an empty cache): every rank runs the whole prompt,
the layer's ``update`` keeps its own positions and returns the whole prompt's K/V, and the
attention is exact ordinary SDPA. Each decode step's ``update`` stores the new token on its
owner and returns this rank's shard, which :func:`treeattn.hf.attention.treeattn_attention`
reduces across the ranks by the plan's schedule (:class:`treeattn.ShardedAttention`).

Storage per layer: one (2, B, Hkv, capacity, D) tensor, K at 0 and V at 1, growing by
doubling; the shard handed to attention is two views of it (no copy).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from transformers.cache_utils import (
    Cache,
    CacheLayerMixin,
    DummyLayer,
    LinearAttentionLayer,
    get_layer_types_and_kwargs,
)

from treeattn.hf.claims import note_update, release
from treeattn.hf.support import HFIntegrationError, check_served, model_type, text_config
from treeattn.hf.window import WindowLayer
from treeattn.runtime.sharded_attention import ShardedAttention
from treeattn.schedule.ir import Schedule

LAYOUTS = ("contiguous", "interleaved")


def owner_of(position: int, prompt: int, world: int, layout: str, interleave: int = 1) -> int:
    """The rank that stores global ``position`` (``prompt`` tokens were prefilled).

    >>> [owner_of(p, 5, 2, "contiguous") for p in range(7)]
    [0, 0, 0, 1, 1, 1, 1]
    >>> [owner_of(p, 5, 2, "interleaved", 2) for p in range(7)]
    [0, 0, 1, 1, 0, 0, 1]
    """
    if layout == "interleaved":
        return (position // interleave) % world
    if position >= prompt:
        return world - 1
    base, extra = divmod(prompt, world)
    edge = extra * (base + 1)  # the first `extra` ranks hold base + 1 tokens
    return position // (base + 1) if position < edge else extra + (position - edge) // base


class ShardedLayer(CacheLayerMixin):
    """One layer's shard; ``mode`` says what the last ``update`` returned.

    Left-padded batches: the prefill's attention tells the layer which prompt positions are
    real (:meth:`drop_padding`, from the mask's last row); each sequence then keeps only its
    real tokens, owned by their index among them, so sequences hold different numbers of
    tokens here (``counts``) and attention takes them as ``kv_len``.
    """

    is_sliding = False
    is_compileable = False

    def __init__(self, cache: ShardedCache, index: int) -> None:
        super().__init__()
        self.cache, self.index = cache, index
        self.store: torch.Tensor | None = None  # (2, B, Hkv, capacity, D)
        self.counts: list[int] = []  # tokens of each sequence held here
        self.real: list[int] = []  # real (unpadded) tokens of each sequence, all ranks
        self.prompt_real: list[int] = []  # real prompt tokens of each sequence
        self.total = 0  # positions of the (padded) sequence, as transformers counts them
        self.mode = "prefill"
        self.prompt = None  # the prefill's (K, V) until its attention has seen the mask
        # ring pieces kept: (sequence or None for the whole batch, positions, kv)
        self.pieces: list[tuple[int | None, torch.Tensor, torch.Tensor]] = []
        self.ring_like: torch.Tensor | None = None  # the last ring block seen
        self.before = 0  # a second turn: tokens held here before its new ones

    @property
    def local(self) -> int:
        """Tokens held here by the longest sequence."""
        return max(self.counts, default=0)

    def lazy_initialization(self, key_states, value_states) -> None:
        self.device, self.dtype = key_states.device, key_states.dtype
        self.is_initialized = True

    def _room(self, shape, need: int) -> None:
        b, h, _, d = shape
        if self.store is not None and self.store.shape[3] >= need:
            return
        cap = max(need, 2 * (self.store.shape[3] if self.store is not None else 0), 16)
        bigger = torch.zeros(2, b, h, cap, d, dtype=self.dtype, device=self.device)
        if self.store is not None:
            bigger[:, :, :, : self.local] = self.store[:, :, :, : self.local]
        self.store = bigger

    def _keep(self, key_states, value_states, real: list[list[int]]) -> None:
        """Store, per sequence, the positions of ``real[b]`` this rank owns."""
        c = self.cache
        self.prompt_real = [len(r) for r in real]
        mine = [[p for i, p in enumerate(r) if c.owner(i, len(r)) == c.rank] for r in real]
        self.store = None
        self._room(key_states.shape, max(len(m) for m in mine) + c.reserve)
        for b, positions in enumerate(mine):
            index = torch.tensor(positions, dtype=torch.long, device=self.device)
            self.store[0, b, :, : len(positions)] = key_states[b].index_select(1, index)
            self.store[1, b, :, : len(positions)] = value_states[b].index_select(1, index)
        self.counts, self.real = [len(m) for m in mine], list(self.prompt_real)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Keep this rank's positions of the new K/V (B, Hkv, S, D); return what attention
        needs: the whole prompt at prefill, this rank's shard at a decode step."""
        k, v = self._update(key_states, value_states)
        note_update(self, k)
        return k, v

    def _update(self, key_states: torch.Tensor, value_states: torch.Tensor):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        c, (b, _, s, _) = self.cache, key_states.shape
        c.check_group()
        c.check_shape(self.index, key_states, value_states)
        if c.ring is None and self.index == c.first_kv:
            c.share_rng(key_states.device)
        if c.ring is not None:  # sharded prefill: this rank's chunks, for the ring
            self.mode = "ring"
            return key_states, value_states
        if self.total == 0:  # prefill, replicated: keep our positions, attend to them all
            self._keep(key_states, value_states, [list(range(s))] * b)
            self.total, self.mode = s, "prefill"
            self.prompt = (key_states, value_states)  # until the attention saw the mask
            return key_states, value_states
        self.prompt = None
        if s != 1 and ("recurrent" in c.kinds or any(r != self.total for r in self.real)):
            raise HFIntegrationError(
                f"{c.name}: a {s}-token forward on a cache holding {self.total} positions "
                "(a second turn) is served for models without recurrent layers and batches "
                "without padding; prefill the whole conversation into a new ShardedCache")
        if self.index == c.first_kv:
            c.agree_on(key_states)
        before = self.local
        for j in range(s):
            for i in range(b):
                if c.owner(self.real[i], self.prompt_real[i]) == c.rank:
                    self._room(key_states.shape, self.counts[i] + 1)
                    at = self.counts[i]
                    self.store[0, i, :, at : at + 1] = key_states[i, :, j : j + 1]  # (Hkv,1,D)
                    self.store[1, i, :, at : at + 1] = value_states[i, :, j : j + 1]
                    self.counts[i] += 1
                self.real[i] += 1
        self.total += s
        if s == 1:
            self.mode = "decode"
            return self.shard()
        # a second turn: the new tokens' K/V, whole here; attention adds this rank's earlier
        # shard (its first `before` tokens)
        self.mode, self.before = "append", before
        return key_states, value_states

    def drop_padding(self, real: torch.Tensor) -> None:
        """After a padded prefill: ``real`` (B, S) bool marks the prompt's real positions;
        keep only those (the shard is rebuilt from the prompt's K/V, which the layer holds
        until its attention has run)."""
        k, v = self.prompt
        self._keep(k, v, [torch.nonzero(row).flatten().tolist() for row in real.cpu()])
        self.prompt = None

    def keep_ring_block(self, src: int, block: torch.Tensor) -> None:
        """Sharded prefill: keep the positions of rank ``src``'s ring block (2, B, Hkv, n, D)
        that this rank's layout owns (a copy: the block itself moves on)."""
        c = self.cache
        layout, prompt, seq = c.ring
        if self.ring_like is None:  # shape, dtype and device only: the block itself moves on
            self.ring_like = block.new_empty(*block.shape[:3], 0, block.shape[4])
        positions = layout.positions(src)
        owned = [i for i, p in enumerate(positions) if c.owner(p, prompt) == c.rank]
        if owned:
            index = torch.tensor(owned, dtype=torch.long, device=block.device)
            at = torch.tensor([positions[i] for i in owned], dtype=torch.long)
            self.pieces.append((seq, at, block.index_select(3, index)))

    def _ordered(self, pieces) -> torch.Tensor | None:
        """The kept pieces of one ring, in position order: (2, B', Hkv, n, D)."""
        if not pieces:
            return None
        order = torch.argsort(torch.cat([at for _, at, _ in pieces]))
        kv = torch.cat([piece for _, _, piece in pieces], dim=3)
        return kv.index_select(3, order.to(kv.device))

    def finish_ring(self, prompts: list[int], total: int, batch: int) -> None:
        """After the sharded prefill: the kept pieces, in position order, become the shard.
        ``prompts[b]``: the real positions of sequence ``b`` prefilled; ``total``: the
        (padded) positions, as transformers counts them."""
        like = self.ring_like
        if like is None and any(prompts):
            raise HFIntegrationError(f"layer {self.index} saw no ring block")
        whole = self._ordered([p for p in self.pieces if p[0] is None])
        per_seq = [whole[:, b:b + 1] if whole is not None else
                   self._ordered([p for p in self.pieces if p[0] == b]) for b in range(batch)]
        self.pieces, self.ring_like = [], None
        counts = [0 if kv is None else kv.shape[3] for kv in per_seq]
        if like is not None:
            self.device, self.dtype = like.device, like.dtype
        self.is_initialized = True
        _, _, hkv, _, d = like.shape if like is not None else (0, 0, 0, 0, 0)
        self.store = None
        self._room((batch, hkv, 0, d), max(counts) + self.cache.reserve)
        for b, kv in enumerate(per_seq):
            if kv is not None:
                self.store[:, b:b + 1, :, : counts[b]] = kv
        self.counts, self.real, self.prompt_real = counts, list(prompts), list(prompts)
        self.total, self.mode, self.prompt = total, "decode", None

    def kv_len(self) -> torch.Tensor | None:
        """Each sequence's tokens here when they differ (B,), else None."""
        if len(set(self.counts)) <= 1:
            return None
        return torch.tensor(self.counts, device=self.device)

    def shard(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's K and V, each (B, Hkv, local, D): views of one storage tensor."""
        if self.store is None:
            raise HFIntegrationError(f"layer {self.index} holds nothing yet")
        kv = self.store[:, :, :, : self.local]
        return kv[0], kv[1]

    def get_seq_length(self) -> int:
        return self.total

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.total + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.store, self.counts, self.real, self.total = None, [], [], 0
        self.mode, self.prompt, self.pieces, self.ring_like = "prefill", None, [], None
        self.is_initialized = False

    def reorder_cache(self, beam_idx) -> None:
        raise HFIntegrationError("beam search reorders the cache: not served by treeattn")

    def crop(self, tokens_to_remove: int) -> None:
        raise HFIntegrationError("cropping the cache (assisted decoding) is not served by "
                                 "treeattn")


class ShardedCache(Cache):
    """A transformers ``Cache`` sharded along the sequence over a process group (``group``:
    the default group when None, or a subgroup from ``dist.new_group``).

    ``config``: the model's config (checked for features treeattn does not serve).
    ``plan_or_algorithm``: what :class:`treeattn.ShardedAttention` takes (a ``Plan``, or an
    algorithm name; ``"auto"``: the planner's pick, on ``topology`` for a CUDA group, as
    :class:`treeattn.ShardedAttention` takes it). ``layout``: ``"contiguous"`` or
    ``"interleaved"`` (``interleave_size`` positions per turn, as vLLM's flag). ``reserve``:
    tokens to make room for up front (e.g. ``max_new_tokens``). ``unlisted``: serve a model
    type outside :data:`treeattn.hf.support.SERVED_MODEL_TYPES` (unvetted). Making it is
    collective.
    """

    def __init__(self, config, plan_or_algorithm="auto", *, layout: str = "contiguous",
                 interleave_size: int = 1, reserve: int = 0, group=None, topology=None,
                 timeout_s: float = 60.0, unlisted: bool = False) -> None:
        kinds = check_served(config, unlisted)
        if layout not in LAYOUTS:
            raise HFIntegrationError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
        if not isinstance(interleave_size, int) or interleave_size < 1:
            raise HFIntegrationError(f"interleave_size must be a positive integer, got "
                                     f"{interleave_size!r}")
        text = text_config(config)
        self.name, self.kinds = model_type(config), kinds
        # the first layer with K/V: its decode steps compare a digest across the ranks
        self.first_kv = next(i for i, k in enumerate(kinds) if k in ("full", "window"))
        self.head_shape: dict[int, tuple[int, int, int]] = {}  # layer: (Hkv, Dk, Dv) seen
        kind = ("algorithm" if isinstance(plan_or_algorithm, str) else "schedule"
                if isinstance(plan_or_algorithm, Schedule) else "plan")
        self.attention = ShardedAttention(group=group, topology=topology, timeout_s=timeout_s,
                                          **{kind: plan_or_algorithm})
        self.rank, self.world = self.attention.rank, self.attention.world
        self.layout, self.interleave, self.reserve = layout, interleave_size, max(0, reserve)
        # during a sharded prefill: (PrefillLayout, prompt positions, the sequence the ring is
        # of, or None for the whole batch)
        self.ring = None
        self.prefilled = None  # (ids, mask) of sharded_prefill, for generate to check
        types, per_layer = get_layer_types_and_kwargs(text)
        layers = []
        for i, (kind, kw) in enumerate(zip(kinds, per_layer)):
            if kind == "full":
                layers.append(ShardedLayer(self, i))
            elif kind == "window":
                layers.append(WindowLayer(self, i, kw["sliding_window"],
                                          chunked=types[i] == "chunked_attention"))
            elif kind == "recurrent":
                layers.append(LinearAttentionLayer(**kw))
            else:
                layers.append(DummyLayer())
        super().__init__(layers=layers)

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        if not 0 <= layer_idx < len(self.layers):
            raise HFIntegrationError(f"layer {layer_idx} updates a ShardedCache made for "
                                     f"{len(self.layers)} layers of {self.name} (a cache "
                                     "built for another config)")
        if isinstance(self.layers[layer_idx], (LinearAttentionLayer, DummyLayer)):
            raise HFIntegrationError(f"layer {layer_idx} of {self.name} stores K/V, and the "
                                     "config says it has none (a cache built for another "
                                     "config)")
        return self.layers[layer_idx].update(key_states, value_states, *args, **kwargs)

    def check_shape(self, index: int, key_states: torch.Tensor,
                    value_states: torch.Tensor) -> None:
        """Refuse K/V whose heads change from one update to the next (a cache used by
        another model), and V heads wider or narrower than K's on a sharded layer."""
        got = (int(key_states.shape[1]), int(key_states.shape[3]), int(value_states.shape[3]))
        want = self.head_shape.setdefault(index, got)
        if got != want:
            raise HFIntegrationError(f"{self.name}: layer {index} stores K/V of {got[0]} heads "
                                     f"of {got[1]}, after {want[0]} of {want[1]} (a cache "
                                     "used by another model)")
        if got[1] != got[2] and self.kinds[index] == "full":
            raise HFIntegrationError(f"{self.name}: layer {index}'s V heads ({got[2]}) differ "
                                     f"from its K heads ({got[1]}), which the sharded "
                                     "attention does not serve")

    def share_rng(self, device: torch.device) -> None:
        """Give every rank the first rank's random state, once per forward (at the first K/V
        layer), so that sampling after it draws alike everywhere: the ranks' scores are the
        same to the bit (the merged attention is, on every rank), and now so is the draw,
        whatever each rank was seeded with (one broadcast of the generator's state)."""
        if self.world == 1:
            return
        ctx = self.attention.ctx
        src = ctx.ranks[0] if getattr(ctx, "ranks", None) else 0
        state = torch.get_rng_state().to(ctx.device)  # (n,) uint8
        dist.broadcast(state, src=src, group=ctx.group)
        torch.set_rng_state(state.cpu())
        if device.type == "cuda":
            state = torch.cuda.get_rng_state(device).to(ctx.device)
            dist.broadcast(state, src=src, group=ctx.group)
            torch.cuda.set_rng_state(state.cpu(), device)

    def agree_on(self, key_states: torch.Tensor) -> None:
        """Every rank must decode the same token: a digest of the new token's K (B, Hkv, 1, D)
        at the first sharded layer, compared across the group (one all-reduce of two numbers
        per step). Ranks that sampled differently, or were given different ids, are refused
        before they attend to one another's shards."""
        k = key_states.detach().double().flatten()
        weights = torch.arange(1, k.numel() + 1, dtype=torch.float64, device=k.device)
        mine = torch.stack([k.sum(), (k * weights).sum()])
        both = torch.cat([mine, -mine])
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self.attention.ctx.group)
        if not torch.equal(both[:2], -both[2:]):
            raise HFIntegrationError(
                f"{self.name}: the ranks decode different tokens (their new keys differ): "
                "give every rank the same ids, and when sampling seed every rank alike and "
                "pass logits_processor=[treeattn.hf.RankZeroScores()]")

    def begin_ring(self, layout, prompt: int, seq: int | None = None) -> None:
        """Enter one ring of a sharded prefill (:func:`treeattn.hf.sharded_prefill`): updates
        return the chunks' K/V and attention runs the ring of ``layout``, for sequence
        ``seq`` of the batch (None: all of it)."""
        self.ring = (layout, prompt, seq)

    def end_ring(self, prompts: list[int], total: int) -> None:
        """Leave sharded prefill: every layer's kept pieces become its shard."""
        self.ring = None
        for layer in self.layers:
            if isinstance(layer, ShardedLayer):
                layer.finish_ring(prompts, total, len(prompts))
            elif isinstance(layer, WindowLayer):
                layer.finish_ring(total)

    def reset(self) -> None:
        self.ring = None
        release(self)
        super().reset()

    def owner(self, position: int, prompt: int) -> int:
        """The rank that keeps a sequence's ``position``-th real token (``prompt`` real
        tokens were prefilled)."""
        return owner_of(position, prompt, self.world, self.layout, self.interleave)

    def check_group(self) -> None:
        """Refuse a cache used in a process group other than the one it was made for."""
        group = self.attention.ctx.group
        if not dist.is_initialized() or dist.get_world_size(group) != self.world \
                or dist.get_rank(group) != self.rank:
            now = (f"rank {dist.get_rank(group)} of {dist.get_world_size(group)}"
                   if dist.is_initialized() else "no process group")
            raise HFIntegrationError(f"this ShardedCache was made for rank {self.rank} of "
                                     f"{self.world}, and is used by {now}")

    @property
    def local_lengths(self) -> list[int]:
        """Tokens each layer holds here for its longest sequence (0: a layer without K/V)."""
        return [layer.local if isinstance(layer, ShardedLayer) else
                int(layer.keys.shape[-2]) if isinstance(layer, WindowLayer)
                and layer.is_initialized else 0 for layer in self.layers]

    def memory_bytes(self) -> dict[str, int]:
        """Bytes this rank holds per layer kind: ``full`` (its shards' tokens, not the
        storage's spare room), ``window`` (the bounded K/V, whole) and ``recurrent`` (the
        conv and recurrent states)."""
        out = {"full": 0, "window": 0, "recurrent": 0}
        for layer in self.layers:
            if isinstance(layer, ShardedLayer) and layer.store is not None:
                per_token = layer.store[:, :, :, :1].numel() * layer.store.element_size()
                out["full"] += per_token * sum(layer.counts)
            elif isinstance(layer, WindowLayer) and layer.is_initialized:
                out["window"] += sum(t.numel() * t.element_size()
                                     for t in (layer.keys, layer.values))
            elif isinstance(layer, LinearAttentionLayer):
                for states in (layer.conv_states, layer.recurrent_states):
                    for t in (states.values() if isinstance(states, dict) else states or []):
                        if isinstance(t, torch.Tensor):
                            out["recurrent"] += t.numel() * t.element_size()
        return out
