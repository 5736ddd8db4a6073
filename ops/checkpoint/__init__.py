from kvcompile.ops.checkpoint.op import checkpoint_capture  # noqa: F401  (registers the op)
