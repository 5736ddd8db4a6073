"""Custom kvcompile ops, one folder each: schema + fake in op.py, fp32 reference in naive.py.

Importing this package registers torch.ops.kvcompile.* .
"""
from kvcompile.ops import (gemv, kv_write, ring, rms_norm, rope_rotate, silu_mul,  # noqa: F401
                           span_attention)
