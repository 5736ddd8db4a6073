"""The dense model families of the registry (models/registry.py) against llama.cpp: a
synthetic tiny F32 GGUF of each (`make-model --arch FAMILY --preset tiny`), teacher-forced
and greedy; Llama 3.1 rope factors and YaRN at 1-2K tokens; quantized files against their
F32 export; on CUDA, against the CPU reference. Files, HF folders, traced programs and
refusals: test_families_io.py."""
from __future__ import annotations

import pytest
import torch

from family_files import family_files, teacher_forced, tokens_of  # noqa: F401 (fixture)
from kvcompile.io.gguf.f32_export import export_f32
from kvcompile.io.loader import load_model
from kvcompile.io.weights import load_weights
from kvcompile.kv.store import KvStore
from kvcompile.models.rope import config_rope_tables, rope_tables
from llama_oracle import (agreement, llama_cpp, llama_cpp_greedy, llama_cpp_logits,
                          our_greedy, top2_gap)

N_TOKENS, N_GREEDY = 512, 64
FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma3", "internlm2"]


def check_against_llama_cpp(path, n_tokens: int, seed: int, cuts=(300, 301),
                            plain_rope: bool = False):
    """Teacher-forced agreement; plain_rope: also show that the file's rope scaling matters
    here (the same model with unscaled rope tables disagrees with llama.cpp)."""
    model = load_model(path, progress=False).model
    tokens = tokens_of(n_tokens, model.config.vocab_size, seed)
    ours = teacher_forced(model, tokens, cuts)
    ref = llama_cpp_logits(llama_cpp(path, n_ctx=n_tokens + 64), tokens)
    top1, kl, kl_max = agreement(ours, ref)
    print(f"\n{path.name}: {n_tokens} tokens, top-1 {top1:.4f}, KL mean {kl:.2e} max "
          f"{kl_max:.2e}, max |dlogit| {(ours - ref).abs().max().item():.2e}, median top-2 "
          f"gap {top2_gap(ref).median().item():.3f}")
    assert top1 >= 0.99 and kl <= 1e-3
    if plain_rope:
        c = model.config
        model.rope_cos, model.rope_sin = rope_tables(c.rotary_dim, c.context_length, c.rope_theta)
        top1_plain, kl_plain, _ = agreement(teacher_forced(model, tokens, cuts), ref)
        print(f"with unscaled rope: top-1 {top1_plain:.4f}, KL mean {kl_plain:.2e}")
        assert kl_plain > 100 * max(kl, 1e-6)
    return model


@pytest.mark.parametrize("family", FAMILIES)
def test_family_matches_llama_cpp(family, family_files):
    path = family_files(family)
    model = check_against_llama_cpp(path, N_TOKENS, seed=len(family))
    prompt = tokens_of(32, model.config.vocab_size, seed=99)
    llm = llama_cpp(path, n_ctx=256)
    ref, gaps = llama_cpp_greedy(llm, prompt, N_GREEDY)
    ours = our_greedy(model, KvStore(model.config, len(prompt) + N_GREEDY), prompt, N_GREEDY)
    first = next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), None)
    print(f"greedy: {'all equal' if first is None else f'first differs at {first}'}")
    assert first is None or gaps[first] < 0.05, (first, gaps[first])


def test_llama3_rope_factors_at_1k5_tokens(family_files):
    path = family_files("llama", "llama3-tiny")
    w = load_weights(path, progress=False)
    factors = w.tensors["rope_freqs.weight"]
    assert factors.min() == 1.0 and factors.max() == 8.0, factors   # non-trivial factors
    cos = config_rope_tables(w.config, factors)[0][:1536]
    assert (cos - rope_tables(w.config.rotary_dim, 1536, w.config.rope_theta)[0]).abs().max() > 0.5
    # an HF config's "llama3" rope_scaling gives the tables of the converted file's factors
    from kvcompile.io.hf_checkpoint import config_from_hf
    c = w.config
    hf = config_from_hf({
        "model_type": "llama", "hidden_size": c.hidden, "num_attention_heads": c.n_heads,
        "intermediate_size": c.ffn, "num_hidden_layers": c.n_layers, "vocab_size": c.vocab_size,
        "max_position_embeddings": c.context_length, "rope_theta": c.rope_theta,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 512}})
    assert (config_rope_tables(hf)[0][:1536] - cos).abs().max() < 1e-4
    check_against_llama_cpp(path, 1536, seed=31, cuts=(700, 701, 1200), plain_rope=True)


def without_windows(model):
    """The same model with every layer attending to the whole context."""
    for block in model.blocks:
        block.attn.window = 0
    return model


def test_gemma3_windows_at_1k_tokens(family_files):
    """Five windowed layers of 64 positions and one global, 1K tokens: equal to llama.cpp,
    and the windows matter (the model without them disagrees)."""
    path = family_files("gemma3")
    model = check_against_llama_cpp(path, 1024, seed=21, cuts=(700, 701))
    assert [model.config.layer_window(i) for i in range(6)] == [64] * 5 + [0]
    tokens = tokens_of(1024, model.config.vocab_size, 21)
    ref = llama_cpp_logits(llama_cpp(path, n_ctx=1088), tokens)
    top1, kl, _ = agreement(teacher_forced(without_windows(model), tokens, (700, 701)), ref)
    print(f"without the windows: top-1 {top1:.4f}, KL mean {kl:.2e}")
    assert kl > 1e-2


