"""The KV cache, split along the sequence across ranks.

Rank ``r`` holds one contiguous run of positions, its *shard*. Shards may have uneven lengths;
the default split (:func:`treeattn.runtime.plans.shard_lengths`) matches
:class:`treeattn.schedule.workload.DecodeWorkload` (the first ``seq_len % world`` ranks get one
extra token).

Where a new token's K/V go (the *append policy*), decided identically on every rank from the
shard lengths alone, so no message is needed:

- ``"last"`` (default): the last rank. Every shard stays a contiguous run of positions in
  rank order, and the positions of rank ``r`` are ``offsets[r] .. offsets[r] + lengths[r]``.
- ``"shortest"``: the rank with the shortest shard (lowest rank on a tie). This keeps the
  shards balanced over a long generation; a shard is then its original contiguous run plus the
  tokens appended to it. Attention does not depend on the order of the keys, so the result is
  the same.

Storage is one tensor per layer of shape (2, B, Hkv, capacity, D), K at index 0 and V at 1,
that grows by doubling. While ``length == capacity`` the filled part is one contiguous block
that can be sent without a copy.
"""

from __future__ import annotations

import torch

from treeattn.runtime.errors import RuntimeFailure

APPEND_POLICIES = ("last", "shortest")


def append_owner(lengths: list[int], policy: str = "last") -> int:
    """The rank that stores the next token's K/V under ``policy``.

    >>> append_owner([3, 2, 2], "last"), append_owner([3, 2, 2], "shortest")
    (2, 1)
    """
    if policy == "last":
        return len(lengths) - 1
    if policy == "shortest":
        return min(range(len(lengths)), key=lambda r: (lengths[r], r))
    raise RuntimeFailure(f"unknown append policy {policy!r}; choose from {APPEND_POLICIES}")


def appends_to(lengths: list[int], rank: int, tokens: int, policy: str = "last") -> int:
    """How many of the next ``tokens`` appended tokens ``rank`` will store.

    A cache reserves that much room up front (``reserve``): growing later copies every
    layer of the shard, which stalls a generation's first token, and a shard without
    spare room stays one contiguous block that can be sent without a copy.

    >>> appends_to([3, 2, 2], 2, 4, "last"), appends_to([3, 2, 2], 1, 4, "shortest")
    (4, 2)
    """
    lengths, mine = list(lengths), 0
    for _ in range(max(0, tokens)):
        owner = append_owner(lengths, policy)
        lengths[owner] += 1
        mine += owner == rank
    return mine


