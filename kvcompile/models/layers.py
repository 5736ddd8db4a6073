"""Building blocks of llama-family models: RMSNorm, rope, SwiGLU MLP, paged attention.

Attention never touches the KV cache directly: it writes new rows with
torch.ops.kvcompile.kv_write and reads with torch.ops.kvcompile.span_attention, both
addressed through a page table, so later passes can move pages (resident / ring) freely.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

import kvcompile.ops  # noqa: F401  (registers torch.ops.kvcompile.*)
from kvcompile.ops import rows
from kvcompile.ops.rope_rotate.naive import rope_f32
from kvcompile.errors import ContextLengthError
from kvcompile.models.quant_weight import QuantWeight, cat_rows, join_rows
from kvcompile.models.rope import rope_tables  # noqa: F401  (its older home: tests import it here)


class RMSNorm(nn.Module):
    cpu_kernels = False           # the CPU's C++ row kernels (use_cpu_kernels)

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """f32 math, x's dtype out: one kernel on CUDA (ops/rms_norm)."""
        return rows.rms_norm(x, self.weight, self.eps, self.cpu_kernels)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + residual, its norm): the residual add fused into the norm's kernel."""
        return rows.add_rms_norm(x, residual, self.weight, self.eps, self.cpu_kernels)


def check_rope_range(lo_hi: tuple[int, int], n_rope: int) -> tuple[int, int]:
    """Positions (min, max) against the rope table's length (the model's context)."""
    if lo_hi[1] >= n_rope:
        raise ContextLengthError(f"position {lo_hi[1]} is beyond the model's context length "
                                 f"{n_rope}; shorten the prompt or max tokens")
    return lo_hi


