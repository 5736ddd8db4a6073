from kvcompile.ops.rms_norm.op import add_rms_norm, rms_norm  # noqa: F401  (registers the ops)
