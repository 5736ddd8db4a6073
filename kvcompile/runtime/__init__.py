"""Streaming runtime: arena, host history, resident/ring pool, fences, policy, telemetry."""
from kvcompile.runtime.arena import Arena, Lease, Region, Transaction  # noqa: F401
from kvcompile.runtime.backend import CpuBackend  # noqa: F401
from kvcompile.runtime.checker import FenceChecker  # noqa: F401
from kvcompile.runtime.copy_engine import Instrument  # noqa: F401
from kvcompile.runtime.make import make_kv_cache  # noqa: F401
from kvcompile.runtime.bracket import forward, forward_bracket  # noqa: F401
from kvcompile.runtime.kv_pages import min_arena_bytes  # noqa: F401
from kvcompile.runtime.streaming_cache import StreamingKvCache  # noqa: F401
