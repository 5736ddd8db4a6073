"""Copy engines move page runs between host history and the arena.

`copy(pairs, note, after=())` copies [(dst, src)] pairs as one operation, ordered after the
given fences, and returns a fence for its completion. The CPU backend's SyncCopyEngine copies at once. ThreadedCopyEngine
runs copies in FIFO order on a worker thread, like a CUDA copy stream, so tests can inject
delays on the copy side and prove that the pool waits on the right fences.
"""
from __future__ import annotations

import queue
from abc import ABC, abstractmethod
import threading
import time
from dataclasses import dataclass
from typing import Callable


from kvcompile.kv.fences import DONE, EventFence, Fence, wait_all


@dataclass
class CopyNote:
    """What a copy means, for the checker: fill pages (host->device) or publish them."""
    kind: str                     # "fill" or "publish"
    pages: tuple[int, ...]        # physical device pages
    owners: tuple = ()            # (layer, logical page) per page, for fills
    host_keys: tuple = ()         # (layer, logical page) host pages read (fill) or written


@dataclass
class Instrument:
    """Test hook: delays (seconds, called per event) and a checker."""
    checker: object = None
    copy_delay: Callable[[], float] | None = None
    compute_delay: Callable[[], float] | None = None


class CopyEngine(ABC):
    def __init__(self, instrument: Instrument | None = None):
        self.instrument = instrument or Instrument()
        self._busy_s = 0.0
        self.bytes_h2d = 0
        self.bytes_d2h = 0

    @abstractmethod
    def copy(self, pairs, note: CopyNote, after=()) -> Fence:
        """pairs: [(dst, src)] tensors copied as one operation (K and V runs of a group)."""

    @property
    def busy_s(self) -> float:
        """Seconds the engine spent copying so far (those it can tell without waiting)."""
        self._harvest()
        return self._busy_s

    def _harvest(self) -> None:
        """Account finished copies whose timing is known only later (CUDA events)."""

    def synchronize(self) -> None:
        pass

    def close(self) -> None:
        pass

    # ---- captured steps (CUDA graphs; on the CPU a "graph" reruns the step: nothing to do)
    def begin_capture(self) -> None:
        """Copies issued until end_capture join the CUDA graph being captured."""

    def end_capture(self) -> tuple[int, int]:
        """Close the copies into the capture; returns the (h2d, d2h) bytes each replay
        moves, which `count_replay` adds when it runs (a capture itself moves nothing)."""
        return 0, 0

    def abandon_capture(self) -> None:
        """A capture failed: forget it without joining."""

    def count_replay(self, h2d: int, d2h: int) -> None:
        self.bytes_h2d += h2d
        self.bytes_d2h += d2h

    def join(self) -> None:
        """Order the compute side after every copy issued so far, without a host wait (a
        replayed step's fills assume the copy side is idle)."""

    def publish_rows(self, pools, hosts, table, positions, maps) -> None:
        """Copy the bytes of `positions` from their K and V arena pages (`table`) to their
        host pages, on the compute side, in the caller's order (kv/row_publish.py).
        The CPU does it at once; CUDA launches a kernel on the current stream."""
        from kvcompile.kv.row_publish import publish_rows_reference
        publish_rows_reference(pools, hosts, table, positions, maps)
        self.bytes_d2h += positions.numel() * sum(m.row_bytes for m in maps)

    def _run(self, pairs, note: CopyNote) -> None:
        chk, delay = self.instrument.checker, self.instrument.copy_delay
        if chk is not None:
            (chk.fill_start(note.pages, note.owners, note.host_keys) if note.kind == "fill"
             else chk.publish_start(note.pages, note.host_keys))
        t0 = time.perf_counter()
        if delay is not None:
            time.sleep(delay())
        n = 0
        for dst, src in pairs:
            dst.copy_(src)
            n += dst.nbytes
        self._busy_s += time.perf_counter() - t0
        if note.kind == "fill":
            self.bytes_h2d += n
        else:
            self.bytes_d2h += n
        if chk is not None:
            (chk.fill_end(note.pages) if note.kind == "fill"
             else chk.publish_end(note.pages, note.host_keys))


class SyncCopyEngine(CopyEngine):
    def copy(self, pairs, note: CopyNote, after=()) -> Fence:
        wait_all(after)
        self._run(pairs, note)
        return DONE


class ThreadedCopyEngine(CopyEngine):
    """One worker = one in-order copy stream. Waiting on a fence that is only set by a later
    item of the same queue would deadlock, exactly as on a CUDA stream: the pool never asks."""

    def __init__(self, instrument: Instrument | None = None):
        super().__init__(instrument)
        self._q: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self._worker = threading.Thread(target=self._loop, name="kvcompile-copy", daemon=True)
        self._worker.start()

    def copy(self, pairs, note: CopyNote, after=()) -> Fence:
        if self._error is not None:
            raise RuntimeError("the copy worker failed") from self._error
        fence = EventFence(note.kind)
        self._q.put((list(pairs), note, tuple(after), fence))
        return fence

    def _loop(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            pairs, note, after, fence = item
            error = self._error
            try:
                wait_all(after)
                if error is None and note.kind != "sync":
                    self._run(pairs, note)
            except BaseException as e:  # noqa: BLE001 - every later fence reports it
                error = self._error = e
            fence.set(error)

    def synchronize(self) -> None:
        done = EventFence("sync")
        self._q.put(([], CopyNote("sync", ()), (), done))
        done.wait()
        if self._error is not None:
            raise RuntimeError("the copy worker failed") from self._error

    def close(self) -> None:
        self._q.put(None)
        self._worker.join()