def test_gemma3_logit_softcap(family_files, tmp_path):
    """A file with final_logit_softcapping: logits capped as llama.cpp caps them."""
    from kvcompile.io.make_model import make_model
    path = tmp_path / "gemma3-cap.gguf"
    make_model("gemma3", "tiny", path, seed=4, final_logit_softcap=5.0)
    model = check_against_llama_cpp(path, 256, seed=2, cuts=(100, 101))
    assert model.config.final_logit_softcap == 5.0


def test_mistral_window_beyond_what_llama_cpp_reads(family_files):
    """llama.cpp reads no sliding window from `llama` files and attends to everything, so
    on a windowed Mistral file it is our oracle only for the rows whose window holds their
    whole context: those agree; later rows differ (the window applies)."""
    path = family_files("mistral", "window-tiny")
    model = load_model(path, progress=False).model
    assert model.layer_plan.windows == tuple((i, 64) for i in range(4))
    tokens = tokens_of(256, model.config.vocab_size, seed=6)
    ours = teacher_forced(model, tokens, cuts=(100, 101))
    ref = llama_cpp_logits(llama_cpp(path, n_ctx=320), tokens)
    top1, kl, _ = agreement(ours[:64], ref[:64])
    assert top1 == 1.0 and kl <= 1e-6
    assert agreement(ours[128:], ref[128:])[1] > 1e-2


def test_yarn_at_1k_tokens(family_files):
    path = family_files("qwen2", "yarn-tiny")
    assert load_weights(path, progress=False).config.rope_scaling["type"] == "yarn"
    check_against_llama_cpp(path, 1024, seed=5, cuts=(512, 513), plain_rope=True)


@pytest.mark.parametrize("family,weight_type", [("qwen2", "q8_0"), ("qwen3", "q4_k"),
                                                ("mistral", "q4_0"), ("gemma3", "q8_0")])
def test_quantized_file_is_exact_against_its_f32_export(family, weight_type, family_files,
                                                        tmp_path):
    """llama.cpp rounds activations inside quantized matmuls: its exact oracle for a
    quantized file is the F32 copy of the dequantized weights."""
    quantized = family_files(family, weight_type=weight_type)
    f32 = export_f32(quantized, tmp_path / "f32.gguf")
    model = load_model(quantized, progress=False).model
    tokens = tokens_of(128, model.config.vocab_size, seed=3)
    ours = teacher_forced(model, tokens, cuts=(64,))
    top1, kl, _ = agreement(ours, llama_cpp_logits(llama_cpp(f32, n_ctx=256), tokens))
    print(f"\n{family} {weight_type}: top-1 {top1:.4f}, KL {kl:.2e}")
    assert top1 >= 0.99 and kl <= 1e-3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family,preset,weight_type,dtype", [
    ("qwen2", "tiny", "f32", "f32"), ("qwen2", "tiny", "q4_k", "bf16"),
    ("qwen3", "tiny", "f32", "f32"), ("qwen3", "tiny", "q8_0", "bf16"),
    ("llama", "llama3-tiny", "f32", "f32"), ("qwen2", "yarn-tiny", "f32", "f32"),
    ("gemma3", "tiny", "f32", "f32"), ("gemma3", "tiny", "q8_0", "bf16")])
def test_cuda_engine_agrees_with_the_cpu_reference(family, preset, weight_type, dtype,
                                                   family_files):
    """The variants on the CUDA kernels (row ops on q/k heads, biased and quantized
    projections, captured programs) against the CPU reference, same file."""
    from kvcompile.engine.engine import Engine
    path = str(family_files(family, preset, weight_type))
    ids = tokens_of(600, 4096, seed=11)     # past gemma3's windows of 64

    def logits(engine):
        engine.store.reset()
        rows = [engine._prefill(ids[:584], 0).float().cpu()]
        return torch.stack(rows + [engine.forward([t], 584 + i).float().cpu()
                                   for i, t in enumerate(ids[584:-1])])
    with torch.inference_mode():
        a = logits(Engine(path, ctx_size=1024, progress=False))
        b = logits(Engine(path, ctx_size=1024, device="cuda", dtype=dtype, progress=False))
    same = a.argmax(-1) == b.argmax(-1)
    top1 = same.float().mean().item()
    rel = ((a - b).abs().max() / a.abs().max()).item()
    best = a.topk(2, -1).values
    near_tie = best[:, 0] - best[:, 1] < 0.05      # bf16 may pick either (greedy_check.py)
    print(f"\n{family} {preset} {weight_type} {dtype}: top-1 {top1:.3f}, max |diff| / max "
          f"|logit| {rel:.2e}, near ties {int(near_tie.sum())}")
    if dtype == "f32":
        assert top1 >= 0.99 and rel < 2e-2
    else:
        assert bool((same | near_tie).all()) and top1 >= 0.75 and rel < 0.1

