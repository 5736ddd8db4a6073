"""place_ring_ops: make streamed layers' page movement explicit ops in the graph."""
from __future__ import annotations

import operator
from typing import Iterable, Sequence

import torch
from torch import fx

import kvcompile.ops.ring  # noqa: F401  (registers ring_acquire / ring_release)
from kvcompile.passes.graph_util import arg, fake_value, layer_of, nodes_of
from kvcompile.passes.pipeline import PassError


class PlaceRingOps:
    """Around each span_attention that reads a streamed layer, insert
    `ring_acquire(token, page_table, layer, distance)` `distance` attention ops earlier and
    `ring_release(token, attn_out, layer)` right after the attention.

    Why: today the streaming runtime moves a layer's pages in a Python hook
    (`cache.layer(i)`), which breaks graphs and cannot be captured. As ops, the copies for
    layer i are issued while layers i-distance .. i-1 compute (prefetch), and the graph
    itself says when a ring slot is free again (release), so one captured program holds the
    whole forward. The attention reads the page table *returned* by its acquire, and one
    token runs through every ring op in graph order, so the order is a data dependency
    that no scheduler may reorder and DCE may not drop (the ops are side-effectful).

    A `kv_write` of the same layer that maps its rows through the same page table (its
    optional `page_table` argument, as the models pass it) is rewired to the acquired table
    as well, and the acquire goes before it: the layer's new rows land where its attention
    reads them (in a ring slot when the layer streams), not through the table as it was
    before the layer's pages were placed.

    `streamed`: the model layers whose pages stream (None: every attention layer).
    A layer is identified by `node.meta["kvcompile_layer"]`, else dynamo's module path
    (`blocks.N`), else the ordinal of the attention in the graph.
    """

    name = "place_ring_ops"

    def __init__(self, distance: int = 1, streamed: Iterable[int] | None = None):
        if not isinstance(distance, int) or isinstance(distance, bool) or distance < 0:
            raise PassError(f"prefetch distance must be an int >= 0 (attention ops ahead), "
                            f"got {distance!r}")
        self.distance = distance
        try:
            self.streamed = None if streamed is None else frozenset(int(i) for i in streamed)
        except (TypeError, ValueError):
            raise PassError(f"streamed must be layer indices (ints) or None, got "
                            f"{streamed!r}") from None

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence) -> fx.GraphModule:
        g = gm.graph
        if nodes_of(gm, "ring_acquire") or nodes_of(gm, "ring_release"):
            raise PassError("the graph already has ring ops; place_ring_ops must run once")
        attns = nodes_of(gm, "span_attention")
        layers = [layer_of(n, i) for i, n in enumerate(attns)]
        writes = nodes_of(gm, "kv_write")
        write_layers = [layer_of(n, i) for i, n in enumerate(writes)]
        todo = [k for k, lay in enumerate(layers)
                if self.streamed is None or lay in self.streamed]
        if not todo:
            return gm
        order = {n: i for i, n in enumerate(g.nodes)}
        first_table = arg(attns[todo[0]], 3, "page_table")
        val = fake_value(first_table, gm, example_inputs)
        device = val.device if isinstance(val, torch.Tensor) else torch.device("cpu")
        first_compute = next(n for n in g.nodes if n.op != "placeholder")
        with g.inserting_before(first_compute):
            token = g.call_function(torch.zeros, (1,),
                                    {"dtype": torch.int64, "device": device})
        token.meta["kvcompile_ring_token"] = True

        ring_nodes = {}                       # node -> its token output
        for k in todo:
            attn, layer = attns[k], layers[k]
            table = arg(attn, 3, "page_table")
            same = [w for w, wl in zip(writes, write_layers)
                    if wl == layer and arg(w, 8, "page_table", None) is table]
            # `distance` attentions ahead, and before the layer's own writes through the table
            anchor = min([attns[max(0, k - self.distance)]] + same, key=order.__getitem__)
            if isinstance(table, fx.Node) and order[table] >= order[anchor]:
                where = g.inserting_after(table)   # the table is computed late: issue then
            else:
                where = g.inserting_before(anchor)
            with where:
                acq = g.call_function(torch.ops.kvcompile.ring_acquire.default,
                                      (token, table, layer, self.distance))
                tok = g.call_function(operator.getitem, (acq, 0))
                placed = g.call_function(operator.getitem, (acq, 1))
            for n in (acq, tok, placed):
                n.meta["kvcompile_layer"] = layer
            acq.meta["kvcompile_prefetch_distance"] = self.distance
            for reader in [attn] + same:
                reader.replace_input_with(table, placed)
            with g.inserting_after(attn):
                rel = g.call_function(torch.ops.kvcompile.ring_release.default,
                                      (token, attn, layer))
            rel.meta["kvcompile_layer"] = layer
            ring_nodes[acq], ring_nodes[rel] = tok, rel

        cur = token                            # thread the token in final graph order
        for n in g.nodes:
            if n in ring_nodes:
                n.update_arg(0, cur)
                cur = ring_nodes[n]
        gm.recompile()
        return gm

