"""The two token mixers of a qwen35 hybrid model, as the GGUF format defines them.

GatedAttention (every `full_attention_interval`-th layer): attn_q yields per head [query,
gate] (head_dim each); q and k get a per-head RMSNorm, then NEOX rope on the first
rotary dims; attention runs over the paged KV through the kvcompile ops; the result is
multiplied by sigmoid(gate) before attn_output.

GatedDeltaNetMixer (the other layers): attn_qkv -> short causal conv -> silu, split into
q, k (L2-normalized, key heads) and v (value heads); beta = sigmoid(ssm_beta x); the
log-decay g = softplus(ssm_alpha x + ssm_dt.bias) * ssm_a, where the file stores
ssm_a = -exp(A_log) already. The delta-rule output is RMS-normalized per head (ssm_norm)
and gated by silu(attn_gate x), then projected by ssm_out.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

import kvcompile.ops  # noqa: F401  (registers torch.ops.kvcompile.*)
from kvcompile.models.config import ModelConfig
from kvcompile.models.gated_deltanet import causal_conv, gdn_chunked, gdn_recurrent
from kvcompile.models.layers import Linear, RMSNorm, SwiGLU, apply_rope_rows


class GatedAttention(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = c.n_heads, c.n_kv_heads, c.head_dim
        self.scale = 1.0 / math.sqrt(c.head_dim)
        self.wq = Linear(c.hidden, 2 * c.n_heads * c.head_dim, bias=False)
        self.wk = Linear(c.hidden, c.n_kv_heads * c.head_dim, bias=False)
        self.wv = Linear(c.hidden, c.n_kv_heads * c.head_dim, bias=False)
        self.wo = Linear(c.n_heads * c.head_dim, c.hidden, bias=False)
        self.q_norm = RMSNorm(c.head_dim, c.rms_eps)
        self.k_norm = RMSNorm(c.head_dim, c.rms_eps)

    def forward(self, x, cos, sin, q_pos, kv):
        t, d = x.shape[0], self.head_dim
        qg = self.wq(x).view(t, self.n_heads, 2 * d)
        q, gate = self.q_norm(qg[..., :d]), qg[..., d:]
        k = self.k_norm(self.wk(x).view(t, self.n_kv_heads, d))
        v = self.wv(x).view(t, self.n_kv_heads, d)
        q, k = apply_rope_rows(q, cos, sin, neox=True), apply_rope_rows(k, cos, sin, neox=True)
        k_rot, v_rot = kv.k_rot, kv.v_rot
        if k_rot is not None:         # quantized K is stored rotated (kvcompile.kv.rotation)
            q, k = q @ k_rot.to(q.dtype), k @ k_rot.to(k.dtype)
        if v_rot is not None:
            v = v @ v_rot.to(v.dtype)
        torch.ops.kvcompile.kv_write(kv.k_pool, kv.v_pool, k, v, q_pos,
                                     kv.k_type, kv.v_type, kv.page_size, kv.page_table)
        out = torch.ops.kvcompile.span_attention(q.contiguous(), kv.k_pool, kv.v_pool,
                                                 kv.page_table, q_pos, kv.k_type, kv.v_type,
                                                 kv.page_size, self.scale,
                                                 kv.workspace)
        if v_rot is not None:
            out = out @ v_rot.to(out.dtype)
        out = out.to(x.dtype) * torch.sigmoid(gate)
        return self.wo(out.reshape(t, self.n_heads * d))


class GatedDeltaNetMixer(nn.Module):
    def __init__(self, c: ModelConfig, chunk: int = 64):
        super().__init__()
        self.hk, self.hv, self.d = c.ssm_k_heads, c.ssm_v_heads, c.ssm_head_dim
        self.eps, self.chunk = c.rms_eps, chunk
        value_dim = self.hv * self.d
        conv_dim = 2 * self.hk * self.d + value_dim
        self.in_qkv = Linear(c.hidden, conv_dim, bias=False)
        self.in_z = Linear(c.hidden, value_dim, bias=False)
        self.in_beta = Linear(c.hidden, self.hv, bias=False)
        self.in_alpha = Linear(c.hidden, self.hv, bias=False)
        self.conv_weight = nn.Parameter(torch.zeros(conv_dim, c.ssm_conv_kernel))
        self.dt_bias = nn.Parameter(torch.zeros(self.hv))
        self.a = nn.Parameter(torch.zeros(self.hv))       # -exp(A_log), as stored
        self.norm = RMSNorm(self.d, c.rms_eps)
        self.out = Linear(value_dim, c.hidden, bias=False)

    def forward(self, x: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor,
                checkpoints=None):
        """x [T, hidden]; conv_state [K-1, conv_dim] and ssm_state [Hv, D, D] (fp32) are
        read and updated in place. checkpoints (a verify forward: RecurrentState.checkpoints
        and padding_rows): the state before the first row and every row's recurrence inputs
        are recorded and the rows run through the decode rule, so a rejected
        draft rolls back to any row (RecurrentState.rollback reruns the kept rows). A
        padding row (a program's, after the real rows) gives the row before it's output,
        so the layers after this one see it equal to that row and write that row's KV
        bytes again; the state it leaves is undone by the executor's rollback."""
        if checkpoints is None:
            return self._mix(x, conv_state, ssm_state)
        conv_before, ssm_before, conv_rows, in_rows, repeats = checkpoints
        torch.ops.kvcompile.checkpoint_capture(conv_before, ssm_before, conv_state,
                                               ssm_state, 0)
        if x.shape[0] > 1 and x.device.type == "cpu":
            return self._rows_as_decode_steps(x, conv_state, ssm_state, checkpoints)
        return self._mix(x, conv_state, ssm_state, record=(conv_rows, in_rows, repeats))

    def _mix(self, x, conv_state, ssm_state, record=None, row: int = 0):
        """The mixer over x's rows; record (conv rows, packed input rows, repeats): the
        rows' recurrence inputs go to rows row.. of those buffers and the rows run through
        the decode rule (_rows_in_order)."""
        t, kd = x.shape[0], self.hk * self.d
        # the recurrence runs in fp32 whatever the weights' dtype
        conv_in = self.in_qkv(x).float()
        mixed, new_conv = causal_conv(conv_in, conv_state, self.conv_weight.float())
        mixed = F.silu(mixed)
        q = _l2norm(mixed[:, :kd].view(t, self.hk, self.d), self.eps)
        k = _l2norm(mixed[:, kd:2 * kd].view(t, self.hk, self.d), self.eps)
        v = mixed[:, 2 * kd:].view(t, self.hv, self.d)
        beta = torch.sigmoid(self.in_beta(x).float())
        g = F.softplus(self.in_alpha(x).float() + self.dt_bias.float()) * self.a.float()
        scale = 1.0 / math.sqrt(self.d)
        if record is not None:
            conv_rows, in_rows, repeats = record
            packed = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1), g, beta],
                               dim=-1)
            torch.ops.kvcompile.checkpoint_capture(conv_rows[None, row:row + t],
                                                   in_rows[None, row:row + t], conv_in,
                                                   packed, 0)
            o, new_ssm = self._rows_in_order(q, k, v, g, beta, ssm_state, scale, repeats)
        elif t == 1:
            o, new_ssm = gdn_recurrent(q, k, v, g, beta, ssm_state, scale)
        else:
            o, new_ssm = gdn_chunked(q, k, v, g, beta, ssm_state, scale, chunk=self.chunk)
        conv_state.copy_(new_conv)
        ssm_state.copy_(new_ssm)
        z = self.in_z(x).float().view(t, self.hv, self.d)
        o = self.norm(o) * F.silu(z)
        return self.out(o.reshape(t, self.hv * self.d).to(x.dtype))

    def _rows_as_decode_steps(self, x, conv_state, ssm_state, checkpoints):
        """The CPU's verify rows: each one the whole mixer as a one-row decode step, its
        inputs recorded. CPU kernels round a row inside a batch differently from the row
        alone (vectorized exp / sigmoid loops and GEMM blocking depend on the row count),
        so batched rows would reach states a decode step never reaches."""
        _, _, conv_rows, in_rows, repeats = checkpoints
        outs = []
        for r in range(x.shape[0]):
            out = self._mix(x[r:r + 1], conv_state, ssm_state, (conv_rows, in_rows, None), r)
            outs.append(torch.where(repeats[r], outs[-1], out) if r else out)
        return torch.cat(outs)

    @staticmethod
    def _rows_in_order(q, k, v, g, beta, ssm, scale, repeats):
        """The rows through gdn_recurrent, the decode rule, in one call: its kernel (fla's
        fused recurrence, one compiled kernel whatever the row count; the reference's
        loop) steps row by row with the state in fp32, so row r's output and state are
        those of r + 1 one-row decode steps. A padding row (repeats) gives the output of
        the last real row before it."""
        o, ssm = gdn_recurrent(q, k, v, g, beta, ssm, scale)
        if repeats is not None and q.shape[0] > 1:
            o = o.index_select(0, torch.cumsum(~repeats, 0) - 1)
        return o, ssm


