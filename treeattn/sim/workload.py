"""One decode step of attention: the model, the context length and how it is sharded.

Sizes (all in bytes, ``B`` the batch, ``n`` a shard's token count):

* KV block of ``n`` tokens: ``2 · B · n · Hkv · D · dtype_bytes`` (the 2 is K and V);
* partial ``(o, lse)``: ``4 · B · Hq · (D + 1)`` (fp32);
* ``max`` and ``den``: ``4 · B · Hq``; ``num``: ``4 · B · Hq · D``;
* attention FLOPs over ``n`` tokens: ``4 · B · Hq · n · D`` (q·Kᵀ and p·V, 2 per MAC).

Sharding rule: the sequence is split into contiguous shards, rank ``r`` holding a shard of
``seq_len // p`` tokens, and the first ``seq_len % p`` ranks one token more. Explicit
``shard_lengths`` (which must sum to ``seq_len``) override the rule.
"""

from __future__ import annotations

from dataclasses import dataclass

from treeattn.sim.errors import SimError
from treeattn.sim.models import ModelConfig

FP32 = 4


@dataclass(frozen=True)
class DecodeWorkload:
    """Decode one token for ``batch`` sequences of ``seq_len`` cached tokens.

    Examples
    --------
    >>> w = DecodeWorkload("debug", seq_len=10)
    >>> w.shards(4)
    [3, 3, 2, 2]
    >>> w.kv_bytes(3) == 2 * 3 * 2 * 16 * 4
    True
    >>> DecodeWorkload("debug", 5, shard_lengths=(0, 5)).shards(2)
    [0, 5]
    """

    model: ModelConfig | str
    seq_len: int
    batch: int = 1
    shard_lengths: tuple[int, ...] | None = None
    include_model: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.model, ModelConfig):
            object.__setattr__(self, "model", ModelConfig.from_name(self.model))
        if int(self.seq_len) <= 0:
            raise SimError(f"seq_len must be positive, got {self.seq_len}")
        if int(self.batch) <= 0:
            raise SimError(f"batch must be positive, got {self.batch}")
        if self.shard_lengths is not None:
            lengths = tuple(int(n) for n in self.shard_lengths)
            if any(n < 0 for n in lengths) or sum(lengths) != self.seq_len:
                raise SimError(
                    f"shard_lengths {list(lengths)} must be non-negative and sum to seq_len "
                    f"{self.seq_len}"
                )
            object.__setattr__(self, "shard_lengths", lengths)

    # -- sharding --------------------------------------------------------------------------
    def shards(self, world: int) -> list[int]:
        """Tokens held by each of ``world`` ranks (see the module's sharding rule)."""
        if world < 2:
            raise SimError(f"a topology with {world} GPU has no reduction to plan")
        if self.shard_lengths is not None:
            if len(self.shard_lengths) != world:
                raise SimError(
                    f"{len(self.shard_lengths)} shard_lengths given for {world} ranks"
                )
            return list(self.shard_lengths)
        if self.seq_len < world:
            raise SimError(f"seq_len {self.seq_len} is smaller than the number of GPUs {world}")
        base, extra = divmod(self.seq_len, world)
        return [base + (1 if r < extra else 0) for r in range(world)]

    # -- sizes -----------------------------------------------------------------------------
    def kv_bytes(self, tokens: int) -> int:
        m = self.model
        return 2 * self.batch * tokens * m.n_kv_heads * m.head_dim * m.dtype_bytes

    @property
    def partial_bytes(self) -> int:
        return FP32 * self.batch * self.model.n_heads * (self.model.head_dim + 1)

    @property
    def max_bytes(self) -> int:
        return FP32 * self.batch * self.model.n_heads

    @property
    def num_bytes(self) -> int:
        return FP32 * self.batch * self.model.n_heads * self.model.head_dim

    def buffer_bytes(self, payload: str) -> int:
        """Size of a non-KV payload buffer (``partial``, ``max``, ``num``, ``den``)."""
        sizes = {
            "partial": self.partial_bytes, "residue": self.partial_bytes, "max": self.max_bytes,
            "num": self.num_bytes, "den": self.max_bytes,
        }
        if payload not in sizes:
            raise SimError(f"no fixed size for payload {payload!r}")
        return sizes[payload]

    def query_bytes(self) -> int:
        m = self.model
        return self.batch * m.n_heads * m.head_dim * m.dtype_bytes

    def attention_bytes(self, tokens: int) -> int:
        """Bytes one partial attention touches: its KV, the query and the partial written."""
        return self.kv_bytes(tokens) + self.query_bytes() + self.partial_bytes

    def attention_flops(self, tokens: int) -> int:
        m = self.model
        return 4 * self.batch * m.n_heads * tokens * m.head_dim

    def merge_bytes(self, payload: str = "partial", elements_bytes: int | None = None) -> int:
        """Bytes a Merge touches: read both operands and write one (3 × the message)."""
        size = self.buffer_bytes(payload) if elements_bytes is None else elements_bytes
        return 3 * size

    def describe(self) -> str:
        return f"{self.model.name} seq_len={self.seq_len} batch={self.batch}"
