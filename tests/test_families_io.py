"""The model families' files and folders: make-model writes each family, HF folders of the
new families equal their GGUFs, configs that cannot run are refused, the layer variants
run in the executor's traced programs, and a file of an unsupported architecture is
refused fast, before its vocabulary is read (`info` still prints its metadata)."""
from __future__ import annotations

import json
import subprocess
import sys
import time

import gguf
import numpy as np
import pytest
import torch

from family_files import family_files, teacher_forced, tokens_of  # noqa: F401 (fixture)
from kvcompile.errors import UnsupportedModelError
from kvcompile.io.loader import load_model
from kvcompile.io.make_model import make_model
from kvcompile.io.weights import load_weights
from kvcompile.kv.store import KvStore
from kvcompile.models.registry import family_for_hf


@pytest.mark.parametrize("family,weight_type", [("qwen2", "q4_k"), ("qwen3", "f32"),
                                                ("mistral", "iq4_xs")])
def test_make_model_cli_writes_each_family(family, weight_type, tmp_path, capsys):
    from kvcompile.io.make_model import main
    from kvcompile.io.model_info import model_info
    out = tmp_path / f"{family}.gguf"
    assert main(["--arch", family, "--preset", "tiny", "--type", weight_type,
                 "--out", str(out)]) == 0
    info = model_info(out)
    print(capsys.readouterr().out)
    assert info["architecture"] == (family if family != "mistral" else "llama")
    assert info["head_dim"] == (128 if family == "mistral" else 64)


