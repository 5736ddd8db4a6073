from kvcompile.ops.gemv.op import gemv, rms_norm_gemv  # noqa: F401  (registers the ops)
