"""The NCCL environment variables the cost model reads: what a backend was started with.

A deployment sets NCCL (and RCCL) variables that change how the library moves a message.
The cost model reads the ones below from the backend (:attr:`treeattn.sim.devices.
BackendModel.nccl_env`, set by ``--nccl-env NAME=VALUE`` on ``plan``, ``predict`` and
``comm``, or by an nccl-tests profile's ``nccl_env`` object, the variables its measurement
ran with; the flag wins); any other name is refused rather than silently ignored.

=================================  =========================================================
name                               what it changes in the model
=================================  =========================================================
``NCCL_ALLOC_P2P_NET_LL_BUFFERS``  ``1``: network send/recv connections get LL buffers, so a
                                   small message across hosts may use LL (default ``0``:
                                   Simple). NCCL 2.30.7 ``src/init.cc``
                                   (``NCCL_PARAM(AllocP2pNetLLBuffers, ..., 0)``),
                                   ``src/transport/net.cc`` (the LL buffer is mapped only
                                   ``if (proxyState->allocP2pNetLLBuffers)``, for send and
                                   receive), ``src/enqueue.cc`` (``addP2pToPlan`` keeps LL
                                   only where every channel's connection has an LL buffer).
                                   RCCL's ``src/init.cc`` has the same parameter, default 0.
``NCCL_NET_SHARED_BUFFERS``        ``0``: network send/recv connections get their own
                                   buffers, one per protocol (LL included, so a small message
                                   across hosts may use LL, as with the variable above), and
                                   the sender starts with credits, so a message across hosts
                                   skips the proxy's slot post (default ``1``: shared, Simple
                                   only unless LL buffers are asked for, the post is paid;
                                   :func:`treeattn.sim.nccl.sendrecv.p2p_parts`). NCCL 2.30.7
                                   ``src/transport/net.cc`` (``sendSetup``: ``shared`` for
                                   every connection without a graph, i.e. send/recv, unless
                                   the variable is ``0``; ``sendProxySetup`` and
                                   ``recvProxySetup`` map ``buffs[p]`` for every protocol when
                                   not shared).
=================================  =========================================================
"""

from __future__ import annotations

from dataclasses import replace

from treeattn.schedule.payloads import SimError

# name -> (allowed values, what it means)
NCCL_ENV = {
    "NCCL_ALLOC_P2P_NET_LL_BUFFERS": (("0", "1"), "LL buffers on network p2p connections"),
    "NCCL_NET_SHARED_BUFFERS": (("0", "1"), "shared buffers on network p2p connections"),
}


def parse_nccl_env(items) -> tuple[tuple[str, str], ...]:
    """``NAME=VALUE`` strings (or pairs) -> sorted ``(name, value)`` pairs, each checked.

    >>> parse_nccl_env(["NCCL_ALLOC_P2P_NET_LL_BUFFERS=1"])
    (('NCCL_ALLOC_P2P_NET_LL_BUFFERS', '1'),)
    """
    out: dict[str, str] = {}
    for item in items or ():
        if isinstance(item, str):
            name, sep, value = item.partition("=")
            if not sep:
                raise SimError(f"--nccl-env wants NAME=VALUE, got {item!r}")
        else:
            name, value = item
        name, value = name.strip(), str(value).strip()
        if name not in NCCL_ENV:
            raise SimError(f"unknown NCCL variable {name!r} (the cost model reads: "
                           f"{', '.join(NCCL_ENV)})")
        allowed = NCCL_ENV[name][0]
        if value not in allowed:
            raise SimError(f"{name}={value!r}: expected one of {', '.join(allowed)}")
        out[name] = value
    return tuple(sorted(out.items()))


def with_env(shape, env: tuple[tuple[str, str], ...]):
    """``shape`` (a :class:`~treeattn.sim.nccl.group_shape.GroupShape`) as the library sees
    the communicator under ``env``."""
    found = dict(env)
    if not found:
        return shape
    shared = found.get("NCCL_NET_SHARED_BUFFERS", "1") == "1"
    # own (unshared) buffers are mapped for every protocol, LL included (net.cc)
    return replace(shape, p2p_net_ll=found.get("NCCL_ALLOC_P2P_NET_LL_BUFFERS") == "1"
                   or not shared, p2p_net_shared=shared)
