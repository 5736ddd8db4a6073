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
        and padding_rows): the rows run one at a time through the decode rule and the state
        after each is recorded, so a rejected draft rolls back to any row. A padding row
        (a program's, after the real rows) gives the row before it's output, so the layers
        after this one see it equal to that row and write that row's KV bytes again; the
        state it leaves is undone by the executor (the checkpoint of the last real row)."""
        t, kd = x.shape[0], self.hk * self.d
        if checkpoints is not None and t > 1 and x.device.type == "cpu":
            return self._rows_as_decode_steps(x, conv_state, ssm_state, checkpoints)
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
        if checkpoints is not None:
            o, new_ssm = self._rows_with_checkpoints(q, k, v, g, beta, ssm_state, scale,
                                                     conv_in, conv_state, checkpoints)
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
        """The CPU's verify rows: each one the whole mixer as a one-row decode step, then
        its state recorded. CPU kernels round a row inside a batch differently from the
        row alone (vectorized exp / sigmoid loops and GEMM blocking depend on the row
        count), so batched rows would record states a decode step never reaches."""
        conv_rows, ssm_rows, repeats = checkpoints
        outs = []
        for r in range(x.shape[0]):
            out = self(x[r:r + 1], conv_state, ssm_state)
            outs.append(torch.where(repeats[r], outs[-1], out) if r else out)
            torch.ops.kvcompile.checkpoint_capture(conv_rows, ssm_rows, conv_state,
                                                   ssm_state, r)
        return torch.cat(outs)

    @staticmethod
    def _rows_with_checkpoints(q, k, v, g, beta, ssm, scale, conv_in, conv_state, checkpoints):
        """Row r through gdn_recurrent (what a one-token decode step runs), then its state
        (the conv window of the last K-1 inputs, the delta-rule matrices) to checkpoint r."""
        conv_rows, ssm_rows, repeats = checkpoints
        width = conv_state.shape[0]
        inputs = torch.cat([conv_state.to(conv_in.dtype), conv_in], dim=0)
        outs = []
        for r in range(q.shape[0]):
            sl = slice(r, r + 1)
            o, ssm = gdn_recurrent(q[sl], k[sl], v[sl], g[sl], beta[sl], ssm, scale)
            torch.ops.kvcompile.checkpoint_capture(conv_rows, ssm_rows,
                                                   inputs[r + 1:r + 1 + width], ssm, r)
            outs.append(torch.where(repeats[r], outs[-1], o) if r else o)
        return torch.cat(outs), ssm


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
