"""Dequantize GGUF tensor data to float32, vectorised in numpy.

Each function takes the raw bytes of a tensor as a ``uint8`` array whose last dim is a whole
number of blocks, and returns float32 values with that last dim replaced by the element
count. The block layouts are GGML's (``ggml-common.h``); all scales are little-endian:

========  =====  =====  =============================================================
type      block  bytes  layout
========  =====  =====  =============================================================
Q8_0      32     34     d:f16, q:int8[32];                      x = d·q
Q4_0      32     18     d:f16, nibbles[16];                     x = d·(q − 8)
Q4_1      32     20     d:f16, m:f16, nibbles[16];              x = d·q + m
Q4_K      256    144    d:f16, dmin:f16, scales[12] (6-bit sc/m ×8), nibbles[128]
Q6_K      256    210    ql[128], qh[64], scales:int8[16], d:f16
========  =====  =====  =============================================================

In the 32-element nibble types, byte ``j`` holds element ``j`` (low nibble) and element
``j + 16`` (high nibble). The tests compare every function with ``gguf.quants.dequantize``.
"""

from __future__ import annotations

import numpy as np

from treeattn.llm.errors import ModelError

# (elements per block, bytes per block), from ggml-common.h
BLOCKS = {
    "F32": (1, 4),
    "F16": (1, 2),
    "BF16": (1, 2),
    "Q8_0": (32, 34),
    "Q4_0": (32, 18),
    "Q4_1": (32, 20),
    "Q4_K": (256, 144),
    "Q6_K": (256, 210),
}


def _blocks(raw: np.ndarray, type_name: str) -> tuple[np.ndarray, tuple[int, ...]]:
    """View ``raw`` as (n_blocks, block_bytes) uint8 and return it with the output shape."""
    per_block, nbytes = BLOCKS[type_name]
    raw = np.ascontiguousarray(raw).view(np.uint8)
    if raw.shape[-1] % nbytes:
        raise ModelError(f"{type_name} tensor row of {raw.shape[-1]} bytes is not whole blocks")
    out_shape = (*raw.shape[:-1], raw.shape[-1] // nbytes * per_block)
    return raw.reshape(-1, nbytes), out_shape


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The fp16 scalar at byte ``start`` of each block, as float32 of shape (n, 1)."""
    return blocks[:, start : start + 2].copy().view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """Split (n, k) bytes into (n, 2k) values: all low nibbles, then all high nibbles."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.float32)


def dequant_q8_0(raw: np.ndarray) -> np.ndarray:
    blocks, shape = _blocks(raw, "Q8_0")
    q = blocks[:, 2:].view(np.int8).astype(np.float32)  # (n, 32)
    return (_f16(blocks, 0) * q).reshape(shape)


def dequant_q4_0(raw: np.ndarray) -> np.ndarray:
    blocks, shape = _blocks(raw, "Q4_0")
    q = _nibbles(blocks[:, 2:])  # (n, 32)
    return (_f16(blocks, 0) * (q - 8.0)).reshape(shape)


def dequant_q4_1(raw: np.ndarray) -> np.ndarray:
    blocks, shape = _blocks(raw, "Q4_1")
    q = _nibbles(blocks[:, 4:])  # (n, 32)
    return (_f16(blocks, 0) * q + _f16(blocks, 2)).reshape(shape)


def _k4_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Unpack Q4_K's 12 bytes into 8 six-bit scales and 8 six-bit mins, each (n, 8)."""
    s = scales.astype(np.uint16)
    sc = np.empty((s.shape[0], 8), np.uint16)
    mn = np.empty((s.shape[0], 8), np.uint16)
    sc[:, :4] = s[:, 0:4] & 63
    mn[:, :4] = s[:, 4:8] & 63
    sc[:, 4:] = (s[:, 8:12] & 0x0F) | ((s[:, 0:4] >> 6) << 4)
    mn[:, 4:] = (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)
    return sc.astype(np.float32), mn.astype(np.float32)


def dequant_q4_k(raw: np.ndarray) -> np.ndarray:
    blocks, shape = _blocks(raw, "Q4_K")
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)  # (n, 1)
    sc, mn = _k4_scales(blocks[:, 4:16])  # (n, 8)
    qs = blocks[:, 16:].reshape(-1, 4, 32)  # 4 groups of 32 bytes -> 64 values each
    q = np.stack([qs & 0x0F, qs >> 4], axis=2).astype(np.float32)  # (n, 4, 2, 32)
    q = q.reshape(-1, 8, 32)  # sub-block j = 2·group + (high nibble)
    x = (d * sc)[:, :, None] * q - (dmin * mn)[:, :, None]
    return x.reshape(shape)


def dequant_q6_k(raw: np.ndarray) -> np.ndarray:
    blocks, shape = _blocks(raw, "Q6_K")
    ql = blocks[:, :128].reshape(-1, 2, 64)  # two halves of 128 values
    qh = blocks[:, 128:192].reshape(-1, 2, 32)
    scales = blocks[:, 192:208].copy().view(np.int8).astype(np.float32)  # (n, 16)
    d = _f16(blocks, 208)  # (n, 1)
    low = np.stack(
        [ql[:, :, :32] & 0x0F, ql[:, :, 32:] & 0x0F, ql[:, :, :32] >> 4, ql[:, :, 32:] >> 4],
        axis=2,
    )  # (n, 2, 4, 32): quarter k of each half
    high = np.stack([(qh >> shift) & 3 for shift in (0, 2, 4, 6)], axis=2)  # (n, 2, 4, 32)
    q = (low | (high << 4)).astype(np.float32) - 32.0  # (n, 2, 4, 32)
    # each quarter of 32 has two scales, one per 16 values: 16 scales per block in order
    q = q.reshape(-1, 16, 16)
    return (d[:, :, None] * scales[:, :, None] * q).reshape(shape)


def dequant_bf16(raw: np.ndarray) -> np.ndarray:
    bits = np.ascontiguousarray(raw).view(np.uint16).astype(np.uint32) << 16
    return bits.view(np.float32)


_DEQUANT = {
    "Q8_0": dequant_q8_0,
    "Q4_0": dequant_q4_0,
    "Q4_1": dequant_q4_1,
    "Q4_K": dequant_q4_k,
    "Q6_K": dequant_q6_k,
    "BF16": dequant_bf16,
}


def dequantize(raw: np.ndarray, type_name: str) -> np.ndarray:
    """Float32 values of GGUF tensor data ``raw`` of type ``type_name`` (e.g. ``"Q4_K"``).

    >>> import numpy as np
    >>> dequantize(np.array([1.5, -2.0], np.float16), "F16").tolist()
    [1.5, -2.0]
    """
    if type_name in ("F32", "F16"):
        return np.asarray(raw).astype(np.float32)
    if type_name not in _DEQUANT:
        supported = ", ".join(BLOCKS)
        raise ModelError(f"unsupported GGUF tensor type {type_name} (supported: {supported})")
    return _DEQUANT[type_name](raw)
