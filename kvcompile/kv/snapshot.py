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
    pages = {i: store.history_pages(i).to("cpu", copy=True) for i in store.layers}
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


@torch.inference_mode()
def put(store, h: History) -> None:
    """Replace the store's history with h."""
    if h.layout != layout(store):
        raise KvLayoutError(f"this history was taken from a store of another layout "
                            f"({h.layout}); this store is {layout(store)}")
    store.synchronize()                            # no copy still reads the history
    store.reset()
    for i in store.layers:
        store.adopt_pages(i, h.pages[i], h.rows[i])
    if h.state is not None:
        conv, ssm, n = h.state
        store.recurrent.restore(RecurrentSnapshot(conv, ssm, n))
    store.prefix.adopt(h.tokens, h.checkpoints)
