"""NCCL's and RCCL's collective cost model.

- :mod:`treeattn.sim.nccl.tables`: the libraries' tuning tables, each constant with its source;
- :mod:`treeattn.sim.nccl.collectives`: the protocol, algorithm and channel choice and the
  time of one collective or point-to-point message;
- :mod:`treeattn.sim.nccl.group_shape`: the communicator's shape (hosts, GPUs per host, arch);
- :mod:`treeattn.sim.nccl.nccltests` and :mod:`treeattn.sim.nccl.fit`: nccl-tests output read
  and turned into a calibration.
"""
