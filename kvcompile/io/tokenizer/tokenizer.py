"""Tokenizer built from GGUF metadata: byte-level BPE (`gpt2`), llama SentencePiece (`llama`)
or Gemma 4's SentencePiece-style BPE (`gemma4`: merges over raw UTF-8, '▁' for spaces).

Behaviour follows llama.cpp's vocabulary (its `llama_tokenize` / `llama_detokenize`), which
is the oracle the tests compare against.
"""
from __future__ import annotations

import numbers

from kvcompile.errors import ModelFileError, UnsupportedModelError
from kvcompile.io.tokenizer.bpe import BytePairEncoder, bpe_text_to_bytes, parse_merges
from kvcompile.io.tokenizer.chat import render_chat_template
from kvcompile.io.tokenizer.detokenize import clean_up_spaces
from kvcompile.io.tokenizer.errors import TokenizerError
from kvcompile.io.tokenizer.pretokenize import PreTokenizer, pre_tokenizer_spec
from kvcompile.io.tokenizer.special import (END_OF_TURN_TEXTS, SpecialTokenSplitter, TokenType,
                                         effective_types)
from kvcompile.io.tokenizer.spm import SPACE_MARK, SentencePieceEncoder

_KEY = "tokenizer.ggml."
_SPECIAL_OR_UNKNOWN = (TokenType.CONTROL, TokenType.UNKNOWN)


