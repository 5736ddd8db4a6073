"""Backends: where device memory, host history and copies come from.

The CPU backend implements the CUDA backend's API (cuda_backend.py): "device" pages are ordinary
tensors, host history is plain (pinned on CUDA), compute is synchronous so its fence is
DONE as soon as the Python call returned (CUDA: an event recorded on the compute stream).
"""
from __future__ import annotations

import time
from typing import Protocol

import torch

from kvcompile.errors import ArenaError
from kvcompile.kv.copy_engine import (CopyEngine, Instrument, SyncCopyEngine,
                                           ThreadedCopyEngine)
from kvcompile.kv.fences import DONE, Fence, all_done
from kvcompile.kv.host_memory import check_host_bytes


class Backend(Protocol):
    """What a KV store asks of its backend; both backends declare every field."""
    name: str
    device: torch.device
    check_plans: bool         # validate every span plan the pool builds (a sync a layer)
    sync_each_forward: bool   # a forward's copies finish before its end returns
    prefetch_next: bool       # begin the next decode step at the end of each forward
    fill_ahead: bool          # a captured step fills the next one's first layers
    decode_depth: float | None    # decode steps' ring, in layers (None: prefill's)

    def device_buffer(self, nbytes: int) -> torch.Tensor: ...
    def host_buffer(self, shape) -> torch.Tensor: ...
    def check_host_bytes(self, nbytes: int) -> None: ...
    def copy_engine(self) -> CopyEngine: ...
    def compute_fence(self) -> Fence: ...
    def readiness_miss(self, fences) -> bool: ...
    def compute_delay(self, seconds: float) -> None: ...


def make_backend(device, arena_mib=0, copy: str = "engine") -> Backend:
    """The backend of a store on `device` (None: the CPU): the CPU's, or CUDA's (pinned
    host history, a copy stream, event fences; `copy` "engine" or "gather", how fills
    reach the device)."""
    dev = torch.device(device if device is not None else "cpu")
    if dev.type == "cuda":
        from kvcompile.kv.cuda_backend import CudaBackend
        return CudaBackend(dev, copy=copy)
    if dev.type != "cpu":
        raise ArenaError(f"the KV store has CPU and CUDA backends, not {dev.type}; use "
                         f"--device cpu or cuda")
    return CpuBackend()


class CpuBackend:
    name = "cpu"
    check_plans = True    # the CI backend validates every span plan it builds
    sync_each_forward = True   # copies finish before end_forward returns (cheap here)
    prefetch_next = True       # begin the next decode step at the end of each forward
    fill_ahead = True          # a captured step fills the next one's first layers
    decode_depth = 1.5         # decode steps' ring, in layers, with split fills (policy.py)

    def __init__(self, threaded_copies: bool = False, instrument: Instrument | None = None):
        self.device = torch.device("cpu")
        self.threaded_copies = threaded_copies
        self.instrument = instrument or Instrument()

    def device_buffer(self, nbytes: int) -> torch.Tensor:
        try:
            return torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        except RuntimeError as e:
            raise ArenaError(f"cannot allocate an arena of {nbytes / 2**20:g} MiB: {e}; "
                             f"use a smaller --kv-stream-arena-mib") from e

    def host_buffer(self, shape) -> torch.Tensor:
        try:
            return torch.zeros(shape, dtype=torch.uint8)
        except RuntimeError as e:
            raise ArenaError(f"cannot allocate {shape} bytes of host KV history: {e}; "
                             f"lower --ctx-size") from e

    def copy_engine(self) -> CopyEngine:
        cls = ThreadedCopyEngine if self.threaded_copies else SyncCopyEngine
        return cls(self.instrument)

    def compute_fence(self) -> Fence:
        """Completion of everything the compute side issued so far."""
        return DONE

    def readiness_miss(self, fences) -> bool:
        """Would the compute side stall on these copies? Here: they are not done yet."""
        return not all_done(fences)

    def compute_delay(self, seconds: float) -> None:
        """Test hook: pretend the compute side is busy for this long."""
        time.sleep(seconds)

    def check_host_bytes(self, nbytes: int) -> None:
        check_host_bytes(nbytes, pinned=False)
