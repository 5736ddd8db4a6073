"""Backends: where device memory, host history and copies come from.

The CPU backend implements the API the CUDA backend will: "device" pages are ordinary
tensors, host history is plain (pinned on CUDA), compute is synchronous so its fence is
DONE as soon as the Python call returned (CUDA: an event recorded on the compute stream).
"""
from __future__ import annotations

import torch

from kvcompile.errors import ArenaError
from kvcompile.runtime.copy_engine import (CopyEngine, Instrument, SyncCopyEngine,
                                           ThreadedCopyEngine)
from kvcompile.runtime.fences import DONE, Fence


class CpuBackend:
    name = "cpu"
    check_plans = True    # the CI backend validates every span plan it builds

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
