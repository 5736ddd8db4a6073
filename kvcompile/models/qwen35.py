"""Qwen3.5-style hybrid decoder (GGUF arch `qwen35`) as a plain nn.Module.

Same calling convention as LlamaModel: `forward(tokens, positions, cache, last_only)`.
Attention layers keep their KV in the store's pages (only those layers need pages: the model
declares them in `layer_plan`); GDN layers keep a RecurrentState, which the store holds
beside them (`store.recurrent`, kv/recurrent_state.py); a forward starting at position 0
resets it. The NextN/MTP layer (stored as block n_layers) is loaded and run by
`mtp_forward`.
"""
from __future__ import annotations

import re
from dataclasses import replace

import torch
from torch import nn

from kvcompile.models.config import ModelConfig
from kvcompile.errors import ModelFileError, UnsupportedModelError
from kvcompile.models.layers import (Embedding, Linear, RMSNorm, check_rope_range, rope_rows,
                                     tie_head)
from kvcompile.models.llama import set_quantized
from kvcompile.models.layer_plan import LayerPlan
from kvcompile.models.qwen35_layers import HybridBlock, NextNLayer, padding_rows
from kvcompile.kv.recurrent_state import RecurrentState
from kvcompile.models.contract import KvAccess
from kvcompile.models.quant_weight import QuantWeight
from kvcompile.models.rope import config_rope_tables

_COMMON = {"attn_norm.weight": "attn_norm.weight", "post_attention_norm.weight": "post_norm.weight",
           "ffn_gate.weight": "mlp.gate.weight", "ffn_up.weight": "mlp.up.weight",
           "ffn_down.weight": "mlp.down.weight"}
_ATTENTION = {"attn_q.weight": "mixer.wq.weight", "attn_k.weight": "mixer.wk.weight",
              "attn_v.weight": "mixer.wv.weight", "attn_output.weight": "mixer.wo.weight",
              "attn_q_norm.weight": "mixer.q_norm.weight",
              "attn_k_norm.weight": "mixer.k_norm.weight"}
_GDN = {"attn_qkv.weight": "mixer.in_qkv.weight", "attn_gate.weight": "mixer.in_z.weight",
        "ssm_conv1d.weight": "mixer.conv_weight", "ssm_dt.bias": "mixer.dt_bias",
        "ssm_a": "mixer.a", "ssm_beta.weight": "mixer.in_beta.weight",
        "ssm_alpha.weight": "mixer.in_alpha.weight", "ssm_norm.weight": "mixer.norm.weight",
        "ssm_out.weight": "mixer.out.weight"}
_NEXTN = {"nextn.eh_proj.weight": "eh_proj.weight", "nextn.enorm.weight": "enorm.weight",
          "nextn.hnorm.weight": "hnorm.weight",
          "nextn.shared_head_norm.weight": "head_norm.weight"}
# optional MTP tensors; when absent the MTP layer shares the main model's
_NEXTN_SHARED = {"nextn.embed_tokens.weight": "token_embd.weight",
                 "nextn.shared_head_head.weight": "output.weight"}
_TOP = {"token_embd.weight": "embed.weight", "output_norm.weight": "norm.weight",
        "output.weight": "lm_head.weight"}


