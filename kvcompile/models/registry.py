"""The one table of model families (models/family.py says what each declares). Adding a
family: its module under models/families/, a line here, and tests."""
from __future__ import annotations

from kvcompile.errors import UnsupportedModelError
from kvcompile.models.families import gemma3, internlm2, llama, mistral, qwen2, qwen3, qwen35
from kvcompile.models.family import Family

FAMILIES: dict[str, Family] = {f.name: f for f in (
    llama.FAMILY,
    mistral.FAMILY,
    qwen2.FAMILY,
    qwen3.FAMILY,
    qwen35.FAMILY,
    gemma3.FAMILY,
    internlm2.FAMILY,
)}

# general.architecture -> the family that reads such files
GGUF_ARCHS: dict[str, Family] = {f.gguf_arch: f for f in FAMILIES.values() if f.reads_gguf}
HF_MODEL_TYPES: dict[str, Family] = {t: f for f in FAMILIES.values() for t in f.hf_model_types}


def family_for_gguf(arch: str, path: str = "the model file") -> Family:
    family = GGUF_ARCHS.get(arch)
    if family is None:
        raise UnsupportedModelError(
            f"{path}: architecture {arch!r} is not supported; supported architectures: "
            f"{', '.join(sorted(GGUF_ARCHS))}. Use a model of one of those families")
    return family


def family_for_hf(model_type, path: str = "config.json") -> Family:
    family = HF_MODEL_TYPES.get(model_type)
    if family is None:
        raise UnsupportedModelError(
            f"{path}: Hugging Face model_type {model_type!r} is not supported; supported: "
            f"{', '.join(sorted(HF_MODEL_TYPES))}")
    return family


def family_named(name: str) -> Family:
    """The family `make-model --arch NAME` writes."""
    family = FAMILIES.get(name)
    if family is None:
        raise UnsupportedModelError(f"cannot make a synthetic {name!r} model; use --arch "
                                    f"{', '.join(FAMILIES)}")
    return family
