"""How a generation runs: where the weights live (device, dtype) and how tokens are picked.

Placement (:func:`place_model`): the transformer blocks and the final norm go to the rank's
device in the requested dtype (``bf16``, ``fp16`` or ``fp32``), in one move; the token
embedding and the output head (often the same tied tensor) stay fp32, so the logits that
sampling and ``--verify`` compare are formed in fp32 whatever the body's dtype. Attention is
fp32-accumulated in every dtype: the kernels return fp32 partials and only the merged output
is cast back to the body's dtype.

Sampling (:class:`Sampler`): temperature 0 is greedy (argmax, the default and the only
mode ``--verify`` can check token for token); otherwise the logits are divided by the
temperature, cut to the ``top_k`` largest and then to the smallest set whose probability
reaches ``top_p`` (the top token always stays), and one token is drawn from a
:class:`torch.Generator` seeded with ``seed``. The draw runs on the CPU in fp32, so a seed
gives the same tokens on any device and any world size, up to the logits' own rounding.
In a distributed run only rank 0 samples; the token is then broadcast.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass

import torch

from treeattn.llm.errors import ModelError

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DEVICES = ("auto", "cpu", "cuda")
# Below this a temperature divides fp32 logits past their range (1e-300 makes them infinite
# and the sampler's probabilities NaN); it would sample as greedy decoding does anyway.
MIN_TEMPERATURE = 1e-3
FP32_MODULES = ("tok_embeddings", "output")  # kept in fp32: the logits are formed in fp32


def dtype_of(name: str) -> torch.dtype:
    """The torch dtype of ``bf16``/``fp16``/``fp32``; ModelError for anything else.

    >>> dtype_of("bf16")
    torch.bfloat16
    """
    if name not in DTYPES:
        raise ModelError(f"unknown dtype {name!r} (known: {', '.join(DTYPES)})")
    return DTYPES[name]


def check_device(device: str) -> None:
    """ModelError for an unknown device name, or for ``cuda`` on a machine without CUDA."""
    if device not in DEVICES:
        raise ModelError(f"unknown device {device!r} (known: {', '.join(DEVICES)})")
    if device == "cuda" and not torch.cuda.is_available():
        raise ModelError("--device cuda was asked for, but CUDA is not available")


def local_device(device: str) -> torch.device:
    """The device a single process (or the launcher's reference) uses for ``device``."""
    check_device(device)
    if device == "cuda" or (device == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def place_model(model, device: torch.device | str, dtype: torch.dtype):
    """Move ``model`` to ``device``: blocks and final norm in ``dtype``, embeddings in fp32.

    In place (a tied output head stays tied: ``Module.to`` rewrites each parameter's data,
    not the parameter), and returns ``model``. Placing an already placed model is a no-op.
    """
    for name, child in model.named_children():
        if name in FP32_MODULES:
            child.to(device=device, dtype=torch.float32)
        else:
            child.to(device=device, dtype=dtype)
    # fp32 rotation frequencies, a plain attribute: on the device, so that a decode step makes
    # no host-to-device copy (which a captured CUDA graph could not hold)
    model.inv_freq = model.inv_freq.to(device=device, dtype=torch.float32)
    return model


def body_dtype(model) -> torch.dtype:
    """The dtype of the transformer blocks (the KV cache's dtype)."""
    return model.norm.weight.dtype


@dataclass(frozen=True)
class Sampling:
    """How tokens are picked: ``temperature`` 0 is greedy; ``seed`` None draws one."""

    temperature: float = 0.0
    top_k: int = 0  # 0: no cut
    top_p: float = 1.0  # 1: no cut
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def check(self) -> Sampling:
        """Return self if every setting is in range, else raise ModelError (one line)."""
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ModelError(f"--temperature must be a finite number >= 0, got {self.temperature}")
        if 0 < self.temperature < MIN_TEMPERATURE:
            raise ModelError(f"--temperature must be 0 (greedy) or at least {MIN_TEMPERATURE:g}, "
                             f"got {self.temperature:g}")
        if self.top_k < 0:
            raise ModelError(f"--top-k must be >= 0 (0: no cut), got {self.top_k}")
        if not (0 < self.top_p <= 1):  # also False for NaN
            raise ModelError(f"--top-p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            raise ModelError(f"--seed must fit in 64 bits, got {self.seed}")
        return self

    def seeded(self) -> Sampling:
        """This sampling with a seed: the given one, or a fresh random one (greedy: None)."""
        if self.greedy:
            return Sampling(0.0, self.top_k, self.top_p, None)
        if self.seed is not None:
            return self
        return Sampling(self.temperature, self.top_k, self.top_p, secrets.randbits(63))


def filter_logits(row: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """``row`` (V,) fp32 with every token outside the top-k / top-p set at ``-inf``.

    >>> filter_logits(torch.tensor([1.0, 3.0, 2.0]), 2, 1.0).tolist()
    [-inf, 3.0, 2.0]
    """
    if 0 < top_k < row.numel():
        kth = torch.topk(row, top_k).values[-1]
        row = row.masked_fill(row < kth, -math.inf)
    if top_p < 1:
        ordered, index = torch.sort(row, descending=True)
        probs = torch.softmax(ordered, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs  # mass of the tokens ranked above
        drop = before >= top_p  # the first token has 0 above it: it always stays
        row = row.scatter(0, index[drop], -math.inf)
    return row


class Sampler:
    """Picks each token from a step's logits (1, V); one instance per generation."""

    def __init__(self, sampling: Sampling) -> None:
        self.sampling = sampling.check()
        self.generator = None
        if not sampling.greedy:
            seed = sampling.seed if sampling.seed is not None else secrets.randbits(63)
            self.generator = torch.Generator().manual_seed(seed % 2**64)

    @property
    def greedy(self) -> bool:
        return self.sampling.greedy

    def __call__(self, logits: torch.Tensor) -> int:
        if self.greedy:
            return int(torch.argmax(logits[0]))
        s = self.sampling
        row = logits[0].detach().to("cpu", torch.float32)  # (V,)
        top = row.max()
        if bool(torch.isnan(row).any()) or not bool(torch.isfinite(top)):
            raise ModelError("the model's logits hold NaN or infinity; cannot sample")
        row = (row - top) / s.temperature  # the top token at 0: a tiny temperature stays finite
        probs = torch.softmax(filter_logits(row, s.top_k, s.top_p), dim=-1)
        return int(torch.multinomial(probs, 1, generator=self.generator))
