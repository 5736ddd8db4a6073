"""GGUF files: reading (metadata, tensor infos, dequantized tensors), metadata -> ModelConfig,
and an F32 export that makes llama.cpp an exact oracle."""

__all__ = ["GgufFile", "TensorInfo", "open_gguf"]


def __getattr__(name):
    # Lazy: the reader imports torch, which the CLI's argument parser (make-model's presets)
    # must not pay for.
    if name in __all__:
        from kvcompile.io.gguf import reader
        return getattr(reader, name)
    raise AttributeError(f"module 'kvcompile.io.gguf' has no attribute {name!r}")
