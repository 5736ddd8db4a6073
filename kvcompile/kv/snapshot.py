"""A store's history taken off the store, and put back: the token ids, every KV layer's
pages up to its rows (as stored: the page format's bytes, quantized pages included), a
hybrid's recurrent state and its checkpoints, all in host memory.

The prompt cache (prompt_cache.py) keeps these for recent conversations; a session file
(engine/session.py) is one on disk. `put` needs a store of the same layout (`layout`):
the same KV layers, page format and recurrent geometry. After it, the next request resumes
from the history exactly as from the store's own (kv/prefix.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvcompile.errors import KvLayoutError
from kvcompile.kv.recurrent_state import RecurrentSnapshot
from kvcompile.kv.store import copy_in_runs


def layout(store) -> dict:
    """What a store must match to take a history: its KV layers and page format, and the
    recurrent state's shapes."""
    out = dict(layers=list(store.layers), page_size=store.page_size,
               k_type=store.k_type.name, v_type=store.v_type.name,
               page_bytes=int(store.pages.shape[1]))
    if store.recurrent is not None:
        out.update(conv=list(store.recurrent.conv.shape), ssm=list(store.recurrent.ssm.shape))
    return out


@dataclass
class History:
    tokens: list[int]
    rows: dict[int, int]                       # layer -> positions held
    pages: dict[int, torch.Tensor]             # layer -> uint8 [pages, page_bytes], host
    layout: dict
    state: tuple | None = None                 # (conv, ssm, n_tokens): the live state
    checkpoints: dict = field(default_factory=dict)   # position -> (conv, ssm)

    @property
    def nbytes(self) -> int:
        n = sum(p.nbytes for p in self.pages.values())
        if self.state is not None:
            n += self.state[0].nbytes + self.state[1].nbytes
        return n + sum(c.nbytes + s.nbytes for c, s in self.checkpoints.values())

    def held(self) -> list[int]:
        """The ids of the positions every layer holds (what a prompt can reuse)."""
        return self.tokens[:min(self.rows.values(), default=0)]


@torch.inference_mode()         # (the store's buffers are inference tensors)
def take(store) -> History:
    """A host copy of the store's history (the store keeps its own)."""
    store.synchronize()
    if store.device.type == "cuda":
        torch.cuda.synchronize(store.device)      # checkpoints are queued copies
    pages = {}
    for i in store.layers:
        view = store.history_pages(i)
        pages[i] = torch.empty(view.shape, dtype=torch.uint8)
        copy_in_runs(pages[i], view)
    state, checkpoints = None, {}
    if store.recurrent is not None:
        r = store.recurrent
        state = (r.conv.to("cpu", copy=True), r.ssm.to("cpu", copy=True), r.n_tokens)
        cps = store.prefix.checkpoints
        if cps is not None:
            checkpoints = {p: (c.to("cpu", copy=True), s.to("cpu", copy=True))
                           for p, (c, s) in cps.saved.items()}
    return History(list(store.prefix.tokens), dict(store.history.rows), pages, layout(store),
                   state, checkpoints)


def held_nbytes(store) -> int:
    """What take(store).nbytes will be, without copying anything."""
    width = int(store.pages.shape[1])
    n = sum(store.history.rows_pages(i) * width for i in store.layers)
    if store.recurrent is not None:
        cps = store.prefix.checkpoints
        n += store.recurrent.nbytes * (1 + (len(cps.saved) if cps is not None else 0))
    return n


def _int(n) -> bool:
    return isinstance(n, int) and not isinstance(n, bool)


def check(store, h: History) -> None:
    """KvLayoutError unless h fits this store as it is: its layout, a page array of exactly
    its rows' pages per KV layer, within the context, and a recurrent state and checkpoints
    of the store's shapes (a history from a file is only what the file says)."""
    if h.layout != layout(store):
        raise KvLayoutError(f"this history was taken from a store of another layout "
                            f"({h.layout}); this store is {layout(store)}")
    if set(h.rows) != set(store.layers) or not set(store.layers) <= set(h.pages):
        raise KvLayoutError(f"this history holds KV layers {sorted(h.rows)} (pages of "
                            f"{sorted(h.pages)}); this store has {list(store.layers)}")
    if not isinstance(h.tokens, list) or not all(map(_int, h.tokens)):
        raise KvLayoutError("this history's token ids are not a list of ints")
    width = int(store.pages.shape[1])
    for i in store.layers:
        n, p = h.rows[i], h.pages[i]
        if not _int(n) or n < 0:
            raise KvLayoutError(f"layer {i}'s rows must be an int >= 0, got {n!r}")
        if n > store.capacity:
            raise KvLayoutError(f"this history holds {n} positions but this store's "
                                f"context holds {store.capacity}: raise ctx_size")
        want = (-(-n // store.page_size), width)
        if not isinstance(p, torch.Tensor):
            raise KvLayoutError(f"layer {i}'s pages are not a tensor")
        if p.dtype != torch.uint8 or tuple(p.shape) != want:
            raise KvLayoutError(f"layer {i}'s pages must be uint8 {list(want)} for its {n} "
                                f"rows, got {p.dtype} {list(p.shape)}")
    r = store.recurrent
    if (r is None) != (h.state is None):
        raise KvLayoutError("this history's recurrent state does not match the store's "
                            "(one has a state, the other none)")
    if r is None:
        if h.checkpoints:
            raise KvLayoutError("this history has recurrent checkpoints; this store has no "
                                "recurrent state")
        return
    shapes = (tuple(r.conv.shape), tuple(r.ssm.shape))
    if len(h.state) != 3 or not _int(h.state[2]) or h.state[2] < 0:
        raise KvLayoutError("this history's recurrent state is not (conv, ssm, n_tokens)")
    for what, (conv, ssm) in [("state", h.state[:2]), *h.checkpoints.items()]:
        if what != "state" and (not _int(what) or what <= 0):
            raise KvLayoutError(f"a recurrent checkpoint at position {what!r}")
        pair = ((conv, r.conv), (ssm, r.ssm))
        if not all(isinstance(t, torch.Tensor) and t.dtype == mine.dtype and
                   t.shape == mine.shape for t, mine in pair):
            raise KvLayoutError(f"this history's recurrent {what} is not two tensors of "
                                f"this store's shapes {shapes}")


@torch.inference_mode()
def put(store, h: History) -> None:
    """Replace the store's history with h (checked first: a history that does not fit
    leaves the store's as it was)."""
    check(store, h)
    store.synchronize()                            # no copy still reads the history
    store.reset()
    for i in store.layers:
        store.adopt_pages(i, h.pages[i], h.rows[i])
    if h.state is not None:
        conv, ssm, n = h.state
        store.recurrent.restore(RecurrentSnapshot(conv, ssm, n))
    store.prefix.adopt(h.tokens, h.checkpoints)
