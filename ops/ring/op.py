"""torch.ops.kvcompile.ring_acquire / ring_release: where a streamed layer's pages enter
and leave the ring, as ops in the graph instead of a Python hook (`cache.layer(i)`).

Both ops thread a **token**: a 1-element int64 tensor that each op consumes and returns
anew. The token chain makes the order of every acquire and release an explicit data
dependency in the FX graph, and both ops are registered as side-effectful so dead code
elimination never drops them (their tokens are not graph outputs).

ring_acquire(token, page_table, layer, distance) -> (token, page_table)
    Placed by `kvcompile.passes.place_ring_ops` `distance` attention ops before the
    attention of `layer`. Returns the page table the attention must read: the attention's
    `page_table` argument is rewired to this output, so the attention depends on its
    acquire by data, not only by node order.
    CPU reference: no copies (the CPU backend's pages are already where the runtime put
    them); returns a fresh token and an identical copy of `page_table`, so results are
    bitwise those of the graph without ring ops.
    Lowering (`kvcompile.passes.lower_ring_ops`, CPU and CUDA alike): over a streaming
    cache the op becomes a call of the runtime's `acquire_pages(layer)`: on CUDA the fork
    to the copy stream after the consumed fences of the ring slots it takes, the layer's
    grouped host->device copies into them, the ready event, the page table written in
    place, and the compute stream's wait on the ready event; a CUDA graph captured over the
    forward holds all of it.

ring_release(token, attn_out, layer) -> token
    Placed right after the attention of `layer`; consuming `attn_out` orders it after that
    attention. CPU reference: returns a fresh token.
    Lowering: the runtime's `release_pages(layer)`: the compute event that marks the
    layer's ring slots consumed (the fence later copies into them wait on), and the
    device->host publish of the rows this forward wrote (host history stays authoritative).
"""
from __future__ import annotations

import torch
from torch.fx.node import has_side_effect


@torch.library.custom_op("kvcompile::ring_acquire", mutates_args=())
def ring_acquire(token: torch.Tensor, page_table: torch.Tensor, layer: int,
                 distance: int) -> tuple[torch.Tensor, torch.Tensor]:
    """CPU reference: ordering only (see the module docstring for the CUDA lowering).
    A forward's chain starts from a zero int64 [1] token that place_ring_ops creates."""
    return token + 1, page_table.clone()


@ring_acquire.register_fake
def _(token, page_table, layer, distance):
    return torch.empty_like(token), torch.empty_like(page_table)


@torch.library.custom_op("kvcompile::ring_release", mutates_args=())
def ring_release(token: torch.Tensor, attn_out: torch.Tensor, layer: int) -> torch.Tensor:
    """CPU reference: ordering only (see the module docstring for the CUDA lowering)."""
    return token + 1


@ring_release.register_fake
def _(token, attn_out, layer):
    return torch.empty_like(token)


for _op in (torch.ops.kvcompile.ring_acquire.default, torch.ops.kvcompile.ring_release.default):
    has_side_effect(_op)
