"""Gemma 3's text decoder: the dense decoder (models/llama.py) with Gemma's layer variants.

- the token embeddings scaled by sqrt(hidden) (in fp32, as llama.cpp does);
- a norm after the attention and after the MLP, before each is added to the residual
  stream (post_attention_norm, post_ffw_norm); GGUF files store Gemma's (1 + w) norm
  weights with the 1 added, so every norm is a plain RMSNorm;
- q/k RMSNorm per head before NEOX rope, GeGLU (tanh-approximated GELU) MLP;
- interleaved layers: five of every six attend over a sliding window with their own rope
  base (unscaled), the sixth over the whole context with the file's base and scaling
  (ModelConfig.layer_window / rope_theta_local);
- the logits soft-capped where the config has a cap.
"""
from __future__ import annotations

import math
from dataclasses import replace

import torch
import torch.nn.functional as F

from kvcompile.models.config import ModelConfig
from kvcompile.models.layers import RMSNorm, SwiGLU, rope_rows
from kvcompile.models.llama import _BLOCK_NAMES, LlamaBlock, LlamaModel
from kvcompile.models.rope import config_rope_tables


class GeGLU(SwiGLU):
    """down(gelu_tanh(gate(x)) * up(x)) (llama.cpp's GELU is the tanh approximation)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is not None:
            gate, up = self.gate_up(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate(x), self.up(x)
        return self.down(F.gelu(gate, approximate="tanh") * up)


class Gemma3Block(LlamaBlock):
    def __init__(self, c: ModelConfig, layer: int):
        super().__init__(c, layer)
        self.mlp = GeGLU(c.hidden, c.ffn)
        self.post_attn_norm = RMSNorm(c.hidden, c.rms_eps)
        self.post_ffw_norm = RMSNorm(c.hidden, c.rms_eps)

    def forward(self, x, mlp_out, cos, sin, q_pos, kv):
        """As LlamaBlock's; the MLP output it returns is already post-normed, so the next
        block (or the final norm) adds it as it is."""
        if mlp_out is None:
            h = self.attn_norm(x)
        else:
            x, h = self.attn_norm.add(x, mlp_out)
        x, h = self.ffn_norm.add(x, self.post_attn_norm(self.attn(h, cos, sin, q_pos, kv)))
        return x, self.post_ffw_norm(self.mlp(h))


class Gemma3Model(LlamaModel):
    block_class = Gemma3Block
    block_names = {**_BLOCK_NAMES, "post_attention_norm.weight": "post_attn_norm.weight",
                   "post_ffw_norm.weight": "post_ffw_norm.weight"}

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        cos, sin = config_rope_tables(local_rope_config(config))
        self.register_buffer("rope_cos_local", cos, persistent=False)
        self.register_buffer("rope_sin_local", sin, persistent=False)
        self.embed_scale = math.sqrt(config.hidden)

    def set_rope_tables(self, freq_factors, device) -> None:
        super().set_rope_tables(freq_factors, device)
        cos, sin = config_rope_tables(local_rope_config(self.config))
        self.rope_cos_local, self.rope_sin_local = cos.to(device), sin.to(device)

    def embed_rows(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        return (x.float() * self.embed_scale).to(x.dtype)

    def layer_ropes(self, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        neox = self.config.rope_neox
        full = rope_rows(self.rope_cos[positions], self.rope_sin[positions], neox)
        local = rope_rows(self.rope_cos_local[positions], self.rope_sin_local[positions], neox)
        return [local if self.config.layer_window(i) else full
                for i in range(self.config.n_layers)]


def local_rope_config(config: ModelConfig) -> ModelConfig:
    """The windowed layers' rope: their own base, no scaling (llama.cpp's swa rope)."""
    return replace(config, rope_theta=config.rope_theta_local or config.rope_theta,
                   rope_scaling={})

