"""Every ggml weight type loads correctly: files made by llama.cpp's own quantizer and by the
gguf package's, from the F32 SmolLM2. Loaded weights must equal the gguf package's
dequantization of the same bytes and sit close to the F32 weights (names, shapes, dimension
order); logits must agree with llama.cpp on the same file."""
from __future__ import annotations

import collections
import time

import gguf
import numpy as np
import pytest
import torch

from kvcompile.kv.store import KvStore
from kvcompile.models.llama import LlamaModel
from kvcompile.io.weights import load_weights
from llama_oracle import agreement, decisive_agreement, llama_cpp, llama_cpp_logits

# llama.cpp file types -> (ftype constant suffix, quantize every tensor with it ("pure")).
# SmolLM2's 576-wide rows are not a multiple of 256, so in K/IQ files only ffn_down takes the
# K/IQ type and the other tensors fall back to Q4_0..Q8_0 / IQ4_NL: the set below still puts
# every required type into some file (Q5_0 in Q4_K_M, Q5_1 in Q5_K_M, Q6_K in both, IQ4_NL
# in IQ4_XS), which test_every_required_type_covered checks.
LLAMA_CPP_FTYPES = {
    "Q8_0": ("Q8_0", False), "Q4_0": ("Q4_0", False), "Q4_1": ("Q4_1", False),
    "Q2_K": ("Q2_K", True),  # the default Q2_K mix stores no tensor as Q2_K for this model
    "Q3_K_S": ("Q3_K_S", True),
    "Q4_K_M": ("Q4_K_M", False), "Q5_K_M": ("Q5_K_M", False),
    "IQ4_XS": ("IQ4_XS", False), "F16": ("F16", False), "BF16": ("BF16", False),
}
# files whose weights are mostly below 4 bits: logits are printed, not held to 90% top-1
LOW_BIT_FILES = {"Q2_K", "Q3_K_S"}
# the list of types that must be covered by at least one file
REQUIRED_TYPES = {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K",
                  "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS"}
# types the gguf package can quantize, assigned round-robin over the 2D weights of one file
GGUF_PY_TYPES = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "BF16", "F16"]
N_TOKENS = 256
# Bounds for the files of 4 bits and more. llama.cpp quantizes the activations inside its
# quantized matmuls (Q8_K for the K-quants), which flips near-ties: over 8 windows x 7 files
# (2026-12-01) every top-1 difference had llama.cpp's top two logits within 0.74 of each
# other, top-1 over all rows was 0.898-0.98 (0.898 failed the earlier 0.90 floor) and the
# mean KL 2.4e-3-7.2e-3. So: no difference where llama.cpp's lead is >= DECISIVE_GAP
# (~90 of 256 rows a window), the mean KL bounded, and a loose floor on all rows.
DECISIVE_GAP = 1.0
MAX_MEAN_KL = 1.5e-2
MIN_TOP1 = 0.85
# Plain modern prose (~420 tokens); the window is drawn at random per session. Top-1
# agreement with llama.cpp is noisy over short windows (it quantizes activations, which flips
# near-ties), so the window is long.
TEXT = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a tin "
    "of oil and a notebook in which he recorded the weather, the ships that passed, and the "
    "birds that rested on the railing. Over thirty years the notebooks filled a shelf in the "
    "kitchen. When the lamp was finally automated, a historian from the mainland asked to "
    "read them, expecting dry lists of wind speeds. Instead she found sketches of storm "
    "clouds, recipes for fish soup, and a long letter, never sent, to a brother who had "
    "emigrated to Argentina. She spent the winter transcribing them.\n\n"
    "To install the package, create a virtual environment with Python 3.11, activate it, and "
    "run pip install with the name of the project. The command downloads the wheel, checks "
    "its hash, and places the files in the site-packages folder of the environment. If the "
    "installation fails because a compiler is missing, install the build tools for your "
    "operating system first: on Ubuntu this is the build-essential package, and on macOS it "
    "is the Xcode command line tools. After the installation finishes, open a Python shell "
    "and import the package to make sure that it works.\n\n"
    "Bread rises because yeast feeds on the sugars in the flour and releases carbon dioxide. "
    "The gas is trapped by a network of gluten proteins, which stretch as the dough is "
    "kneaded. A warm kitchen speeds the process up, while a cold refrigerator slows it down, "
    "which is why many bakers let their dough rest overnight to develop more flavor. When "
    "the loaf goes into a hot oven, the trapped gas expands one last time, the crust turns "
    "brown, and the kitchen fills with the smell of fresh bread."
)


