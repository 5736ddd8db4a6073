"""Small helpers the passes share: finding kvcompile ops, layers and shapes in a graph."""
from __future__ import annotations

import re
from typing import Sequence

import torch
from torch import fx

from kvcompile.passes.pipeline import op_name

_BLOCK = re.compile(r"(?:^|\.)(?:blocks|layers)\.(\d+)(?:\.|$)")


def is_op(node: fx.Node, name: str) -> bool:
    return node.op == "call_function" and op_name(node.target) == f"kvcompile.{name}"


def nodes_of(gm: fx.GraphModule, name: str) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if is_op(n, name)]


def layer_of(node: fx.Node, ordinal: int) -> int:
    """The model layer an op belongs to: `node.meta["kvcompile_layer"]` if set, else the
    innermost `blocks.N` of dynamo's nn_module_stack, else its ordinal among its kind."""
    if "kvcompile_layer" in node.meta:
        return int(node.meta["kvcompile_layer"])
    stack = node.meta.get("nn_module_stack") or {}
    for path, _ in reversed(list(stack.values())):
        m = list(_BLOCK.finditer(str(path)))
        if m:
            return int(m[-1].group(1))
    return ordinal


_REQUIRED = object()


def arg(node: fx.Node, index: int, name: str, default=_REQUIRED):
    """A call's argument by keyword or position; `default` for an optional one the call
    left out."""
    if name in node.kwargs:
        return node.kwargs[name]
    if index < len(node.args) or default is _REQUIRED:
        return node.args[index]
    return default


def fake_value(node, gm: fx.GraphModule, example_inputs: Sequence):
    """The (fake or example) tensor a node produces: dynamo's example_value / aot's val; for
    hand-built graphs without metadata, propagate fake tensors from the example inputs once."""
    if not isinstance(node, fx.Node):
        return node
    for key in ("val", "example_value", "tensor_meta"):
        if key in node.meta:
            return node.meta[key]
    if not gm.meta.get("kvcompile_fake_propagated"):
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx.passes.fake_tensor_prop import FakeTensorProp
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        fakes = [mode.from_tensor(t) if isinstance(t, torch.Tensor) else t
                 for t in example_inputs]
        FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*fakes)
        gm.meta["kvcompile_fake_propagated"] = True
        return node.meta.get("val")
    return None
