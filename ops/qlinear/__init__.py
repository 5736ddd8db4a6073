"""Quantized linear: GGUF block-format weights times activations."""

from kvcompile.ops.qlinear import op  # noqa: F401,E402  (registers qlinear, qembedding)
