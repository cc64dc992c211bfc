"""Sleep until another process changes a word of shared memory: the Linux futex, via ctypes.

Why: a rank that waits for a shared-memory message (:mod:`treeattn.testbed.transport.shm`) can only
spin, yield or nap, all of which cost. Spinning holds a core; with more ranks than cores,
that is the core the sender needs. Napping (``time.sleep``) costs about 85 µs of latency
per check on Linux, the kernel's default 50 µs timer slack included. And every nap's
wake-up takes the core from a rank that is computing; measured at 4 ranks on 2 cores, the
waiting ranks used about 22% of a core each, 23 µs for each check. A futex puts the waiter
to sleep in the kernel until the sender's ``wake``, so waiting costs no CPU, and the
wake-up is as prompt as the scheduler allows.

Protocol (``futex(2)``): ``wait(addr, seen)`` sleeps only while the 32-bit word at ``addr``
still holds ``seen``. The kernel checks this atomically with queueing the waiter, so a
change made before the sleep starts is never missed. The writer stores the new value,
then calls ``wake(addr)``. The mailbox counters are 64-bit; on little-endian x86-64 their
low 32 bits are the first four bytes. Those bits change with every message, so waiting on
them is exact. Shared (not ``FUTEX_PRIVATE``) operations, because waiter and writer are
different processes mapping the same ``/dev/shm`` file.

Available on Linux x86-64 only: the same condition under which the mailboxes exist at all.
Elsewhere :data:`AVAILABLE` is false and callers nap as before.
"""

from __future__ import annotations

import ctypes
import platform
import sys

_SYS_FUTEX_X86_64 = 202  # arch/x86/entry/syscalls/syscall_64.tbl
_FUTEX_WAIT = 0
_FUTEX_WAKE = 1
_WAKE_ALL = 0x7FFFFFFF


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _load_syscall():
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)  # CDLL releases the GIL during the call
        call = libc.syscall
    except (OSError, AttributeError):
        return None
    call.restype = ctypes.c_long
    call.argtypes = [ctypes.c_long, ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32,
                     ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint32]
    return call


_syscall = _load_syscall()
AVAILABLE = _syscall is not None


def wait(addr: int, seen: int, timeout_s: float) -> None:
    """Sleep while the 32-bit word at ``addr`` equals ``seen`` (its low 32 bits), at most
    ``timeout_s``. Returns on a wake, a timeout, a signal, or at once if the word differs;
    the caller re-checks its condition in every case."""
    whole = int(timeout_s)
    span = _Timespec(whole, int((timeout_s - whole) * 1e9))
    _syscall(_SYS_FUTEX_X86_64, addr, _FUTEX_WAIT, seen & 0xFFFFFFFF,
             ctypes.addressof(span), None, 0)


def wake(addr: int) -> None:
    """Wake every process sleeping on the word at ``addr``: about 1 µs when none is. A no-op
    where futexes are unavailable (nobody can be sleeping on one)."""
    if _syscall is not None:
        _syscall(_SYS_FUTEX_X86_64, addr, _FUTEX_WAKE, _WAKE_ALL, None, None, 0)
