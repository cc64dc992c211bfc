"""The test bed's transport, plugged into the runtime (:class:`SharedMemory`, a
:class:`~treeattn.runtime.transport.LocalPlugin`): on CPU gloo ranks of one host, small
messages and collectives take shared-memory mailboxes, a plain reduction of partials runs as
one C call over them, and the local launcher pins its ranks to cores (and plugs the rest of the
test bed into them: its CPU kernels and profile reader).

``treeattn.testbed.plug_in()`` installs it; the commands do so for every run.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from treeattn.kernels.dispatch import plug_in_cpu
from treeattn.runtime.errors import RuntimeFailure
from treeattn.runtime.group import RankContext
from treeattn.sim.files.profiles import plug_in_host_profiles
from treeattn.testbed.host.profiles import CpuProfiles
from treeattn.testbed.kernels.chain import CpuChain
from treeattn.testbed.transport import shm, shm_program
from treeattn.testbed.transport.binding import (
    BIND_CHOICES,
    GROUP_CPUS_ENV,
    available_cpus,
    pin_rank,
)
from treeattn.testbed.transport.shm_collectives import MailboxCollectives


@dataclass(frozen=True)
class SharedMemory:
    """Mailboxes between the CPU ranks of one host, and core pinning for local launches."""

    def check_launch(self, world: int, threads: int | None, bind: str) -> None:
        if bind not in BIND_CHOICES:
            raise RuntimeFailure(f"--bind must be one of {', '.join(BIND_CHOICES)}, "
                                 f"got {bind!r}")

    def launcher_cpus(self) -> list[int]:
        return available_cpus()

    def start_rank(self, local_rank: int, world: int, threads: int | None, bind: str,
                   cpus: list[int]) -> None:
        os.environ[GROUP_CPUS_ENV] = ",".join(map(str, cpus))
        # before joining, so that gloo's threads are bound with the rank
        pin_rank(local_rank, world, threads, bind)
        # the rest of the test bed, as the launcher has it (treeattn.testbed.plug_in)
        plug_in_host_profiles(CpuProfiles())
        plug_in_cpu(CpuChain())

    def open_channel(self, ctx: RankContext) -> shm.ShmChannel | None:
        return shm.open_channel(ctx)

    def collective_ops(self, ctx: RankContext, members: tuple[int, ...], handle,
                       channel: shm.ShmChannel) -> MailboxCollectives:
        return MailboxCollectives(ctx, members, handle, channel)

    def compile_program(self, steps, names: list[str], rank: int, channel: shm.ShmChannel,
                        dims) -> shm_program.ShmProgram | None:
        return shm_program.compile_program(steps, names, rank, channel, dims)

    def calibrate(self, ctx: RankContext, dims, max_bytes: int) -> dict:
        from treeattn.testbed.calibration.calibrate import calibrate_in_group

        return calibrate_in_group(ctx, dims, max_bytes)
