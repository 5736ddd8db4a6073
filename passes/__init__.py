"""FX passes over traced kvcompile models, each `(gm, example_inputs) -> gm`, applied as an
ordered, named pipeline (`PassPipeline`); any pass can be disabled by name.

Not a pass: fusing KV quantization into the writes. `kv_write` already quantizes on write
(q8_0 / q4_0 codes and scales computed inside the op, one kernel on CUDA), so there is no
separate quantize node for a pass to fuse.
"""
from kvcompile.passes.checkpoint import checkpoint_hook
from kvcompile.passes.kernels import select_attention_kernel
from kvcompile.passes.lower_ring import LowerRingOps
from kvcompile.passes.lowerable import LOWERINGS, check_lowerable
from kvcompile.passes.pipeline import (DISABLE_ENV, PassError, PassPipeline, call_targets,
                                      compile_model)
from kvcompile.passes.ring import PlaceRingOps


def default_pipeline(distance: int = 1, streamed=None) -> PassPipeline:
    """The order matters: kernels are chosen before ring ops rewire the attention inputs,
    checkpoint sites are recorded on the final graph, and check_lowerable sees everything
    the other passes inserted."""
    return PassPipeline([select_attention_kernel, PlaceRingOps(distance, streamed),
                         checkpoint_hook, check_lowerable])


def streamed_pipeline(runtime) -> PassPipeline:
    """A streamed store's forward: ring ops at every attention, at its own layer (the store
    prefetches ahead by itself), lowered to `runtime`'s page movement (the KV store's
    acquire_pages / release_pages, held weakly). Neither ring pass can be disabled."""
    return PassPipeline([select_attention_kernel, PlaceRingOps(0), LowerRingOps(runtime),
                         checkpoint_hook, check_lowerable],
                        required=("place_ring_ops", "lower_ring_ops"))


__all__ = ["PassPipeline", "PassError", "PlaceRingOps", "LowerRingOps",
           "select_attention_kernel", "checkpoint_hook", "check_lowerable",
           "default_pipeline", "streamed_pipeline", "LOWERINGS",
           "DISABLE_ENV", "call_targets", "compile_model"]
