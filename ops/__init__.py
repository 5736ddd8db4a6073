"""Custom kvcompile ops, one folder each: schema + fake in op.py, fp32 reference in naive.py.

Importing this package registers torch.ops.kvcompile.* .
"""
from kvcompile.ops import kv_write, ring, span_attention  # noqa: F401
