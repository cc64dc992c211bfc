"""Pure-torch partial attention and merge: the CPU path and the oracle for the Triton kernels.

The math (docs/design.md): for a query ``q`` and a shard ``(K, V)``,
``s = q·Kᵀ·scale``, ``lse = logsumexp(s)``, ``o = softmax(s)·V``. Two partials merge as
``lse = logaddexp(lse_a, lse_b)``, ``o = o_a·exp(lse_a − lse) + o_b·exp(lse_b − lse)``. The
identity is the empty shard ``(o = 0, lse = −inf)``; merging identities gives the identity.

``partial_attention`` is written to be fast on a CPU for long T, where decoding is bound by
reading K and V once. The GQA group is a matmul of ``(B, Hkv, G, D)`` against ``(B, Hkv, T, D)``,
so K and V are never repeated per query head. It is *two-pass* rather than an online softmax
over small chunks: one matmul writes the scores of a whole segment of T into a reused
``(B, Hkv, G, t)`` fp32 buffer (G·t floats, small beside the t·D of K), the exact max and
logsumexp are taken over it, ``exp`` is applied in place, and one matmul with V gives the
output. K and V are each read once, by two large BLAS calls, with no per-chunk rescaling or
allocation; in fp32 it measured as fast as torch's fused CPU FlashAttention kernel
(``_scaled_dot_product_flash_attention_for_cpu``, T=128k, Hq/Hkv 9/3 D=64 and 8/8 D=128, one
thread). What limits it is MKL's throughput for matmuls with only G rows (G = Hq/Hkv) and, for
16-bit inputs, the upcast (``benchmarks/results/kernels-cpu-1thread.md`` has the ratios to the
read bandwidth of ``sum()``). T is only cut into several segments, merged with
the usual ``(max, sum, acc)`` rescaling, when the score buffer would exceed
``_SCORE_CAP_ELEMS`` floats (4·B·Hq·t bytes; the default cap allows 32M tokens for one head).
16-bit K and V are upcast block by block into one reused fp32 buffer sized to stay in the L2
cache (allocating a fresh buffer per block costs page faults and was 7x slower). Everything
accumulates in fp32 and the segments and blocks depend only on the shapes, so the result is
deterministic.

``naive_attention`` is the textbook oracle: repeat K and V per query head, float64 softmax.
"""

from __future__ import annotations

import torch

from treeattn.kernels.checks import check_pair, check_partial_inputs, check_partials

# Scores kept at once, in floats (B*Hq*t): T longer than cap/(B*Hq) tokens is cut into segments.
_SCORE_CAP_ELEMS = 1 << 25
# Elements per fp32 block that 16-bit K or V is upcast into (B*Hkv*t*D): 1 MiB, so that the K
# and V blocks stay in a 2 MiB L2 (1 MiB measured best of 256 KiB..4 MiB, single thread).
_CHUNK_ELEMS_16BIT = 1 << 18
_MIN_CHUNK_T = 256


