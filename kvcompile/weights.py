"""The one entry point for model weights: a GGUF file or a Hugging Face checkpoint folder.

Whatever the source, tensors come back keyed by GGUF names (`token_embd.weight`,
`blk.{i}.attn_q.weight`, ...) in PyTorch layout [out, in], with a ModelConfig that says
how to interpret them (notably `rope_neox` for the Q/K row layout).
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from kvcompile.config import ModelConfig
from kvcompile.default_model import default_model_path


@dataclass
class LoadedWeights:
    config: ModelConfig
    tensors: dict[str, torch.Tensor]
    metadata: dict
    source: str  # "gguf" or "hf"


def is_hf_checkpoint(path: str | os.PathLike) -> bool:
    p = Path(path)
    return p.is_dir() or p.name == "config.json" or p.suffix == ".safetensors"


def load_weights(path: str | os.PathLike | None = None, dtype: torch.dtype = torch.float32,
                 progress: bool = True) -> LoadedWeights:
    """Load a .gguf file or a Hugging Face folder (config.json + *.safetensors)."""
    path = Path(path if path is not None else default_model_path())
    if is_hf_checkpoint(path):
        from kvcompile.hf_checkpoint import load_hf_checkpoint
        return load_hf_checkpoint(path, dtype=dtype, progress=progress)
    return load_gguf_weights(path, dtype=dtype, progress=progress)


def load_gguf_weights(path: str | os.PathLike, dtype: torch.dtype = torch.float32,
                      progress: bool = True) -> LoadedWeights:
    from kvcompile.gguf.arch_config import config_from_metadata
    from kvcompile.gguf.dequant import check_dequantizable
    from kvcompile.gguf.reader import open_gguf

    f = open_gguf(path)
    config = config_from_metadata(f.metadata, f.tensors, path=str(path))
    for info in f.tensors.values():
        check_dequantizable(info.name, info.ggml_type)
    tensors = {}
    bar = tqdm(f.tensors, desc=f"loading {Path(path).name}", unit="tensor",
               disable=not progress, file=sys.stderr, leave=False)
    for name in bar:
        tensors[name] = f.tensor(name, dtype=dtype)
    return LoadedWeights(config=config, tensors=tensors, metadata=f.metadata, source="gguf")
