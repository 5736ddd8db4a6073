"""How much host memory the machine has, and the check a store makes before it allocates
its history there."""
from __future__ import annotations

import os

from kvcompile.errors import ArenaError


def host_memory_bytes() -> int:
    """Physical memory of this machine (0 when the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def available_host_bytes() -> int:
    """Memory the OS could give now without swapping (Linux's MemAvailable; else the
    physical memory)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return host_memory_bytes()


def check_host_bytes(nbytes: int, pinned: bool) -> None:
    """KV history that cannot fit in host memory fails now, with what to change, instead of
    swapping or dying part way through allocating it."""
    have = host_memory_bytes()
    if have and nbytes > have:
        kind = "pinned host memory" if pinned else "host memory"
        raise ArenaError(f"the KV history needs {nbytes / 2**30:.1f} GiB of {kind}; this "
                         f"machine has {have / 2**30:.1f} GiB; lower --ctx-size or use a "
                         f"smaller KV type (--cache-type-k/-v q8_0)")