class Tokenizer:
    """Text <-> token ids for one vocabulary; build it with `from_metadata` (GGUF key/values)
    or `kvcompile.io.tokenizer.load_tokenizer(path)`. `encode` returns llama.cpp's
    `llama_tokenize` ids; `decode` returns `llama_detokenize`'s text (remove_special =
    skip_special, unparse_special = not skip_special). Not implemented: per-token lstrip /
    rstrip attributes (llama.cpp sets them only for Phi-3 and some BERT-style models)."""

    def __init__(self, *, model: str, tokens: list[str], types: list[int], scores: list[float],
                 merges: list[str], pre: str | None, bos_id: int | None, eos_id: int | None,
                 add_bos: bool | None, add_eos: bool, add_space_prefix: bool | None,
                 chat_template: str | None):
        self.model = model
        self.pre = pre
        self._tokens = tokens
        self._types = effective_types(tokens, types, eos_id)
        self._token_to_id = {text: i for i, text in enumerate(tokens)}
        self.bos_id, self.eos_id = bos_id, eos_id
        self.add_eos = add_eos
        self.chat_template = chat_template
        self._splitter = SpecialTokenSplitter(tokens, self._types)
        # token texts are GPT-2 byte-to-char strings (not '▁' SentencePiece-style text)
        self._byte_level = False
        if model in ("gpt2", "gemma4"):
            spec = pre_tokenizer_spec(pre)
            self._pre = PreTokenizer(spec)
            self._byte_level = not spec.spm_style
            self._bpe = BytePairEncoder(self._token_to_id, parse_merges(merges), spec.ignore_merges,
                                        self._byte_level, spec.whole_newline_runs)
            self.add_bos = spec.force_add_bos or (spec.default_add_bos if add_bos is None
                                                  else add_bos)
            self.add_space_prefix = False  # llama.cpp ignores the key for BPE vocabularies
            self._clean_spaces = spec.clean_spaces
        else:
            self._spm = SentencePieceEncoder(self._token_to_id, scores)
            self.add_bos = True if add_bos is None else add_bos
            self.add_space_prefix = True if add_space_prefix is None else add_space_prefix
            self._clean_spaces = False
        self._pieces = [self._render(i) for i in range(len(tokens))]
        self._hidden_unless_special = [t in _SPECIAL_OR_UNKNOWN for t in self._types]

    # ---- construction -------------------------------------------------------------------

    @classmethod
    def from_metadata(cls, meta: dict[str, object]) -> "Tokenizer":
        model = meta.get(_KEY + "model")
        if model not in ("gpt2", "llama", "gemma4"):
            raise UnsupportedModelError(
                f"tokenizer.ggml.model = {model!r} is not supported; kvcompile reads 'gpt2' "
                f"(byte-level BPE), 'llama' (SentencePiece) and 'gemma4' vocabularies")
        tokens = _list_of(meta, "tokens", str, required=True)
        n = len(tokens)
        types = [int(t) for t in _list_of(meta, "token_type", numbers.Integral)]
        types = types or [int(TokenType.NORMAL)] * n
        scores = [float(s) for s in _list_of(meta, "scores", numbers.Real)] or [0.0] * n
        merges = _list_of(meta, "merges", str, required=(model != "llama"))
        if len(types) != n or len(scores) != n:
            raise ModelFileError(
                f"tokenizer metadata is inconsistent: {n} tokens but {len(types)} token types "
                f"and {len(scores)} scores; re-convert the model")
        default_bos, default_eos = {"llama": (1, 2), "gpt2": (11, 11)}.get(model, (None, None))
        pre = {"gpt2": meta.get(_KEY + "pre"), "gemma4": "gemma4"}.get(model)  # as llama.cpp
        return cls(
            model=model, tokens=tokens, types=types, scores=scores, merges=merges, pre=pre,
            bos_id=_token_id(meta, "bos_token_id", default_bos, n),
            eos_id=_token_id(meta, "eos_token_id", default_eos, n),
            add_bos=_opt_bool(meta, "add_bos_token"),
            add_eos=bool(_opt_bool(meta, "add_eos_token")),
            add_space_prefix=_opt_bool(meta, "add_space_prefix"),
            chat_template=meta.get("tokenizer.chat_template") or None)

    # ---- properties ---------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return len(self._tokens)

    @property
    def stop_ids(self) -> list[int]:
        """Ids that end generation: EOS and the end-of-turn tokens present in the vocab."""
        ids = {self.eos_id} if self.eos_id is not None else set()
        ids.update(i for t in END_OF_TURN_TEXTS if (i := self._token_to_id.get(t)) is not None
                   and self._types[i] == TokenType.CONTROL)
        return sorted(ids)

    def token_text(self, token_id: int) -> str:
        """The vocabulary entry as stored (e.g. 'Ġthe', '▁the', '<0x0A>')."""
        return self._tokens[self._check_id(token_id)]

    def token_id(self, text: str) -> int | None:
        return self._token_to_id.get(text)

    # ---- encode -------------------------------------------------------------------------

    def encode(self, text: str, add_bos: bool | None = None, parse_special: bool = True,
               add_eos: bool | None = None) -> list[int]:
        """Text -> token ids. add_bos/add_eos None follow the model's metadata."""
        if not isinstance(text, str):
            raise TokenizerError(f"encode() takes a str, got {type(text).__name__}; decode "
                                 f"bytes as UTF-8 first")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise TokenizerError(
                f"text has a lone surrogate code point {text[exc.start]!r} at index {exc.start}, "
                f"which is not valid Unicode; decode input bytes with errors='replace'") from None
        add_bos = self.add_bos if add_bos is None else add_bos
        add_eos = self.add_eos if add_eos is None else add_eos
        out: list[int] = []
        if add_bos:
            out.append(self._required_id(self.bos_id, "BOS"))
        parts = self._splitter.split(text, parse_special)
        if self.model != "llama":
            for part in parts:
                if isinstance(part, int):
                    out.append(part)
                    continue
                if not self._byte_level:
                    part = part.replace(" ", SPACE_MARK)
                for word in self._pre.split(part):
                    out.extend(self._bpe.encode_word(word))
        else:
            prev_special = True  # the first raw fragment gets the space prefix too
            for part in parts:
                if isinstance(part, int):
                    out.append(part)
                    prev_special = True
                    continue
                if self.add_space_prefix and prev_special:
                    part = " " + part
                out.extend(self._spm.encode(part.replace(" ", SPACE_MARK)))
                prev_special = False
        if add_eos:
            out.append(self._required_id(self.eos_id, "EOS"))
        return out

    # ---- decode -------------------------------------------------------------------------

    def token_bytes(self, token_id: int, special: bool = True) -> bytes:
        """The bytes one token stands for (control tokens as their text unless special=False).
        A multi-byte character can be split across tokens: join bytes before decoding."""
        i = self._check_id(token_id)
        if not special and self._hidden_unless_special[i]:
            return b""
        return self._pieces[i]

    def decode_bytes(self, ids: list[int], skip_special: bool = False) -> bytes:
        ids = list(ids)
        strip_space = self.add_space_prefix
        if skip_special and self.add_bos and ids and ids[0] == self.bos_id:
            ids, strip_space = ids[1:], False
        if skip_special and self.add_eos and ids and ids[-1] == self.eos_id:
            ids = ids[:-1]
        out = bytearray()
        for k, tid in enumerate(ids):
            piece = self.token_bytes(tid, special=not skip_special)
            if k == 0 and strip_space and piece.startswith(b" "):
                piece = piece[1:]
            out += piece
        data = bytes(out)
        return clean_up_spaces(data) if self._clean_spaces else data

    def decode(self, ids: list[int], skip_special: bool = False) -> str:
        """Token ids -> text, as llama.cpp's detokenizer (invalid UTF-8 becomes U+FFFD)."""
        return self.decode_bytes(ids, skip_special).decode("utf-8", errors="replace")

    # ---- chat ---------------------------------------------------------------------------

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            template: str | None = None, **extra) -> str:
        """Render chat messages with the model's Jinja template (or `template`)."""
        return render_chat_template(
            template if template is not None else self.chat_template, messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self._text_or_empty(self.bos_id),
            eos_token=self._text_or_empty(self.eos_id), **extra)

    # ---- helpers ------------------------------------------------------------------------

    def _render(self, i: int) -> bytes:
        text, kind = self._tokens[i], self._types[i]
        if kind in (TokenType.CONTROL, TokenType.UNKNOWN, TokenType.USER_DEFINED):
            return text.encode("utf-8")
        if kind == TokenType.NORMAL:
            if self._byte_level:
                return bpe_text_to_bytes(text)
            return text.replace(SPACE_MARK, " ").encode("utf-8")
        if kind == TokenType.BYTE and len(text) == 6 and text.startswith("<0x"):
            return bytes([int(text[3:5], 16)])
        return b""  # unused / undefined tokens print nothing, as in llama.cpp

    def _check_id(self, token_id: int) -> int:
        i = int(token_id)
        if not 0 <= i < len(self._tokens):
            raise TokenizerError(f"token id {token_id} is outside the vocabulary "
                                 f"(0..{len(self._tokens) - 1})")
        return i

    def _required_id(self, token_id: int | None, name: str) -> int:
        if token_id is None:
            raise TokenizerError(f"the model defines no {name} token; call encode() with "
                                 f"add_{name.lower()}=False")
        return token_id

    def _text_or_empty(self, token_id: int | None) -> str:
        return "" if token_id is None else self._tokens[token_id]

    def __repr__(self) -> str:
        return (f"Tokenizer(model={self.model!r}, pre={self.pre!r}, vocab_size={self.vocab_size}, "
                f"bos_id={self.bos_id}, eos_id={self.eos_id}, add_bos={self.add_bos})")


def _list_of(meta: dict, key: str, kind, required: bool = False) -> list:
    value = meta.get(_KEY + key)
    if value is None:
        if required:
            raise ModelFileError(f"GGUF metadata lacks {_KEY + key}; the tokenizer cannot be "
                                 f"built, re-convert the model with its tokenizer")
        return []
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, kind) for v in value):
        what = {str: "strings", numbers.Integral: "integers"}.get(kind, "numbers")
        raise ModelFileError(f"GGUF metadata {_KEY + key} must be a list of {what}; the file "
                             f"is corrupt or was written by a broken converter")
    return list(value)


def _token_id(meta: dict, key: str, default: int | None, n_tokens: int) -> int | None:
    """A special token id; one outside the vocabulary means none (llama.cpp drops it too)."""
    value = meta.get(_KEY + key, default)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        return None
    return int(value) if 0 <= value < n_tokens else None


def _opt_bool(meta: dict, key: str) -> bool | None:
    value = meta.get(_KEY + key)
    return None if value is None else bool(value)
