"""SM-driven host->device copies: a Triton kernel that reads pinned host memory directly.

Pinned memory is mapped into the device's address space (unified addressing), so a kernel
can load from it over PCIe / C2C like from device memory. Compared with the copy engine
(cudaMemcpyAsync on a side stream) it costs SMs but no DMA setup; the measured comparison
is in docs/streaming.md. `CudaBackend(copy="gather")` (EngineConfig.stream_copy="gather")
uses it for fills; publishes (device->host) stay on the copy engine.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 8192        # int32 words per program: 32 KiB, 16-byte loads per thread


@triton.jit
def _copy_words(dst, src, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(dst + offs, tl.load(src + offs, mask=m), mask=m)


def _words(t: torch.Tensor) -> torch.Tensor:
    """A contiguous uint8 run as int32 words (page runs are whole pages: 16-byte multiples)."""
    if not t.is_contiguous() or t.nbytes % 4 or t.data_ptr() % 16:
        raise ValueError("gather copies need contiguous, 16-byte aligned runs of whole words")
    return t.reshape(-1).view(torch.int32)


def gather_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst (device) <- src (pinned host), by SMs, on the current stream."""
    if src.device.type != "cpu" or not src.is_pinned():
        raise ValueError("the gather copy reads pinned host memory only")
    d, s = _words(dst), _words(src)
    n = d.numel()
    if n:
        _copy_words[(triton.cdiv(n, BLOCK),)](d, s, n, BLOCK=BLOCK, num_warps=8)
