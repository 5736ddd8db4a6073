from kvcompile.ops.span_attention.op import span_attention  # noqa: F401  (registers the op)
