"""``plan --gpus N``: the deployment with the lowest time per output token for a GPU budget.

Every split of ``N`` GPUs into ``tp`` tensor-parallel ranks and ``cp = N / tp``
context-parallel replicas, with each ``dcp`` the model's heads allow inside the TP group
(:func:`treeattn.sim.deploy.capacity.check_split`), is checked for memory first
(:func:`treeattn.sim.deploy.capacity.memory_check`). Only the splits that fit are priced
(:func:`treeattn.sim.deploy.token.predict_token`, whose attention merge is the planner's pick for
that split, so the merge algorithm is searched with the split). A split that does not fit is
reported with the bytes it needs against those available and no time: it cannot run.

Ranking: fitting splits by TPOT (then fewer communicating ranks, then the label), then the
ones that do not fit by how far over they are. The search prices each split's attention
merge with a small simulation budget (``MAX_SIMULATED``): the closed form bounds every
candidate from below and the best-bounded few are simulated, as in the planner itself.
"""

from __future__ import annotations

from dataclasses import dataclass

from treeattn.schedule.payloads import SimError
from treeattn.schedule.workload import ModelConfig
from treeattn.sim.deploy.capacity import MemoryCheck, Split, check_split, memory_check
from treeattn.sim.deploy.token import (
    TokenPrediction,
    check_token_model,
    deployment_topology,
    predict_token,
)
from treeattn.sim.network import TRANSPORTS, resolve_hardware
from treeattn.topo.hardware import normalize_model

MAX_SIMULATED = 2  # simulations per split's attention plan (see the module docstring)


@dataclass
class Deployment:
    """One split considered: its memory check, and its prediction when it fits."""

    split: Split
    memory: MemoryCheck
    prediction: TokenPrediction | None = None
    refused: str | None = None  # why the split cannot run (heads, memory)

    @property
    def fits(self) -> bool:
        return self.prediction is not None

    @property
    def tpot_s(self) -> float | None:
        return self.prediction.tpot_s if self.prediction else None

    def to_json(self) -> dict:
        if self.prediction is not None:
            return self.prediction.to_json()
        return {"deployment": self.split.label, "gpus": self.split.gpus, "tp": self.split.tp,
                "dcp": self.split.dcp, "cp": self.split.cp, "tpot_s": None,
                "tokens_per_s": None, "refused": self.refused, **self.memory.to_json()}


def splits(model: ModelConfig, gpus: int) -> list[Split]:
    """Every (tp, dcp, cp) of ``gpus`` GPUs that ``model``'s heads allow."""
    out = []
    for tp in (d for d in range(1, gpus + 1) if gpus % d == 0):
        for dcp in (d for d in range(1, tp + 1) if tp % d == 0):
            split = Split(tp=tp, cp=gpus // tp, dcp=dcp)
            try:
                check_split(model, split)
            except SimError:
                continue
            out.append(split)
    return out


def search(topology, model: ModelConfig | str, seq_len: int, gpus: int, *, batch: int = 1,
           weights_dtype: str | None = None, kv_dtype: str | None = None, hardware=None,
           backend=None, transports: tuple[str, ...] = TRANSPORTS) -> list[Deployment]:
    """Every split of ``gpus`` GPUs, best first (see the module docstring), each priced on
    the fastest of ``transports`` that runs its collectives.

    Raises :class:`SimError` when no split fits (the bytes of the closest one in the
    message) or the budget has no split the model's heads allow.
    """
    model = ModelConfig.from_name(model) if isinstance(model, str) else model
    check_token_model(model)
    if not isinstance(gpus, int) or gpus < 1:
        raise SimError(f"--gpus must be a positive integer, got {gpus!r}")
    topo = deployment_topology(topology, Split(tp=gpus))
    capacity = resolve_hardware(topo, hardware)[0].memory_bytes
    gpu = normalize_model(topo.gpu_model(0))
    options = splits(model, gpus)
    if not options:
        raise SimError(f"no TP split of {gpus} GPUs divides {model.name}'s {model.n_heads} "
                       f"query and {model.n_kv_heads} KV heads")
    found = []
    for split in options:
        memory = memory_check(model, split, seq_len, batch, capacity, weights_dtype, kv_dtype,
                              gpu_model=gpu)
        d = Deployment(split, memory)
        if split.seq_ranks > seq_len:
            d.refused = f"{seq_len} tokens cannot be sharded over {split.seq_ranks} ranks"
        elif not memory.fits:
            d.refused = "does not fit: " + memory.describe()
        else:
            try:
                d.prediction = predict_token(topo, model, seq_len, split, batch=batch,
                                             weights_dtype=weights_dtype, kv_dtype=kv_dtype,
                                             hardware=hardware, backend=backend,
                                             max_simulated=MAX_SIMULATED,
                                             transports=transports)
            except SimError as exc:  # e.g. a merge across nodes on a one-node transport
                d.refused = str(exc)
        found.append(d)
    fitting = sorted((d for d in found if d.fits),
                     key=lambda d: (d.tpot_s, d.split.seq_ranks, d.split.label))
    others = sorted((d for d in found if not d.fits),
                    key=lambda d: (d.memory.need_bytes, d.split.label))
    if not fitting:
        closest = others[0]
        raise SimError(f"no split of {gpus} GPUs fits {model.name} at {seq_len:,} tokens × "
                       f"batch {batch}: the closest, {closest.split.label}, "
                       + (closest.memory.describe() if not closest.memory.fits
                          else closest.refused))
    return fitting + others
