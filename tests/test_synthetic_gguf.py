"""The synthetic GGUF writer: the seed-27b tensor plan and metadata, every weight type,
sane value scales, streaming with bounded memory, llama.cpp loading quantized files, and
the make-model entry point."""
from __future__ import annotations

import tracemalloc

import gguf
import numpy as np
import pytest
import torch

from kvcompile.kv.store import KvStore
from kvcompile.io.gguf.arch_config import config_from_metadata
from kvcompile.io.gguf.reader import open_gguf
from kvcompile.io.gguf.synthetic import preset_config, tensor_plan, write_synthetic_gguf
from kvcompile.io.gguf.synthetic_presets import add_model_metadata
from kvcompile.io.gguf.synthetic_vocab import add_tokenizer, vocab_for
from kvcompile.io.make_model import main as make_model_main
from kvcompile.io.make_model import make_model

F32 = gguf.GGMLQuantizationType.F32


def test_seed_27b_plan_names_shapes_bytes():
    cfg = preset_config("qwen35", "seed-27b")
    plan = {t.name: t for t in tensor_plan(cfg, "bf16")}
    attn = [i for i in range(64) if f"blk.{i}.attn_q.weight" in plan]
    gdn = [i for i in range(64) if f"blk.{i}.ssm_a" in plan]
    assert attn == list(range(3, 64, 4)) and len(gdn) == 48 and not set(attn) & set(gdn)
    # independent arithmetic of the seed geometry, PyTorch order [out, in]
    h, kdim, vdim = 5120, 16 * 128, 48 * 128
    shapes = {
        "token_embd.weight": (248320, h), "output.weight": (248320, h),
        "blk.0.attn_qkv.weight": (2 * kdim + vdim, h), "blk.0.attn_gate.weight": (vdim, h),
        "blk.0.ssm_conv1d.weight": (2 * kdim + vdim, 4), "blk.0.ssm_a": (48,),
        "blk.0.ssm_dt.bias": (48,), "blk.0.ssm_beta.weight": (48, h),
        "blk.0.ssm_alpha.weight": (48, h), "blk.0.ssm_norm.weight": (128,),
        "blk.0.ssm_out.weight": (h, vdim), "blk.3.attn_q.weight": (2 * 24 * 256, h),
        "blk.3.attn_k.weight": (4 * 256, h), "blk.3.attn_v.weight": (4 * 256, h),
        "blk.3.attn_output.weight": (h, 24 * 256), "blk.3.attn_q_norm.weight": (256,),
        "blk.63.ffn_up.weight": (17408, h), "blk.63.ffn_down.weight": (h, 17408),
        "blk.64.nextn.eh_proj.weight": (h, 2 * h), "blk.64.attn_q.weight": (2 * 24 * 256, h),
        "blk.64.nextn.enorm.weight": (h,), "blk.64.nextn.hnorm.weight": (h,),
    }
    for name, shape in shapes.items():
        assert plan[name].shape == shape, name
    assert "blk.65.attn_norm.weight" not in plan
    vectors = [t for t in plan.values() if len(t.shape) == 1 or t.name.endswith("conv1d.weight")]
    assert all(t.ggml_type == F32 for t in vectors)
    assert all(t.ggml_type == gguf.GGMLQuantizationType.BF16
               for t in plan.values() if t not in vectors)
    n_matrix = sum(np.prod(t.shape) for t in plan.values() if t not in vectors)
    n_vector = sum(np.prod(t.shape) for t in vectors)
    per_attn = (2 * 24 * 256 + 2 * 4 * 256) * h + 24 * 256 * h
    per_gdn = (2 * kdim + vdim) * h + vdim * h + 2 * 48 * h + vdim * h
    ffn = 3 * 17408 * h
    expect = 2 * 248320 * h + 16 * (per_attn + ffn) + 48 * (per_gdn + ffn) \
        + per_attn + ffn + 2 * h * h
    total = sum(t.n_bytes for t in plan.values())
    print(f"\nseed-27b: {len(plan)} tensors, {(n_matrix + n_vector) / 1e9:.2f} B params, "
          f"{total / 2**30:.2f} GiB as bf16")
    assert n_matrix == expect and total == 2 * n_matrix + 4 * n_vector


