"""One-sided transports inside one NVLink domain (:mod:`treeattn.sim.onesided.transports`)."""

from treeattn.sim.onesided.transports import (
    ONE_SIDED,
    TRANSPORTS,
    OneSided,
    one_sided,
    unoffered_reason,
)

__all__ = ["ONE_SIDED", "TRANSPORTS", "OneSided", "one_sided", "unoffered_reason"]
