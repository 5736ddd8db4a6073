from kvcompile.ops.rope_rotate.op import rope_rotate  # noqa: F401  (registers the op)
