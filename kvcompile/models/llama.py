"""The dense decoder of the llama-like families (llama, mistral, qwen2, qwen3: SmolLM2, Llama
2/3, Mistral, Qwen2.5, Qwen3, ...) as a plain nn.Module over a paged KV cache. The config
switches the attention variants (QKV bias, per-head q/k norm); a file's rope_freqs.weight
(Llama 3.1+) divides the rope frequencies."""
from __future__ import annotations

import re
from dataclasses import replace

import torch
from torch import nn

from kvcompile.models.config import ModelConfig
from kvcompile.errors import ModelFileError, UnsupportedModelError
from kvcompile.models.layer_plan import LayerPlan, windows_of
from kvcompile.models.layers import (Embedding, Linear, PagedAttention, RMSNorm, SwiGLU,
                                     check_rope_range, rope_rows, tie_head)
from kvcompile.models.quant_weight import QuantWeight
from kvcompile.models.rope import config_rope_tables

# GGUF tensor name (after "blk.{i}.") -> parameter name inside LlamaBlock
_BLOCK_NAMES = {
    **{f"attn_{h}.{p}": f"attn.w{h}.{p}" for h in "qkv" for p in ("weight", "bias")},
    **{f"ffn_{m}.weight": f"mlp.{m}.weight" for m in ("gate", "up", "down")},
    "attn_norm.weight": "attn_norm.weight",
    "attn_output.weight": "attn.wo.weight",
    "attn_q_norm.weight": "attn.q_norm.weight",
    "attn_k_norm.weight": "attn.k_norm.weight",
    "ffn_norm.weight": "ffn_norm.weight",
}
_TOP_NAMES = {"token_embd.weight": "embed.weight", "output_norm.weight": "norm.weight",
              "output.weight": "lm_head.weight"}
# unused by llama.cpp too; rope_freqs.weight becomes the rope tables, not a parameter
_IGNORED = re.compile(r"blk\.\d+\.attn_rot_embd\.weight|rope_freqs\.weight")


class LlamaBlock(nn.Module):
    def __init__(self, c: ModelConfig, layer: int):
        super().__init__()
        self.attn_norm = RMSNorm(c.hidden, c.rms_eps)
        self.attn = PagedAttention(c.hidden, c.n_heads, c.n_kv_heads, c.head_dim, c.rope_neox,
                                   c.qkv_bias, c.rms_eps if c.qk_norm else None,
                                   c.layer_window(layer), c.attn_scale)
        self.ffn_norm = RMSNorm(c.hidden, c.rms_eps)
        self.mlp = SwiGLU(c.hidden, c.ffn)

    def forward(self, x, mlp_out, cos, sin, q_pos, kv):
        """x: the residual stream; mlp_out: the previous block's MLP output, not yet added
        (None in the first block). Returns (x, this block's MLP output): every residual add
        runs inside the norm after it (RMSNorm.add), one kernel for both."""
        if mlp_out is None:
            h = self.attn_norm(x)
        else:
            x, h = self.attn_norm.add(x, mlp_out)
        x, h = self.ffn_norm.add(x, self.attn(h, cos, sin, q_pos, kv))
        return x, self.mlp(h)


