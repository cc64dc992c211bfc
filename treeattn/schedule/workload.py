"""One decode step of attention: the model, the context length and how it is sharded.

Sizes (all in bytes, ``B`` the batch, ``n`` a shard's token count):

* KV block of ``n`` tokens: ``2 · B · n · Hkv · D · dtype_bytes`` (the 2 is K and V);
* partial ``(o, lse)``: ``4 · B · Hq · (D + 1)`` (fp32), or ``2 · B · Hq · D + 4 · B · Hq``
  when the partials travel in bf16 (``partial_dtype``, below);
* ``max`` and ``den``: ``4 · B · Hq``; ``num``: ``4 · B · Hq · D``;
* attention FLOPs over ``n`` tokens: ``4 · B · Hq · n · D`` (q·Kᵀ and p·V, 2 per MAC).

Wire format (``partial_dtype``): how a partial ``(o, lse)`` travels, ``"fp32"`` or ``"bf16"``
(o in bf16, lse in fp32; :data:`~treeattn.schedule.payloads.PARTIAL_DTYPES`). ``None``, the
default, lets each algorithm move its own: treeattn's schedules fp32, each baseline the format
its engine moves (:data:`treeattn.schedule.algorithms.ENGINE_PARTIAL_DTYPE`). Every payload
whose layout is marked ``wire`` follows it, so a new algorithm's messages do too.

Sharding rule (:func:`treeattn.schedule.ir.shard_sizes`): the sequence is split into
contiguous shards, rank ``r`` holding a shard of ``seq_len // p`` tokens, and the first
``seq_len % p`` ranks one token more. Explicit ``shard_lengths`` (which must sum to
``seq_len``) override the rule. Payload sizes come from the IR's one table of payload
layouts (:data:`treeattn.schedule.ir.PAYLOAD_LAYOUTS`).

:class:`ModelConfig` is THE registry of model shapes (:data:`MODELS`); values are copied
from each model's published ``config.json`` on the Hugging Face Hub:

* ``smollm2-135m``: HuggingFaceTB/SmolLM2-135M/config.json (hidden_size 576,
  intermediate_size 1536, num_hidden_layers 30, num_attention_heads 9, num_key_value_heads 3,
  head_dim 576/9 = 64, vocab_size 49152, tie_word_embeddings true, bfloat16).
* ``llama-3.2-1b``: meta-llama/Llama-3.2-1B/config.json (2048, 8192, 16 layers, 32 heads,
  8 KV heads, head_dim 64, vocab 128256, tied embeddings, bfloat16).
* ``llama-3.1-8b``: meta-llama/Llama-3.1-8B/config.json (4096, 14336, 32 layers, 32 heads,
  8 KV heads, head_dim 128, vocab 128256, bfloat16).
* ``llama-3.1-70b``: meta-llama/Llama-3.1-70B/config.json (8192, 28672, 80 layers, 64 heads,
  8 KV heads, head_dim 128, vocab 128256, bfloat16).
* ``llama-3.1-405b``: meta-llama/Llama-3.1-405B/config.json (16384, 53248, 126 layers,
  128 heads, 8 KV heads, head_dim 128, vocab 128256, bfloat16).
* ``deepseek-v3``: deepseek-ai/DeepSeek-V3/config.json
  (https://huggingface.co/deepseek-ai/DeepSeek-V3/blob/main/config.json): hidden_size 7168,
  intermediate_size 18432 (the dense FFN of the first ``first_k_dense_replace`` = 3 layers),
  num_hidden_layers 61, num_attention_heads 128, q_lora_rank 1536, kv_lora_rank 512,
  qk_nope_head_dim 128, qk_rope_head_dim 64, v_head_dim 128, n_routed_experts 256,
  num_experts_per_tok 8, moe_intermediate_size 2048, n_shared_experts 1, vocab_size 129280,
  untied embeddings; FP8 (e4m3, 128×128 blocks) weights as published, bfloat16 activations.

  MLA (multi-head latent attention) with absorbed projections: the cache holds one latent
  per token and layer, ``kv_lora_rank + qk_rope_head_dim`` = 576 values, which is both K and
  V; every query head attends to it. In this registry an MLA model is one KV head of width
  576 (``n_kv_heads = 1``, ``head_dim = 576``) whose KV block is that one latent, not a K and
  a V (:meth:`DecodeWorkload.kv_bytes`). The merged partial is priced at that width too
  (``o`` of absorbed MLA is 512 wide, so a partial is counted 12% large). Under tensor
  parallelism every rank keeps the whole latent (the one KV head is replicated,
  :func:`treeattn.sim.parallel.group_workload`), which decode context parallelism removes.
* ``debug``: a tiny fp32 flavour for tests (2 layers, 4 query heads, 2 KV heads, head_dim 16).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from treeattn.schedule.ir import Compute
from treeattn.schedule.payloads import (
    PARTIAL_DTYPES,
    PAYLOAD_LAYOUTS,
    ComputeLabel,
    Payload,
    SimError,
    payload_bytes,
    payload_numel,
    query_slots,
    shard_sizes,
)


def real_slots(batch: int, world: int, origin: int) -> int:
    """How many of ``origin``'s pass-Q slots hold a real query (``i·world + origin < B``).

    >>> [real_slots(5, 4, s) for s in range(4)]
    [2, 1, 1, 1]
    """
    return max(0, -(-(batch - origin) // world))

FP32 = 4



DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# What weights and a KV cache can be stored in (FP8 e4m3 as DeepSeek-V3 publishes its
# weights and vLLM/SGLang store fp8 KV caches); computation stays in DTYPE_BYTES' dtypes.
STORAGE_DTYPE_BYTES = {**DTYPE_BYTES, "float8": 1}


@dataclass(frozen=True)
class ModelConfig:
    """The shapes of one decoder-only transformer.

    ``n_heads`` is Hq, ``n_kv_heads`` is Hkv (GQA: ``Hq % Hkv == 0``), ``head_dim`` is D and
    ``dim`` the hidden size. ``dtype_bytes`` is derived from ``dtype``.

    Examples
    --------
    >>> m = ModelConfig.from_name("llama-3.1-8b")
    >>> (m.n_layers, m.n_heads, m.n_kv_heads, m.head_dim, m.dtype_bytes)
    (32, 32, 8, 128, 2)
    >>> ModelConfig.from_name("debug").dtype
    'float32'
    """

    name: str
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    dim: int
    ffn_dim: int
    vocab_size: int
    dtype: str = "bfloat16"
    tie_embeddings: bool = False
    # MLA (0: grouped-query attention): the latent's width and the query projections.
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    q_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    # Mixture of experts (0 routed experts: a dense gated MLP of ``ffn_dim`` in every layer).
    n_routed_experts: int = 0
    experts_per_token: int = 0
    moe_ffn_dim: int = 0
    n_shared_experts: int = 0
    first_dense_layers: int = 0  # layers before the first MoE layer use the dense MLP
    dtype_bytes: int = field(init=False)

    def __post_init__(self) -> None:
        if self.dtype not in STORAGE_DTYPE_BYTES:
            raise SimError(f"model {self.name}: unknown dtype {self.dtype!r}")
        for attr in ("n_layers", "n_heads", "n_kv_heads", "head_dim", "dim", "vocab_size"):
            if getattr(self, attr) <= 0:
                raise SimError(f"model {self.name}: {attr} must be positive")
        if self.n_heads % self.n_kv_heads:
            raise SimError(f"model {self.name}: n_heads % n_kv_heads != 0 (GQA)")
        if self.kv_lora_rank and (self.n_kv_heads != 1
                                  or self.head_dim != self.kv_lora_rank + self.qk_rope_head_dim):
            raise SimError(f"model {self.name}: an MLA model is one KV head of width "
                           "kv_lora_rank + qk_rope_head_dim")
        object.__setattr__(self, "dtype_bytes", STORAGE_DTYPE_BYTES[self.dtype])

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def is_moe(self) -> bool:
        return self.n_routed_experts > 0

    @classmethod
    def from_name(cls, name: str) -> ModelConfig:
        """The registered configuration called ``name`` (case-insensitive)."""
        key = str(name).strip().lower()
        if key not in MODELS:
            raise SimError(f"unknown model {name!r} (known: {', '.join(MODELS)})")
        return MODELS[key]

    @classmethod
    def debug(cls) -> ModelConfig:
        """The tiny fp32 flavour used by tests."""
        return MODELS["debug"]

    def weight_bytes_per_token(self) -> int:
        """Bytes of weights one decode step reads outside attention's softmax core.

        Q/K/V/O projections and the gated MLP of every layer, plus the output head; the input
        embedding is a row gather and is not counted.
        """
        attn = self.dim * self.head_dim * (2 * self.n_heads + 2 * self.n_kv_heads)
        mlp = 3 * self.dim * self.ffn_dim
        head = self.vocab_size * self.dim
        return (self.n_layers * (attn + mlp) + head) * self.dtype_bytes


MODELS: dict[str, ModelConfig] = {
    m.name: m
    for m in (
        ModelConfig("smollm2-135m", 30, 9, 3, 64, 576, 1536, 49152, tie_embeddings=True),
        ModelConfig("llama-3.2-1b", 16, 32, 8, 64, 2048, 8192, 128256, tie_embeddings=True),
        ModelConfig("llama-3.1-8b", 32, 32, 8, 128, 4096, 14336, 128256),
        ModelConfig("llama-3.1-70b", 80, 64, 8, 128, 8192, 28672, 128256),
        ModelConfig("llama-3.1-405b", 126, 128, 8, 128, 16384, 53248, 128256),
        ModelConfig("deepseek-v3", 61, 128, 1, 576, 7168, 18432, 129280, kv_lora_rank=512,
                    qk_rope_head_dim=64, q_lora_rank=1536, qk_nope_head_dim=128, v_head_dim=128,
                    n_routed_experts=256, experts_per_token=8, moe_ffn_dim=2048,
                    n_shared_experts=1, first_dense_layers=3),
        ModelConfig("debug", 2, 4, 2, 16, 64, 128, 256, dtype="float32"),
    )
}


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
    # Where the merged output must land: "replicated" (the rest of the layer runs replicated,
    # treeattn's own model) or "head_sharded" (a tensor-parallel output projection follows).
    layout: str = "replicated"
    # Tensor parallelism: heads split over this many GPUs, the sequence over the rest (see
    # treeattn.sim.parallel). 1: every GPU holds every head of its shard.
    tp: int = 1
    # How partials travel: "fp32", "bf16" (o in bf16, lse in fp32), or None: each
    # algorithm's own format (see the module docstring)
    partial_dtype: str | None = None

    def __post_init__(self) -> None:
        if self.partial_dtype is not None and self.partial_dtype not in PARTIAL_DTYPES:
            raise SimError(f"partial dtype must be one of {', '.join(PARTIAL_DTYPES)}, got "
                           f"{self.partial_dtype!r}")
        if not isinstance(self.tp, int) or self.tp < 1:
            raise SimError(f"tensor-parallel size must be a positive integer, got {self.tp!r}")
        if self.layout not in ("replicated", "head_sharded"):
            raise SimError(f"output layout must be 'replicated' or 'head_sharded', "
                           f"got {self.layout!r}")
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
        return shard_sizes(self.seq_len, world)

    # -- sizes -----------------------------------------------------------------------------
    def dims(self, tokens: int = 0, world: int = 1) -> dict[str, int]:
        """The symbol values of :data:`~treeattn.schedule.ir.PAYLOAD_LAYOUTS` for a block of
        ``tokens`` tokens on ``world`` ranks (``P``, and ``Bq`` the pass-Q query slots)."""
        m = self.model
        return {"B": self.batch, "Hq": m.n_heads, "Hkv": m.n_kv_heads, "D": m.head_dim,
                "T": tokens, "P": world, "Bq": query_slots(self.batch, world)}

    def kv_bytes(self, tokens: int) -> int:
        """K and V of ``tokens`` tokens; an MLA model caches one latent that is both."""
        numel = payload_numel(Payload.KV, self.dims(tokens))
        return (numel // 2 if self.model.is_mla else numel) * self.model.dtype_bytes

    @property
    def partial_bytes(self) -> int:
        return self.buffer_bytes(Payload.PARTIAL)

    @property
    def max_bytes(self) -> int:
        return self.buffer_bytes(Payload.MAX)

    @property
    def num_bytes(self) -> int:
        return self.buffer_bytes(Payload.NUM)

    def buffer_bytes(self, payload: str, world: int = 1) -> int:
        """Size of a non-KV payload buffer (``partial``, ``max``, ``num``, ...) on ``world``
        ranks (only the pass-Q ``qblock`` and ``outbox`` depend on the world).

        Memoised per workload: generators ask for the same few sizes once per rank.

        >>> w = DecodeWorkload("debug", 8, batch=5)  # Bq = 2 slots on 4 ranks
        >>> w.buffer_bytes("qblock", 4), w.buffer_bytes("outbox", 4)
        (512, 2176)
        """
        cache = self.__dict__.setdefault("_buffer_bytes", {})
        key = (payload, world)
        if key not in cache:
            layout = PAYLOAD_LAYOUTS.get(payload)
            if layout is None or payload == Payload.KV:
                raise SimError(f"no fixed size for payload {payload!r}")
            cache[key] = payload_bytes(payload, self.dims(world=world), self.model.dtype_bytes,
                                       self.wire_dtype)
        return cache[key]

    @property
    def wire_dtype(self) -> str:
        """The partial wire format sizes are priced in (``partial_dtype``, fp32 when unset)."""
        return self.partial_dtype or "fp32"

    def chunk_bytes(self, payload: str, count: int) -> list[int]:
        """Bytes of each of ``count`` chunks of a payload buffer (schedule.py's chunks).

        ``partial`` is sliced along the query-head axis (``o`` and ``lse`` together);
        ``max``/``num``/``den`` are sliced as flat fp32 arrays.

        >>> DecodeWorkload("debug", 8).chunk_bytes("partial", 3)  # 4 heads: 2, 1, 1
        [136, 68, 68]
        """
        if PAYLOAD_LAYOUTS[Payload(payload)].chunk_axis == "Hq":
            per_head = payload_bytes(payload, {**self.dims(), "Hq": 1}, self.model.dtype_bytes,
                                     self.wire_dtype)
            return [per_head * h for h in shard_sizes(self.model.n_heads, count)]
        elements = self.buffer_bytes(payload) // FP32
        return [FP32 * n for n in shard_sizes(elements, count)]

    def query_bytes(self) -> int:
        m = self.model
        return self.batch * m.n_heads * m.head_dim * m.dtype_bytes

    def attention_bytes(self, tokens: int) -> int:
        """Bytes one partial attention touches: its KV, the query and the partial written."""
        return self.kv_bytes(tokens) + self.query_bytes() + self.partial_bytes

    def attention_step(self, tokens: int, label: str = ComputeLabel.ATTENTION) -> Compute:
        """The Compute step of a partial attention over ``tokens`` (own shard or a block)."""
        return Compute(label, self.attention_bytes(tokens), self.attention_flops(tokens))

    def attention_flops(self, tokens: int, batch: int | None = None) -> int:
        m = self.model
        return 4 * (self.batch if batch is None else batch) * m.n_heads * tokens * m.head_dim

    def qblock_attention_step(self, tokens: int, world: int, origin: int = 0) -> Compute:
        """One pass-Q step: the block of ``origin``'s query slots over the own shard of
        ``tokens`` tokens, the block read and one outbox slot written. Of the
        ``Bq = ceil(B / world)`` slots only the real ones (queries ``i·world + origin < B``)
        are attended, each over its own sequence's KV: padding slots are skipped, as a
        batched decode kernel over the real rows would (a block with none still pays the
        step's kernel launch)."""
        real = real_slots(self.batch, world, origin)
        kv = self.kv_bytes(tokens) // self.batch * real  # (2, real, Hkv, T, D)
        slot = self.buffer_bytes(Payload.OUTBOX, world) // world  # (Bq, Hq, D+1) fp32
        nbytes = (kv + self.buffer_bytes(Payload.QBLOCK, world) + slot) if real else 0
        return Compute(ComputeLabel.ATTENTION_QBLOCK, nbytes,
                       self.attention_flops(tokens, real))

    def describe(self) -> str:
        return f"{self.model.name} seq_len={self.seq_len} batch={self.batch}"
