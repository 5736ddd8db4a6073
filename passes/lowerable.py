"""check_lowerable: every custom op left in the graph must have a lowering."""
from __future__ import annotations

from typing import Sequence

import torch
from torch import fx

from kvcompile.passes.pipeline import PassError, op_name

# kvcompile op -> where its CUDA lowering lives (the CPU runs the reference op).
LOWERINGS = {
    "kvcompile.kv_write": "ops/kv_write (triton_op: quantize-on-write kernel)",
    "kvcompile.span_attention": "ops/span_attention (triton_op: decode / prefill kernels)",
    "kvcompile.ring_acquire": "passes/lower_ring (the runtime's acquire_pages) or the "
                              "ordering-only reference over a resident cache",
    "kvcompile.ring_release": "passes/lower_ring (the runtime's release_pages) or the "
                              "ordering-only reference",
    "kvcompile.rms_norm": "ops/rms_norm (triton_op: one kernel a norm)",
    "kvcompile.add_rms_norm": "ops/rms_norm (triton_op: residual add + norm)",
    "kvcompile.rope_rotate": "ops/rope_rotate (triton_op: rope + KV Hadamard rotations)",
    "kvcompile.silu_mul": "ops/silu_mul (triton_op: SwiGLU activation)",
    "kvcompile.gemv": "ops/gemv (triton_op: weight-streaming GEMV for <= 8 rows)",
    "kvcompile.qlinear": "ops/qlinear (triton_op: products with GGUF block-format weights)",
    "kvcompile.qembedding": "ops/qlinear (triton_op: quantized embedding rows)",
    "kvcompile.gdn_recurrent": "kvcompile/models/gated_deltanet.py (fla-core's fused "
                               "recurrent kernel on CUDA)",
    "kvcompile.checkpoint_capture": "ops/checkpoint (two device copies into fixed buffers)",
}
# namespaces torch itself lowers (inductor / the eager fallback)
BUILTIN_NAMESPACES = {"aten", "prims", "higher_order", "_c10d_functional", "_dtensor"}


def check_lowerable(gm: fx.GraphModule, example_inputs: Sequence) -> fx.GraphModule:
    """Fail at compile time, with the op's name, when the graph calls a custom op nothing
    lowers (a kvcompile op without an entry in LOWERINGS, or another library's op).

    Why: otherwise the failure shows up at capture or on the device, far from its cause.
    Runs last, so ops inserted by earlier passes are checked too.
    """
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        t = n.target
        if not isinstance(t, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
            continue
        name = op_name(t)
        ns = name.split(".", 1)[0]
        if name in LOWERINGS or (ns in BUILTIN_NAMESPACES):
            continue
        raise PassError(f"the model calls {name} (graph node {n.name}), which has no kvcompile "
                        f"lowering; lowered custom ops: {sorted(LOWERINGS)}. Add a lowering "
                        f"(kvcompile.passes.lowerable.LOWERINGS) or keep the op out of the "
                        f"compiled forward")
    return gm
