"""``WindowLayer``: a sliding-window or chunked layer of a
:class:`~treeattn.hf.cache.ShardedCache`, whole on every rank as transformers keeps it."""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicSlidingWindowLayer

from treeattn.hf.claims import note_update
from treeattn.hf.support import HFIntegrationError


class WindowLayer(DynamicSlidingWindowLayer):
    """A sliding-window or chunked layer: transformers' own bounded layer (the last
    ``sliding_window - 1`` tokens), whole on every rank and attended locally.

    In a sharded prefill (``mode == "ring"``) each rank's chunks need the ``window - 1``
    positions before them, which may lie on other ranks: the K/V blocks go once round the
    ranks (the pass-KV ring's order, no attention merged), and each rank keeps only the
    positions some query of its own sees, and the prompt's last ``window - 1`` (the layer's
    state for the decode steps, the same on every rank); then it attends locally with
    transformers' mask rule (:meth:`sees`).
    """

    def __init__(self, cache, index: int, sliding_window: int, chunked: bool = False) -> None:
        """``cache``: the :class:`~treeattn.hf.cache.ShardedCache` this layer belongs to."""
        super().__init__(sliding_window=sliding_window)
        self.cache, self.index, self.chunked, self.mode = cache, index, chunked, "local"
        self.pieces: list[tuple[list[int], torch.Tensor]] = []  # ring: (positions, kv)
        self.tail: list[tuple[list[int], torch.Tensor]] = []

    def update(self, key_states, value_states, *args, **kwargs):
        c = self.cache
        c.check_group()
        c.check_shape(self.index, key_states, value_states)
        if c.ring is not None:  # sharded prefill: this rank's chunks, for the gather
            if c.ring[2] is not None:
                raise HFIntegrationError(f"{c.name}: sharded_prefill of a left-padded batch "
                                         "runs full-attention layers only; prefill it "
                                         "replicated (generate on the empty ShardedCache)")
            self.mode = "ring"
            note_update(self, key_states)
            return key_states, value_states
        self.mode = "local"
        if self.index == c.first_kv:
            c.share_rng(key_states.device)
            if self.cumulative_length and key_states.shape[2] == 1:
                c.agree_on(key_states)
        k, v = super().update(key_states, value_states, *args, **kwargs)
        note_update(self, k)
        return k, v

    def sees(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """(T, S) bool: query positions ``q_pos`` (T,) see keys ``k_pos`` (S,), by
        transformers' sliding-window (``k > q - window``) or chunked (same chunk) rule,
        causal."""
        q, k = q_pos[:, None], k_pos[None, :]
        near = (k // self.sliding_window == q // self.sliding_window) if self.chunked \
            else k > q - self.sliding_window
        return near & (k <= q)

    def gather(self, own: torch.Tensor) -> tuple[list[int], torch.Tensor]:
        """Sharded prefill: the positions this rank's queries see, from every rank's block
        (``own``: this rank's (2, B, Hkv, T, D)); returns them ascending and their K/V
        (2, B, Hkv, m, D). Collective (the ring)."""
        from treeattn.runtime.prefill.ring import ring_attention

        c = self.cache
        layout, prompt, _ = c.ring
        mine = layout.positions(c.rank, queries=True)
        lo = prompt - (self.sliding_window - 1)  # the state kept for decoding starts here
        wanted = set(range(max(lo, 0), prompt))
        for q in mine:
            wanted.update(range(max(q - self.sliding_window + 1, 0), q + 1))
        found: list[tuple[list[int], torch.Tensor]] = []

        def keep(src: int, block: torch.Tensor) -> None:
            positions = layout.positions(src)
            take = [i for i, p in enumerate(positions) if p in wanted]
            if take:
                index = torch.tensor(take, dtype=torch.long, device=block.device)
                found.append(([positions[i] for i in take], block.index_select(3, index)))

        b, hkv, _, d = own.shape[1:]
        q = own.new_empty(b, hkv, 0, d)  # no queries: the ring only carries the blocks
        ring_attention(c.attention.ctx, layout, q, own, keep)
        positions = [p for ps, _ in found for p in ps]
        kv = torch.cat([piece for _, piece in found], dim=3)
        order = sorted(range(len(positions)), key=positions.__getitem__)
        kv = kv.index_select(3, torch.tensor(order, dtype=torch.long, device=kv.device))
        positions = [positions[i] for i in order]
        tail = [i for i, p in enumerate(positions) if p >= lo]
        self.tail = [([positions[i] for i in tail],
                      kv.index_select(3, torch.tensor(tail, dtype=torch.long,
                                                      device=kv.device)))]
        return positions, kv

    def finish_ring(self, prompt: int) -> None:
        """After the sharded prefill: the prompt's last ``window - 1`` positions are the
        layer's state, as transformers' own layer holds it after ``prompt`` tokens."""
        if not self.tail:
            raise HFIntegrationError(f"layer {self.index} saw no ring block")
        _, kv = self.tail[0]
        self.device, self.dtype = kv.device, kv.dtype
        self.keys, self.values = kv[0].contiguous(), kv[1].contiguous()
        self._sliding_window_tensor = self._sliding_window_tensor.to(self.device)
        self.cumulative_length, self.is_initialized = prompt, True
        self.tail, self.mode = [], "local"

    def reset(self) -> None:
        super().reset()
        self.pieces, self.tail, self.mode = [], [], "local"
