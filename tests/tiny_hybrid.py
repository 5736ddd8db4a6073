"""A tiny qwen35 model (8 layers: Gated DeltaNet + attention + an MTP layer) written as a
synthetic GGUF by our writer and loaded back, for the hybrid tests."""
from __future__ import annotations

from kvcompile.io.gguf.synthetic import preset_config, write_synthetic_gguf
from kvcompile.models.qwen35 import Qwen35Model
from kvcompile.io.weights import load_weights


def write_tiny_hybrid(path, seed: int):
    """Write the GGUF at path; returns path."""
    write_synthetic_gguf(preset_config("qwen35", "tiny", n_layers=8, vocab_size=512), path,
                         "f32", seed=seed)
    return path


def tiny_hybrid(tmp_dir, seed: int, device="cpu") -> Qwen35Model:
    w = load_weights(write_tiny_hybrid(tmp_dir / "qwen35-tiny.gguf", seed), progress=False)
    return Qwen35Model.from_weights(w.config, w.tensors, device=device)
