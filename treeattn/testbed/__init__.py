"""The CPU test bed: CPU ranks of one host standing in for a GPU cluster.

Everything here exists so that the CPU's predicted-against-measured loop (``treeattn
calibrate``, ``run --check`` on local ranks) is tight; a GPU cluster's path needs none of it.

- :mod:`treeattn.testbed.transport`: shared-memory mailboxes between the ranks, futex waits,
  small collectives over them, a rank's whole reduction as one C call, core pinning;
- :mod:`treeattn.testbed.host`: what a rank's host CPU adds to a simulated step (shared
  cores, cold steps, the compiled reduction's costs), and CPU calibration profiles turned
  into those models;
- :mod:`treeattn.testbed.kernels`: the CPU kernel chain (numpy for small calls, a C kernel,
  torch's fused kernel);
- :mod:`treeattn.testbed.calibration`: the microbenchmarks that write a CPU profile.
"""


def plug_in() -> None:
    """Plug the test bed into this process (and into the ranks the local launcher spawns from
    it): the CPU kernel chain into :mod:`treeattn.kernels`, and the shared-memory transport for
    CPU ranks of one host into the runtime. It imports torch, so the planner's paths never
    call it."""
    from treeattn.kernels.dispatch import plug_in_cpu
    from treeattn.runtime.transport import plug_in as plug_transport
    from treeattn.testbed.kernels.chain import CpuChain
    from treeattn.testbed.transport.plugin import SharedMemory

    plug_in_cpu(CpuChain())
    plug_transport(SharedMemory())
