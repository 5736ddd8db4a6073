"""Hugging Face checkpoints (config.json + *.safetensors) as GGUF-named tensors; the family of
config.json's model_type (models/registry.py) reads its config and names its tensors.

HF stores q/k projection rows in the NEOX rope layout (rotation pairs (i, i + d/2));
llama.cpp's converter permutes them into adjacent pairs for GGUF. Here the weights are kept
as stored and the config says `rope_neox=True`, so the model rotates the halves instead.
"""
from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from kvcompile.errors import ModelFileError, UnsupportedModelError
from kvcompile.models.config import ModelConfig
from kvcompile.models.families.dense import HF_LAYER_NAMES, HF_TOP_NAMES
from kvcompile.models.family import Family
from kvcompile.models.registry import family_for_hf

# a llama-style checkpoint's names (each family declares its layers' map: hf_tensor_names)
_TOP_NAMES, _LAYER_NAMES = HF_TOP_NAMES, HF_LAYER_NAMES
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_SKIPPED = re.compile(r".*rotary_emb\.inv_freq")  # recomputed from rope_theta


def gguf_name(hf_name: str, family: Family | None = None) -> str | None:
    """HF tensor name -> GGUF tensor name (None for buffers that are recomputed) in
    `family`'s checkpoints (default: llama's)."""
    family = family or family_for_hf("llama")
    if hf_name in _TOP_NAMES:
        return _TOP_NAMES[hf_name]
    m = _LAYER.fullmatch(hf_name)
    if m and m.group(2) in family.hf_tensor_names:
        return f"blk.{m.group(1)}.{family.hf_tensor_names[m.group(2)]}"
    if _SKIPPED.fullmatch(hf_name):
        return None
    raise UnsupportedModelError(
        f"checkpoint tensor {hf_name!r} has no place in a {family.name} model; the checkpoint "
        f"is of another architecture than its config.json's model_type says")


def _folder(path: Path) -> Path:
    if not path.exists():
        raise ModelFileError(f"model path {str(path)!r} does not exist; check the path")
    return path if path.is_dir() else path.parent


def read_hf_config(folder: Path) -> dict:
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise ModelFileError(f"{str(folder)!r} has no config.json; pass a Hugging Face "
                             f"checkpoint folder (config.json + *.safetensors) or a .gguf file")
    try:
        return json.loads(cfg_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelFileError(f"{cfg_path} is not valid JSON ({exc}); re-download it") from exc


def config_from_hf(hf: dict, path: str = "config.json") -> ModelConfig:
    return family_for_hf(hf.get("model_type"), path).config_from_hf(hf, path)


def load_hf_checkpoint(path: str | os.PathLike, dtype: torch.dtype = torch.float32,
                       progress: bool = True):
    from safetensors import SafetensorError, safe_open

    from kvcompile.io.loaded_weights import LoadedWeights

    folder = _folder(Path(path))
    hf = read_hf_config(folder)
    family = family_for_hf(hf.get("model_type"), str(folder / "config.json"))
    config = family.config_from_hf(hf, str(folder / "config.json"))
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelFileError(f"{str(folder)!r} has config.json but no *.safetensors weights; "
                             f"download the weights (PyTorch .bin checkpoints are not read)")
    tensors: dict[str, torch.Tensor] = {}
    try:
        handles = [safe_open(str(f), framework="pt") for f in files]
    except (SafetensorError, OSError) as exc:
        raise ModelFileError(f"cannot read the safetensors files in {folder} ({exc}); "
                             f"re-download them") from exc
    names = [(h, n) for h in handles for n in h.keys()]
    bar = tqdm(names, desc=f"loading {folder.name}", unit="tensor", disable=not progress,
               file=sys.stderr, leave=False)
    for handle, name in bar:
        target = gguf_name(name, family)
        if target is None:
            continue
        try:
            t = handle.get_tensor(name)
            if family.hf_tensor_fix is not None:
                t = family.hf_tensor_fix(target, t)
            tensors[target] = t.to(dtype)
        except (SafetensorError, OSError, RuntimeError) as exc:
            raise ModelFileError(f"tensor {name!r} in {folder} cannot be read ({exc}); the "
                                 f"safetensors file is truncated or corrupt, re-download it") from exc
    if not config.name:
        config = _replace(config, name=folder.name)
    if "output.weight" not in tensors:
        config = _replace(config, tie_embeddings=True)
    elif config.tie_embeddings:  # tied but stored twice: keep one, as GGUF does
        del tensors["output.weight"]
    if "token_embd.weight" in tensors and tensors["token_embd.weight"].shape[0] != config.vocab_size:
        config = _replace(config, vocab_size=int(tensors["token_embd.weight"].shape[0]))
    return LoadedWeights(config=config, tensors=tensors, metadata=hf, source="hf")


def _replace(config: ModelConfig, **changes) -> ModelConfig:
    from dataclasses import replace
    return replace(config, **changes)


def checkpoint_numel(path: str | os.PathLike) -> int:
    """Elements of every tensor in the folder's safetensors files (their headers only)."""
    from safetensors import SafetensorError, safe_open
    folder = _folder(Path(path))
    total = 0
    for f in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(str(f), framework="pt") as h:
                for name in h.keys():
                    n = 1
                    for d in h.get_slice(name).get_shape():
                        n *= d
                    total += n
        except (SafetensorError, OSError) as exc:
            raise ModelFileError(f"cannot read {f} ({exc}); re-download it") from exc
    return total
