"""The arena: one fixed device allocation carved into named regions.

Regions are (offset, size) byte ranges of a single uint8 buffer; views are slices of it,
never copies. The region map only changes through a transaction (begin / reserve / commit):
regions whose size is unchanged keep their offset, the others are placed first-fit in the
gaps. Commit refuses to move, resize or drop a region that is still leased, and waits for
the completion fence the last lease left behind (a lease alone does not prove the device
stopped using the memory). Abort leaves the old map untouched.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvcompile.errors import ArenaError
from kvcompile.kv.fences import DONE, AllOf, Fence

ALIGN = 256  # bytes; every region starts aligned so typed views (fp16, f32, int32) are legal
MIB = 1 << 20


def align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def mib_for(nbytes: int) -> int:
    """Smallest whole number of MiB that holds nbytes."""
    return max(1, math.ceil(nbytes / MIB))


@dataclass(frozen=True)
class Region:
    name: str
    offset: int
    size: int
    generation: int   # bumps whenever the region is (re)placed; views of older ones are stale


class Lease:
    """Keeps a region in place. Release it with the fence of the device's last use."""

    def __init__(self, arena: "Arena", region: Region):
        self.arena, self.region = arena, region
        self.active = True

    def view(self, offset: int = 0, size: int | None = None) -> torch.Tensor:
        if not self.active:
            raise ArenaError(f"lease on region {self.region.name!r} was released; take a new one")
        return self.arena._slice(self.region, offset, size)

    def release(self, fence: Fence = DONE) -> None:
        if not self.active:
            raise ArenaError(f"lease on region {self.region.name!r} released twice")
        self.active = False
        self.arena._release(self.region.name, fence)


class Transaction:
    """A proposed region map; nothing changes in the arena until commit()."""

    def __init__(self, arena: "Arena"):
        self.arena = arena
        self.sizes = {name: r.size for name, r in arena._regions.items()}
        self.open = True

    def reserve(self, name: str, nbytes: int) -> "Transaction":
        self._check_open()
        if nbytes < 0:
            raise ArenaError(f"region {name!r}: size must be >= 0, got {nbytes}")
        self.sizes[name] = int(nbytes)
        return self

    def drop(self, name: str) -> "Transaction":
        self._check_open()
        self.sizes.pop(name, None)
        return self

    def plan(self) -> dict[str, tuple[int, int]]:
        """name -> (offset, size); raises ArenaError naming the smallest arena that works."""
        old = self.arena._regions
        need = sum(align(s) for s in self.sizes.values())
        if need > self.arena.nbytes:
            raise ArenaError(
                f"the arena of {self.arena.nbytes / MIB:g} MiB cannot hold "
                f"{_describe(self.sizes)}; use an arena of at least {mib_for(need)} MiB "
                f"(--kv-stream-arena-mib {mib_for(need)})")
        placed = {n: (old[n].offset, s) for n, s in self.sizes.items()
                  if n in old and old[n].size == s}
        for name in sorted((n for n in self.sizes if n not in placed),
                           key=lambda n: -self.sizes[n]):
            placed[name] = (self._first_fit(placed, align(self.sizes[name])), self.sizes[name])
        return placed

    def commit(self) -> None:
        self._check_open()
        plan = self.plan()
        a = self.arena
        moved = [n for n, r in a._regions.items() if plan.get(n) != (r.offset, r.size)]
        leased = [n for n in moved if a._leases.get(n, 0)]
        if leased:
            raise ArenaError(f"cannot move or drop regions {leased}: still leased; release "
                             f"their leases (with a completion fence) before changing the layout")
        for n in moved:
            a._last_use.pop(n, DONE).wait()   # the device must have stopped using them
        a._regions = {n: (a._regions[n] if n not in moved and n in a._regions
                          else Region(n, off, size, a._next_generation()))
                      for n, (off, size) in plan.items()}
        a.epoch += 1
        self.open = False

    def abort(self) -> None:
        self.open = False

    def _first_fit(self, placed, size: int) -> int:
        spans = sorted((off, align(s)) for off, s in placed.values())
        cursor = 0
        for off, s in spans:
            if off - cursor >= size:
                return cursor
            cursor = max(cursor, off + s)
        if self.arena.nbytes - cursor >= size:
            return cursor
        # Fragmented: the total fits (checked in plan) but the kept regions block it.
        raise ArenaError(
            f"the arena of {self.arena.nbytes / MIB:g} MiB is fragmented by regions that keep "
            f"their place; drop and re-reserve them in one transaction, or use an arena of at "
            f"least {mib_for(sum(s for _, s in spans) + size)} MiB")

    def _check_open(self):
        if not self.open:
            raise ArenaError("this arena transaction was already committed or aborted")

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if self.open:
            self.commit() if exc_type is None else self.abort()
        return False


class Arena:
    def __init__(self, nbytes: int, buffer: torch.Tensor | None = None, device="cpu"):
        if nbytes <= 0:
            raise ArenaError(f"the arena needs a positive size, got {nbytes} bytes")
        self.nbytes = int(nbytes)
        self.buffer = (torch.empty(self.nbytes, dtype=torch.uint8, device=device)
                       if buffer is None else buffer)
        if self.buffer.dtype != torch.uint8 or self.buffer.numel() != self.nbytes:
            raise ArenaError("the arena buffer must be a flat uint8 tensor of nbytes")
        self._regions: dict[str, Region] = {}
        self._leases: dict[str, int] = {}
        self._last_use: dict[str, Fence] = {}
        self._generation = 0
        self.epoch = 0

    @classmethod
    def of_mib(cls, mib: float, device="cpu") -> "Arena":
        return cls(int(mib * MIB), device=device)

    def begin(self) -> Transaction:
        return Transaction(self)

    def region(self, name: str) -> Region:
        try:
            return self._regions[name]
        except KeyError:
            raise ArenaError(f"the arena has no region {name!r}; regions: "
                             f"{sorted(self._regions)}") from None

    def regions(self) -> dict[str, Region]:
        return dict(self._regions)

    def view(self, name: str, offset: int = 0, size: int | None = None) -> torch.Tensor:
        return self._slice(self.region(name), offset, size)

    def lease(self, name: str) -> Lease:
        r = self.region(name)
        self._leases[name] = self._leases.get(name, 0) + 1
        return Lease(self, r)

    def leased(self, name: str) -> bool:
        return self._leases.get(name, 0) > 0

    def is_current(self, region: Region) -> bool:
        """False for a region object from an older layout (its views must not be used)."""
        return self._regions.get(region.name) == region

    def _slice(self, r: Region, offset: int, size: int | None) -> torch.Tensor:
        if not self.is_current(r):
            raise ArenaError(f"region {r.name!r} was moved by a newer layout; rebind its views")
        size = r.size - offset if size is None else size
        if offset < 0 or size < 0 or offset + size > r.size:
            raise ArenaError(f"view [{offset}, {offset + size}) is outside region {r.name!r} "
                             f"of {r.size} bytes")
        return self.buffer[r.offset + offset: r.offset + offset + size]

    def _release(self, name: str, fence: Fence) -> None:
        self._leases[name] -= 1
        prev = self._last_use.get(name)
        # Keep every outstanding fence: the region is free once all its users completed.
        self._last_use[name] = fence if prev is None or prev.query() else AllOf((prev, fence))

    def _next_generation(self) -> int:
        self._generation += 1
        return self._generation


def _describe(sizes: dict[str, int]) -> str:
    return ", ".join(f"{n} ({s / MIB:.2f} MiB)" for n, s in sizes.items()) or "nothing"
