"""Forwards over a KV store by hand, inside its bracket (what the executor's eager path does),
for tests of the store's own machinery."""
from __future__ import annotations


def forward(model, store, tokens, positions, last_only: bool = False, layers=None,
            start: int | None = None, ahead: bool = True, **model_kw):
    """model(tokens, positions, store) between store.begin_forward and end_forward: the
    forward's rows become history when it returns. start: positions are start, start + 1,
    ... (the store does not read the tensor)."""
    store.begin_forward(positions, layers, start)
    ok = False
    try:
        out = model(tokens, positions, store, last_only=last_only, **model_kw)
        ok = True
        return out
    finally:
        store.end_forward(ok, ahead)
