"""Custom kvcompile ops, one folder each: schema + fake in op.py, fp32 reference in naive.py.

Importing this package registers torch.ops.kvcompile.* .
"""
from kvcompile.ops import (checkpoint, gemv, kv_write, qlinear, ring,  # noqa: F401
                           rms_norm, rope_rotate, silu_mul, span_attention)
