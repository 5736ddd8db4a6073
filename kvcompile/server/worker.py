"""The Engine's thread: one job at a time from a bounded FIFO queue.

A job is a function of the Engine run on this thread (a generation, a session save); what it
reports (`emit`) reaches the request's asyncio handler through `loop.call_soon_threadsafe`.
A full queue refuses the job (QueueFull: the handler answers 503). A job whose client went
away is cancelled: skipped if it still waits, stopped at its next piece if it runs.
"""
from __future__ import annotations

import asyncio
import queue
import threading
from typing import Callable


class QueueFull(Exception):
    pass


class Job:
    """One request's work and its channel back to the event loop that handles it."""

    def __init__(self, work: Callable, loop: asyncio.AbstractEventLoop):
        self.work = work                      # work(engine, job) -> value
        self.events: asyncio.Queue = asyncio.Queue()
        self._loop = loop
        self._cancelled = threading.Event()

    def emit(self, kind: str, value=None) -> None:
        """From the engine's thread: ("start" | "piece" | "done" | "error", value)."""
        try:
            self._loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:                  # the loop is closed: nobody listens
            self.cancel()

    def cancel(self) -> None:
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    @property
    def cancel_event(self) -> threading.Event:
        """Set when the client goes: the Engine stops at its next prefill chunk or token."""
        return self._cancelled


class EngineWorker:
    def __init__(self, engine, queue_size: int):
        if queue_size < 1:
            raise ValueError(f"the queue holds at least one request, got {queue_size}")
        self.engine, self.queue_size = engine, queue_size
        self._jobs: queue.Queue = queue.Queue(maxsize=queue_size)
        self._stopping = False
        self._current: Job | None = None      # the running job
        self.running = 0                      # 1 while a job runs
        self._thread = threading.Thread(target=self._serve, name="kvcompile-engine",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """The running job stops at its next piece; the waiting ones never start."""
        self._stopping = True
        current = self._current
        if current is not None:
            current.cancel()
        try:
            self._jobs.put_nowait(None)       # wakes the thread if it waits
        except queue.Full:
            pass
        self._thread.join(timeout)

    @property
    def depth(self) -> int:
        """Jobs waiting (the running one not counted)."""
        return self._jobs.qsize()

    def submit(self, job: Job) -> None:
        try:
            self._jobs.put_nowait(job)
        except queue.Full:
            raise QueueFull(self.queue_size) from None

    def _serve(self) -> None:
        while True:
            job = self._jobs.get()
            if self._stopping:
                break
            if job is None or job.cancelled:
                continue
            self._current, self.running = job, 1
            try:
                value = job.work(self.engine, job)
            except Exception as e:            # reported to the request; the thread goes on
                job.emit("error", e)
            else:
                job.emit("done", value)
            finally:
                self._current, self.running = None, 0
        pending = [job]                       # stopped: these never run
        while not self._jobs.empty():
            pending.append(self._jobs.get_nowait())
        for job in filter(None, pending):
            job.emit("error", RuntimeError("the server is shutting down"))