def identity_partial(
    b: int, hq: int, d: int, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """The merge identity: an empty shard, ``o = 0`` (B, Hq, D) and ``lse = -inf`` (B, Hq)."""
    o = torch.zeros(b, hq, d, dtype=torch.float32, device=device)  # (B, Hq, D)
    lse = torch.full((b, hq), float("-inf"), dtype=torch.float32, device=device)  # (B, Hq)
    return o, lse


def _segment_len(b: int, hq: int) -> int:
    """Tokens per two-pass segment: the score buffer holds at most ``_SCORE_CAP_ELEMS`` floats."""
    return max(_MIN_CHUNK_T, _SCORE_CAP_ELEMS // max(1, b * hq))


def _block_len(b: int, hkv: int, d: int) -> int:
    """Tokens per fp32 upcast block of 16-bit K or V."""
    return max(_MIN_CHUNK_T, _CHUNK_ELEMS_16BIT // max(1, b * hkv * d))


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
    return partial_attention_checked(q, k, v, scale, kv_len)


def partial_attention_checked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                              kv_len: torch.Tensor | None = None):
    """:func:`partial_attention` for inputs already checked (``scale`` resolved): the public
    dispatcher checks once and calls this."""
    if torch.is_grad_enabled():  # an inference kernel: it writes into reused buffers, which
        with torch.no_grad():  # autograd forbids (the decorator form costs ~14 µs a call)
            return _partial_attention(q, k, v, scale, kv_len)
    return _partial_attention(q, k, v, scale, kv_len)


def _partial_attention(q, k, v, scale: float, kv_len):
    b, hq, d = q.shape
    hkv, t_total = k.shape[1], k.shape[2]
    g = hq // hkv
    t_end = t_total
    if kv_len is not None:
        kv_len = kv_len.to(torch.int64).clamp(0, t_total)  # (B,)
        t_end = int(kv_len.max().item()) if b > 0 else 0
    if t_end == 0:
        return identity_partial(b, hq, d, q.device)
    qg = q.reshape(b, hkv, g, d).to(torch.float32) * scale  # (B, Hkv, G, D)
    seg = min(_segment_len(b, hq), t_end)
    if kv_len is None and k.dtype == torch.float32 and seg == t_end:
        o, lse = _dense_fp32(qg, k, v)
        return o.reshape(b, hq, d), lse.reshape(b, hq)
    blk = min(_block_len(b, hkv, d), seg) if k.dtype != torch.float32 else 0
    work = _Workspace(b, hkv, g, d, seg, blk, q.device)
    state = None
    for s0 in range(0, t_end, seg):
        part = _two_pass(qg, k, v, s0, min(s0 + seg, t_end), kv_len, work)
        state = part if state is None else _combine(state, part)
    o, lse = _finish(*state)
    return o.reshape(b, hq, d), lse.reshape(b, hq)


def _dense_fp32(qg: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The two passes in one segment, for fp32 K/V read in place and every row seeing at
    least one token (no ``kv_len``): no masks, no empty-row guards, no workspace. A decode
    step's merges and small shards are a few microseconds of arithmetic wrapped in ~30 torch
    calls of ~5 µs each on a CPU, so the call count is the cost; this path makes 9."""
    s = torch.matmul(qg, k.transpose(-1, -2))  # (B, Hkv, G, T)
    m = s.amax(-1, keepdim=True)  # (B, Hkv, G, 1): finite, every row has a token
    p = s.sub_(m).exp_()  # (B, Hkv, G, T)
    l_sum = p.sum(-1, keepdim=True)  # (B, Hkv, G, 1) >= 1
    o = torch.matmul(p, v).div_(l_sum)  # (B, Hkv, G, D)
    return o, l_sum.log_().add_(m).squeeze(-1)


class _Workspace:
    """Buffers reused across segments: flat, so that any shorter view is still contiguous."""

    def __init__(
        self, b: int, hkv: int, g: int, d: int, seg: int, blk: int, device: torch.device
    ) -> None:
        self.scores = torch.empty(b * hkv * g * seg, device=device)  # (B*Hkv*G*seg,)
        self.kbuf = torch.empty(b * hkv * blk * d, device=device)  # (B*Hkv*blk*D,)
        self.vbuf = torch.empty(b * hkv * blk * d, device=device)  # (B*Hkv*blk*D,)
        self.tile = torch.empty(b * hkv * g * blk, device=device)  # (B*Hkv*G*blk,)
        self.blk = blk

    @staticmethod
    def view(flat: torch.Tensor, *shape: int) -> torch.Tensor:
        n = 1
        for s in shape:
            n *= s
        return flat[:n].view(shape)


def _two_pass(
    qg: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    s0: int,
    s1: int,
    kv_len: torch.Tensor | None,
    work: _Workspace,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Online-softmax state ``(max, sum, acc)`` of tokens ``[s0, s1)``: scores of the whole
    segment in one buffer, exact max, ``exp`` in place, then one pass over V."""
    b, hkv, g, d = qg.shape
    n = s1 - s0
    s = work.view(work.scores, b, hkv, g, n)  # (B, Hkv, G, n)
    if work.blk == 0:  # fp32: K and V slices are read in place
        torch.matmul(qg, k[:, :, s0:s1].transpose(-1, -2), out=s)
    else:
        for c0 in range(0, n, work.blk):
            c1 = min(c0 + work.blk, n)
            kc = work.view(work.kbuf, b, hkv, c1 - c0, d).copy_(k[:, :, s0 + c0 : s0 + c1])
            tile = work.view(work.tile, b, hkv, g, c1 - c0)  # (B, Hkv, G, c)
            s[..., c0:c1] = torch.matmul(qg, kc.transpose(-1, -2), out=tile)
    if kv_len is not None and int(kv_len.min().item()) < s1:
        pos = torch.arange(s0, s1, device=qg.device)  # (n,)
        s.masked_fill_((pos[None, :] >= kv_len[:, None])[:, None, None, :], float("-inf"))
    m = s.amax(-1, keepdim=True)  # (B, Hkv, G, 1)
    p = s.sub_(_safe_max(m)).exp_()  # (B, Hkv, G, n)
    l_sum = p.sum(-1, keepdim=True)  # (B, Hkv, G, 1)
    if work.blk == 0:
        acc = torch.matmul(p, v[:, :, s0:s1])  # (B, Hkv, G, D)
    else:
        acc = torch.zeros(b * hkv, g, d, device=qg.device)  # (B*Hkv, G, D)
        p3 = p.view(b * hkv, g, n)
        for c0 in range(0, n, work.blk):
            c1 = min(c0 + work.blk, n)
            vc = work.view(work.vbuf, b, hkv, c1 - c0, d).copy_(v[:, :, s0 + c0 : s0 + c1])
            acc.baddbmm_(p3[..., c0:c1], vc.view(b * hkv, c1 - c0, d))
        acc = acc.view(b, hkv, g, d)
    return m, l_sum, acc


def _combine(
    a: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    c: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Merge two online-softmax states ``(max, sum, acc)``; a -inf max has zero weight."""
    m = torch.maximum(a[0], c[0])
    m_safe = _safe_max(m)
    wa, wc = torch.exp(a[0] - m_safe), torch.exp(c[0] - m_safe)  # 0 where a max is -inf
    return m, a[1] * wa + c[1] * wc, a[2] * wa + c[2] * wc


def _merge_stacked(o: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge stacked partials (n >= 1, B, Hq, D) and (n, B, Hq), in fp32."""
    lse = lse.to(torch.float32)
    m = lse.amax(0)  # (B, Hq)
    w = torch.exp(lse - _safe_max(m))  # (n, B, Hq); 0 for an identity
    acc = (w[..., None] * o.to(torch.float32)).sum(0)  # (B, Hq, D)
    return _finish(m[..., None], w.sum(0)[..., None], acc)


def merge_stacked(o: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge n stacked partials (n, B, Hq, D) and (n, B, Hq) into one (B, Hq, D), (B, Hq).

    Examples
    --------
    >>> o = torch.tensor([[[[1.0]]], [[[3.0]]]])  # n=2, B=Hq=D=1
    >>> lse = torch.zeros(2, 1, 1)  # equal weights
    >>> out, l = merge_stacked(o, lse)
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
    (oa, la), (ob, lb) = ((x[0].float(), x[1].float()) for x in (a, b))
    lse = torch.logaddexp(la, lb)  # (B, Hq); -inf only when both are identities
    # a finite stand-in for a -inf lse keeps both weights exp(-inf) = 0, so o = 0 there
    ref = lse.clamp_min(torch.finfo(torch.float32).min)
    wa = (la - ref).exp_().unsqueeze_(-1)  # (B, Hq, 1)
    wb = (lb - ref).exp_().unsqueeze_(-1)
    return torch.addcmul(oa * wa, ob, wb), lse  # (B, Hq, D), (B, Hq)


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
