"""Custom kvcompile ops, one folder each: schema + fake in op.py, fp32 reference in naive.py.

Importing this package registers torch.ops.kvcompile.* .
"""
from kvcompile.ops import (gemv, kv_write, qlinear, ring, rms_norm, rope_rotate,  # noqa: F401
                           silu_mul, span_attention)
