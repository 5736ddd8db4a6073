"""The fixed layout of a captured decode step over a streamed cache.

A decode step's device work depends on the split (resident pages per layer) and on how many
logical pages it reads -- not on the position within them, once the pool works in fixed
mode (pool.py: ring slots from slot 0, every streamed page filled, the step's rows published
by a kernel that reads its positions). So one capture serves every position whose page lies
in [first, pages): a layout. A step past it, or a new split, needs another layout (and its
capture). A layout may reach `slack` pages past the step that made it, so that decode
crosses that many page boundaries per capture, at the price of filling those pages every
step (junk that attention never reads): the default is none.

`ahead`: how many of the step's first layers were filled before it began (the last replay
of the same layout filled them for the next step: pool.fill_ahead); the step's program
skips those fills, so a layout has a program for each value it is replayed with.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepLayout:
    resident: int     # resident pages per layer (the split)
    first: int        # first logical page the steps write (published from here on)
    pages: int        # logical pages per layer every step reads, fills and tables
    layers: tuple     # the KV layers a step acquires, in order
    ahead: int = 0    # first layers whose fills were issued before the step (module doc)

    def serves(self, resident: int, first: int, pages: int, layers: tuple) -> bool:
        """Can a step over `pages` pages that writes from page `first` run in this one?"""
        return (resident == self.resident and layers == self.layers
                and self.first <= first and pages <= self.pages)

    @classmethod
    def around(cls, resident: int, first: int, pages: int, layers: tuple, room: int,
               slack: int = 0) -> "StepLayout":
        """A new layout for a step over `pages` pages, reaching `slack` pages further but
        at most `room` (the cache's capacity, or what the split's ring can stream)."""
        return cls(resident, first, max(pages, min(room, pages + slack)), tuple(layers))
