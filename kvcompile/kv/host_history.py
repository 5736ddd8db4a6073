"""How far each KV layer's history reaches, and, for a streamed store, the history itself.

`RowCounts`: per layer, the positions [0, rows) whose KV the store holds (layers may differ:
an MTP layer runs its own forwards). An all-resident store keeps only these: its device
pages are the history.

`HostHistory`: the authoritative copy of every layer's KV in host memory (pinned on CUDA),
one array uint8 [max_pages, pair.stride] a layer, each row a K page and a V page
(kv_pages.PagePair), laid out exactly like the arena's pages so a run of contiguous pages is
one copy; `k` and `v` are its K and V views. Pages at or past a layer's rows hold nothing
yet and need no host->device copy.
"""
from __future__ import annotations

import torch


class RowCounts:
    def __init__(self, layers, page_size: int):
        self.layers = tuple(layers)
        self.page_size = page_size
        self.rows = {i: 0 for i in self.layers}

    def has_rows(self, layer: int, logical_page: int) -> bool:
        return logical_page * self.page_size < self.rows[layer]

    def rows_pages(self, layer: int) -> int:
        """Number of logical pages holding at least one published row."""
        return -(-self.rows[layer] // self.page_size)

    def reset(self) -> None:
        """Forget the sequence (contents need no clearing: rows says what is valid)."""
        for i in self.layers:
            self.rows[i] = 0

    def truncate(self, n_rows: int, layers=None) -> None:
        for i in self.layers if layers is None else layers:
            self.rows[i] = min(self.rows[i], n_rows)

    def publish(self, n_rows: int, layers) -> None:
        """Record that rows up to n_rows of these layers are now held."""
        for i in layers:
            self.rows[i] = max(self.rows[i], n_rows)

    @property
    def nbytes(self) -> int:
        return 0


class HostHistory(RowCounts):
    def __init__(self, layers, max_pages: int, pair, page_size: int, alloc=None):
        super().__init__(layers, page_size)
        alloc = alloc or (lambda shape: torch.zeros(shape, dtype=torch.uint8))
        self.max_pages = max_pages
        self.kv, self.k, self.v = {}, {}, {}
        for i in self.layers:
            self.kv[i] = alloc((max_pages, pair.stride))
            self.k[i], self.v[i] = pair.views(self.kv[i])

    @property
    def nbytes(self) -> int:
        return sum(self.kv[i].nbytes for i in self.layers)
