"""torch.ops.kvcompile.rope_rotate: rope for the q and k heads of a step and the Hadamard
rotations of quantized KV (kvcompile.kv.rotation), as one op.

x [T, H, D]: heads < n_rope get rope on their first R dims (cos, sin [T, R] from
layers.rope_rows) and then @ rot_a; the other heads @ rot_b; a rotation left None is the
identity. Returns a new [T, H, D] in x's dtype (fp32 math, one rounding). With n_rope = 0 it
is a rotation alone. (The attention output's rotation back is span_attention's `out_rot`.)

A rotation must be c * S, c = rot[0, 0] > 0, S a sign matrix (entries -1, 0, 1), as
kvcompile.kv.rotation makes them: the CUDA kernel multiplies by S exactly and scales by c
(tests/test_kernels_rows.py checks every rotation kv_rotation can make). The CPU reference
multiplies by rot itself.
"""
from __future__ import annotations

from typing import Optional

import torch

from kvcompile.errors import OpInputError
from kvcompile.ops.cast import TL_DTYPES
from kvcompile.ops.rope_rotate.naive import rope_rotate_naive
from kvcompile.ops.rope_rotate.triton_kernel import rope_rotate_triton


def check_rope_rotate_args(x, cos, sin, n_rope, rot_a, rot_b):
    if x.dim() != 3 or x.dtype not in TL_DTYPES:
        raise OpInputError(f"rope_rotate needs x [T, H, D] in f32, f16 or bf16; got "
                           f"{tuple(x.shape)} {x.dtype}")
    t, h, d = x.shape
    if not 0 <= n_rope <= h:
        raise OpInputError(f"n_rope must lie in 0..{h} (the heads of x); got {n_rope}")
    if n_rope and (cos.dim() != 2 or cos.shape != sin.shape or cos.shape[0] != t
                   or cos.shape[1] > d or cos.shape[1] % 2):
        raise OpInputError(f"cos and sin must be [T={t}, R] with R even and <= D={d}; got "
                           f"{tuple(cos.shape)} and {tuple(sin.shape)}")
    for name, rot in (("rot_a", rot_a), ("rot_b", rot_b)):
        if rot is not None and rot.shape != (d, d):
            raise OpInputError(f"{name} must be [D, D] = [{d}, {d}], got {tuple(rot.shape)}")


@torch.library.triton_op("kvcompile::rope_rotate", mutates_args=())
def rope_rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, neox: bool,
                n_rope: int, rot_a: Optional[torch.Tensor],
                rot_b: Optional[torch.Tensor]) -> torch.Tensor:
    check_rope_rotate_args(x, cos, sin, n_rope, rot_a, rot_b)
    if x.device.type == "cuda":
        return rope_rotate_triton(x, cos, sin, neox, n_rope, rot_a, rot_b)
    return rope_rotate_naive(x, cos, sin, neox, n_rope, rot_a, rot_b)   # plain torch ops
