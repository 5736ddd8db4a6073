"""Synthetic files of the model families (make-model presets, written once per session
and kind) and the helpers test_families*.py share."""
from __future__ import annotations

import zlib

import pytest
import torch

from kvcompile.io.make_model import make_model
from kvcompile.kv.store import KvStore


@pytest.fixture(scope="session")
def family_files(tmp_path_factory):
    """(family, preset, weight type) -> GGUF path, written on first use."""
    made = {}

    def get(family, preset="tiny", weight_type="f32"):
        key = (family, preset, weight_type)
        if key not in made:
            path = tmp_path_factory.mktemp(family) / f"{family}-{preset}.{weight_type}.gguf"
            make_model(family, preset, path, weight_type=weight_type,
                       seed=zlib.crc32(repr(key).encode()) % 1000)
            made[key] = path
        return made[key]
    return get


def tokens_of(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(300, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.inference_mode()
def teacher_forced(model, tokens: list[int], cuts=(300, 301)) -> torch.Tensor:
    """Logits of every row, fed as a session is: a prefill chunk, one decode row, the rest."""
    cache = KvStore(model.config, len(tokens))
    bounds = [0, *cuts, len(tokens)]
    return torch.cat([model(torch.tensor(tokens[a:b]), torch.arange(a, b), cache)
                      for a, b in zip(bounds, bounds[1:])])
