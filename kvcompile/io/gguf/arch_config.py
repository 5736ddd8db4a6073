"""GGUF metadata -> ModelConfig, through a small table of supported architectures.

Each entry maps `general.architecture` to a builder `(metadata, tensors) -> ModelConfig`.
A new family registers its own builder (usually `base_fields` plus its extra keys):

    ARCH_BUILDERS["qwen35"] = build_qwen35_config
"""
from __future__ import annotations

from typing import Callable, Mapping

from kvcompile.errors import UnsupportedModelError
from kvcompile.io.gguf.config_fields import base_fields, require
from kvcompile.io.gguf.qwen35_config import build_qwen35_config
from kvcompile.models.config import ModelConfig


def build_llama_config(md: Mapping, tensors: Mapping, path: str = "the model file") -> ModelConfig:
    # GGUF llama files carry Q/K rows permuted by convert_hf_to_gguf into adjacent-pair rope.
    return ModelConfig(**base_fields("llama", md, tensors, rope_neox=False, path=path))


ARCH_BUILDERS: dict[str, Callable[..., ModelConfig]] = {
    "llama": build_llama_config,
    "qwen35": build_qwen35_config,
}


def config_from_metadata(md: Mapping, tensors: Mapping, path: str = "the model file") -> ModelConfig:
    arch = md.get("general.architecture")
    if not arch:
        require(md, "general.architecture", path)
    builder = ARCH_BUILDERS.get(arch)
    if builder is None:
        raise UnsupportedModelError(
            f"{path}: architecture {arch!r} is not supported; supported architectures: "
            f"{', '.join(sorted(ARCH_BUILDERS))}. Use a model of one of those families")
    return builder(md, tensors, path=path)