def rope_rows(cos: torch.Tensor, sin: torch.Tensor,
              neox: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [T, R/2] -> (cos, signed sin) [T, R] laid out like the rotated dims, so that
    rotating is `x * cos + partner(x) * sin` (rope_rotate, apply_rope_rows). The models build
    them once a forward for every layer."""
    if neox:
        return torch.cat([cos, cos], -1), torch.cat([-sin, sin], -1)
    return cos.repeat_interleave(2, -1), torch.stack([-sin, sin], -1).flatten(-2)


def apply_rope_rows(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    neox: bool) -> torch.Tensor:
    """x [T, H, D]; cos/sin [T, R] from rope_rows; rotates the first R dims in f32 and rounds
    once (rope_rotate's formula, ops/rope_rotate/naive.rope_f32): each output is a*c - b*s
    or b*c + a*s, rounded as the pairwise formula rounds it (the sign sits in the table:
    b*(-s) is -(b*s) exactly). Torch ops: qwen35's attention (llama layers use the
    rope_rotate op)."""
    rot = cos.shape[-1]
    out = rope_f32(x[..., :rot].float(), cos, sin, neox).to(x.dtype)
    rest = x[..., rot:]
    return torch.cat([out, rest], dim=-1) if rest.shape[-1] else out


class Linear(nn.Linear):
    """nn.Linear whose decode calls (a few rows, f16 / bf16, CUDA) take the gemv op, which
    streams the weight closer to HBM bandwidth than cuBLAS does for them (ops/gemv). A
    weight kept in its GGUF block format (`set_quantized`) goes through the qlinear op
    instead, for every row count (ops/qlinear)."""

    qtype = 0                     # ggml type id of a quantized weight; 0: dense `weight`
    cpu_kernels = False           # the CPU's C++ row kernels (use_cpu_kernels)

    def set_quantized(self, w: QuantWeight) -> None:
        """Take a quantized weight in place of the dense one (which is dropped)."""
        if tuple(w.shape) != (self.out_features, self.in_features):
            raise ValueError(f"weight {tuple(w.shape)} for a Linear "
                             f"{(self.out_features, self.in_features)}")
        self.weight = None
        self.register_buffer("qweight", w.planar)
        self.qtype = w.ggml_id
        self.qtype_name = w.type_name

    def quant_weight(self) -> QuantWeight | None:
        if not self.qtype:
            return None
        return QuantWeight(self.qweight, self.qtype_name, (self.out_features, self.in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.qtype:
            return rows.qlinear(x, self.qweight, self.qtype, self.in_features, self.bias)
        return rows.linear(x, self.weight, self.bias)

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of this fused [gate; up] projection (one kernel on the GEMV
        paths, ops/gemv and ops/qlinear)."""
        if self.qtype:
            if x.shape[0] <= 8 and x.is_cuda:
                return torch.ops.kvcompile.qlinear(x, self.qweight, self.qtype,
                                                   self.in_features, self.bias, True)
            return rows.silu_mul(self(x), self.cpu_kernels)
        return rows.linear_silu_mul(x, self.weight, self.bias)


class Embedding(nn.Embedding):
    """nn.Embedding whose table may stay in its GGUF block format: the rows asked for are
    dequantized by the qembedding op into `dtype` (set with the weight)."""

    qtype = 0
    cpu_kernels = False           # the CPU's C++ kernels (use_cpu_kernels)

    def set_quantized(self, w: QuantWeight, dtype: torch.dtype) -> None:
        if tuple(w.shape) != (self.num_embeddings, self.embedding_dim):
            raise ValueError(f"table {tuple(w.shape)} for an Embedding "
                             f"{(self.num_embeddings, self.embedding_dim)}")
        self.weight = None
        self.register_buffer("qweight", w.planar)
        self.qtype, self.qtype_name, self.out_dtype = w.ggml_id, w.type_name, dtype

    def quant_weight(self) -> QuantWeight | None:
        if not self.qtype:
            return None
        return QuantWeight(self.qweight, self.qtype_name,
                           (self.num_embeddings, self.embedding_dim))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.qtype:
            return rows.qembedding(self.qweight, self.qtype, self.embedding_dim, tokens,
                                   self.out_dtype, self.cpu_kernels)
        return super().forward(tokens)


def tie_head(head: Linear, embed: Embedding) -> None:
    """The LM head reads the token embedding's table (dense or quantized)."""
    q = embed.quant_weight()
    if q is None:
        head.weight = embed.weight
    else:
        head.set_quantized(q)


def fuse_linears(*linears: Linear) -> Linear | None:
    """One Linear computing all of `linears` (outputs concatenated), for one GEMM instead of
    several: a decode step reads every weight once, and small GEMMs reach a much smaller
    share of HBM bandwidth than one large one. The originals' weights (and biases) become
    views of the fused ones, so nothing is stored twice and they keep working. Quantized
    weights fuse when their types agree (rows are independent in every GGUF format);
    otherwise None: the projections stay separate."""
    has_bias = linears[0].bias is not None
    quant = [m.quant_weight() for m in linears]
    if any(q is not None for q in quant):
        fused_q = None if any(q is None for q in quant) else cat_rows(quant)
        if fused_q is None:
            return None
        fused = Linear(fused_q.shape[1], fused_q.shape[0], bias=has_bias, device="meta")
        fused.set_quantized(fused_q)
        start = 0
        for m in linears:
            n = m.out_features
            m.qweight = fused.qweight[start:start + n]
            start += n
    else:
        w = join_rows([m.weight for m in linears])
        fused = Linear(w.shape[1], w.shape[0], bias=has_bias, device="meta")
        fused.weight = nn.Parameter(w, requires_grad=False)
        start = 0
        for m in linears:
            n = m.weight.shape[0]
            m.weight = nn.Parameter(fused.weight[start:start + n], requires_grad=False)
            start += n
    if has_bias:
        fused.bias = nn.Parameter(join_rows([m.bias[:, None] for m in linears])[:, 0],
                                  requires_grad=False)
        start = 0
        for m in linears:
            n = m.out_features
            m.bias = nn.Parameter(fused.bias[start:start + n], requires_grad=False)
            start += n
    return fused


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.gate = Linear(hidden, ffn, bias=False)
        self.up = Linear(hidden, ffn, bias=False)
        self.down = Linear(ffn, hidden, bias=False)
        self.gate_up: nn.Linear | None = None     # set by fuse()

    def fuse(self) -> None:
        """gate and up as one GEMM (after the weights are loaded; None when their
        quantized types differ)."""
        self.gate_up = fuse_linears(self.gate, self.up)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is not None:
            return self.down(self.gate_up.silu_mul(x))
        return self.down(F.silu(self.gate(x)) * self.up(x))


class PagedAttention(nn.Module):
    cpu_kernels = False           # the CPU's C++ KV kernels (use_cpu_kernels)

    """GQA attention whose KV lives in page pools, read and written through the kvcompile ops.
    Variants: biases on q, k and v (qwen2); an RMSNorm over each q and k head before rope
    (qwen3, gemma3: `qk_norm_eps` given); a sliding window (`window` > 0: each row sees its
    last `window` positions); a score scale other than 1 / sqrt(head_dim) (gemma3 27B)."""

    def __init__(self, hidden: int, n_heads: int, n_kv_heads: int, head_dim: int,
                 rope_neox: bool, qkv_bias: bool = False, qk_norm_eps: float | None = None,
                 window: int = 0, scale: float = 0.0):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.rope_neox = rope_neox
        self.window = window
        self.scale = scale or 1.0 / math.sqrt(head_dim)
        self.wq = Linear(hidden, n_heads * head_dim, bias=qkv_bias)
        self.wk = Linear(hidden, n_kv_heads * head_dim, bias=qkv_bias)
        self.wv = Linear(hidden, n_kv_heads * head_dim, bias=qkv_bias)
        self.wo = Linear(n_heads * head_dim, hidden, bias=False)
        self.wqkv: nn.Linear | None = None        # set by fuse()
        norms = qk_norm_eps is not None
        self.q_norm = RMSNorm(head_dim, qk_norm_eps) if norms else None
        self.k_norm = RMSNorm(head_dim, qk_norm_eps) if norms else None

    def fuse(self) -> None:
        """q, k and v as one GEMM (after the weights are loaded)."""
        self.wqkv = fuse_linears(self.wq, self.wk, self.wv)

    def heads(self, x: torch.Tensor) -> torch.Tensor:
        """The q, k and v heads of x as one [T, Hq + 2 Hk, D] tensor (q and k normed per head
        where the model has q/k norms)."""
        t, d, hq, hk = x.shape[0], self.head_dim, self.n_heads, self.n_kv_heads
        if self.wqkv is None:
            qkv = torch.cat([self.wq(x), self.wk(x), self.wv(x)], -1).view(t, -1, d)
        else:
            qkv = self.wqkv(x).view(t, -1, d)
        if self.q_norm is None:
            return qkv
        q, k, v = qkv.split([hq, hk, hk], dim=1)
        return torch.cat([self.q_norm(q), self.k_norm(k), v], 1)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                q_pos: torch.Tensor, kv) -> torch.Tensor:
        """x [T, hidden]; cos/sin [T, R] (rope_rows); q_pos int32 [T] (each row's position:
        kv_write maps it through the page table to the row's slot); kv a LayerKv. Quantized
        K / V are stored rotated (kvcompile.kv.rotation): rope and both rotations are one
        rope_rotate; span_attention rotates its output back (in its reduce on decode)."""
        t, hq, hk = x.shape[0], self.n_heads, self.n_kv_heads
        qkv = rows.rope_rotate(self.heads(x), cos, sin, self.rope_neox, hq + hk, kv.k_rot,
                               kv.v_rot, self.cpu_kernels)
        q, k, v = qkv.split([hq, hk, hk], dim=1)
        rows.kv_write(kv.k_pool, kv.v_pool, k, v, q_pos, kv.k_type, kv.v_type, kv.page_size,
                      kv.page_table, self.cpu_kernels)
        out = rows.span_attention(q, kv.k_pool, kv.v_pool, kv.page_table, q_pos, kv.k_type,
                                  kv.v_type, kv.page_size, self.scale, kv.workspace,
                                  kv.v_rot_blocks, self.window, self.cpu_kernels)
        return self.wo(out.reshape(t, hq * self.head_dim))


def use_cpu_kernels(model: nn.Module) -> None:
    """The CPU's fast path (engine/dtypes.cpu_fast_path): the model's norms, projections and
    attention layers call the C++ CPU kernels in eager steps (ops/rows.py); without it
    they run the fp32 torch references."""
    for m in model.modules():
        if isinstance(m, (RMSNorm, Linear, Embedding, PagedAttention)):
            m.cpu_kernels = True