def _quantize_llama_cpp(src, dst, ftype_name: str, pure: bool) -> None:
    import llama_cpp
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype_name}")
    params.nthread = 2
    params.pure = pure
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), params)
    assert rc == 0, f"llama.cpp failed to quantize to {ftype_name}"


def _quantize_gguf_py(src, dst) -> None:
    """Same metadata as src; every 2D weight except token_embd in the next GGUF_PY_TYPES type."""
    r = gguf.GGUFReader(str(src))
    w = gguf.GGUFWriter(str(dst), r.fields["general.architecture"].contents())
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.file_type"):
            continue
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, f.contents(), f.types[0], sub)
    w.add_file_type(gguf.LlamaFileType.GUESSED)
    i = 0
    for t in r.tensors:
        arr = np.array(t.data, dtype=np.float32).reshape(tuple(reversed(t.shape.tolist())))
        if arr.ndim == 1:
            w.add_tensor(t.name, arr)
            continue
        name = "Q8_0" if t.name == "token_embd.weight" else GGUF_PY_TYPES[i % len(GGUF_PY_TYPES)]
        i += t.name != "token_embd.weight"
        qtype = gguf.GGMLQuantizationType[name]
        w.add_tensor(t.name, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


class QuantizedFiles:
    """Quantizes on first request, once per session, into one tmp folder."""

    def __init__(self, f32_path, folder):
        self.f32_path, self.folder, self.paths = f32_path, folder, {}
        self.types: dict[str, collections.Counter] = {}  # filled by the per-file checks

    def __getitem__(self, label):
        if label not in self.paths:
            t0 = time.perf_counter()
            path = self.folder / f"smollm2-{label}.gguf"
            if label == "gguf-py":
                _quantize_gguf_py(self.f32_path, path)
            else:
                _quantize_llama_cpp(self.f32_path, path, *LLAMA_CPP_FTYPES[label])
            print(f"quantized {label} in {time.perf_counter() - t0:.1f} s")
            self.paths[label] = path
        return self.paths[label]


@pytest.fixture(scope="session")
def quantized_files(smollm2_f32_path, tmp_path_factory):
    return QuantizedFiles(smollm2_f32_path, tmp_path_factory.mktemp("quantized"))


@pytest.fixture(scope="session")
def f32_weights(smollm2_f32_path):
    return load_weights(smollm2_f32_path, progress=False).tensors


@pytest.fixture(scope="session")
def prompt_tokens(smollm2_path):
    from llama_cpp import Llama
    tok = Llama(str(smollm2_path), vocab_only=True, verbose=False)
    ids = tok.tokenize(TEXT.encode(), add_bos=False)
    start = int(np.random.default_rng().integers(0, len(ids) - N_TOKENS + 1))
    print(f"tokens {start}..{start + N_TOKENS} of {len(ids)}")
    return ids[start:start + N_TOKENS]


def _check_file_weights(path, loaded, f32_weights) -> tuple[collections.Counter, float]:
    """Loaded tensors == gguf.quants.dequantize of the file's bytes (random sample per type),
    same names/shapes as F32, and near the F32 values (a transposed load would not be)."""
    reader = gguf.GGUFReader(str(path))
    by_type = collections.defaultdict(list)
    for t in reader.tensors:
        by_type[t.tensor_type.name].append(t)
    assert set(loaded) == set(f32_weights)
    assert all(loaded[n].shape == f32_weights[n].shape for n in loaded)
    rng = np.random.default_rng()
    worst = 0.0
    for tname, group in by_type.items():
        for idx in rng.choice(len(group), min(3, len(group)), replace=False):
            t = group[idx]
            ref = gguf.quants.dequantize(np.array(t.data), t.tensor_type)
            ref = torch.from_numpy(np.ascontiguousarray(ref, dtype=np.float32))
            got = loaded[t.name]
            assert tuple(got.shape) == tuple(f32_weights[t.name].shape), t.name
            assert torch.equal(got, ref.reshape(got.shape)), (path.name, t.name, tname)
            f32 = f32_weights[t.name]
            worst = max(worst, ((got - f32).norm() / f32.norm()).item())
    assert worst < 0.6, f"{path.name}: a tensor is far from its F32 source (rel err {worst:.3f})"
    return collections.Counter({k: len(v) for k, v in by_type.items()}), worst


def _kvcompile_logits(w, tokens) -> torch.Tensor:
    model = LlamaModel.from_weights(w.config, w.tensors, dtype=torch.float32, device="cpu")
    cache = KvStore(w.config, max_tokens=len(tokens))
    with torch.inference_mode():
        return model(torch.tensor(tokens), torch.arange(len(tokens)), cache)


# the README's test command runs these; the others go with `-m slow` (CI runs both)
QUICK_FTYPES = ("Q8_0", "Q4_K_M", "Q5_K_M", "IQ4_XS", "gguf-py")


@pytest.mark.parametrize("label", [
    pytest.param(label, marks=() if label in QUICK_FTYPES else pytest.mark.slow)
    for label in [*LLAMA_CPP_FTYPES, "gguf-py"]])
def test_quant_file(label, quantized_files, f32_weights, prompt_tokens):
    path = quantized_files[label]
    w = load_weights(path, progress=False)
    types, worst = _check_file_weights(path, w.tensors, f32_weights)
    quantized_files.types[label] = types
    ours = _kvcompile_logits(w, prompt_tokens)
    del w
    ref = llama_cpp_logits(llama_cpp(path, n_ctx=2 * N_TOKENS), prompt_tokens)
    top1, kl, kl_max = agreement(ours, ref)
    sure, n_sure = decisive_agreement(ours, ref, DECISIVE_GAP)
    held = label not in LOW_BIT_FILES
    print(f"\n{label:8s} vs llama.cpp on the same file, {len(prompt_tokens)} tokens: "
          f"top1 {top1:6.1%} ({sure:6.1%} of {n_sure} rows led by >= {DECISIVE_GAP})  KL mean "
          f"{kl:.2e} max {kl_max:.2e}  weight rel err <= {worst:.3f}"
          f"  {'' if held else '(below 4 bits: not held to the bounds) '}{dict(types)}")
    if held:
        assert n_sure >= N_TOKENS // 5 and sure == 1.0, \
            f"{label}: top-1 differs from llama.cpp where its lead is >= {DECISIVE_GAP}"
        assert kl <= MAX_MEAN_KL and top1 >= MIN_TOP1, (label, top1, kl)


@pytest.mark.slow          # the coverage of all the files above, the slow ones included
def test_every_required_type_covered(quantized_files):
    seen = set()
    for label in [*LLAMA_CPP_FTYPES, "gguf-py"]:
        if label not in quantized_files.types:  # this test run alone
            reader = gguf.GGUFReader(str(quantized_files[label]))
            quantized_files.types[label] = collections.Counter(
                t.tensor_type.name for t in reader.tensors)
        seen |= set(quantized_files.types[label])
    print("types exercised:", sorted(seen))
    missing = REQUIRED_TYPES - seen
    assert not missing, f"no quantized file holds {sorted(missing)}"
