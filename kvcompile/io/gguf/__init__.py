"""GGUF files: reading (metadata, tensor infos, dequantized tensors), metadata -> ModelConfig,
and an F32 export that makes llama.cpp an exact oracle."""
from kvcompile.io.gguf.reader import GgufFile, TensorInfo, open_gguf

__all__ = ["GgufFile", "TensorInfo", "open_gguf"]
