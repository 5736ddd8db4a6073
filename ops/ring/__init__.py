from kvcompile.ops.ring.op import ring_acquire, ring_release  # noqa: F401  (registers the ops)
