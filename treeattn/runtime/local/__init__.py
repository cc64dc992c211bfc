"""The one-host CPU transport: what CPU ranks of one machine use instead of a network.

Shared-memory mailboxes (:mod:`~treeattn.runtime.local.shm`) with futex waits
(:mod:`~treeattn.runtime.local.futex`), small collectives over them
(:mod:`~treeattn.runtime.local.shm_collectives`), a rank's whole reduction as one C call
(:mod:`~treeattn.runtime.local.shm_program`), core pinning
(:mod:`~treeattn.runtime.local.binding`) and the host-cost calibrations that go with them
(:mod:`~treeattn.runtime.local.cold`, :mod:`~treeattn.runtime.local.overhead`).
"""