def write_hf_folder(gguf_path, folder, family: str) -> None:
    """An HF checkpoint of a NEOX-layout (qwen) GGUF: the same tensors under HF names."""
    from safetensors.torch import save_file
    w = load_weights(gguf_path, progress=False)
    c = w.config
    names = {g: h for h, g in family_for_hf(family).hf_tensor_names.items()}
    top = {"token_embd.weight": "model.embed_tokens.weight",
           "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
    hf = {}
    for name, t in w.tensors.items():
        _, i, rest = name.split(".", 2) if name.startswith("blk.") else (None, None, name)
        hf[top[name] if i is None else f"model.layers.{i}.{names[rest]}"] = t.contiguous()
    folder.mkdir()
    save_file(hf, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({
        "model_type": family, "hidden_size": c.hidden, "num_attention_heads": c.n_heads,
        "num_key_value_heads": c.n_kv_heads, "head_dim": c.head_dim, "intermediate_size": c.ffn,
        "num_hidden_layers": c.n_layers, "vocab_size": c.vocab_size,
        "max_position_embeddings": c.context_length, "rms_norm_eps": c.rms_eps,
        "rope_theta": c.rope_theta, "tie_word_embeddings": False,
        "sliding_window": 131072, "use_sliding_window": False}))


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_hf_folder_equals_its_gguf(family, family_files, tmp_path):
    path = family_files(family)
    write_hf_folder(path, tmp_path / "hf", family)
    w = load_weights(tmp_path / "hf", progress=False)
    assert w.config.qkv_bias == (family == "qwen2") and w.config.qk_norm == (family == "qwen3")
    hf_model = family_for_hf(family).model_class().from_weights(w.config, w.tensors)
    tokens = tokens_of(96, w.config.vocab_size, seed=8)
    ours = teacher_forced(hf_model, tokens, cuts=(48,))
    ref = teacher_forced(load_model(path, progress=False).model, tokens, cuts=(48,))
    assert (ours - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize("config,words", [
    ({"model_type": "qwen2", "sliding_window": 4096, "use_sliding_window": True},
     ["max_window_layers", "use_sliding_window false"]),
    ({"model_type": "gemma2"}, ["'gemma2' is not supported", "qwen3"]),
], ids=["qwen2-some-layers-windowed", "unknown-model-type"])
def test_hf_configs_that_cannot_run_are_refused(config, words):
    from kvcompile.io.hf_checkpoint import config_from_hf
    base = {"hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 128,
            "num_hidden_layers": 1, "vocab_size": 400, "max_position_embeddings": 32768}
    with pytest.raises(UnsupportedModelError) as err:
        config_from_hf({**base, **config})
    assert all(w in str(err.value) for w in words), err.value


def test_mistral_hf_window_windows_every_layer():
    """Mistral 7B v0.1's config.json: every layer over the last 4096 positions; a window as
    long as the context, or switched off, is none."""
    from kvcompile.io.hf_checkpoint import config_from_hf
    from kvcompile.models.layer_plan import LayerPlan
    base = {"model_type": "mistral", "hidden_size": 64, "num_attention_heads": 4,
            "intermediate_size": 128, "num_hidden_layers": 3, "vocab_size": 400,
            "max_position_embeddings": 32768}
    c = config_from_hf({**base, "sliding_window": 4096})
    assert c.sliding_window == 4096
    assert LayerPlan.of(c).windows == ((0, 4096), (1, 4096), (2, 4096))
    assert config_from_hf({**base, "sliding_window": 32768}).sliding_window == 0
    assert config_from_hf({**base, "sliding_window": 4096,
                           "use_sliding_window": False}).sliding_window == 0


@torch.inference_mode()
def test_traced_programs_of_the_layer_variants(tmp_path):
    """q/k norm and QKV bias in the executor's traced programs (a prefill chunk, decode and
    verify widths): equal to the eager model bit for bit."""
    from kvcompile.executor.executor import Executor
    path = tmp_path / "variants.gguf"
    make_model("qwen3", "tiny", path, qkv_bias=True, n_layers=2)
    model = load_model(path, progress=False).model
    assert model.config.qkv_bias and model.config.qk_norm
    prompt = tokens_of(140, model.config.vocab_size, seed=4)
    runs = []
    for traced in (False, True):
        store = KvStore.for_model(model, 512, "f32", "f32", 0, device=torch.device("cpu"))
        ex = Executor(model, store, ubatch=128, capture=traced, compile=traced)
        ex.begin_request(200)
        out = [ex.step(prompt[:128], 0), ex.step(prompt[128:], 128)]
        pos = len(prompt)
        for width in (1, 2, 1):
            out.append(ex.verify(prompt[:width], pos)[0])
            pos += width
        runs.append(out)
    assert {("prefill", 128), ("step", 1), ("step", 2)} <= set(ex.programs)
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def write_foreign_gguf(path, n_vocab: int = 200_000):
    """A header of an unsupported architecture with a large vocabulary (no tensors)."""
    w = gguf.GGUFWriter(str(path), "gemma2")
    w.add_uint32("gemma2.block_count", 2)
    w.add_token_list([f"tok{i}" for i in range(n_vocab)])
    w.add_token_scores(np.zeros(n_vocab, dtype=np.float32).tolist())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_unsupported_architecture_is_refused_before_its_vocabulary(tmp_path):
    from kvcompile.engine.engine import Engine
    path = write_foreign_gguf(tmp_path / "gemma2.gguf")
    t0 = time.perf_counter()
    with pytest.raises(UnsupportedModelError, match="'gemma2' is not supported") as err:
        Engine(str(path))
    seconds = time.perf_counter() - t0
    print(f"\nrefused in {seconds:.3f} s: {err.value}")
    assert seconds < 2.0 and "qwen3" in str(err.value)
    info = subprocess.run([sys.executable, "-m", "kvcompile", "info", str(path)],
                          capture_output=True, text=True, timeout=120)
    assert info.returncode == 1 and "gemma2.block_count" in info.stdout, info
    assert "'gemma2' is not supported" in info.stderr.splitlines()[-1], info.stderr


def test_gemma3_streamed_equals_all_resident(family_files):
    """Gemma 3's windowed layers over a streamed store give the all-resident greedy tokens:
    in a 1 MiB arena (no room for window rings: windows and the global layer's history
    cross from the host every step), and in 8 MiB, where each windowed layer keeps its
    window in a ring of its own and the global layer stays resident: nothing crosses."""
    from kvcompile.engine.engine import Engine
    path = str(family_files("gemma3"))
    prompt = tokens_of(400, 4096, seed=12)
    engines = [Engine(path, ctx_size=1024, kv_stream_arena_mib=mib, progress=False)
               for mib in (0, 1, 8)]
    runs = [e.generate(prompt, max_tokens=24, temperature=0) for e in engines]
    assert engines[1].store.streamer.rings is None and runs[1].kv["h2d_bytes"] > 0
    assert set(engines[2].store.streamer.rings.windows) == {0, 1, 2, 3, 4}
    assert runs[2].kv["h2d_bytes"] == 0, runs[2].kv
    ids = [r.token_ids for r in runs]
    assert ids[0] == ids[1] == ids[2] and len(ids[0]) == 24


def test_info_shows_the_sliding_windows(family_files):
    from kvcompile.io.model_info import format_model_info, model_info
    info = model_info(family_files("gemma3"))
    assert info["sliding_window"] == (64, 5)
    assert "window         64 positions on 5 of 6 layers" in format_model_info(info)
    assert model_info(family_files("qwen3"))["sliding_window"] is None


def test_gemma3_hf_folder_equals_its_gguf(family_files, tmp_path):
    """An HF gemma3_text checkpoint of the tiny GGUF (Gemma's (1 + w) norms stored as w,
    its own norm names, the config's sliding window, pattern and local rope base): the
    same logits as the GGUF."""
    from safetensors.torch import save_file
    path = family_files("gemma3")
    w = load_weights(path, progress=False)
    c = w.config
    names = {g: h for h, g in family_for_hf("gemma3_text").hf_tensor_names.items()}
    top = {"token_embd.weight": "model.embed_tokens.weight",
           "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
    hf = {}
    for name, t in w.tensors.items():
        _, i, rest = name.split(".", 2) if name.startswith("blk.") else (None, None, name)
        t = t - 1.0 if name.endswith("norm.weight") else t
        hf[top[name] if i is None else f"model.layers.{i}.{names[rest]}"] = t.contiguous()
    folder = tmp_path / "hf"
    folder.mkdir()
    save_file(hf, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({
        "model_type": "gemma3_text", "hidden_size": c.hidden, "num_attention_heads": c.n_heads,
        "num_key_value_heads": c.n_kv_heads, "head_dim": c.head_dim,
        "intermediate_size": c.ffn, "num_hidden_layers": c.n_layers,
        "vocab_size": c.vocab_size, "max_position_embeddings": c.context_length,
        "rms_norm_eps": c.rms_eps, "rope_theta": c.rope_theta, "rope_local_base_freq": 10000.0,
        "sliding_window": 64, "sliding_window_pattern": 6, "query_pre_attn_scalar": c.head_dim,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "tie_word_embeddings": False,
        "final_logit_softcapping": None}))
    hw = load_weights(folder, progress=False)
    assert hw.config.layer_window(0) == 64 and hw.config.layer_window(5) == 0
    assert torch.equal(hw.tensors["blk.0.attn_norm.weight"], w.tensors["blk.0.attn_norm.weight"])
    model = family_for_hf("gemma3_text").model_class().from_weights(hw.config, hw.tensors)
    tokens = tokens_of(200, c.vocab_size, seed=9)
    ours = teacher_forced(model, tokens, cuts=(100,))
    ref = teacher_forced(load_model(path, progress=False).model, tokens, cuts=(100,))
    assert (ours - ref).abs().max().item() < 1e-4
