"""CUDA backend: the arena on the device, host history in pinned memory, copies on a side
stream, fences as CUDA events.

Nothing here blocks the host inside a forward: a layer's attention waits for its copies by
a stream wait on their events (`CudaFence.device_wait`), and a copy into a page waits for
the page's consumed fence (an event recorded on the compute stream at release) the same
way. The pool only ever waits on events already recorded (docs/streaming.md, "the rule that
keeps them deadlock-free"): a CUDA stream wait on an event not yet recorded would not wait.

Copy-busy time comes from timing events around each copy, read when they are done (never
synchronizing for it); the streaming cache settles a forward's share at the next begin, so
copies that land after the host moved on still count for their own forward.
"""
from __future__ import annotations

import functools
import itertools

import torch

from kvcompile.errors import ArenaError
from kvcompile.kv.host_memory import check_host_bytes
from kvcompile.kv.checker import FenceChecker
from kvcompile.kv.copy_engine import CopyEngine, CopyNote, Instrument
from kvcompile.kv.fences import Fence, all_done, latest_per_stream

# torch.cuda._sleep spins for a number of GPU clock cycles; only test delays use it, so a
# rough clock (an H200 runs at ~1.5-2 GHz) is enough.
SLEEP_CYCLES_PER_S = 1.5e9


class CudaFence(Fence):
    """An event recorded on a stream: complete once the stream passed that point.
    stream_key (device, stream handle) and seq (global record order) let waiters skip
    fences implied by another: a stream runs in order (fences.latest_per_stream)."""

    __slots__ = ("event", "device", "what", "stream_key", "seq")

    def __init__(self, event: torch.cuda.Event, device: int, what: str = "",
                 stream_key=None, seq: int = 0):
        self.event, self.device, self.what = event, device, what   # device: an index (cheap)
        self.stream_key, self.seq = stream_key, seq

    def query(self) -> bool:
        return self.event.query()

    def wait(self) -> None:
        self.event.synchronize()

    def device_wait(self, stream=None) -> None:
        if stream is None:
            stream = torch.cuda.current_stream(self.device)
        if _key(stream) != self.stream_key:   # on its own stream it is already ordered
            stream.wait_event(self.event)

    def __repr__(self):
        return f"CudaFence({self.what!r}, done={self.query()})"


_SEQ = itertools.count(1)


def _key(stream) -> tuple:
    return (stream.device_index, stream.cuda_stream)


def record(stream: torch.cuda.Stream, device: int, what: str, timing: bool = False) -> CudaFence:
    ev = torch.cuda.Event(enable_timing=timing)
    ev.record(stream)
    return CudaFence(ev, device, what, _key(stream), next(_SEQ))


def device_sleep(seconds: float, stream=None) -> None:
    """Keep a stream busy for about `seconds` (a test delay that the fences must absorb)."""
    cycles = int(seconds * SLEEP_CYCLES_PER_S)
    if cycles > 0:
        with torch.cuda.stream(torch.cuda.current_stream() if stream is None else stream):
            torch.cuda._sleep(cycles)


