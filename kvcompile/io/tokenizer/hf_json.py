"""A Hugging Face checkpoint's tokenizer.json (+ tokenizer_config.json) as GGUF-style
tokenizer metadata, so HF folders use the same Tokenizer as GGUF files.

Only byte-level BPE vocabularies are read; their pre-tokenizer is recognised by its
structure (and, for regex splits, by the exact pattern) and mapped to llama.cpp's name.
"""
from __future__ import annotations

import json
from pathlib import Path

from kvcompile.errors import ModelFileError, UnsupportedModelError
from kvcompile.io.tokenizer.special import TokenType

_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
_SPLIT_NAMES = {_LLAMA3_SPLIT: "llama3", _QWEN2_SPLIT: "qwen2"}


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise ModelFileError(f"cannot parse {path} ({exc}); re-download it") from exc


def _pre_name(pre: dict | None, where: Path) -> str:
    steps = (pre or {}).get("pretokenizers", []) if (pre or {}).get("type") == "Sequence" else [pre or {}]
    kinds = [s.get("type") for s in steps]
    regex_bytelevel = kinds[-1:] == ["ByteLevel"] and steps[-1].get("use_regex", True)
    if kinds == ["ByteLevel"] and regex_bytelevel:
        return "gpt-2"
    if kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits") and regex_bytelevel:
        return "smollm"
    if kinds == ["Split", "ByteLevel"] and not regex_bytelevel:
        name = _SPLIT_NAMES.get((steps[0].get("pattern") or {}).get("Regex"))
        if name:
            return name
    raise UnsupportedModelError(
        f"the pre-tokenizer in {where} ({' + '.join(map(str, kinds)) or 'none'}) is not one "
        f"kvcompile recognises (GPT-2, SmolLM, Llama-3, Qwen2 styles); convert the model to "
        f"GGUF with llama.cpp's convert_hf_to_gguf.py and load the .gguf")


def _token_text(value) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


def hf_tokenizer_metadata(folder: str | Path) -> dict:
    folder = Path(folder)
    path = folder / "tokenizer.json"
    tj = _read_json(path)
    if not tj:
        raise ModelFileError(f"{folder} has no tokenizer.json; kvcompile needs it to tokenize "
                             f"(or convert the model to GGUF, which carries its tokenizer)")
    model = tj.get("model") or {}
    if model.get("type") != "BPE" or model.get("byte_fallback"):
        raise UnsupportedModelError(
            f"{path} holds a {model.get('type')!r} tokenizer"
            f"{' with byte fallback' if model.get('byte_fallback') else ''}; only byte-level BPE "
            f"is read from tokenizer.json: convert the model to GGUF instead")
    vocab: dict[str, int] = dict(model.get("vocab") or {})
    added = tj.get("added_tokens") or []
    vocab.update({t["content"]: t["id"] for t in added})
    n = max(vocab.values()) + 1
    tokens = [f"[PAD{i}]" for i in range(n)]
    types = [int(TokenType.UNUSED)] * n
    for text, i in vocab.items():
        tokens[i], types[i] = text, int(TokenType.NORMAL)
    for t in added:
        types[t["id"]] = int(TokenType.CONTROL if t.get("special") else TokenType.USER_DEFINED)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]

    cfg = _read_json(folder / "tokenizer_config.json")
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": _pre_name(tj.get("pre_tokenizer"), path),
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.add_bos_token": bool(cfg.get("add_bos_token", False)),
    }
    for key in ("bos", "eos"):
        text = _token_text(cfg.get(f"{key}_token"))
        if text in vocab:
            meta[f"tokenizer.ggml.{key}_token_id"] = vocab[text]
    template = cfg.get("chat_template")
    if isinstance(template, list):       # named templates: use the default one
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    if template:
        meta["tokenizer.chat_template"] = template
    return meta