class LlamaModel(nn.Module):
    # what a subclass of the dense decoder changes (models/gemma3.py): its block and the
    # GGUF names of the block's tensors
    block_class = LlamaBlock
    block_names = _BLOCK_NAMES

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed = Embedding(config.vocab_size, config.hidden)
        self.blocks = nn.ModuleList(self.block_class(config, i) for i in range(config.n_layers))
        self.norm = RMSNorm(config.hidden, config.rms_eps)
        self.lm_head = Linear(config.hidden, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        cos, sin = config_rope_tables(config)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    @classmethod
    def from_weights(cls, config: ModelConfig, tensors: dict[str, torch.Tensor],
                     dtype=torch.float32, device="cpu") -> "LlamaModel":
        """Build from tensors keyed by GGUF names (weights [out, in], dense tensors or
        QuantWeights kept in their block format); output.weight absent means the head is
        tied to token_embd; rope_freqs.weight, where present, divides the rope frequencies."""
        config = replace(config, tie_embeddings="output.weight" not in tensors,
                         qkv_bias=config.qkv_bias or "blk.0.attn_q.bias" in tensors)
        tied = config.tie_embeddings
        state = {}
        for name, t in tensors.items():
            key = _module_name(name, cls.block_names)
            if key is not None:
                state[key] = t
        with torch.device("meta"):
            model = cls(config)
        expected = dict(model.named_parameters(remove_duplicate=True))
        missing, extra = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
        if extra:
            raise ModelFileError(f"the model file has tensors {extra[:5]} beyond the "
                                 f"{config.n_layers} layers its metadata declares; the file's "
                                 f"metadata and tensors disagree")
        if missing:
            raise ModelFileError(f"the model file lacks tensors for {missing[:5]}"
                                 f"{' ...' if len(missing) > 5 else ''}; it is not a complete "
                                 f"{config.arch} checkpoint")
        for key, param in expected.items():
            if tuple(state[key].shape) != tuple(param.shape):
                raise ModelFileError(f"tensor {key} has shape {tuple(state[key].shape)}, the "
                                     f"config expects {tuple(param.shape)}; the file's metadata "
                                     f"and tensors disagree")
        set_quantized(model, state, dtype)
        # norm weights stay f32 (as GGUF stores them and llama.cpp applies them)
        model.load_state_dict({k: state[k].to(device=device, dtype=torch.float32 if
                                              k.endswith("norm.weight") else dtype)
                               for k in expected if not isinstance(state[k], QuantWeight)},
                              strict=False, assign=True)
        if tied:
            tie_head(model.lm_head, model.embed)
        factors = tensors.get("rope_freqs.weight")
        model.set_rope_tables(None if factors is None else factors.float(), device)
        model.fuse_projections()
        return model.eval().requires_grad_(False)   # inference only: no autograd bookkeeping

    def set_rope_tables(self, freq_factors: torch.Tensor | None, device) -> None:
        """The rope tables on `device` (freq_factors: rope_freqs.weight, or None)."""
        cos, sin = config_rope_tables(self.config, freq_factors)
        self.rope_cos, self.rope_sin = cos.to(device), sin.to(device)

    @property
    def device(self) -> torch.device:
        return self.rope_cos.device

    @property
    def layer_plan(self) -> LayerPlan:
        """Every layer is attention with KV pages (windowed where the config says); no
        recurrent state, no MTP layer."""
        layers = tuple(range(self.config.n_layers))
        return LayerPlan(self.config.n_layers, layers, windows=windows_of(self.config, layers))

    def fuse_projections(self) -> None:
        """q/k/v and gate/up as one GEMM each (layers.fuse_linears): fewer, larger GEMMs."""
        for block in self.blocks:
            block.attn.fuse()
            block.mlp.fuse()

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache,
                last_only: bool = False) -> torch.Tensor:
        """tokens, positions: int64 [T]; cache: the KV store (KvAccess). Returns float32 logits
        [T, vocab] (or [1, vocab] for the last row only)."""
        if not torch.compiler.is_compiling():
            self.check_positions(positions, cache)
        x = self.embed_rows(tokens)
        ropes = self.layer_ropes(positions)
        q_pos = positions.to(torch.int32)
        mlp_out = None
        for i, block in enumerate(self.blocks):
            kv = cache.layer(i)
            x, mlp_out = block(x, mlp_out, *ropes[i], q_pos, kv)
        if last_only:
            x, mlp_out = x[-1:], mlp_out[-1:]
        logits = self.lm_head(self.norm.add(x, mlp_out)[1]).float()
        cap = self.config.final_logit_softcap
        return cap * torch.tanh(logits / cap) if cap else logits

    def embed_rows(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embed(tokens)

    def layer_ropes(self, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's (cos, sin) rows (rope_rows) at `positions`: one table for all."""
        rows = rope_rows(self.rope_cos[positions], self.rope_sin[positions],
                         self.config.rope_neox)
        return [rows] * self.config.n_layers

    def check_positions(self, positions: torch.Tensor, cache) -> tuple[int, int]:
        """Host-side range check, (min, max) (eager only: the cache reads the positions
        once, a sync, so the compiled graph skips it)."""
        return check_rope_range(cache.check_positions(positions), self.rope_cos.shape[0])



def set_quantized(model: nn.Module, state: dict, dtype: torch.dtype) -> None:
    """Hand each QuantWeight of `state` (keyed by parameter name) to the Linear or
    Embedding that owns it; `dtype`: the activations' (a quantized embedding's output)."""
    for key, w in state.items():
        if isinstance(w, QuantWeight):
            owner, _, leaf = key.rpartition(".")
            module = model.get_submodule(owner)
            if leaf != "weight" or not isinstance(module, (Linear, Embedding)):
                raise ModelFileError(f"tensor {key} is stored quantized ({w.type_name}) but "
                                     f"its layer takes only dense weights; convert the file "
                                     f"with that tensor in F16 / F32")
            if isinstance(module, Embedding):
                module.set_quantized(w, dtype)
            else:
                module.set_quantized(w)


def _module_name(gguf_name: str, block_names: dict) -> str | None:
    if gguf_name in _TOP_NAMES:
        return _TOP_NAMES[gguf_name]
    m = re.fullmatch(r"blk\.(\d+)\.(.+)", gguf_name)
    if m and m.group(2) in block_names:
        return f"blocks.{m.group(1)}.{block_names[m.group(2)]}"
    if _IGNORED.fullmatch(gguf_name):
        return None
    raise UnsupportedModelError(f"tensor {gguf_name!r} has no place in a llama-family model; "
                                f"this file needs a different architecture")