class CudaCopyEngine(CopyEngine):
    """Copies on one side stream, in issue order (a FIFO, like the CPU's threaded engine)."""

    def __init__(self, device: torch.device, instrument: Instrument | None = None,
                 gather: bool = False):
        super().__init__(instrument)
        self.device = device.index
        self.stream = torch.cuda.Stream(device)
        self._key = _key(self.stream)
        self._waited: dict = {}         # stream key -> seq of the last fence this stream waited on
        self._timed: list = []          # (start, end) timing events of copies not yet counted
        self._captured: list | None = None   # [h2d, d2h] bytes of the copies being captured
        self._gather = None
        if gather:                      # fills by an SM kernel reading pinned memory
            from kvcompile.kv.cuda_gather import gather_copy
            self._gather = gather_copy

    def copy(self, pairs, note: CopyNote, after=()) -> Fence:
        s, chk, delay = self.stream, self.instrument.checker, self.instrument.copy_delay
        fill = note.kind == "fill"
        n = 0
        with torch.cuda.stream(s):
            for f in latest_per_stream(after):
                key = f.stream_key
                if key is not None and (key == self._key or self._waited.get(key, 0) >= f.seq):
                    continue                # implied: own stream, or a later fence waited on
                f.device_wait(s)            # a stream wait; a CPU fence blocks the host
                if key is not None:
                    self._waited[key] = f.seq
            if delay is not None:
                device_sleep(delay(), s)
            if chk is not None:             # TimelineChecker: stamps this point of the stream
                (chk.fill_start(note.pages, note.owners, note.host_keys) if fill
                 else chk.publish_start(note.pages, note.host_keys))
            timed = self._captured is None  # a capture cannot time (nor read) its events
            start = record(s, self.device, "copy start", timing=True) if timed else None
            for dst, src in pairs:
                if fill and self._gather is not None and _gatherable(dst, src):
                    self._gather(dst, src)
                else:
                    dst.copy_(src, non_blocking=True)
                n += dst.nbytes
            if chk is not None:             # before the fence, so its waiters come later
                (chk.fill_end(note.pages) if fill
                 else chk.publish_end(note.pages, note.host_keys))
            end = record(s, self.device, note.kind, timing=timed)
        if not timed:
            self._captured[0 if fill else 1] += n
            return end
        self._timed.append((start.event, end.event))
        if fill:
            self.bytes_h2d += n
        else:
            self.bytes_d2h += n
        return end

    def _harvest(self) -> None:
        if self._timed and self._timed[-1][1].query():   # in order: the last done, all done
            for a, b in self._timed:
                self._busy_s += a.elapsed_time(b) / 1000
            self._timed.clear()
            return
        done = 0
        for a, b in self._timed:            # one in-order stream: stop at the first pending
            if not b.query():
                break
            self._busy_s += a.elapsed_time(b) / 1000
            done += 1
        del self._timed[:done]

    def synchronize(self) -> None:
        self.stream.synchronize()
        self._harvest()

    def begin_capture(self) -> None:
        """Fork the copy stream from the capturing (current) stream: from here on its work
        is part of the graph. Waits skipped as implied by earlier ones are forgotten (those
        were not captured)."""
        fork = record(torch.cuda.current_stream(self.device), self.device, "capture fork")
        self.stream.wait_event(fork.event)
        self._waited = {fork.stream_key: fork.seq}
        self._captured = [0, 0]

    def end_capture(self) -> tuple[int, int]:
        """Join the copy stream back into the capturing stream (a capture must end joined)."""
        moved, self._captured = self._captured, None
        self._waited = {}               # what was waited on inside the graph is not history
        self.join()
        return (moved[0], moved[1]) if moved else (0, 0)

    def abandon_capture(self) -> None:
        self._captured, self._waited = None, {}

    def publish_rows(self, pools, hosts, table, positions, maps) -> None:
        from kvcompile.kv.row_publish import publish_rows_cuda
        publish_rows_cuda(pools, hosts, table, positions, maps)
        n = positions.numel() * sum(m.row_bytes for m in maps)
        if self._captured is not None:
            self._captured[1] += n
        else:
            self.bytes_d2h += n

    def join(self) -> None:
        ev = torch.cuda.Event()
        ev.record(self.stream)
        torch.cuda.current_stream(self.device).wait_event(ev)

    def close(self) -> None:
        self.synchronize()


def _gatherable(dst, src) -> bool:
    return (src.is_pinned() and dst.is_contiguous() and src.is_contiguous()
            and dst.nbytes % 4 == 0 and dst.data_ptr() % 16 == 0 and src.data_ptr() % 16 == 0)


COPY_MODES = ("engine", "gather")


