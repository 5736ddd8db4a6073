"""What a model family declares, so that the loader, `info`, Hugging Face folders and
`make-model` find everything about an architecture in one place (models/registry.py holds
the table, models/families/ one module per family).

A family reads a GGUF header (`config_from_gguf`: metadata and tensor infos -> ModelConfig)
and an HF config.json (`config_from_hf`), names its HF tensors in GGUF terms
(`hf_tensor_names`: a layer's HF suffix -> GGUF suffix; top-level names are shared), says
which module runs it (`model_class`, imported only when a model is built: the CLI's help
and make-model stay free of torch) and which synthetic geometries `make-model` writes
(`presets`, `synthetic_metadata` for keys beyond the shared ones).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, Protocol

from kvcompile.io.gguf.synthetic_config import SyntheticConfig
from kvcompile.models.config import ModelConfig


class FamilyModel(Protocol):
    """The constructor every family's module class offers (LlamaModel, Qwen35Model)."""
    config: ModelConfig

    @classmethod
    def from_weights(cls, config: ModelConfig, tensors: dict, dtype=..., device=...): ...


@dataclass(frozen=True)
class Family:
    name: str                                    # the table's key, make-model's --arch
    gguf_arch: str                               # general.architecture of its files
    config_from_gguf: Callable[..., ModelConfig]  # (metadata, tensors, path=) -> config
    model_class: Callable[[], type[FamilyModel]]  # () -> the nn.Module class
    presets: Mapping[str, SyntheticConfig]
    config_from_hf: Callable[..., ModelConfig] | None = None   # (config.json dict, path)
    hf_model_types: tuple[str, ...] = ()
    hf_tensor_names: Mapping[str, str] = field(default_factory=dict)
    # (gguf writer, SyntheticConfig) -> None: the family's own `{arch}.*` keys
    synthetic_metadata: Callable[..., None] | None = None
    # another family's GGUF files are read by this one (mistral's are llama files)
    reads_gguf: bool = True
    # (GGUF name, HF tensor) -> the tensor as a GGUF file stores it (gemma3: norms + 1)
    hf_tensor_fix: Callable[[str, object], object] | None = None