class ShardedKVCache:
    """This rank's shard of a multi-layer KV cache, plus every rank's shard length.

    Every rank calls :meth:`append` with the same new token; only the owner stores it, and all
    ranks update the shared length table, so they agree on the layout without communicating.
    ``reserve`` is the number of tokens a generation will append: the ranks that will store
    some of them allocate that room now (:func:`appends_to`).
    """

    def __init__(
        self,
        rank: int,
        lengths: list[int],
        n_layers: int,
        batch: int,
        n_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        policy: str = "last",
        reserve: int = 0,
    ) -> None:
        append_owner(lengths, policy)  # validates the policy
        if not 0 <= rank < len(lengths):
            raise RuntimeFailure(f"rank {rank} is outside the world of {len(lengths)}")
        self.rank, self.lengths, self.policy = rank, list(lengths), policy
        self.shape = (batch, n_kv_heads, head_dim)
        cap = lengths[rank] + appends_to(lengths, rank, reserve, policy)
        self._store = [
            torch.zeros(2, batch, n_kv_heads, cap, head_dim, dtype=dtype, device=device)
            for _ in range(n_layers)
        ]  # each (2, B, Hkv, cap, D)

    @property
    def length(self) -> int:
        """Tokens held by this rank."""
        return self.lengths[self.rank]

    @property
    def capacity(self) -> int:
        return self._store[0].shape[3]

    @property
    def n_layers(self) -> int:
        return len(self._store)

    def fill(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Set this rank's whole shard of ``layer``; k, v are (B, Hkv, length, D)."""
        expected = (self.shape[0], self.shape[1], self.length, self.shape[2])
        if tuple(k.shape) != expected or tuple(v.shape) != expected:
            raise RuntimeFailure(f"shard must be {expected}, got {tuple(k.shape)}")
        self._store[layer][0, :, :, : self.length] = k
        self._store[layer][1, :, :, : self.length] = v

    def put(self, layer: int, offset: int, kv: torch.Tensor) -> None:
        """Write ``kv`` (2, B, Hkv, n, D) at shard positions ``offset .. offset + n - 1`` of
        ``layer``, inside the filled length: a sharded prefill fills its shard piece by
        piece as the pieces pass by (:mod:`treeattn.llm.prefill`)."""
        n = kv.shape[3]
        if offset < 0 or offset + n > self.length:
            raise RuntimeFailure(f"shard piece {offset}..{offset + n} is outside the shard "
                                 f"of {self.length} tokens")
        self._store[layer][:, :, :, offset : offset + n] = kv

    def kv(self, layer: int = 0) -> torch.Tensor:
        """The filled part of ``layer`` as (2, B, Hkv, length, D); a view, no copy."""
        return self._store[layer][:, :, :, : self.length]

    def layer(self, layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """``(k, v)`` views of ``layer``, each (B, Hkv, length, D)."""
        kv = self.kv(layer)
        return kv[0], kv[1]

    def append(self, new_kv: list[tuple[torch.Tensor, torch.Tensor]]) -> int:
        """Append one token to every layer; ``new_kv[l]`` is (k, v), each (B, Hkv, 1, D).

        Returns the rank that stored it (see the module docstring for the policy).
        """
        if len(new_kv) != self.n_layers:
            raise RuntimeFailure(f"append needs {self.n_layers} layers, got {len(new_kv)}")
        for layer, (k, v) in enumerate(new_kv):
            self.stage(layer, k, v)
        return self.commit()

    def next_owner(self) -> int:
        """The rank that stores the next token (the same answer on every rank)."""
        return append_owner(self.lengths, self.policy)

    def stage(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Write the next token's K/V of ``layer`` (each (B, Hkv, 1, D)) where it will live,
        before :meth:`commit` counts it, and return this rank's shard of ``layer`` with it:
        (2, B, Hkv, length + 1, D) on the owner, (2, B, Hkv, length, D) elsewhere (views).

        Decoding stages each layer's new K/V before that layer's attention, so the new
        token's own key is attended as part of its owner's shard: no separate one-key
        partial and merge per layer.
        """
        if self.next_owner() != self.rank:
            return self.kv(layer)
        if self.length == self.capacity:  # grows every layer at once, so only layer 0 can
            self._grow(max(1, 2 * self.capacity))
        pos = self.length
        self._store[layer][0, :, :, pos : pos + 1] = k  # (B, Hkv, 1, D)
        self._store[layer][1, :, :, pos : pos + 1] = v
        return self._store[layer][:, :, :, : pos + 1]  # (2, B, Hkv, length + 1, D)

    def commit(self) -> int:
        """Count the staged token in every rank's length table; returns its owner."""
        owner = self.next_owner()
        self.lengths[owner] += 1
        return owner

    def _grow(self, capacity: int) -> None:
        for i, store in enumerate(self._store):
            bigger = store.new_zeros(*store.shape[:3], capacity, store.shape[4])
            bigger[:, :, :, : store.shape[3]] = store
            self._store[i] = bigger

    def nbytes(self) -> int:
        """Bytes of tensor storage this cache holds (all layers, full capacity)."""
        return sum(s.numel() * s.element_size() for s in self._store)

    def tensors(self) -> list[torch.Tensor]:
        """The storage tensors, for memory accounting."""
        return list(self._store)
