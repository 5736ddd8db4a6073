from kvcompile.ops.kv_write.op import kv_write  # noqa: F401  (registers the op)
