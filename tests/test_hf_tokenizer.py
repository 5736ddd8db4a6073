"""tokenizer.json from a Hugging Face folder: our Tokenizer against the `tokenizers`
library on the same file, and a HF folder generating the same tokens as its GGUF twin."""
import json
import random

import pytest

from kvcompile.engine.engine import Engine
from kvcompile.errors import UnsupportedModelError
from kvcompile.io.gguf.reader import open_gguf
from kvcompile.io.tokenizer import Tokenizer
from kvcompile.io.tokenizer.hf_json import _LLAMA3_SPLIT, hf_tokenizer_metadata
from test_hf_checkpoint import small_model  # noqa: F401  (fixture: 4-layer SmolLM2, GGUF + HF)

tokenizers = pytest.importorskip("tokenizers")

PRE_TOKENIZERS = {
    "smollm": {"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": True},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}]},
    "llama3": {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": _LLAMA3_SPLIT}, "behavior": "Isolated",
         "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]},
}


def write_tokenizer_files(folder, meta: dict, style: str) -> None:
    """A tokenizer.json + tokenizer_config.json holding the GGUF's vocabulary and merges."""
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    special = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                "normalized": False, "special": True} for i, (t, k) in enumerate(zip(tokens, types))
               if k == 3]
    tj = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": special,
          "normalizer": None, "pre_tokenizer": PRE_TOKENIZERS[style], "post_processor": None,
          "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                      "use_regex": True},
          "model": {"type": "BPE", "dropout": None, "unk_token": None,
                    "continuing_subword_prefix": None, "end_of_word_suffix": None,
                    "fuse_unk": False, "byte_fallback": False, "ignore_merges": style == "llama3",
                    "vocab": {t: i for i, t in enumerate(tokens)},
                    "merges": list(meta["tokenizer.ggml.merges"])}}
    (folder / "tokenizer.json").write_text(json.dumps(tj), encoding="utf-8")
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": tokens[meta["tokenizer.ggml.bos_token_id"]],
        "eos_token": tokens[meta["tokenizer.ggml.eos_token_id"]], "add_bos_token": False,
        "chat_template": meta["tokenizer.chat_template"]}), encoding="utf-8")


@pytest.fixture(scope="module")
def smollm2_meta(smollm2_path):
    return open_gguf(smollm2_path).metadata


def sample_texts(seed: int) -> list[str]:
    rng = random.Random(seed)
    words = ["the", " The", "12345", "3.14159", "don't", "WE'LL", "  spaces", "\n\n", "\t",
             "naïve", "café", "Über", "日本語", "привет", "مرحبا", "😀", "foo_bar(x)", "<|im_start|>",
             "  ", "x1y2z3", "!!!", " ?", "'s", "line\r\n"]
    return ["".join(rng.choice(words) for _ in range(rng.randint(1, 30))) for _ in range(300)]


@pytest.mark.parametrize("style", ["smollm", "llama3"])
def test_hf_tokenizer_json_matches_tokenizers_library(tmp_path, smollm2_meta, style):
    write_tokenizer_files(tmp_path, smollm2_meta, style)
    ours = Tokenizer.from_metadata(hf_tokenizer_metadata(tmp_path))
    theirs = tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    seed = random.randrange(1 << 30)
    texts = sample_texts(seed)
    mismatches = [t for t in texts
                  if ours.encode(t, add_bos=False) != theirs.encode(t, add_special_tokens=False).ids]
    print(f"{style} (seed {seed}): {len(texts) - len(mismatches)}/{len(texts)} texts identical")
    assert not mismatches, mismatches[:3]


def test_hf_pre_tokenizer_unknown_is_a_clear_error(tmp_path, smollm2_meta):
    write_tokenizer_files(tmp_path, smollm2_meta, "smollm")
    tj = json.loads((tmp_path / "tokenizer.json").read_text())
    tj["pre_tokenizer"] = {"type": "Whitespace"}
    (tmp_path / "tokenizer.json").write_text(json.dumps(tj))
    with pytest.raises(UnsupportedModelError, match="GGUF"):
        hf_tokenizer_metadata(tmp_path)


def test_hf_folder_generates_like_its_gguf(small_model, smollm2_meta):  # noqa: F811
    gguf_path, hf_dir, _ = small_model
    write_tokenizer_files(hf_dir, smollm2_meta, "smollm")
    messages = [{"role": "user", "content": "List two colours."}]
    from_gguf = Engine(str(gguf_path), ctx_size=256, progress=False)
    from_hf = Engine(str(hf_dir), ctx_size=256, progress=False)
    a = from_gguf.generate(messages=messages, max_tokens=12, temperature=0)
    b = from_hf.generate(messages=messages, max_tokens=12, temperature=0)
    print(repr(a.text), repr(b.text))
    assert a.prompt_tokens == b.prompt_tokens and a.token_ids == b.token_ids