def padding_rows(positions: torch.Tensor) -> torch.Tensor:
    """bool [T]: the rows that repeat the position of the row before (a program's padding)."""
    return torch.cat([positions.new_zeros(1, dtype=torch.bool), positions[1:] == positions[:-1]])


def _l2norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    # ggml_l2_norm: x / max(||x||, eps)
    return x / x.norm(dim=-1, keepdim=True).clamp_min(eps)


class HybridBlock(nn.Module):
    """Pre-norm residual block: x += mixer(attn_norm x); x += mlp(post_attention_norm x)."""

    def __init__(self, c: ModelConfig, attention: bool):
        super().__init__()
        self.attention = attention
        self.attn_norm = RMSNorm(c.hidden, c.rms_eps)
        self.mixer = GatedAttention(c) if attention else GatedDeltaNetMixer(c)
        self.post_norm = RMSNorm(c.hidden, c.rms_eps)
        self.mlp = SwiGLU(c.hidden, c.ffn)

    def forward(self, x, *mixer_args):
        # the mixer's residual add inside the post norm's kernel (RMSNorm.add), same bits
        x, h = self.post_norm.add(x, self.mixer(self.attn_norm(x), *mixer_args))
        return x + self.mlp(h)


class NextNLayer(nn.Module):
    """The MTP head: h' = block(eh_proj([enorm(embed(token)), hnorm(h)])), logits from
    head_norm(h'). `h` is the main model's final hidden state after output_norm."""

    def __init__(self, c: ModelConfig):
        super().__init__()
        self.enorm = RMSNorm(c.hidden, c.rms_eps)
        self.hnorm = RMSNorm(c.hidden, c.rms_eps)
        self.eh_proj = Linear(2 * c.hidden, c.hidden, bias=False)
        self.block = HybridBlock(c, attention=True)
        self.head_norm = RMSNorm(c.hidden, c.rms_eps)

    def forward(self, embedded, hidden, cos, sin, q_pos, kv):
        x = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1))
        return self.head_norm(self.block(x, cos, sin, q_pos, kv))