class Qwen35Model(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed = Embedding(config.vocab_size, config.hidden)
        self.blocks = nn.ModuleList(HybridBlock(config, config.is_attention_layer(i))
                                    for i in range(config.n_layers))
        self.norm = RMSNorm(config.hidden, config.rms_eps)
        self.lm_head = Linear(config.hidden, config.vocab_size, bias=False)
        self.mtp = NextNLayer(config) if config.nextn_layers else None
        # the MTP layer's own embedding / LM head when the file has them (else shared)
        self.mtp_embed: Embedding | None = None
        self.mtp_head: Linear | None = None
        self._set_rope(config)

    def _set_rope(self, c: ModelConfig, device=None):
        cos, sin = config_rope_tables(c)
        if device is not None:  # (re)build on a real device after a meta-device init
            cos, sin = cos.to(device), sin.to(device)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    # ---- layout -----------------------------------------------------------------------
    @property
    def layer_plan(self) -> LayerPlan:
        """GDN layers (recurrent), every full_attention_interval-th attention, the MTP layer."""
        return LayerPlan.of(self.config)

    @property
    def device(self) -> torch.device:
        return self.rope_cos.device

    def recurrent_state(self, store: KvAccess) -> RecurrentState:
        """The state of the GDN layers, which the store keeps beside the KV pages."""
        if store.recurrent is None:
            raise UnsupportedModelError("this KV store has no recurrent state for a hybrid "
                                        "model's GDN layers; make it with "
                                        "KvStore.for_model(model, ...)")
        return store.recurrent

    # ---- compute ----------------------------------------------------------------------
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache,
                last_only: bool = False, state: RecurrentState | None = None,
                return_hidden: bool = False, checkpoints: bool = False,
                state_begun: bool = False):
        """tokens, positions int64 [T] (consecutive); returns float32 logits [T, vocab]
        ([1, vocab] with last_only), plus the final normed hidden [T, hidden] (the MTP
        layer's input) with return_hidden. checkpoints: record what rolls the recurrent
        state back to any row (a speculative verify step; RecurrentState.rollback).
        state_begun: the caller ran the state's host bookkeeping (`state.begin`) for this
        forward already (a traced forward's runtime, which cannot leave it to the
        trace)."""
        state = state if state is not None else self.recurrent_state(cache)
        if not torch.compiler.is_compiling() and not state_begun:
            lo, _ = self._check_positions(positions, cache)   # consecutive: lo = positions[0]
            state.begin(lo, positions.shape[0])
        x = self.embed(tokens)
        cos, sin = rope_rows(self.rope_cos[positions], self.rope_sin[positions], neox=True)
        q_pos = positions.to(torch.int32)
        # a verify program's padding rows repeat the last row's position (executor.py)
        repeats = padding_rows(positions) if checkpoints else None
        for i, block in enumerate(self.blocks):
            if block.attention:
                kv = cache.layer(i)
                x = block(x, cos, sin, q_pos, kv)
            else:
                x = block(x, *state.layer(i),
                          (*state.checkpoints(i), repeats) if checkpoints else None)
        hidden = self.norm(x)
        logits = self.lm_head(hidden[-1:] if last_only else hidden).float()
        return (logits, hidden) if return_hidden else logits

    def mtp_forward(self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                    cache, return_hidden: bool = False, last_only: bool = False):
        """One MTP step for each row: row i mixes the embedding of tokens[i] with the main
        model's normed hidden state hidden[i] and attends (MTP layer KV) up to positions[i].
        Which token/position pairs with which hidden state is the caller's convention
        (typically hidden of position p with the token at p + 1). last_only: logits of the
        last row only ([1, vocab]; the hidden rows stay whole)."""
        if self.mtp is None:
            raise UnsupportedModelError("this model has no NextN/MTP layer; speculative "
                                        "decoding needs a drafter of another kind")
        layer = self.config.n_layers
        if not cache.has_layer(layer):
            raise UnsupportedModelError("the KV store has no pages for the MTP layer; make it "
                                        "with KvStore.for_model(model, ...)")
        if not torch.compiler.is_compiling():
            self._check_positions(positions, cache)
        kv = cache.layer(layer)
        cos, sin = rope_rows(self.rope_cos[positions], self.rope_sin[positions], neox=True)
        emb = (self.embed if self.mtp_embed is None else self.mtp_embed)(tokens)
        h = self.mtp(emb, hidden.to(emb.dtype), cos, sin, positions.to(torch.int32), kv)
        head = self.lm_head if self.mtp_head is None else self.mtp_head
        logits = head(h[-1:] if last_only else h).float()
        return (logits, h) if return_hidden else logits

    def _check_positions(self, positions, cache) -> tuple[int, int]:
        return check_rope_range(cache.check_positions(positions), self.rope_cos.shape[0])

    # ---- loading ----------------------------------------------------------------------
    @classmethod
    def from_weights(cls, config: ModelConfig, tensors: dict[str, torch.Tensor],
                     dtype=torch.float32, device="cpu") -> "Qwen35Model":
        """Build from tensors keyed by GGUF names ([out, in]); a missing tensor is named."""
        tied = "output.weight" not in tensors
        config = replace(config, tie_embeddings=tied)
        with torch.device("meta"):
            model = cls(config)
        expected = {name: _gguf_name(name, config) for name, _ in model.named_parameters()}
        state, shared = {}, {}
        for gguf_name, t in tensors.items():
            key = _module_name(gguf_name, config)
            (shared if key is None else state)[gguf_name if key is None else key] = t
        optional = {"mtp.head_norm.weight"} | ({"lm_head.weight"} if tied else set())
        missing = [g for n, g in expected.items() if n not in state and n not in optional]
        if missing:
            raise ModelFileError(
                f"the qwen35 model file lacks tensor(s) {missing[:5]}"
                f"{' ...' if len(missing) > 5 else ''}; it is incomplete or mislabelled")
        if "mtp.head_norm.weight" in expected:
            state.setdefault("mtp.head_norm.weight", state["norm.weight"])
        if tied:
            state["lm_head.weight"] = state["embed.weight"]
        for key, gguf_name in expected.items():
            want = tuple(model.get_parameter(key).shape)
            if tuple(state[key].shape) != want:
                raise ModelFileError(
                    f"tensor {gguf_name} has shape {tuple(state[key].shape)} but the "
                    f"metadata implies {want}; the file's metadata and tensors disagree")
        set_quantized(model, {k: state[k] for k in expected}, dtype)
        # vectors (norms, GDN decay/bias) and the conv kernel stay fp32, as GGUF stores them
        model.load_state_dict({k: state[k].to(device=device, dtype=_param_dtype(k, state[k], dtype))
                               for k in expected if not isinstance(state[k], QuantWeight)},
                              strict=False, assign=True)
        if tied:
            tie_head(model.lm_head, model.embed)
        mtp = f"blk.{config.n_layers}.nextn."
        if mtp + "embed_tokens.weight" in shared:
            model.mtp_embed = _own(Embedding, shared[mtp + "embed_tokens.weight"], device, dtype)
        if mtp + "shared_head_head.weight" in shared:
            model.mtp_head = _own(Linear, shared[mtp + "shared_head_head.weight"], device, dtype)
        model._set_rope(config, device)
        return model.eval()


