"""checkpoint_hook: find and check what a speculative verify forward must be able to undo."""
from __future__ import annotations

from typing import Sequence

from torch import fx

from kvcompile.passes.graph_util import arg, layer_of, nodes_of
from kvcompile.passes.pipeline import PassError

_STATE_ROOTS = ("placeholder", "get_attr")


def _root(node):
    """Follow views/getitems back to the value they alias (best effort, for validation)."""
    seen = 0
    while isinstance(node, fx.Node) and node.op in ("call_method", "call_function") and seen < 64:
        name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
        if name not in ("view", "reshape", "__getitem__", "getitem", "select", "narrow",
                        "unflatten", "flatten"):
            break
        node, seen = node.args[0], seen + 1
    return node


def checkpoint_hook(gm: fx.GraphModule, example_inputs: Sequence) -> fx.GraphModule:
    """A verify forward must be undoable: every op that changes state living outside the
    graph is found, checked and recorded (the pass inserts nothing: a hybrid model's verify
    forward places `checkpoint_capture` itself, in each GDN layer: the state before its rows
    and the rows' recurrence inputs):

    - each kv_write -> `meta["kvcompile_checkpoint"] = {"kind": "kv_suffix", ...}`: a
      rejection truncates the KV rows it wrote (capture = its slots, or its positions and
      the page table that maps them, and the row count per layer, no bytes);
    - each checkpoint_capture -> `{"kind": "row_states"}`: what a rollback reruns the kept
      rows from (kv/recurrent_state.py);
    - each in-place method on a graph input (e.g. a recurrent state's `copy_`) ->
      `{"kind": "state_snapshot"}`: rejection restores those bytes exactly (from the
      row_states of the same forward when it has them).

    `gm.meta["kvcompile_checkpoint_sites"]` lists (node name, kind, layer). A KV pool that
    is not a graph input (made inside the graph) cannot be captured or restored: error.
    """
    sites = []
    for i, n in enumerate(nodes_of(gm, "kv_write")):
        for idx, name in ((0, "k_pool"), (1, "v_pool")):
            pool = _root(arg(n, idx, name))
            if not (isinstance(pool, fx.Node) and pool.op in _STATE_ROOTS):
                raise PassError(f"checkpoint_hook: {n.name} writes a {name} that is not a graph "
                                f"input ({pool}); a verify forward could not be undone. Pass "
                                f"the KV pools into the compiled forward")
        layer = layer_of(n, i)
        table = arg(n, 8, "page_table", None)
        n.meta["kvcompile_checkpoint"] = {"kind": "kv_suffix", "layer": layer,
                                          "slots": str(arg(n, 4, "slots")),
                                          "page_table": None if table is None else str(table)}
        sites.append((n.name, "kv_suffix", layer))
    for n in nodes_of(gm, "checkpoint_capture"):
        n.meta["kvcompile_checkpoint"] = {"kind": "row_states"}
        sites.append((n.name, "row_states", None))
    for n in gm.graph.nodes:
        if (n.op == "call_method" and n.target.endswith("_") and not n.target.startswith("_")
                and isinstance(_root(n.args[0]), fx.Node) and _root(n.args[0]).op in _STATE_ROOTS):
            n.meta["kvcompile_checkpoint"] = {"kind": "state_snapshot",
                                              "state": _root(n.args[0]).name}
            sites.append((n.name, "state_snapshot", None))
    gm.meta["kvcompile_checkpoint_sites"] = sites
    return gm
