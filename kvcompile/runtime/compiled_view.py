"""What a compiled forward sees of a streaming cache.

The eager model places a layer's pages through a Python hook (`cache.layer(i)` acquires
them), which torch.compile cannot trace. A compiled forward gets this view instead: its
`layer(i)` is only the layer's buffers (pools, page table: graph inputs), and the pass
pipeline (`passes.streamed_pipeline`) puts `ring_acquire` / `ring_release` around each
layer's attention and lowers them to the cache's `acquire_pages` / `release_pages`. So the
traced graph says where pages move, and a CUDA graph captured over it holds the copies.

Should the forward run eagerly after all (dynamo fell back), `layer(i)` acquires like the
hook, so the result is the same either way.
"""
from __future__ import annotations

import torch

from kvcompile.kv_cache import LayerKv


class CompiledKvView:
    streams = True

    def __init__(self, cache):
        self.cache = cache
        self._kv = cache._kv

    def layer(self, i: int) -> LayerKv:
        if not torch.compiler.is_compiling():
            self.cache.acquire_pages(i)
        return self._kv[i]

    @property
    def recurrent(self):
        """A hybrid model's recurrent state (the model reads it from the cache)."""
        return getattr(self.cache, "recurrent", None)

    def has_layer(self, i: int) -> bool:
        return i in self._kv

    def check_positions(self, positions: torch.Tensor) -> tuple[int, int]:
        return self.cache.check_positions(positions)

    # the lowered ring ops' calls (passes/ring.py)
    def acquire_pages(self, i: int) -> torch.Tensor:
        return self.cache.acquire_pages(i)

    def release_pages(self, i: int) -> None:
        self.cache.release_pages(i)