def _own(cls, w, device, dtype):
    """The MTP layer's own embedding or LM head (Embedding / Linear) from a file tensor."""
    rows, cols = w.shape
    module = (cls(rows, cols, device="meta") if cls is Embedding
              else cls(cols, rows, bias=False, device="meta"))
    if isinstance(w, QuantWeight):
        module.set_quantized(*((w, dtype) if cls is Embedding else (w,)))
    else:
        module.weight = nn.Parameter(w.to(device=device, dtype=dtype), requires_grad=False)
    return module.requires_grad_(False)


def _param_dtype(key: str, t: torch.Tensor, dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if t.dim() == 1 or key.endswith("conv_weight") else dtype


def _module_name(gguf_name: str, c: ModelConfig) -> str | None:
    if gguf_name in _TOP:
        return _TOP[gguf_name]
    m = re.fullmatch(r"blk\.(\d+)\.(.+)", gguf_name)
    if m:
        i, rest = int(m.group(1)), m.group(2)
        if i < c.n_layers:
            table = {**_COMMON, **(_ATTENTION if c.is_attention_layer(i) else _GDN)}
            if rest in table:
                return f"blocks.{i}.{table[rest]}"
        elif i < c.n_layers + c.nextn_layers:
            if rest in _NEXTN:
                return f"mtp.{_NEXTN[rest]}"
            if rest in {**_COMMON, **_ATTENTION}:
                return f"mtp.block.{ {**_COMMON, **_ATTENTION}[rest]}"
            if rest in _NEXTN_SHARED:
                return None  # loaded separately
    raise UnsupportedModelError(f"tensor {gguf_name!r} has no place in a qwen35 model with "
                                f"{c.n_layers} layers (+{c.nextn_layers} NextN); the file "
                                f"needs a different architecture or its metadata is wrong")


def _gguf_name(param: str, c: ModelConfig) -> str:
    """Inverse of _module_name, for error messages."""
    inverse_top = {v: k for k, v in _TOP.items()}
    if param in inverse_top:
        return inverse_top[param]
    if param.startswith("mtp."):
        rest = param[len("mtp."):]
        block = rest[len("block."):] if rest.startswith("block.") else None
        table = {**_COMMON, **_ATTENTION} if block is not None else _NEXTN
        inverse = {v: k for k, v in table.items()}
        return f"blk.{c.n_layers}.{inverse[block if block is not None else rest]}"
    _, i, rest = param.split(".", 2)
    table = {**_COMMON, **(_ATTENTION if c.is_attention_layer(int(i)) else _GDN)}
    return f"blk.{i}.{ {v: k for k, v in table.items()}[rest]}"
