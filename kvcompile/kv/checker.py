"""Instrumented fence checker: records every read-before-ready and overwrite-before-consumed.

It watches physical device pages (resident pages and ring slots) and host pages through
events reported by the copy engine (copy start/end, on its own thread) and by the pool on
the compute side (read start/end, release). Page content is named by its owner, the
(layer, logical page) it holds. Rules:
- a copy into a device page may start only when the previous owner released it, nobody
  is reading it and no publish (device->host) from it is in flight;
- a read may start only on a page whose last copy finished and that holds the reader's page;
- a host->device copy may not read a host page whose publish is still in flight.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field


@dataclass
class _Page:
    owner: tuple | None = None
    held: bool = False
    filling: int = 0
    readers: int = 0
    publishing: int = 0


@dataclass
class FenceChecker:
    violations: list[str] = field(default_factory=list)
    events: int = 0

    def __post_init__(self):
        self._lock = threading.Lock()
        self._pages: dict[int, _Page] = {}
        self._host_pending: dict[tuple, int] = {}

    def _page(self, p: int) -> _Page:
        return self._pages.setdefault(p, _Page())

    def _bad(self, msg: str) -> None:
        self.violations.append(msg)

    # ---- copy side (engine thread) ---------------------------------------------------------
    def fill_start(self, pages, owners, host_keys=()) -> None:
        with self._lock:
            self.events += 1
            for p, owner in zip(pages, owners):
                s = self._page(p)
                if s.held or s.readers or s.publishing or s.filling:
                    self._bad(f"overwrite-before-consumed: page {p} filled for {owner} while "
                              f"{s.owner} held={s.held} readers={s.readers} "
                              f"publishing={s.publishing} filling={s.filling}")
                s.owner, s.held = owner, True
                s.filling += 1
            for k in host_keys:
                if self._host_pending.get(k):
                    self._bad(f"host page {k} read before its publish completed")

    def fill_end(self, pages) -> None:
        with self._lock:
            for p in pages:
                self._page(p).filling -= 1

    def publish_start(self, pages, host_keys) -> None:
        with self._lock:
            self.events += 1
            for p in pages:
                self._page(p).publishing += 1
            for k in host_keys:
                self._host_pending[k] = self._host_pending.get(k, 0) + 1

    def publish_end(self, pages, host_keys) -> None:
        with self._lock:
            for p in pages:
                self._page(p).publishing -= 1
            for k in host_keys:
                self._host_pending[k] -= 1

    # ---- compute side ------------------------------------------------------------------------
    def claim(self, pages, owners) -> None:
        """A page taken without a copy (its logical page has no rows on the host yet)."""
        self.fill_start(pages, owners)
        self.fill_end(pages)

    def read_start(self, pages, owners) -> None:
        with self._lock:
            self.events += 1
            for p, owner in zip(pages, owners):
                s = self._page(p)
                if s.filling or s.owner != owner:
                    self._bad(f"read-before-ready: page {p} read as {owner} while it holds "
                              f"{s.owner} (copy in flight: {bool(s.filling)})")
                s.readers += 1

    def read_end(self, pages) -> None:
        with self._lock:
            for p in pages:
                self._page(p).readers -= 1

    def release(self, pages) -> None:
        with self._lock:
            for p in pages:
                self._page(p).held = False
