"""An ordered, named pipeline of FX passes, each `(gm, example_inputs) -> gm`.

Any pass can be switched off by name for debugging: `run(gm, inputs, disable={"name"})`
or the environment variable `KVCOMPILE_DISABLE_PASSES=a,b`. A name that is not in the
pipeline is an error (a typo must not silently leave a pass on). The names of the passes
that ran are recorded in `gm.meta["kvcompile_passes"]`.
"""
from __future__ import annotations

from typing import Callable, Iterable, Sequence

import torch
from torch import fx

from kvcompile.errors import KvcompileError
from kvcompile.ops import debug

DISABLE_ENV = debug.DISABLE_PASSES_ENV
LOWERS = ("graph", "inductor")

PassFn = Callable[[fx.GraphModule, Sequence], fx.GraphModule]


class PassError(KvcompileError):
    """A compiler pass cannot handle the graph (or the pipeline was configured wrongly)."""


def pass_name(p: PassFn) -> str:
    return getattr(p, "name", None) or getattr(p, "__name__", None) or type(p).__name__


class PassPipeline:
    """Passes applied in the order given; names must be unique."""

    def __init__(self, passes: Iterable[PassFn], required: Iterable[str] = ()):
        """required: names that may not be disabled (without them the program is wrong,
        not only slower)."""
        self.passes = list(passes)
        self.names = [pass_name(p) for p in self.passes]
        dup = sorted({n for n in self.names if self.names.count(n) > 1})
        if dup:
            raise PassError(f"pass names must be unique in a pipeline; repeated: {dup}")
        self.required = frozenset(required)
        if not self.required <= set(self.names):
            raise PassError(f"required passes {sorted(self.required - set(self.names))} are "
                            f"not in the pipeline {self.names}")

    def _disabled(self, disable: Iterable[str] | None) -> set[str]:
        names = {disable} if isinstance(disable, str) else set(disable or ())
        names |= debug.DISABLE_PASSES
        unknown = sorted(names - set(self.names))
        if unknown:
            raise PassError(f"cannot disable unknown pass(es) {unknown} (from the disable "
                            f"argument or {DISABLE_ENV}); the pipeline's passes are "
                            f"{self.names}")
        kept = sorted(names & self.required)
        if kept:
            raise PassError(f"pass(es) {kept} cannot be disabled in this pipeline: its "
                            f"forward is wrong without them")
        return names

    def run(self, gm: fx.GraphModule, example_inputs: Sequence,
            disable: Iterable[str] | None = None) -> fx.GraphModule:
        off = self._disabled(disable)
        ran = []
        for name, p in zip(self.names, self.passes):
            if name in off:
                continue
            out = p(gm, example_inputs)
            if not isinstance(out, fx.GraphModule):
                raise PassError(f"pass {name!r} returned {type(out).__name__}, not a "
                                f"GraphModule (a pass is (gm, example_inputs) -> gm)")
            gm = out
            ran.append(name)
        gm.graph.lint()
        gm.recompile()
        gm.meta["kvcompile_passes"] = ran
        return gm

    __call__ = run

    def backend(self, disable: Iterable[str] | None = None, lower: str = "graph"):
        """A torch.compile backend: run the pipeline, then
        - lower="graph": execute the resulting graph as is (op by op, the eager kernels: the
          same bits as the eager model, CUDA-graph capturable);
        - lower="inductor": hand it to inductor, which fuses the torch ops around the
          kvcompile ops into Triton kernels (the kvcompile ops keep their own kernels).
          Equal to eager within float rounding, not bitwise (fused reductions and FMAs
          round differently); slower than "graph" on the 8B decode (docs/findings.md)."""
        if lower not in LOWERS:
            raise PassError(f"unknown lowering {lower!r}; use one of {LOWERS}")

        def compile_fn(gm: fx.GraphModule, example_inputs):
            gm = self.run(gm, example_inputs, disable=disable)
            if lower == "graph":
                return gm.forward
            from torch._inductor.compile_fx import compile_fx
            return compile_fx(gm, example_inputs)
        return compile_fn


def call_targets(gm: fx.GraphModule) -> list[str]:
    """Names of the call_function targets in graph order (for tests and debugging)."""
    return [op_name(n.target) for n in gm.graph.nodes if n.op == "call_function"]


def op_name(target) -> str:
    """'kvcompile.span_attention' for the packet and for any of its overloads."""
    if isinstance(target, torch._ops.OpOverload):
        target = target.overloadpacket
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name.replace("::", ".")
    return getattr(target, "__name__", str(target))


def compile_model(model, pipeline: PassPipeline, disable: Iterable[str] | None = None,
                  lower: str = "graph", **compile_kwargs):
    """`torch.compile(model, fullgraph=True)` through `pipeline`, then lowered (`backend`).
    A pass's KvcompileError reaches the caller as itself, not wrapped in dynamo's
    BackendCompilerFailed, so bad input reads like every other kvcompile error."""
    import functools

    from torch._dynamo.exc import BackendCompilerFailed

    compiled = torch.compile(model, fullgraph=True, backend=pipeline.backend(disable, lower),
                             **compile_kwargs)

    @functools.wraps(compiled)
    def run(*args, **kwargs):
        try:
            return compiled(*args, **kwargs)
        except BackendCompilerFailed as e:
            inner = getattr(e, "inner_exception", None)
            if isinstance(inner, KvcompileError):
                raise inner from None
            raise
    return run
