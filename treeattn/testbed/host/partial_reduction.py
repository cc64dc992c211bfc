"""Which rank schedules are a plain reduction of partials, and what such a rank costs.

A rank's steps are a *plain reduction* when the first is its ``attention`` and every later one
is a Send of its whole running ``partial``, a Recv of a whole partial that replaces it (a
broadcast), or a Recv of one immediately followed by the partial Merge of that message. Tree
and allgather at every world size, and butterfly at powers of two, are plain reductions on
every rank; schedules that move KV blocks, chunks of heads or collectives are not.

Why it matters: on CPU ranks of one host the runtime runs such a rank, its attention included,
as one C call over shared-memory mailboxes (``treeattn/testbed/transport/shm_program.py``),
without the executor's Python steps. Those steps cost more than the call's, and more again with
cold caches after the kernel, so the simulator prices such a rank with the program's own
calibrated cost per message (:class:`ProgramCosts`, from ``executor.program_step_s`` in a
calibration profile) and charges it no cold extras. Both sides decide with
:func:`reduction_ops`, so they cannot disagree about which ranks run as a program.

IR-only: no simpy, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from treeattn.schedule.ir import Compute, Merge, Recv, Send

SEND, RECV_MERGE, RECV_REPLACE = "send", "recv+merge", "recv"


@dataclass(frozen=True)
class ProgramCosts:
    """The calibrated host cost of a message step inside the C program, and the limits of
    the mailboxes it uses (larger messages or tags take the Python steps)."""

    send_s: float
    recv_s: float
    max_bytes: int  # the largest message a mailbox holds
    tags: int  # tags 0 .. tags - 1 have mailboxes
    max_world: int = 8  # larger groups get no mailboxes (their segment would be too large)

    def runs(self, world: int, one_host: bool) -> bool:
        """Whether a group of ``world`` ranks gets the mailboxes programs run over: every
        rank on one host, and no more ranks than :attr:`max_world`."""
        return one_host and world <= self.max_world

    def takes(self, steps) -> bool:
        """Whether a rank with these steps runs as a program in a group that has mailboxes
        (:meth:`runs`): a plain reduction whose every message fits a mailbox."""
        ops = reduction_ops(steps)
        return ops is not None and all(0 <= tag < self.tags and nbytes <= self.max_bytes
                                       for _, _, _, tag, nbytes in ops)


def reduction_ops(steps) -> list[tuple[str, int, int, int, int]] | None:
    """The ops of a plain reduction, ``(kind, first step index, peer, tag, nbytes)``, one per
    Send, Recv or Recv-and-Merge pair, in step order; None when ``steps`` is not one.

    >>> from treeattn.schedule.ir import Compute, Merge, Recv, Send
    >>> steps = [Compute("attention", 0, 0), Recv(1, 8, 0), Merge(8, "partial", 0),
    ...          Send(1, 8, 0)]
    >>> reduction_ops(steps)
    [('recv+merge', 1, 1, 0, 8), ('send', 3, 1, 0, 8)]
    >>> reduction_ops([Compute("attention", 0, 0), Recv(1, 8, 0), Send(1, 8, 0)]) is None
    True
    """
    if not steps or not isinstance(steps[0], Compute) or steps[0].label != "attention":
        return None
    ops, index = [], 1
    while index < len(steps):
        step = steps[index]
        if not (isinstance(step, Send | Recv) and step.payload == "partial"
                and step.chunk is None):
            return None
        if isinstance(step, Send):
            ops.append((SEND, index, step.dst, step.tag, step.nbytes))
            index += 1
        elif not step.reduce:
            ops.append((RECV_REPLACE, index, step.src, step.tag, step.nbytes))
            index += 1
        else:
            merge = steps[index + 1] if index + 1 < len(steps) else None
            if not (isinstance(merge, Merge) and merge.op == "partial"
                    and merge.tag == step.tag):
                return None  # merged later, or not at all: the Python steps
            ops.append((RECV_MERGE, index, step.src, step.tag, step.nbytes))
            index += 2
    return ops or None
