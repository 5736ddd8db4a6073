"""Count what one streamed decode step asks of the host and the CUDA API, on a CPU.

The real `CudaBackend` / `CudaCopyEngine` run with `torch.cuda` events, streams and stream
contexts replaced by counting fakes (tensors stay on the CPU, so copies happen at once) and
a model that does nothing but the cache's per-layer protocol (`check_positions`, then
`cache.layer(i)` for every layer), so every count is the runtime's own: device ops it
issues (aten ops: `copy_` is a cudaMemcpyAsync on the device), event records / queries,
stream waits, host syncs, host reads of the positions tensor, and Python function calls.

Device model of the fakes: the host runs ahead. Events recorded since the last host sync
are pending, and so is a stream with such an event; the harness marks the device idle
between steps (the engine reads the logits of each step, which syncs).

    python tools/profile/count_stream_calls.py [--layers 32] [--ctx 8192] [--arena-pages 630]
        [--steps 4] [--json PATH]

Default geometry: Llama-3-8B's 32 layers and 256-row pages, 8K context, q8_0/q4_0 KV, and
an arena of 630 pages, which is what 256 MiB holds at 8 KV heads x 128 (the H200 profile in
benchmarks/results/profile_decode.json); heads are shrunk (1 x 64) so the host history is
small: the counts depend on pages, not bytes.
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import itertools
import json
import pstats
import time
from collections import Counter
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kvcompile.models.config import ModelConfig
from kvcompile.kv.arena import MIB
from kvcompile.kv.kv_pages import min_arena_bytes
from kvcompile.kv.store import KvStore

HOST_READS = ("tolist", "item", "__int__", "__index__", "__float__", "__bool__", "cpu",
              "numpy")


class FakeCuda:
    """Counting stand-ins for torch.cuda.{Event, Stream, stream, current_stream, ...}."""

    COMPUTE = 7                        # the compute stream's handle

    def __init__(self):
        self.counts = Counter()
        self.last_tick = 0             # ticks: one per event record, in host issue order
        self.last_on: dict = {}        # stream handle -> tick of its last record
        self.idle_at = 0               # events recorded at or before this tick are complete
        self.handles = itertools.count(100)
        self.current = self.COMPUTE
        fake = self

        class Event:
            def __init__(self, enable_timing=False, **_):
                self.timing, self.tick, self.handle = enable_timing, None, None

            def record(self, stream=None):
                fake.counts["event_record"] += 1
                fake.last_tick += 1
                self.tick = fake.last_tick
                self.handle = fake.current if stream is None else stream.cuda_stream
                fake.last_on[self.handle] = self.tick

            def query(self):
                fake.counts["event_query"] += 1
                return self.tick is not None and self.tick <= fake.idle_at

            def synchronize(self):
                fake.counts["host_sync"] += 1
                fake.idle_at = max(fake.idle_at, self.tick or 0)

            def elapsed_time(self, other):
                fake.counts["event_elapsed"] += 1
                if max(self.tick or 1 << 62, other.tick or 1 << 62) > fake.idle_at:
                    raise RuntimeError("elapsed_time on an event that has not completed")
                return 0.01

        class Stream:
            def __init__(self, device=None, handle=None, **_):
                self.cuda_stream = next(fake.handles) if handle is None else handle
                self.device_index = 0

            def wait_event(self, event):
                fake.counts["stream_wait"] += 1
                if event.tick is None:
                    raise RuntimeError("stream wait on an event never recorded (a no-op on "
                                       "CUDA: the runtime's fence rule is broken)")

            def query(self):
                fake.counts["stream_query"] += 1
                return fake.idle_at >= fake.last_on.get(self.cuda_stream, 0)

            def synchronize(self):
                fake.counts["host_sync"] += 1
                fake.idle()

            def __eq__(self, other):
                return isinstance(other, Stream) and other.cuda_stream == self.cuda_stream

            def __hash__(self):
                return hash(self.cuda_stream)

        @contextlib.contextmanager
        def stream(s):
            fake.counts["stream_switch"] += 1
            prev, fake.current = fake.current, s.cuda_stream
            try:
                yield
            finally:
                fake.current = prev

        def current_stream(device=None):
            return Stream(handle=fake.current)   # a new object each call, as torch does

        def synchronize(device=None):
            fake.counts["host_sync"] += 1
            fake.idle()

        def sleep(cycles):
            fake.counts["sleep"] += 1

        self.Event, self.Stream = Event, Stream
        self.patches = dict(Event=Event, Stream=Stream, stream=stream,
                            current_stream=current_stream, synchronize=synchronize,
                            _sleep=sleep, is_available=lambda: True, current_device=lambda: 0)

    def idle(self) -> None:
        """The device caught up with everything issued so far."""
        self.idle_at = self.last_tick

    @contextlib.contextmanager
    def active(self):
        with contextlib.ExitStack() as st:
            for name, fn in self.patches.items():
                st.enter_context(mock.patch.object(torch.cuda, name, fn))
            yield self


def fake_cuda_backend(fake: FakeCuda, **kw):
    """The real CudaBackend and CudaCopyEngine, on CPU tensors (build inside fake.active())."""
    from kvcompile.kv.cuda_backend import CudaBackend, CudaCopyEngine

    class FakeCudaBackend(CudaBackend):
        def __init__(self):
            super().__init__("cuda:0", **kw)
            self.device = torch.device("cpu")      # tensors: CPU; streams/events: the fakes

        def device_buffer(self, nbytes):
            return torch.empty(nbytes, dtype=torch.uint8)

        def host_buffer(self, shape):
            return torch.zeros(shape, dtype=torch.uint8)

        def copy_engine(self):
            return CudaCopyEngine(torch.device("cuda", 0), self.instrument,
                                  gather=self.copy == "gather")

    return FakeCudaBackend()


class Positions(torch.Tensor):
    """A positions tensor that counts host reads of its values (a host sync on CUDA)."""

    reads = Counter()

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in HOST_READS:
            cls.reads[name] += 1
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **(kwargs or {}))
        return out.as_subclass(Positions) if type(out) is torch.Tensor else out


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.__name__.split(".")[0]] += 1
        return func(*args, **(kwargs or {}))


class ProtocolModel:
    """Only what a model does with the cache: check the positions, acquire every layer."""

    def __init__(self, layers):
        self.layers = layers

    def __call__(self, tokens, positions, cache, last_only=False):
        cache.check_positions(positions)
        for i in self.layers:
            cache.layer(i)
        return tokens


def forward(model, store, tokens, positions, start=None):
    """One forward inside the store's bracket (the executor's eager path)."""
    store.begin_forward(positions, None, start)
    out = model(tokens, positions, store)
    store.end_forward()
    return out


def geometry(layers: int = 32):
    return ModelConfig(arch="llama", n_layers=layers, hidden=64, ffn=64, n_heads=1,
                       n_kv_heads=1, head_dim=64, vocab_size=16, context_length=1 << 20)


def arena_mib(cfg, pages: int, k="q8_0", v="q4_0", page_size=256) -> float:
    """The smallest arena for `pages` pages a layer, plus two alignment units."""
    return (min_arena_bytes(cfg, pages * page_size, k, v, page_size) + 2 * 256) / MIB


def count(layers=32, ctx=8192, arena_pages=630, steps=4, prefill_chunk=4096,
          check_plans=False, warm=6, start=False) -> dict:
    """Per-step averages over `steps` decode steps after a prefill and `warm` steps (the
    policy settles its split: a change waits for the pages that switch roles). start:
    forwards pass the first position as an int (forward(..., start=))."""
    cfg = geometry(layers)
    fake = FakeCuda()
    with fake.active():
        cache = KvStore(cfg, ctx + 64, arena_mib(cfg, arena_pages), "q8_0", "q4_0",
                                 backend=fake_cuda_backend(fake))
        cache.streamer.pool.check_plans = check_plans
        model = ProtocolModel(cache.layers)
        tok = torch.zeros(1, dtype=torch.long)
        with torch.inference_mode():
            for s in range(0, ctx, prefill_chunk):
                n = min(prefill_chunk, ctx - s)
                forward(model, cache, tok.expand(n), torch.arange(s, s + n))
                fake.idle()
            for p in range(ctx, ctx + warm):
                forward(model, cache, tok, torch.tensor([p]))
                fake.idle()
            p = ctx + warm

            def steps_(n, wrap=contextlib.nullcontext):
                nonlocal p
                for _ in range(n):
                    pos = torch.tensor([p]).as_subclass(Positions)
                    with wrap():
                        forward(model, cache, tok, pos, **({"start": p} if start else {}))
                    fake.idle()
                    p += 1

            fake.counts.clear()
            Positions.reads.clear()
            ops = OpCounter()
            steps_(steps, lambda: ops)               # 1: device ops and fake CUDA calls
            counts, reads = Counter(fake.counts), sum(Positions.reads.values())
            prof = cProfile.Profile()                # 2: Python calls (without the counter)
            steps_(steps, lambda: prof)
            t = time.perf_counter()                  # 3: host time, nothing attached
            steps_(steps)
            wall = time.perf_counter() - t
        cache.close()
    calls = sum(v[1] for v in pstats.Stats(prof).stats.values())   # incl. recursive calls
    tel = cache.telemetry[-1]
    per = {k: v / steps for k, v in sorted(counts.items())}
    per.update({f"aten.{k}": v / steps for k, v in sorted(ops.ops.items())})
    per["positions_host_reads"] = reads / steps
    per["python_calls"] = calls / steps
    per["host_ms_with_fakes"] = wall / steps * 1e3
    return dict(layers=layers, ctx=ctx, arena_pages=arena_pages,
                resident_pages_per_layer=cache.streamer.pool.r, ring_slots=tel.ring_slots,
                repartitions=sum(s.repartitioned for s in cache.telemetry[-3 * steps:]),
                readiness_misses=tel.readiness_misses,
                streamed_pages_per_layer=tel.streamed_reads / tel.layers, per_step=per)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--arena-pages", type=int, default=630)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--start", action="store_true", help="forwards pass start= (no read)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    res = count(a.layers, a.ctx, a.arena_pages, a.steps, start=a.start)
    print(json.dumps(res, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