class CudaBackend:
    name = "cuda"
    check_plans = False        # validating plans costs a host sync per layer; CI checks them
    # An eager forward's publishes finish on the copy stream, ahead of the next fills; a
    # replay's rows are published on the compute stream, before the event every page's
    # last use becomes (pool.replayed)
    sync_each_forward = False
    # Begin the next eager forward at the end of each one (streamer.py): off on CUDA (a
    # prefill chunk's guess is always wrong); EngineConfig.prefetch_next turns it on.
    prefetch_next = False
    # A captured decode step fills the next one's first layers (Streamer.end_issue): off
    # until device runs compare it with the default (EngineConfig.fill_ahead).
    fill_ahead = False
    # Decode's own ring of 1.25 layers with split fills (policy.py; faster than prefill's
    # ring at 64K and 128K, docs/benchmarks.md); EngineConfig.decode_depth overrides it.
    decode_depth = 1.25

    def __init__(self, device="cuda", instrument: Instrument | None = None,
                 copy: str = "engine"):
        """copy: "engine" (cudaMemcpyAsync on a side stream, the default) or "gather" (an SM
        kernel reading pinned memory for fills; EngineConfig.stream_copy)."""
        self.copy = copy
        if self.copy not in COPY_MODES:
            raise ArenaError(f"unknown streaming copy mode {self.copy!r}; use one of "
                             f"{COPY_MODES} (stream_copy)")
        device = torch.device(device)
        if device.type != "cuda":
            raise ArenaError(f"the CUDA streaming backend needs a cuda device, got {device}")
        if not torch.cuda.is_available():
            raise ArenaError("the CUDA streaming backend needs CUDA, which is not available; "
                             "use --device cpu")
        self.device = torch.device("cuda", device.index if device.index is not None
                                   else torch.cuda.current_device())
        self.instrument = instrument or Instrument()
        self._index = self.device.index     # int: the per-layer stream lookups stay cheap

    def device_buffer(self, nbytes: int) -> torch.Tensor:
        try:
            return torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        except (torch.OutOfMemoryError, RuntimeError) as e:
            free, total = torch.cuda.mem_get_info(self.device)
            raise ArenaError(f"cannot allocate an arena of {nbytes / 2**20:g} MiB on "
                             f"{self.device} ({free / 2**20:.0f} of {total / 2**20:.0f} MiB "
                             f"free); use a smaller --kv-stream-arena-mib") from e

    def host_buffer(self, shape) -> torch.Tensor:
        try:
            return torch.zeros(shape, dtype=torch.uint8, device="cpu", pin_memory=True)
        except RuntimeError as e:
            n = 1
            for d in (shape if isinstance(shape, (tuple, list)) else (shape,)):
                n *= int(d)
            raise ArenaError(f"cannot pin {n / 2**20:.0f} MiB of host memory for the KV "
                             f"history ({e}); lower --ctx-size or use a smaller KV type "
                             f"(--cache-type-k/-v q8_0)") from e

    def check_host_bytes(self, nbytes: int) -> None:
        check_host_bytes(nbytes, pinned=True)

    def copy_engine(self) -> CopyEngine:
        return CudaCopyEngine(self.device, self.instrument, gather=self.copy == "gather")

    def compute_fence(self) -> Fence:
        return record(torch.cuda.current_stream(self._index), self._index, "compute")

    def readiness_miss(self, fences) -> bool:
        """The compute stream would stall: the copies are pending and it has nothing else
        queued (the host runs ahead, so "pending" alone would count nearly every layer)."""
        # the stream first: while the host runs ahead it is busy, and one query answers
        return (bool(fences) and torch.cuda.current_stream(self._index).query()
                and not all_done(latest_per_stream(fences)))

    def compute_delay(self, seconds: float) -> None:
        device_sleep(seconds, torch.cuda.current_stream(self._index))


class TimelineChecker:
    """FenceChecker for the device: every event is stamped on the stream that performs it
    (a timing event at that point of the stream) and `replay()` feeds the checker in device
    time order. Ties keep issue order, which respects every fence: the pool only waits on
    events recorded before the waiter is issued. Markers sit inside the fences (a copy's
    end marker before its completion event, a layer's read end and release before its
    consumed event), so correct ordering never looks like a violation."""

    def __init__(self, checker: FenceChecker | None = None):
        self.checker = checker or FenceChecker()
        self._log: list = []

    def _mark(self, name, *args):
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()                              # the current stream: copy or compute
        self._log.append((ev, len(self._log), name, args))

    # the FenceChecker's events, each marked on the stream that performs it
    EVENTS = frozenset({"fill_start", "fill_end", "publish_start", "publish_end", "claim",
                        "read_start", "read_end", "release"})

    def __getattr__(self, name):
        if name in TimelineChecker.EVENTS:
            return functools.partial(self._mark, name)
        raise AttributeError(name)

    def replay(self) -> FenceChecker:
        """Wait for the device, then run the recorded events through the checker."""
        torch.cuda.synchronize()
        if self._log:
            base = self._log[0][0]
            for _, _, name, args in sorted(self._log,
                                           key=lambda e: (base.elapsed_time(e[0]), e[1])):
                getattr(self.checker, name)(*args)
        self._log = []
        return self.checker

    @property
    def violations(self) -> list[str]:
        return self.checker.violations