def test_seed_27b_metadata_reads_back(tmp_path):
    # header-only file (no tensors): the metadata alone must give the seed geometry
    cfg = preset_config("qwen35", "seed-27b")
    path = tmp_path / "meta.gguf"
    w = gguf.GGUFWriter(str(path), arch="qwen35")
    add_model_metadata(w, cfg)
    add_tokenizer(w, cfg.vocab_size)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    f = open_gguf(path)
    c = config_from_metadata(f.metadata, f.tensors, path=str(path))
    print(c)
    assert (c.n_layers, c.nextn_layers, c.hidden, c.ffn, c.vocab_size) == (64, 1, 5120, 17408, 248320)
    assert (c.n_heads, c.n_kv_heads, c.head_dim, c.rotary_dim, c.rope_neox) == (24, 4, 256, 64, True)
    assert (c.ssm_k_heads, c.ssm_v_heads, c.ssm_head_dim, c.ssm_conv_kernel) == (16, 48, 128, 4)
    assert [i for i in range(64) if c.is_attention_layer(i)] == list(range(3, 64, 4))
    assert len(f.metadata["tokenizer.ggml.tokens"]) == 248320


SMALL = dict(n_layers=4, vocab_size=512)


@pytest.mark.parametrize("wtype", ["f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0"])
def test_weight_types_and_value_scales(wtype, tmp_path):
    path = tmp_path / f"m.{wtype}.gguf"
    write_synthetic_gguf(preset_config("qwen35", "tiny", **SMALL), path, wtype, seed=5)
    r = gguf.GGUFReader(str(path))
    want = gguf.GGMLQuantizationType[wtype.upper()]
    vals = {t.name: gguf.quants.dequantize(t.data, t.tensor_type).reshape(
        tuple(reversed(t.shape.tolist()))) for t in r.tensors}
    types = {t.name: t.tensor_type for t in r.tensors}
    assert types["blk.0.attn_qkv.weight"] == want and types["output.weight"] == want
    assert types["blk.0.ssm_conv1d.weight"] == F32 and types["blk.0.ssm_a"] == F32
    tol = 0.25 if wtype.startswith("q4") or wtype.startswith("q5") else 0.05
    for name, fan_in in (("blk.0.ffn_down.weight", 512), ("blk.3.attn_q.weight", 256),
                         ("blk.1.attn_qkv.weight", 256)):
        std = vals[name].std()
        assert abs(std * np.sqrt(fan_in) - 1) < tol, (name, std)
    a, dt = vals["blk.0.ssm_a"], vals["blk.0.ssm_dt.bias"]
    norm = vals["blk.0.attn_norm.weight"]
    print(f"{wtype}: ffn_down std*sqrt(fan_in) {vals['blk.0.ffn_down.weight'].std() * np.sqrt(512):.3f}"
          f", ssm_a in [{a.min():.3f}, {a.max():.3f}], dt_bias in [{dt.min():.2f}, "
          f"{dt.max():.2f}], norm mean {norm.mean():.3f}")
    assert -1.0 <= a.min() and a.max() <= -0.05 and -2.0 <= dt.min() and dt.max() <= 1.0
    assert abs(norm.mean() - 1) < 0.05 and 0.05 < norm.std() < 0.15


def test_values_independent_of_thread_count(tmp_path):
    cfg = preset_config("llama", "tiny", vocab_size=8192, hidden=512)
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    write_synthetic_gguf(cfg, a, "bf16", seed=2, workers=1)
    write_synthetic_gguf(cfg, b, "bf16", seed=2, workers=3)
    assert a.read_bytes() == b.read_bytes()


def test_writing_streams_with_bounded_memory(tmp_path, monkeypatch):
    # the embedding and output tensors are 48 MiB of float32 each; with 4 MiB chunks the
    # writer's peak numpy memory stays a few chunks, far below one whole tensor
    import kvcompile.io.gguf.synthetic_values as values
    monkeypatch.setattr(values, "CHUNK_ELEMENTS", 1 << 20)
    cfg = preset_config("llama", "tiny", vocab_size=49152, hidden=256, n_layers=1)
    largest = 49152 * 256 * 4
    vocab_for(cfg.vocab_size)  # parse the source tokenizer first (cached); not streaming
    tracemalloc.start()
    write_synthetic_gguf(cfg, tmp_path / "big.gguf", "f32", seed=1, workers=1)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    size = (tmp_path / "big.gguf").stat().st_size
    print(f"file {size / 2**20:.1f} MiB, largest tensor {largest / 2**20:.0f} MiB, "
          f"peak traced {peak / 2**20:.1f} MiB")
    assert size > 2 * largest and peak < largest / 3


