"""Completion fences: proof that the device finished an operation.

A lease says "someone still wants this memory"; only a fence says "the device stopped
touching it". On the CPU backend synchronous work returns DONE (trivially complete); the
threaded CPU copy engine returns EventFence (set by its worker, like a CUDA event recorded
on a copy stream). The CUDA backend wraps torch.cuda.Event in the same methods, plus
`stream_key` and `seq` (which stream recorded it, and when): waits implied by a later
fence of the same stream are skipped.

`device_wait(stream)` orders later work of a device stream after the fence without blocking
the host (CUDA: a stream wait on the event). The default blocks the host, which is the
only option for fences the device cannot see (a CPU thread's event) and is exact on the
CPU backend, where "the device" is the calling thread.
"""
from __future__ import annotations

import threading
from abc import ABC, abstractmethod


class Fence(ABC):
    stream_key = None     # (device, stream) of a device event; None: not a stream's
    seq = 0               # record order of a stream's fences

    @abstractmethod
    def query(self) -> bool:
        """True once the operation completed (never blocks)."""

    @abstractmethod
    def wait(self) -> None:
        """Block until the operation completed."""

    def device_wait(self, stream=None) -> None:
        """Order work issued later on `stream` (default: the current one) after this fence."""
        self.wait()


class DoneFence(Fence):
    def query(self) -> bool:
        return True

    def wait(self) -> None:
        return None

    def device_wait(self, stream=None) -> None:
        return None

    def __repr__(self):
        return "DONE"


DONE = DoneFence()


class EventFence(Fence):
    """Set exactly once by whoever performs the operation."""

    def __init__(self, what: str = ""):
        self._event = threading.Event()
        self.what = what
        self.error: BaseException | None = None

    def set(self, error: BaseException | None = None) -> None:
        """Complete; with an error, waiters raise instead of reading what never landed."""
        self.error = error
        self._event.set()

    def query(self) -> bool:
        return self._event.is_set()

    def wait(self) -> None:
        self._event.wait()
        if self.error is not None:
            raise RuntimeError(f"{self.what} failed on the copy engine") from self.error

    def __repr__(self):
        return f"EventFence({self.what!r}, done={self.query()})"


class AllOf(Fence):
    """Complete once every fence of a list completed."""

    def __init__(self, fences):
        self.fences = tuple(fences)

    def query(self) -> bool:
        return all_done(self.fences)

    def wait(self) -> None:
        wait_all(self.fences)

    def device_wait(self, stream=None) -> None:
        device_wait_all(self.fences, stream)


def all_done(fences) -> bool:
    return all(f.query() for f in fences)


def wait_all(fences) -> None:
    for f in fences:
        f.wait()


def device_wait_all(fences, stream=None) -> None:
    for f in latest_per_stream(fences):
        f.device_wait(stream)


def latest_per_stream(fences) -> list:
    """The fences that imply all the others: of fences recorded on one in-order device
    stream (the same `stream_key`, numbered by `seq` in record order) only the last one
    recorded, since it completes after the earlier ones; every other fence once."""
    last, out, seen = {}, [], set()
    for f in fences:
        key = f.stream_key
        if key is None:
            if f not in seen:
                seen.add(f)
                out.append(f)
        elif key not in last or f.seq > last[key].seq:
            last[key] = f
    return out + list(last.values())
