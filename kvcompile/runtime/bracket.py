"""The forward bracket: begin_forward / end_forward around a model call when the cache
streams (a resident cache has none)."""
from __future__ import annotations

from contextlib import contextmanager


def is_streamed(cache) -> bool:
    """A cache whose forwards are bracketed (begin_forward / end_forward: the streaming
    cache), as opposed to one whose pages all sit on the device."""
    return cache.streams


@contextmanager
def forward_bracket(cache, positions, layers=None, start: int | None = None,
                    keep: bool = True, ahead: bool = True):
    """begin_forward / end_forward around the body when the cache has them (a resident
    cache has none). The forward's rows become history when the body returns and `keep`
    (a CUDA graph capture, which computes nothing, passes keep=False); `ahead`: see
    end_forward."""
    if not is_streamed(cache):
        yield
        return
    cache.begin_forward(positions, layers, start)
    ok = False
    try:
        yield
        ok = keep
    finally:
        cache.end_forward(ok, ahead)


def forward(model, cache, tokens, positions, last_only: bool = False, layers=None,
            start: int | None = None, ahead: bool = True, **model_kw):
    """model(tokens, positions, cache) with the streaming bracket when the cache has one.
    start: positions are start, start + 1, ... (saves the cache a read of the tensor);
    ahead: see end_forward; model_kw go to the model (return_hidden)."""
    with forward_bracket(cache, positions, layers, start, ahead=ahead):
        return model(tokens, positions, cache, last_only=last_only, **model_kw)

