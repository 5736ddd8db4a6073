"""How a KV store's arena is cut into KV pages: bytes of a layer's page, how many pages fit
an arena, the smallest arena that serves a context.

A physical page holds a K page and then a V page (`PagePair`): a run of pages, in the arena
and in host history alike, is one contiguous block, so streaming it is one copy (half the
copies of separate K and V pools, each twice as large). The K and V pools the kernels see
are strided views of it: rows of page_bytes, `stride` bytes apart."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcompile.errors import ArenaError
from kvcompile.ops import kv_format as F
from kvcompile.kv.arena import ALIGN, align


def check_arena_mib(arena_mib) -> None:
    """0 / None (everything on the device), "auto" (what the memory budget leaves) or a
    positive size in MiB; ArenaError otherwise. The one check of an arena size."""
    if arena_mib == "auto" or arena_mib is None:
        return
    if not isinstance(arena_mib, (int, float)) or isinstance(arena_mib, bool) \
            or not arena_mib >= 0:
        raise ArenaError(f"kv_stream_arena_mib (--kv-stream-arena-mib) must be 0 (everything "
                         f"on the device), auto (what --gpu-memory-gib leaves) or a positive "
                         f"size in MiB, got {arena_mib!r}")


def min_arena_bytes(config, max_tokens: int, k_type="f32", v_type="f32", page_size=256,
                    workspace_bytes: int = 0) -> int:
    """Smallest arena that serves max_tokens: the ring must hold one layer's whole context."""
    pair = PagePair(*page_bytes(config, k_type, v_type, page_size))
    return align(workspace_bytes) + align(-(-max_tokens // page_size) * pair.stride)


def page_bytes(config, k_type, v_type, page_size) -> tuple[int, int]:
    h, d = config.n_kv_heads, config.head_dim
    return (F.page_bytes(F.kv_type(k_type), page_size, h, d),
            F.page_bytes(F.kv_type(v_type), page_size, h, d))


@dataclass(frozen=True)
class PagePair:
    """A K page of kb bytes at offset 0 and a V page of vb bytes at v_offset of a physical
    page of `stride` bytes (both 16-byte aligned: typed views and TMA descriptors of either
    pool are legal)."""
    kb: int
    vb: int

    @property
    def v_offset(self) -> int:
        return align16(self.kb)

    @property
    def stride(self) -> int:
        return self.v_offset + align16(self.vb)

    def fit(self, nbytes: int) -> int:
        """Physical pages whose region, rounded up to the arena's alignment, fits nbytes."""
        return max(nbytes, 0) // ALIGN * ALIGN // self.stride

    def views(self, pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """uint8 [N, stride] -> (K pool [N, kb], V pool [N, vb]), views of `pages`."""
        assert pages.dim() == 2 and pages.shape[1] == self.stride and pages.stride(1) == 1
        return pages[:, :self.kb], pages[:, self.v_offset:self.v_offset + self.vb]


def align16(n: int) -> int:
    return -(-n // 16) * 16
