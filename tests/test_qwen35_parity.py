"""Synthetic qwen35 (hybrid, with MTP layer) and llama GGUFs written by our writer: kvcompile
equals llama.cpp over 256 teacher-forced tokens; broken files fail with a clear error."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from kvcompile.kv.store import KvStore
from kvcompile.errors import ModelFileError, UnsupportedModelError
from kvcompile.io.gguf.synthetic import preset_config, write_synthetic_gguf
from kvcompile.models.llama import LlamaModel
from kvcompile.models.qwen35 import Qwen35Model
from kvcompile.io.weights import load_weights
from llama_oracle import agreement, llama_cpp, llama_cpp_logits

N_TOKENS, N_PREFILL = 256, 192


@pytest.fixture(scope="module")
def qwen35_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen35") / "qwen35-tiny.f32.gguf"
    write_synthetic_gguf(preset_config("qwen35", "tiny"), path, "f32", seed=1234)
    return path


@pytest.fixture(scope="module")
def llama_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama") / "llama-tiny.f32.gguf"
    write_synthetic_gguf(preset_config("llama", "tiny"), path, "f32", seed=4321)
    return path


def _teacher_forced(model, cache, tokens):
    """Prefill the first N_PREFILL tokens in one forward (chunked GDN / multi-row
    attention), then decode the rest one token at a time (recurrent GDN)."""
    with torch.no_grad():
        rows = [model(tokens[:N_PREFILL], torch.arange(N_PREFILL), cache)]
        for p in range(N_PREFILL, len(tokens)):
            rows.append(model(tokens[p:p + 1], torch.tensor([p]), cache))
    return torch.cat(rows)


def _report(name, ours, ref):
    top1, kl_mean, kl_max = agreement(ours, ref)
    lp = torch.log_softmax(ref.double(), -1)
    entropy = -(lp.exp() * lp).sum(-1)
    top2 = ref.topk(2, dim=-1).values
    gap = (top2[:, 0] - top2[:, 1]).double()
    qs = torch.tensor([0.05, 0.5, 0.95], dtype=torch.float64)
    print(f"\n{name}: top-1 {top1:.4f}, KL mean {kl_mean:.3e} max {kl_max:.3e}, "
          f"max |dlogit| {(ours - ref).abs().max().item():.2e}; oracle entropy q05/50/95 "
          f"{entropy.quantile(qs).numpy().round(2)} (max {np.log(ref.shape[1]):.2f}), "
          f"top-2 gap q05/50/95 {gap.quantile(qs).numpy().round(3)}")
    return top1, kl_mean, entropy, gap


def _context_sensitivity(llm, tokens):
    """KL between oracle logits of the same final token after two different contexts:
    a large value shows attention/recurrence matter, so agreement tests them."""
    a = llama_cpp_logits(llm, tokens)[-1]
    other = tokens[:-1][torch.randperm(len(tokens) - 1, generator=torch.Generator().manual_seed(0))]
    b = llama_cpp_logits(llm, torch.cat([other, tokens[-1:]]).tolist())[-1]
    lp, lq = torch.log_softmax(a.double(), -1), torch.log_softmax(b.double(), -1)
    return (lp.exp() * (lp - lq)).sum().item()


@pytest.mark.parametrize("arch", ["qwen35", "llama"])
def test_synthetic_model_matches_llama_cpp(arch, qwen35_file, llama_file):
    path = qwen35_file if arch == "qwen35" else llama_file
    w = load_weights(path, progress=False)
    assert w.config.arch == arch
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(300, w.config.vocab_size, (N_TOKENS,), generator=gen)
    if arch == "qwen35":
        assert w.config.nextn_layers == 1 and w.config.n_layers == 8
        model = Qwen35Model.from_weights(w.config, w.tensors)
        cache = KvStore.for_model(model, N_TOKENS)
        # only the 2 attention layers + the MTP layer own KV pages
        assert model.layer_plan.kv_layers == (3, 7, 8) and cache.layers == (3, 7, 8)
    else:
        model = LlamaModel.from_weights(w.config, w.tensors)
        cache = KvStore(w.config, N_TOKENS)
    ours = _teacher_forced(model, cache, tokens)
    llm = llama_cpp(path, n_ctx=512)
    ref = llama_cpp_logits(llm, tokens.tolist())
    top1, kl_mean, entropy, gap = _report(f"synthetic {arch}", ours, ref)
    sensitivity = _context_sensitivity(llm, tokens)
    print(f"context sensitivity (KL after a shuffled context): {sensitivity:.3f}")
    assert top1 >= 0.99 and kl_mean <= 1e-3
    # non-degenerate: broad but not uniform distributions that depend on the context
    assert entropy.median() < np.log(ref.shape[1]) - 0.5 and gap.median() > 0.05
    assert sensitivity > 0.05


def _rewrite(src, dst, drop_tensors=(), drop_keys=(), set_u32=None):
    """Copy a GGUF, leaving out some tensors / keys or overriding uint32 keys."""
    r = gguf.GGUFReader(str(src))
    arch = r.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(str(dst), arch=arch)
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in drop_keys:
            continue
        if set_u32 and key in set_u32:
            w.add_uint32(key, set_u32[key])
            continue
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, f.contents(), f.types[0], sub)
    for t in r.tensors:
        if t.name not in drop_tensors:
            w.add_tensor(t.name, np.array(t.data), raw_shape=tuple(reversed(t.shape.tolist())),
                         raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def _load_model(path):
    w = load_weights(path, progress=False)
    return Qwen35Model.from_weights(w.config, w.tensors)


@pytest.mark.parametrize("tensor", ["blk.1.ssm_a", "blk.3.attn_q_norm.weight",
                                    "blk.8.nextn.eh_proj.weight", "blk.0.ssm_conv1d.weight"])
def test_missing_tensor_is_named(tensor, qwen35_file, tmp_path):
    bad = _rewrite(qwen35_file, tmp_path / "bad.gguf", drop_tensors={tensor})
    with pytest.raises(ModelFileError, match=tensor.replace(".", r"\.")) as err:
        _load_model(bad)
    print(err.value)


@pytest.mark.parametrize("key", ["qwen35.ssm.conv_kernel", "qwen35.ssm.group_count",
                                 "qwen35.rope.dimension_sections",
                                 "qwen35.attention.layer_norm_rms_epsilon"])
def test_missing_key_is_named(key, qwen35_file, tmp_path):
    bad = _rewrite(qwen35_file, tmp_path / "bad.gguf", drop_keys={key})
    with pytest.raises(ModelFileError, match=key.replace(".", r"\.")) as err:
        _load_model(bad)
    print(err.value)


def test_two_nextn_layers_is_a_capability_error(tmp_path):
    path = tmp_path / "two-mtp.gguf"
    cfg = preset_config("qwen35", "tiny", nextn_layers=2, vocab_size=512, n_layers=4)
    write_synthetic_gguf(cfg, path, "f32", seed=3)
    with pytest.raises(UnsupportedModelError, match="2 NextN/MTP layers") as err:
        load_weights(path, progress=False)
    print(err.value)


def test_forward_must_continue_the_recurrent_state(qwen35_file):
    from kvcompile.errors import KvLayoutError
    model = _load_model(qwen35_file)
    cache = KvStore.for_model(model, 64)
    with torch.no_grad():
        model(torch.tensor([400, 500, 600]), torch.arange(3), cache)
        with pytest.raises(KvLayoutError, match="consumed 3 tokens") as err:
            model(torch.tensor([700]), torch.tensor([5]), cache)
    print(err.value)


def test_snapshot_restore_replays_exactly(qwen35_file):
    # speculative decoding's rollback: after restore + KV overwrite, the same tokens give
    # bitwise the same logits as the first time
    model = _load_model(qwen35_file)
    cache = KvStore.for_model(model, 128)
    state = cache.recurrent
    gen = torch.Generator().manual_seed(9)
    prompt, draft = torch.randint(300, 4096, (70,), generator=gen), torch.randint(300, 4096, (4,), generator=gen)
    with torch.no_grad():
        model(prompt, torch.arange(70), cache)
        snap = state.snapshot()
        first = model(draft, torch.arange(70, 74), cache)
        moved = (state.ssm - snap.ssm).abs().max().item()
        model(torch.randint(300, 4096, (3,), generator=gen), torch.arange(74, 77), cache)
        state.restore(snap)
        again = model(draft, torch.arange(70, 74), cache)
    print(f"state moved by {moved:.3e} over the draft; replay max diff "
          f"{(again - first).abs().max().item():.1e}; recurrent state {state.nbytes} B "
          f"in {len(state.layers)} GDN layers, KV pages only for layers {cache.layers}")
    assert moved > 1e-3 and torch.equal(again, first) and state.n_tokens == 74
    assert set(state.layers).isdisjoint(cache.layers)


def test_quantized_qwen35_file_is_exact_against_its_f32_export(tmp_path):
    # llama.cpp rounds activations inside quantized matmuls, so the exact oracle for a
    # Q4_0 file is llama.cpp on an F32 copy of its dequantized weights
    from kvcompile.io.gguf.f32_export import export_f32
    q4 = tmp_path / "qwen35.q4_0.gguf"
    write_synthetic_gguf(preset_config("qwen35", "tiny", vocab_size=2048), q4, "q4_0", seed=21)
    f32 = export_f32(q4, tmp_path / "qwen35.f32.gguf")
    model = _load_model(q4)
    tokens = torch.randint(300, 2048, (128,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ours = model(tokens, torch.arange(128), KvStore.for_model(model, 128))
    ref = llama_cpp_logits(llama_cpp(f32, n_ctx=256), tokens.tolist())
    top1, kl_mean, _, _ = _report("q4_0 qwen35 vs llama.cpp on its F32 export", ours, ref)
    assert top1 >= 0.99 and kl_mean <= 1e-3


@pytest.mark.parametrize("k_type,v_type", [("q8_0", "q8_0"), ("q8_0", "q4_0")])
def test_quantized_kv_degrades_no_more_than_llama_cpp(k_type, v_type, qwen35_file):
    """Quantized KV on the attention layers (stored Hadamard-rotated, as llama.cpp does):
    against the exact f32-KV oracle our loss is no worse than llama.cpp's own."""
    ids = {"q8_0": 8, "q4_0": 2}
    model = _load_model(qwen35_file)
    tokens = torch.randint(300, 4096, (N_TOKENS,), generator=torch.Generator().manual_seed(17))
    ours = _teacher_forced(model, KvStore.for_model(model, N_TOKENS, k_type, v_type), tokens)
    exact = llama_cpp_logits(llama_cpp(qwen35_file, n_ctx=512), tokens.tolist())
    llm = llama_cpp(qwen35_file, n_ctx=512, type_k=ids[k_type], type_v=ids[v_type])
    theirs = llama_cpp_logits(llm, tokens.tolist())
    top1, kl, _ = agreement(ours, exact)
    top1_cpp, kl_cpp, _ = agreement(theirs, exact)
    top1_pair, kl_pair, _ = agreement(ours, theirs)
    print(f"\nqwen35 KV {k_type}/{v_type}: ours vs f32-KV oracle top-1 {top1:.2%} KL {kl:.2e}; "
          f"llama.cpp top-1 {top1_cpp:.2%} KL {kl_cpp:.2e}; ours vs llama.cpp same KV top-1 "
          f"{top1_pair:.2%} KL {kl_pair:.2e}")
    assert kl <= 1.5 * kl_cpp + 1e-6 and top1 >= top1_cpp - 0.02