@pytest.mark.parametrize("wtype,min_top1", [("bf16", 0.95), ("q8_0", 0.9)])
def test_llama_cpp_loads_quantized_files(wtype, min_top1, tmp_path):
    from kvcompile.models.qwen35 import Qwen35Model
    from kvcompile.io.weights import load_weights
    from llama_oracle import agreement, llama_cpp, llama_cpp_logits
    path = tmp_path / f"q.{wtype}.gguf"
    write_synthetic_gguf(preset_config("qwen35", "tiny", vocab_size=2048), path, wtype, seed=8)
    tokens = torch.randint(300, 2048, (96,), generator=torch.Generator().manual_seed(1))
    ref = llama_cpp_logits(llama_cpp(path, n_ctx=256), tokens.tolist())
    loaded = load_weights(path, progress=False)
    model = Qwen35Model.from_weights(loaded.config, loaded.tensors)
    with torch.no_grad():
        ours = model(tokens, torch.arange(96), KvStore.for_model(model, 96))
    top1, kl, kl_max = agreement(ours, ref)
    # llama.cpp rounds activations to the weight's precision inside matmuls; we do not
    print(f"{wtype} file: llama.cpp vs kvcompile (dequantized weights) top-1 {top1:.3f}, "
          f"KL mean {kl:.2e} max {kl_max:.2e}")
    assert torch.isfinite(ref).all() and top1 >= min_top1 and kl < 0.05


def test_make_model_cli(tmp_path, capsys):
    assert make_model_main(["--arch", "qwen35", "--preset", "seed-27b", "--out",
                            str(tmp_path / "x.gguf"), "--type", "bf16", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "16 attention + 48 Gated DeltaNet, 1 MTP" in out and "27.3" in out
    assert not (tmp_path / "x.gguf").exists()
    path = tmp_path / "t.gguf"
    assert make_model_main(["--arch", "llama", "--out", str(path), "--type", "q8_0",
                            "--set", "n_layers=2", "--set", "vocab_size=1024"]) == 0
    c = config_from_metadata(open_gguf(path).metadata, open_gguf(path).tensors)
    assert (c.arch, c.n_layers, c.vocab_size) == ("llama", 2, 1024)
    for bad, msg in ((["--preset", "huge"], "no preset 'huge'"),
                     (["--set", "layers=3"], "expected FIELD=VALUE"),
                     (["--set", "n_layers=x"], "not a number"),
                     (["--set", "n_heads=3"], "multiple of KV heads"),
                     (["--set", "n_layers=0"], "must be positive")):
        assert make_model_main(["--arch", "qwen35", "--out", str(tmp_path / "b.gguf")] + bad) == 2
        last = capsys.readouterr().err.strip().splitlines()[-1]
        print(last)
        assert last.startswith("kvcompile: error:") and msg in last
    with pytest.raises(Exception, match="is a folder"):
        make_model("qwen35", "tiny", tmp_path)


@pytest.mark.parametrize("kind,vocab", [("bytes", 1024), ("smollm2", 4096), ("smollm2", 60000)])
def test_synthetic_tokenizer_agrees_with_llama_cpp(kind, vocab, tmp_path):
    from llama_cpp import Llama

    from kvcompile.io.tokenizer import load_tokenizer
    path = tmp_path / f"tok-{kind}.gguf"
    write_synthetic_gguf(preset_config("llama", "tiny", vocab_size=vocab, n_layers=1,
                                       tokenizer=kind), path, "f32", seed=0)
    llm = Llama(model_path=str(path), n_ctx=64, n_threads=2, verbose=False, vocab_only=True)
    ours = load_tokenizer(path)
    texts = ["Hello there, the cat sat on the mat.", "  spaces\tand\nnewlines  ",
             "Ünïcödé ✓ 日本語 🙂", "<|im_start|>user\nhi<|im_end|>", "x = 3.14159 * (2 ** 10)"]
    for text in texts:
        ref = llm.tokenize(text.encode(), add_bos=False, special=True)
        got = ours.encode(text)
        assert got == ref, (text, got, ref)
        assert llm.detokenize(ref, special=True).decode() == text
    print(f"{kind} vocab {vocab}: {len(texts)} texts, ids equal llama.cpp's, e.g. "
          f"{ours.encode(texts[0])[:12]}")
