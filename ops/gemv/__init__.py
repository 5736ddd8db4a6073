from kvcompile.ops.gemv.op import gemv  # noqa: F401  (registers the op)
