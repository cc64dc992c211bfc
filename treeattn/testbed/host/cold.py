"""Cold host steps: what the first merge, message or collective after an attention kernel
costs beyond a warm one, and which steps pay it (used by :mod:`treeattn.sim.engine`).

On a CPU the attention kernel streams the rank's KV shard through the core's caches, so the
host code that runs next finds none of its code or data there. Calibration measures the
extra seconds per kind of step right after a kernel (:mod:`treeattn.testbed.calibration.cold`, the
profile's ``cold`` section); the engine charges them like this:

* a Compute of the attention family (``attention``, ``attention_block``,
  ``attention_qblock``) that reads at least ``after_bytes`` makes its rank *cold* for every
  kind of step;
* the first Merge or small Compute after it pays ``merge_s``; the first Send pays
  ``message_s / 2`` and the first Recv the other half (α is split the same way);
* the first Collective of a cold rank over the calibrated ``world`` costs what calibration
  measured for that collective right after the kernel (``collectives_s[op]``), not its warm
  price: the rank spends the difference, on its core, before it joins;
* a kind that has paid is warm again until the rank's next attention.

GPUs and uncalibrated CPUs have no ``cold`` section, and then nothing changes. The closed
forms (:mod:`treeattn.sim.closed_form`) leave these costs out, so they stay lower bounds of
the engine's prediction.
"""

from __future__ import annotations

from dataclasses import dataclass

from treeattn.schedule.payloads import ComputeLabel, SimError

STREAMING = frozenset({ComputeLabel.ATTENTION, ComputeLabel.ATTENTION_BLOCK,
                       ComputeLabel.ATTENTION_QBLOCK})
KINDS = ("merge", "send", "recv", "collective")
DEFAULT_AFTER_BYTES = 4 << 20  # twice a 2 MiB L2, when the profile does not say


@dataclass(frozen=True)
class ColdSteps:
    """Extra seconds of the first host step of each kind after a streaming kernel.

    >>> c = ColdSteps(merge_s=5e-5, message_s=8e-5, world=4,
    ...               collective_s=(("all_gather", 6e-4),))
    >>> c.send_s, round(c.collective_extra("all_gather", 4, 2.5e-4), 9)
    (4e-05, 0.00035)
    >>> c.collective_extra("broadcast", 4, 2e-4), c.collective_extra("all_gather", 2, 2e-4)
    (0.0, 0.0)
    """

    merge_s: float = 0.0
    message_s: float = 0.0
    collective_s: tuple[tuple[str, float], ...] = ()  # whole seconds right after a kernel
    world: int = 0  # the ranks those collectives ran over
    after_bytes: float = DEFAULT_AFTER_BYTES

    def __post_init__(self) -> None:
        values = [self.merge_s, self.message_s, *(s for _, s in self.collective_s)]
        if any(not v >= 0 for v in values) or not self.after_bytes > 0:
            raise SimError("cold steps: every cost must be >= 0 and after_bytes > 0")

    @property
    def send_s(self) -> float:
        return self.message_s / 2

    @property
    def recv_s(self) -> float:
        return self.message_s / 2

    def collective_extra(self, op: str, members: int, warm_s: float) -> float:
        """What a cold ``op`` over ``members`` ranks costs beyond its warm price ``warm_s``."""
        if members != self.world:
            return 0.0
        return max(0.0, dict(self.collective_s).get(op, 0.0) - warm_s)

    def makes_cold(self, label, nbytes: float) -> bool:
        """Whether a Compute with ``label`` over ``nbytes`` leaves its rank's caches cold."""
        return label in STREAMING and nbytes >= self.after_bytes


def cold_from_profile(section) -> ColdSteps | None:
    """The profile's ``cold`` section as :class:`ColdSteps` (None when absent)."""
    if section is None:
        return None
    try:
        collectives = section.get("collectives_s") or {}
        return ColdSteps(
            merge_s=float(section.get("merge_s", 0.0)),
            message_s=float(section.get("message_s", 0.0)),
            collective_s=tuple(sorted((str(op), float(s)) for op, s in collectives.items())),
            world=int(section.get("world", 0)),
            after_bytes=float(section.get("after_bytes", DEFAULT_AFTER_BYTES)))
    except (AttributeError, TypeError, ValueError):
        raise SimError("calibration profile: cold must hold numbers (merge_s, message_s, "
                       "collectives_s, world, after_bytes)") from None
