"""What a weight loader returns, from a GGUF file (weights.py) or a Hugging Face folder
(hf_checkpoint.py)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcompile.models.config import ModelConfig


@dataclass
class LoadedWeights:
    config: ModelConfig
    tensors: dict[str, torch.Tensor]
    metadata: dict
    source: str  # "gguf" or "hf"
    seconds: dict | None = None   # GGUF: header, read (file bytes not hidden), wait (copies)
