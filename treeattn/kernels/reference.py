"""Pure-torch partial attention and merge: the CPU path and the oracle for the Triton kernels.

The math (DESIGN.md): for a query ``q`` and a shard ``(K, V)``,
``s = q·Kᵀ·scale``, ``lse = logsumexp(s)``, ``o = softmax(s)·V``. Two partials merge as
``lse = logaddexp(lse_a, lse_b)``, ``o = o_a·exp(lse_a − lse) + o_b·exp(lse_b − lse)``. The
identity is the empty shard ``(o = 0, lse = −inf)``; merging identities gives the identity.

``partial_attention`` is written to be fast on a CPU for long T: the GQA group is a matmul of
``(B, Hkv, G, D)`` against ``(B, Hkv, T, D)``, so K and V are never repeated per query head,
and T is walked in chunks with an online softmax so memory stays bounded. 16-bit K and V are
upcast chunk by chunk into one reused fp32 buffer (allocating a fresh buffer per chunk costs
page faults and was 7x slower on the benchmark machine). Everything accumulates in fp32 and the
chunking depends only on shapes, so the result is deterministic.

``naive_attention`` is the textbook oracle: repeat K and V per query head, float64 softmax.
"""

from __future__ import annotations

import torch

from treeattn.kernels.checks import check_pair, check_partial_inputs, check_partials

# Elements of K per chunk (B*Hkv*t*D). fp32 chunks are views, so they can be large; 16-bit
# chunks are copied into an fp32 buffer that should stay in cache (≈4 MiB measured best).
_CHUNK_ELEMS_FP32 = 1 << 24
_CHUNK_ELEMS_16BIT = 1 << 20
_MIN_CHUNK_T = 256


