"""lower_ring_ops: a streamed forward's ring ops become the runtime's page movement."""
from __future__ import annotations

import weakref
from typing import Protocol, Sequence

import torch
from torch import fx
from torch.fx.node import has_side_effect

from kvcompile.passes.graph_util import arg, nodes_of
from kvcompile.passes.pipeline import PassError


class _Runtime(torch.nn.Module):
    """The object whose `acquire_pages(layer)` / `release_pages(layer)` move a streamed
    layer's pages (the KV store), held by the graph as an attribute, weakly: torch.compile
    keeps every backend it has seen (and so this graph) for the life of the process, which
    must not keep a dropped Engine's arena and pinned history alive."""

    def __init__(self, runtime):
        super().__init__()
        self._runtime = weakref.ref(runtime)

    @property
    def runtime(self):
        runtime = self._runtime()
        if runtime is None:
            raise PassError("the KV store of this traced forward is gone (its Engine was "
                            "closed)")
        return runtime


def acquire_pages(holder: _Runtime, token, table, layer: int):
    """A lowered ring_acquire: the layer's pages placed (fills issued ahead, this layer's
    waited for), its page table written; returns (token, the table the attention reads).
    The token is None: node order orders the lowered calls."""
    return token, holder.runtime.acquire_pages(layer)


def release_pages(holder: _Runtime, token, attn_out, layer: int):
    """A lowered ring_release: the layer's ring slots consumed, its written rows published."""
    holder.runtime.release_pages(layer)
    return token


class PageRuntime(Protocol):
    """What the lowered ring ops call: the streamed KV store."""
    def acquire_pages(self, layer: int) -> torch.Tensor: ...
    def release_pages(self, layer: int) -> None: ...


has_side_effect(acquire_pages)
has_side_effect(release_pages)


class LowerRingOps:
    """Lower ring_acquire / ring_release to the streaming runtime's page movement: each
    becomes a call of `runtime.acquire_pages(layer)` / `runtime.release_pages(layer)`.

    The graph is then executed node by node (the "graph" lowering), so the copies, fences
    and page-table writes happen exactly where the ops stand; a CUDA graph captured over the
    forward holds them. The ops must sit at their own layer (distance 0): the runtime's
    pool keeps its prefetch ahead by itself, and an acquire releases the layer before it.
    Without this pass the ops are the CPU reference's ordering tokens, and a streamed
    forward would read pages nobody placed, so a pipeline that needs it marks it required.
    """

    name = "lower_ring_ops"

    def __init__(self, runtime: PageRuntime):
        self._runtime = weakref.ref(runtime)      # (held weakly: see _Runtime)

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence) -> fx.GraphModule:
        acquires, releases = nodes_of(gm, "ring_acquire"), nodes_of(gm, "ring_release")
        if not acquires:
            raise PassError("lower_ring_ops found no ring ops: a streamed forward needs "
                            "place_ring_ops before it (is it disabled?)")
        g = gm.graph
        runtime = self._runtime()
        if runtime is None:
            raise PassError("lower_ring_ops: the KV store this pipeline was made for is gone")
        gm.add_submodule("kv_ring", _Runtime(runtime))
        first_compute = next(n for n in g.nodes if n.op != "placeholder")
        with g.inserting_before(first_compute):
            holder = g.get_attr("kv_ring")
        for n in acquires:
            table = arg(n, 1, "page_table")
            layer, distance = arg(n, 2, "layer"), arg(n, 3, "distance")
            if distance != 0:
                raise PassError(f"ring_acquire of layer {layer} sits {distance} attention(s) "
                                f"ahead; the streaming runtime prefetches by itself and needs "
                                f"each acquire at its layer (PlaceRingOps(distance=0))")
            n.target, n.args, n.kwargs = acquire_pages, (holder, None, table, layer), {}
        for n in releases:
            out, layer = arg(n, 1, "attn_out"), arg(n, 2, "layer")
            n.target, n.args, n.kwargs = release_pages, (holder, None, out, layer), {}
        # Node order is execution order now: the ordering token (a tensor made every
        # forward) and its getitems go.
        for n in acquires:
            for u in list(n.users):
                if u.args[1] == 0 and not u.users:
                    g.erase_node(u)
        for n in list(g.nodes):
            if n.meta.get("kvcompile_ring_token") and not n.users:
                g.erase_node(n)
        gm.recompile()
        return gm
