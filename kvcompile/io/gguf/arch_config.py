"""GGUF metadata -> ModelConfig, through the family registry (models/registry.py): the
family whose files carry this `general.architecture` reads the header."""
from __future__ import annotations

from typing import Mapping

from kvcompile.io.gguf.config_fields import require
from kvcompile.models.config import ModelConfig
from kvcompile.models.registry import GGUF_ARCHS, family_for_gguf

# the architectures a GGUF may declare (reader.open_gguf refuses others before the vocabulary)
ARCH_BUILDERS = {arch: family.config_from_gguf for arch, family in GGUF_ARCHS.items()}


def config_from_metadata(md: Mapping, tensors: Mapping, path: str = "the model file") -> ModelConfig:
    arch = md.get("general.architecture")
    if not arch:
        require(md, "general.architecture", path)
    return family_for_gguf(arch, path).config_from_gguf(md, tensors, path=path)
