"""select_attention_kernel: choose the decode or prefill attention kernel per phase."""
from __future__ import annotations

from typing import Sequence

import torch
from torch import fx

from kvcompile.ops.span_attention.op import DECODE_MAX_ROWS
from kvcompile.passes.graph_util import arg, fake_value, nodes_of
from kvcompile.passes.pipeline import PassError


def select_attention_kernel(gm: fx.GraphModule, example_inputs: Sequence) -> fx.GraphModule:
    """Annotate every span_attention with the kernel its phase needs, from the query-row
    count of its fake/example `q`: <= DECODE_MAX_ROWS rows (decode, verify) -> "decode"
    (split-K flash-decoding), more -> "prefill" (causal flash attention); a symbolic row
    count (a dynamic-shape graph serving both phases) -> "by_shape" (the op dispatches at
    run time, as it does eagerly).

    Why: a phase program is captured per shape bucket, so the choice the op otherwise makes
    on every call can be fixed at compile time; the CUDA lowering reads
    `node.meta["kvcompile_kernel"]` (and `gm.meta["kvcompile_phase"]` names the program).
    The threshold is the op's own, so the annotation never changes which kernel runs.
    """
    kinds = []
    for n in nodes_of(gm, "span_attention"):
        q = fake_value(arg(n, 0, "q"), gm, example_inputs)
        if not isinstance(q, torch.Tensor) or q.dim() != 3:
            raise PassError(f"select_attention_kernel: no [T, heads, dim] query value for "
                            f"{n.name}; trace with torch.compile or pass example inputs")
        rows = q.shape[0]
        if isinstance(rows, int):
            kind = "decode" if rows <= DECODE_MAX_ROWS else "prefill"
        else:
            kind = "by_shape"
        n.meta["kvcompile_kernel"] = kind
        n.meta["kvcompile_rows"] = rows if isinstance(rows, int) else str(rows)
        kinds.append(kind)
    gm.meta["kvcompile_phase"] = (kinds[0] if kinds and len(set(kinds)) == 1
                                  else "mixed" if kinds else "none")
    return gm
