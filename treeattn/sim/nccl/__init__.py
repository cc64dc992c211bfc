"""NCCL's and RCCL's collective cost model.

- :mod:`treeattn.sim.nccl.tables`: the libraries' tuning tables, each constant with its source;
- :mod:`treeattn.sim.nccl.collectives`: NCCL's protocol, algorithm and channel choice and
  the time of one collective (:mod:`~treeattn.sim.nccl.cost` the priced variant,
  :mod:`~treeattn.sim.nccl.rccl` RCCL's model, :mod:`~treeattn.sim.nccl.sendrecv` send/recv
  and all-to-all);
- :mod:`treeattn.sim.nccl.group_shape`: the communicator's shape (hosts, GPUs per host, arch);
- :mod:`treeattn.sim.nccl.nccltests` and :mod:`treeattn.sim.nccl.fit`: nccl-tests output read
  and turned into a calibration.
"""
