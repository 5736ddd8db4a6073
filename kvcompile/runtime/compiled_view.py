"""What a compiled forward sees of a streaming cache.

The eager model places a layer's pages through a Python hook (`cache.layer(i)` acquires
them), which torch.compile cannot trace. A compiled forward gets this view instead: its
`layer(i)` is only the layer's buffers (pools, page table: graph inputs), and the pass
pipeline (`passes.streamed_pipeline`) puts `ring_acquire` / `ring_release` around each
layer's attention and lowers them to the cache's `acquire_pages` / `release_pages`. So the
traced graph says where pages move, and a CUDA graph captured over it holds the copies.

Should the forward run eagerly after all (dynamo disabled), `layer(i)` acquires like the
hook, so the result is the same either way.

The view holds the cache weakly: torch.compile keeps every backend it has seen (and so the
pass pipeline, this view) for the life of the process, which must not keep a dropped
Engine's arena and pinned history alive.
"""
from __future__ import annotations

import weakref

import torch

from kvcompile.errors import KvLayoutError
from kvcompile.kv_cache import LayerKv


class CompiledKvView:
    streams = True

    def __init__(self, cache):
        self._cache = weakref.ref(cache)

    @property
    def cache(self):
        cache = self._cache()
        if cache is None:
            raise KvLayoutError("the KV cache of this compiled forward is gone (its Engine "
                                "was closed)")
        return cache

    def layer(self, i: int) -> LayerKv:
        cache = self.cache
        if not torch.compiler.is_compiling():
            cache.acquire_pages(i)
        return cache._kv[i]

    @property
    def recurrent(self):
        """A hybrid model's recurrent state (the model reads it from the cache)."""
        return getattr(self.cache, "recurrent", None)

    def has_layer(self, i: int) -> bool:
        return self.cache.has_layer(i)

    def check_positions(self, positions: torch.Tensor) -> tuple[int, int]:
        return self.cache.check_positions(positions)

    # the lowered ring ops' calls (passes/lower_ring.py)
    def acquire_pages(self, i: int) -> torch.Tensor:
        return self.cache.acquire_pages(i)

    def release_pages(self, i: int) -> None:
        self.cache.release_pages(i)
