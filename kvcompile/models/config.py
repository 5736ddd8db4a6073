"""Model geometry, independent of the file format it was read from."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ModelConfig:
    arch: str                     # GGUF general.architecture (models/registry.py)
    n_layers: int
    hidden: int
    ffn: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab_size: int
    context_length: int
    rms_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_dim: int | None = None   # rotated dims per head; None means head_dim
    rope_neox: bool = False       # False: GGUF llama layout (adjacent pairs); True: NEOX halves
    rope_scaling: dict = field(default_factory=dict)
    tie_embeddings: bool = False
    name: str = ""
    # attention variants of the dense families (models/families/)
    qkv_bias: bool = False        # qwen2: biases on the q, k and v projections
    qk_norm: bool = False         # qwen3: per-head RMSNorm of q and k before rope
    # sliding-window attention (mistral, gemma3): a windowed layer's rows see their last
    # `sliding_window` positions; with a pattern n > 1 every n-th layer ((i + 1) % n == 0)
    # is global, the others windowed (gemma3: 6); pattern 1: every layer windowed
    sliding_window: int = 0
    sliding_window_pattern: int = 1
    rope_theta_local: float = 0.0  # gemma3: the windowed layers' rope base, unscaled (0: none)
    attn_scale: float = 0.0        # the scores' scale; 0: 1 / sqrt(head_dim)
    final_logit_softcap: float = 0.0   # logits = cap * tanh(logits / cap) where > 0
    # hybrid models (qwen35): Gated DeltaNet recurrent layers between full-attention layers
    full_attention_interval: int = 1   # layer i is attention iff (i + 1) % interval == 0
    ssm_conv_kernel: int = 0
    ssm_k_heads: int = 0
    ssm_v_heads: int = 0
    ssm_head_dim: int = 0
    nextn_layers: int = 0              # NextN/MTP layers stored after the n_layers main ones

    def layer_window(self, i: int) -> int:
        """Layer i's sliding window, 0 for a global layer."""
        n = self.sliding_window_pattern
        if not self.sliding_window or (n > 1 and (i + 1) % n == 0):
            return 0
        return self.sliding_window

    def is_attention_layer(self, i: int) -> bool:
        return (i + 1) % self.full_attention_interval == 0

    @property
    def rotary_dim(self) -> int:
        return self.rope_dim or self.head_dim

    @property
    def n_params_attn_kv(self) -> int:
        return self.n_kv_heads * self.head_dim
