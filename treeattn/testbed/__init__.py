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

It sits behind interfaces of the layers it serves, and nothing of theirs imports it (only the
commands and the CLI do, ``tests/test_layers.py``):

========================================  ==============================================
interface                                 the test bed's implementation
========================================  ==============================================
``sim.host_model.HostSpec`` (engine)      ``host.model.CpuHost`` on ``HardwareModel.host``
``sim.files.profiles.HostProfiles``       ``host.profiles.CpuProfiles``
``runtime.transport.LocalPlugin``         ``transport.plugin.SharedMemory``
``kernels.dispatch.CpuKernels``           ``kernels.chain.CpuChain``
========================================  ==============================================

:func:`plug_in` plugs in all but the first (which a CPU profile's hardware carries);
:func:`plug_in_profiles` only the profile reader, without importing torch.
"""


def plug_in_profiles() -> None:
    """Let the planner read profiles of this host's CPU ranks (``treeattn calibrate``'s):
    :class:`treeattn.testbed.host.profiles.CpuProfiles`. Needs no torch."""
    from treeattn.sim.files.profiles import plug_in_host_profiles
    from treeattn.testbed.host.profiles import CpuProfiles

    plug_in_host_profiles(CpuProfiles())


def plug_in() -> None:
    """Plug the test bed into this process (and into the ranks the local launcher spawns from
    it): the CPU kernel chain into :mod:`treeattn.kernels`, the shared-memory transport for
    CPU ranks of one host into the runtime, and the reader of CPU profiles into the planner.
    It imports torch, so the planner's paths call :func:`plug_in_profiles` alone."""
    from treeattn.kernels.dispatch import plug_in_cpu
    from treeattn.runtime.transport import plug_in as plug_transport
    from treeattn.testbed.kernels.chain import CpuChain
    from treeattn.testbed.transport.plugin import SharedMemory

    plug_in_profiles()
    plug_in_cpu(CpuChain())
    plug_transport(SharedMemory())
