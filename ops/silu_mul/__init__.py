from kvcompile.ops.silu_mul.op import silu_mul  # noqa: F401  (registers the op)