def identity_partial(
    b: int, hq: int, d: int, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """The merge identity: an empty shard, ``o = 0`` (B, Hq, D) and ``lse = -inf`` (B, Hq)."""
    o = torch.zeros(b, hq, d, dtype=torch.float32, device=device)  # (B, Hq, D)
    lse = torch.full((b, hq), float("-inf"), dtype=torch.float32, device=device)  # (B, Hq)
    return o, lse


def _chunk_len(b: int, hkv: int, d: int, dtype: torch.dtype) -> int:
    budget = _CHUNK_ELEMS_FP32 if dtype == torch.float32 else _CHUNK_ELEMS_16BIT
    return max(_MIN_CHUNK_T, budget // max(1, b * hkv * d))


def _safe_max(m: torch.Tensor) -> torch.Tensor:
    """Replace -inf maxima (fully masked rows) by 0 so that ``exp(s - m)`` gives 0, not NaN."""
    return torch.where(torch.isneginf(m), torch.zeros_like(m), m)


def _finish(
    m: torch.Tensor, l_sum: torch.Tensor, acc: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Normalise an online-softmax state (max, sum, unnormalised output) into a partial."""
    nonempty = l_sum > 0  # (..., 1)
    o = torch.where(nonempty, acc / torch.where(nonempty, l_sum, 1.0), 0.0)
    lse = torch.where(nonempty, _safe_max(m) + torch.log(l_sum), float("-inf"))
    return o, lse.squeeze(-1)


def partial_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float | None = None,
    kv_len: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one query token per sequence over a KV shard, as a partial ``(o, lse)``.

    Parameters
    ----------
    q : torch.Tensor
        (B, Hq, D) query, fp32, fp16 or bf16.
    k, v : torch.Tensor
        (B, Hkv, T, D) keys and values of the shard, same dtype as ``q``; ``Hq % Hkv == 0``.
    scale : float, optional
        Score scale, default ``1 / sqrt(D)``.
    kv_len : torch.Tensor, optional
        (B,) valid lengths; positions ``t >= kv_len[b]`` are masked. Values are clamped to
        ``[0, T]``.

    Returns
    -------
    o : torch.Tensor
        (B, Hq, D) fp32 softmax-weighted values; zero where nothing is visible.
    lse : torch.Tensor
        (B, Hq) fp32 log-sum-exp of the scaled scores; ``-inf`` where nothing is visible.

    Examples
    --------
    >>> q, k = torch.ones(1, 2, 4), torch.zeros(1, 1, 3, 4)
    >>> o, lse = partial_attention(q, k, k + 1.0)
    >>> o[0, 0].tolist(), round(lse[0, 0].item(), 4)  # three equal scores: log(3)
    ([1.0, 1.0, 1.0, 1.0], 1.0986)
    """
    scale = check_partial_inputs(q, k, v, scale, kv_len)
    b, hq, d = q.shape
    hkv, t_total = k.shape[1], k.shape[2]
    g = hq // hkv
    qg = q.reshape(b, hkv, g, d).to(torch.float32) * scale  # (B, Hkv, G, D)
    m = torch.full((b, hkv, g, 1), float("-inf"), device=q.device)  # (B, Hkv, G, 1)
    l_sum = torch.zeros(b, hkv, g, 1, device=q.device)  # (B, Hkv, G, 1)
    acc = torch.zeros(b, hkv, g, d, device=q.device)  # (B, Hkv, G, D)
    t_end = t_total
    if kv_len is not None:
        kv_len = kv_len.to(torch.int64).clamp(0, t_total)  # (B,)
        t_end = int(kv_len.max().item()) if b > 0 else 0
    chunk = _chunk_len(b, hkv, d, k.dtype)
    bufs = None
    if k.dtype != torch.float32 and t_end > 0:
        shape = (b, hkv, min(chunk, t_end), d)
        bufs = (torch.empty(shape, device=q.device), torch.empty(shape, device=q.device))
    for c0 in range(0, t_end, chunk):
        c1 = min(c0 + chunk, t_end)
        kc, vc = k[:, :, c0:c1], v[:, :, c0:c1]  # (B, Hkv, t, D)
        if bufs is not None:
            kc = bufs[0][:, :, : c1 - c0].copy_(kc)
            vc = bufs[1][:, :, : c1 - c0].copy_(vc)
        s = torch.matmul(qg, kc.transpose(-1, -2))  # (B, Hkv, G, t)
        if kv_len is not None:
            pos = torch.arange(c0, c1, device=q.device)  # (t,)
            s.masked_fill_((pos[None, :] >= kv_len[:, None])[:, None, None, :], float("-inf"))
        m_new = torch.maximum(m, s.amax(-1, keepdim=True))  # (B, Hkv, G, 1)
        m_safe = _safe_max(m_new)
        p = s.sub_(m_safe).exp_()  # (B, Hkv, G, t)
        alpha = torch.exp(m - m_safe)  # (B, Hkv, G, 1); 0 while m was -inf
        l_sum = l_sum * alpha + p.sum(-1, keepdim=True)
        acc = acc * alpha + torch.matmul(p, vc)  # (B, Hkv, G, D)
        m = m_new
    o, lse = _finish(m, l_sum, acc)
    return o.reshape(b, hq, d), lse.reshape(b, hq)


def _merge_stacked(o: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge stacked partials (n >= 1, B, Hq, D) and (n, B, Hq), in fp32."""
    lse = lse.to(torch.float32)
    m = lse.amax(0)  # (B, Hq)
    w = torch.exp(lse - _safe_max(m))  # (n, B, Hq); 0 for an identity
    acc = (w[..., None] * o.to(torch.float32)).sum(0)  # (B, Hq, D)
    return _finish(m[..., None], w.sum(0)[..., None], acc)


def merge_partials(o: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge n stacked partials (n, B, Hq, D) and (n, B, Hq) into one (B, Hq, D), (B, Hq).

    Examples
    --------
    >>> o = torch.tensor([[[[1.0]]], [[[3.0]]]])  # n=2, B=Hq=D=1
    >>> lse = torch.zeros(2, 1, 1)  # equal weights
    >>> out, l = merge_partials(o, lse)
    >>> out.item(), round(l.item(), 4)
    (2.0, 0.6931)
    """
    check_partials(o, lse, stacked=True)
    if o.shape[0] == 0:
        return identity_partial(o.shape[1], o.shape[2], o.shape[3], o.device)
    return _merge_stacked(o, lse)


def merge(
    a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partials ``(o, lse)``; ``-inf``-safe, so two identities give the identity."""
    check_pair(a, b)
    o = torch.stack([a[0].to(torch.float32), b[0].to(torch.float32)])  # (2, B, Hq, D)
    lse = torch.stack([a[1].to(torch.float32), b[1].to(torch.float32)])  # (2, B, Hq)
    return _merge_stacked(o, lse)


def naive_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float | None = None,
    kv_len: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Textbook ``softmax(q·Kᵀ·scale)·V`` in float64, K and V repeated per query head.

    The oracle for tests. Returns ``(o, lse)`` like :func:`partial_attention`, rounded to
    fp32; ``o`` is the attention output. Memory is O(B·Hq·T·D): use small shapes.
    """
    scale = check_partial_inputs(q, k, v, scale, kv_len)
    b, hq, d = q.shape
    hkv, t_total = k.shape[1], k.shape[2]
    kr = k.to(torch.float64).repeat_interleave(hq // hkv, dim=1)  # (B, Hq, T, D)
    vr = v.to(torch.float64).repeat_interleave(hq // hkv, dim=1)  # (B, Hq, T, D)
    s = torch.einsum("bhd,bhtd->bht", q.to(torch.float64), kr) * scale  # (B, Hq, T)
    if kv_len is not None:
        visible = torch.arange(t_total, device=q.device)[None, :] < kv_len[:, None]  # (B, T)
        s = s.masked_fill(~visible[:, None, :], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # (B, Hq); -inf when nothing is visible
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # (B, Hq, T)
    o = torch.einsum("bht,bhtd->bhd", p, vr)  # (B, Hq, D)
    if t_total == 0:
        lse = torch.full((b, hq), float("-inf"), dtype=torch.float64, device=q.device)
    return o.to(torch.float32), lse.to(torch.float32)
