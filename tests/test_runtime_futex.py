"""Sleeping on a shared counter (treeattn/testbed/transport/futex.py) and the mailbox receive that
uses it (treeattn/testbed/transport/shm.py).

Each wait here is given a timeout far longer than the test may take (60 s) and runs in a
child process or thread that is joined with a shorter deadline: if a wake were lost, or a
changed word ignored, the waiter would still be asleep at the join and the test fails. No
test asserts how fast anything is.
"""

from __future__ import annotations

import mmap
import multiprocessing
import threading
import time

import numpy as np
import pytest
import torch

from treeattn.runtime.group import RankContext
from treeattn.testbed.transport import futex, shm

pytestmark = pytest.mark.skipif(not futex.AVAILABLE, reason="futexes need Linux x86-64")

LONG_S = 60.0  # a waiter's own timeout: never reached when the protocol works
JOIN_S = 20.0  # how long the test waits for it


def _shared_word() -> tuple[mmap.mmap, np.ndarray]:
    """A page shared with forked children (anonymous mmap is MAP_SHARED), as int64s."""
    page = mmap.mmap(-1, mmap.PAGESIZE)
    return page, np.frombuffer(page, dtype=np.int64)


def _sleep_on(words: np.ndarray, seen: int) -> None:
    futex.wait(words.ctypes.data, seen, LONG_S)


def _fork_waiter(words: np.ndarray, seen: int):
    child = multiprocessing.get_context("fork").Process(target=_sleep_on, args=(words, seen))
    child.start()
    return child


def _finished(child, deadline_s: float = JOIN_S) -> bool:
    child.join(deadline_s)
    if child.is_alive():
        child.kill()
        child.join()
        return False
    return True


def test_a_wait_on_a_word_that_already_changed_returns_at_once():
    _page, words = _shared_word()
    words[0] = 7
    assert _finished(_fork_waiter(words, seen=6))


def test_a_process_sleeping_on_a_word_is_woken_by_another_process_store_and_wake():
    _page, words = _shared_word()
    child = _fork_waiter(words, seen=0)
    time.sleep(0.3)  # let it fall asleep first (if not yet, it sees the change: also correct)
    words[0] = 1
    futex.wake(words.ctypes.data)
    assert _finished(child)


def test_only_the_low_32_bits_are_compared():
    """The mailbox counters are 64-bit; the wait must still notice a change of the low word."""
    _page, words = _shared_word()
    words[0] = (5 << 32) | 3
    assert _finished(_fork_waiter(words, seen=4))  # 3 != 4 in the low word


def test_without_a_wake_the_waiter_keeps_sleeping():
    """The control for the tests above: a store alone does not end the sleep (the kernel
    only compares the word when the wait starts), so their joins do test the wake."""
    _page, words = _shared_word()
    child = _fork_waiter(words, seen=0)
    time.sleep(0.3)
    words[0] = 1
    assert not _finished(child, deadline_s=1.0)


def _oversubscribed_pair() -> list[shm.ShmChannel]:
    seg = np.zeros(shm.segment_bytes(2), dtype=np.uint8)
    pair = [shm.ShmChannel(RankContext(r, 2, r, torch.device("cpu"), "gloo", LONG_S), seg)
            for r in range(2)]
    for channel in pair:
        channel.spin_checks = 0  # as with more ranks than cores: straight to sleeping
    return pair


@pytest.mark.parametrize("futex_on", [True, False], ids=["futex", "naps"])
def test_a_sleeping_receive_gets_the_message_sent_after_it_fell_asleep(monkeypatch, futex_on):
    """The receiver sleeps on its mailbox's written counter; the send's store and wake must
    end that sleep (a sleep slice as long as the run's timeout, so nothing else would). With
    futexes off, the receive naps and still gets the message."""
    monkeypatch.setattr(shm, "_SLEEP_S", LONG_S)
    monkeypatch.setattr(futex, "AVAILABLE", futex_on)
    sender, receiver = _oversubscribed_pair()
    got, result = torch.zeros(5), []
    waiter = threading.Thread(target=lambda: result.append(receiver.irecv(got, 0, 2).wait()))
    waiter.start()
    time.sleep(0.3)
    sender.isend(torch.arange(5.0), 1, tag=2)
    waiter.join(JOIN_S)
    assert not waiter.is_alive() and result == [True]
    assert got.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
