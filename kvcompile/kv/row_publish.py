"""Publish a forward's rows, not its pages: the bytes of the positions a captured decode step
wrote, copied from one layer's K and V arena pages into its host pages.

A captured step cannot choose at replay time which page a copy reads, so copying pages
means copying every page it might write, each copy a memcpy node of the graph and queued on
the copy stream ahead of the next layers' fills (docs/streaming.md, "Fixed forwards"). Here
the step's own positions and page table (device tensors) pick the bytes: on CUDA one Triton
kernel per layer on the compute stream writes the pinned host pages through unified
addressing; on the CPU the same indexing in torch (`publish_rows_reference`, also the
kernel's oracle). A position's bytes in a page come from `ops.kv_format.row_byte_offsets`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcompile.ops import kv_format as F

BLOCK = 1024        # bytes of a row one program copies


@dataclass(frozen=True)
class RowMap:
    """Where a position's bytes lie in a page of one KV type and role: byte i of the row is
    at base[i] + position_in_page * stride[i]."""
    base: torch.Tensor
    stride: torch.Tensor
    page_size: int

    @classmethod
    def of(cls, t, n_kv_heads: int, page_size: int, head_dim: int, role: str, device):
        base, stride = F.row_byte_offsets(F.kv_type(t), n_kv_heads, page_size, head_dim,
                                          role=role)
        return cls(base.to(device), stride.to(device), page_size)

    @property
    def row_bytes(self) -> int:
        return self.base.numel()


def publish_rows_reference(pools, hosts, table: torch.Tensor, positions: torch.Tensor,
                           maps) -> None:
    """For K and V (pools, hosts, maps: pairs) and every p in positions: host[page of p] <-
    the bytes of p from pool[table[page of p]] (pages are rows of uint8 [pages, bytes],
    stride(0) apart)."""
    pos = positions.to(torch.long)
    for pool, host, m in zip(pools, hosts, maps):
        lp, within = pos // m.page_size, pos % m.page_size
        phys = table[lp].to(torch.long)
        idx = m.base[None, :] + within[:, None] * m.stride[None, :]
        host[lp[:, None], idx] = pool[phys[:, None], idx]


def publish_rows_cuda(pools, hosts, table: torch.Tensor, positions: torch.Tensor,
                      maps) -> None:
    """The same by one Triton kernel on the current stream; hosts are pinned memory."""
    from kvcompile.kv.row_publish_kernel import launch
    for pool, host in zip(pools, hosts):
        if not (F.dense_pages(pool) and F.dense_pages(host)):
            raise ValueError("row publishing needs rows of pages with a dense last dim")
        if pool.shape[1] != host.shape[1]:
            raise ValueError(f"pool pages of {pool.shape[1]} bytes, host pages of "
                             f"{host.shape[1]}")
    if len({m.page_size for m in maps}) != 1:
        raise ValueError("K and V pages must hold the same positions")
    launch(pools, hosts, [(m.base, m.stride) for m in maps], table, positions,
           maps[0].page_size, BLOCK)
