"""The geometry of a synthetic model (`make-model`): the fields every family's presets set
(models/families/*.py) and the writer reads (synthetic.py, synthetic_presets.py)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SyntheticConfig:
    arch: str                        # general.architecture written: llama, qwen2, qwen3, qwen35
    n_layers: int                    # main stack, without NextN layers
    hidden: int
    ffn: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab_size: int
    context_length: int = 4096
    rope_theta: float = 10000.0
    rope_dim: int | None = None      # rotated dims per head (None: all)
    rms_eps: float = 1e-6
    logit_gain: float = 2.0          # std of the logits for a unit-RMS final hidden state
    residual_gain: float = 1.0       # gain of the matrices that write the residual stream
    # attention variants of the dense families
    qkv_bias: bool = False           # qwen2: biases on the q, k and v projections
    qk_norm: bool = False            # qwen3: per-head RMSNorm of q and k before rope
    post_norms: bool = False         # gemma3: norms after the attention and after the MLP
    sliding_window: int = 0          # mistral, gemma3: the windowed layers' window
    final_logit_softcap: float = 0.0   # gemma3: logits capped by cap * tanh(x / cap)
    # rope scaling: "" none, "linear" / "yarn" (metadata keys), "llama3" (a rope_freqs tensor)
    rope_scaling: str = ""
    rope_factor: float = 1.0
    rope_original_context: int = 0   # yarn / llama3: the context the model was trained at
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    # qwen35 hybrid
    full_attention_interval: int = 4
    gdn_k_heads: int = 0
    gdn_v_heads: int = 0
    gdn_head_dim: int = 0
    conv_kernel: int = 4
    nextn_layers: int = 0
    name: str = ""
    tokenizer: str = "auto"          # synthetic_vocab: auto, smollm2 or bytes

    @property
    def hybrid(self) -> bool:
        """Gated DeltaNet layers between the attention layers (qwen35)."""
        return self.gdn_v_heads > 0

    def is_full_attention(self, layer: int) -> bool:
        return not self.hybrid or (layer + 1) % self.full_attention_interval == 0

    @property
    def rotary_dim(self) -> int:
        return self.rope_dim or self.head_dim
