"""One-sided transports inside one NVLink domain (:mod:`treeattn.sim.onesided.transports`)."""

from treeattn.sim.onesided.transports import ONE_SIDED, TRANSPORTS, OneSided, offered, one_sided

__all__ = ["ONE_SIDED", "TRANSPORTS", "OneSided", "offered", "one_sided"]
