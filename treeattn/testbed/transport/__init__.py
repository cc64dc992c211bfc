"""The one-host CPU transport: what CPU ranks of one machine use instead of a network.

Shared-memory mailboxes (:mod:`~treeattn.testbed.transport.shm`) with futex waits
(:mod:`~treeattn.testbed.transport.futex`), small collectives over them
(:mod:`~treeattn.testbed.transport.shm_collectives`), a rank's whole reduction as one C call
(:mod:`~treeattn.testbed.transport.shm_program`) and core pinning
(:mod:`~treeattn.testbed.transport.binding`). The host-cost calibrations that go with them
are in :mod:`treeattn.testbed.calibration`.
"""
