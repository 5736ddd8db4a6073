"""Model file -> (config, tokenizer, nn.Module): the family registry (models/registry.py)
picks the model class by architecture."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from kvcompile.models.config import ModelConfig
from kvcompile.io.default_model import resolve_model_path
from kvcompile.models.registry import family_for_gguf


@dataclass
class LoadedModel:
    path: str
    config: ModelConfig
    metadata: dict
    tokenizer: object
    model: torch.nn.Module
    seconds: dict = field(default_factory=dict)   # wall time of each part of the load


@dataclass
class ModelSource:
    """A model file's header, parsed once: its path, config and (GGUF) the opened file,
    whose metadata and tensor infos the memory plan and the loader read."""
    path: str
    config: ModelConfig
    gguf: object | None           # kvcompile.io.gguf.reader.GgufFile; None for an HF folder


def open_model(path) -> ModelSource:
    """The model's header (GGUF metadata, or a Hugging Face folder's config.json); no tensor
    is read, so a bad option can be refused before the load."""
    from pathlib import Path

    from kvcompile.io.weights import is_hf_checkpoint
    if isinstance(path, ModelSource):
        return path
    if is_hf_checkpoint(path):
        from kvcompile.io.hf_checkpoint import config_from_hf, read_hf_config
        folder = Path(path) if Path(path).is_dir() else Path(path).parent
        return ModelSource(str(path), config_from_hf(read_hf_config(folder),
                                                     str(folder / "config.json")), None)
    from kvcompile.io.gguf.arch_config import ARCH_BUILDERS, config_from_metadata
    from kvcompile.io.gguf.reader import open_gguf
    f = open_gguf(path, archs=ARCH_BUILDERS)  # another family is refused before its vocabulary
    return ModelSource(str(path), config_from_metadata(f.metadata, f.tensors, path=str(path)), f)


def read_config(path) -> ModelConfig:
    return open_model(path).config


def load_model(model=None, *, device: str | torch.device = "cpu",
               dtype: torch.dtype = torch.float32, progress: bool = True,
               keep_quantized: bool | None = None) -> LoadedModel:
    """model: None (the default model), a path, or a ModelSource (its header already
    parsed: the load reads only tensors); keep_quantized: weights.weight_plan's."""
    from kvcompile.io.tokenizer import Tokenizer
    from kvcompile.io.weights import load_weights

    source = model if isinstance(model, ModelSource) else None
    path = source.path if source else resolve_model_path(model)
    clock = [time.perf_counter()]

    def lap() -> float:
        clock.append(time.perf_counter())
        return clock[-1] - clock[-2]

    weights = load_weights(path, dtype=dtype, progress=progress, device=device,
                           keep_quantized=keep_quantized, opened=source.gguf if source else None)
    seconds = {"weights": lap(), **{f"weights.{k}": v for k, v in (weights.seconds or {}).items()}}
    cls = family_for_gguf(weights.config.arch, path).model_class()
    meta = weights.metadata
    if weights.source == "hf":                # HF folders keep the vocabulary in tokenizer.json
        from pathlib import Path

        from kvcompile.io.tokenizer.hf_json import hf_tokenizer_metadata
        folder = Path(path) if Path(path).is_dir() else Path(path).parent
        meta = hf_tokenizer_metadata(folder)
    tokenizer = Tokenizer.from_metadata(meta)
    seconds["tokenizer"] = lap()
    module = cls.from_weights(weights.config, weights.tensors, dtype=dtype, device=device)
    seconds["model"] = lap()
    return LoadedModel(path, weights.config, meta, tokenizer, module.eval(), seconds)
