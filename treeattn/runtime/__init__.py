"""The distributed runtime: run a plan's schedule for real and measure it.

- :mod:`treeattn.runtime.group`: process groups from the torchrun environment, waits with
  timeouts that name the peer.
- :mod:`treeattn.runtime.launch`: a local launcher that spawns ``N`` ranks, watches them and
  stops the whole group when one fails.
- :mod:`treeattn.runtime.executor`: executes a :class:`treeattn.schedule.ir.Schedule`
  (:mod:`treeattn.runtime.wire`: its message layout; :mod:`treeattn.runtime.native`: the
  backend's own all-reduce).
- :mod:`treeattn.runtime.prefill.ring`: one layer's context-parallel prefill attention, a
  ring passing K/V blocks.
- :mod:`treeattn.runtime.transport`: messages through the process group, or a transport
  plugged in for ranks of one host (the CPU test bed's, :mod:`treeattn.testbed`);
  :mod:`treeattn.runtime.collective_ops`: a group's collectives.
- :mod:`treeattn.runtime.plans`: from a request to a schedule, and the shard split.
- :mod:`treeattn.runtime.measure.timing`, :mod:`treeattn.runtime.measure.check`: measurement
  and predicted-vs-measured runs.

The model and the sharded KV cache live in :mod:`treeattn.llm`, which builds on this package.
"""

from treeattn.runtime.errors import RankLost, RankTimeout, RuntimeFailure

__all__ = ["RankLost", "RankTimeout", "RuntimeFailure"]
