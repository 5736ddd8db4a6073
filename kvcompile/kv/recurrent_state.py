"""Recurrent state of a hybrid model's Gated DeltaNet layers, owned by the runtime.

Per GDN layer: the conv state (the last K-1 inputs of the short convolution, oldest first)
and the delta-rule state matrices [Hv, Dk, Dv]. Both are fp32 whatever the weights' dtype:
the state is summed into at every token, so rounding would accumulate.

The tensors are allocated once and only ever updated in place (copy_), so their addresses
stay fixed for CUDA graphs; snapshot/restore copy into and out of them. This state never
enters the KV page pool: the KV policy only sees attention layers.

Speculative verify: `reserve_rows(R)` allocates the buffers of verify forwards of up to R
rows; a forward asked for checkpoints records each GDN layer's state before its first row
and every row's recurrence inputs (the conv input; q and k of the key heads, v, gate, beta
packed), all through `kvcompile::checkpoint_capture`, and runs the rows through the decode
rule. Then `rollback(keep)` puts the state back and reruns the delta rule over the first
`keep` rows' recorded inputs, every layer's kept rows in one call (q and k tiled to the
value heads, the layers' heads side by side): the same opaque recurrence, which steps row
by row, on the same inputs, so the state is bit for bit the one the forward held after row
keep-1. A row costs conv_dim + 2 D Hk + D Hv + 2 Hv floats a layer instead of a whole state
(157 MB at the 27B geometry), so wide verify rounds fit a device budget.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcompile.models.config import ModelConfig
from kvcompile.errors import KvLayoutError
from kvcompile.models.gated_deltanet import expand_key_heads, gdn_recurrent


@dataclass
class RecurrentSnapshot:
    conv: torch.Tensor
    ssm: torch.Tensor
    n_tokens: int


class RecurrentState:
    def __init__(self, config: ModelConfig, device="cpu"):
        self.layers = tuple(i for i in range(config.n_layers) if not config.is_attention_layer(i))
        self._slot = {layer: j for j, layer in enumerate(self.layers)}
        kd = vd = config.ssm_head_dim
        conv_dim = 2 * config.ssm_k_heads * kd + config.ssm_v_heads * vd
        self.hk, self.hv, self.d = config.ssm_k_heads, config.ssm_v_heads, kd
        n = len(self.layers)
        self.conv = torch.zeros(n, max(config.ssm_conv_kernel - 1, 0), conv_dim,
                                dtype=torch.float32, device=device)
        self.ssm = torch.zeros(n, config.ssm_v_heads, kd, vd, dtype=torch.float32, device=device)
        self.n_tokens = 0   # positions consumed since the last reset (host-side bookkeeping)
        # once reserve_rows(R) ran: the state before a verify forward ([n, ...]) and its
        # rows' inputs ([R, n, conv_dim] and [R, n, packed q k v g beta])
        self.conv_before = self.ssm_before = self.conv_rows = self.in_rows = None
        self._forward_start = 0    # first position of the latest forward

    @property
    def nbytes(self) -> int:
        return self.conv.nbytes + self.ssm.nbytes

    @property
    def checkpoint_rows(self) -> int:
        return 0 if self.conv_rows is None else self.conv_rows.shape[0]

    @staticmethod
    def row_floats(hk: int, hv: int, d: int) -> int:
        """Floats of one layer's packed recurrence inputs a row: q, k (key heads), v,
        gate, beta."""
        return 2 * hk * d + hv * d + 2 * hv

    def reserve_rows(self, rows: int) -> None:
        """Buffers for verify forwards of up to `rows` rows (allocated once; a larger
        request replaces them)."""
        if rows > self.checkpoint_rows:
            n = len(self.layers)
            if self.conv_before is None:
                self.conv_before, self.ssm_before = self.conv.clone(), self.ssm.clone()
            self.conv_rows = self.conv.new_zeros((rows, n, self.conv.shape[-1]))
            self.in_rows = self.conv.new_zeros((rows, n, self.row_floats(self.hk, self.hv,
                                                                         self.d)))

    def checkpoints(self, i: int):
        """Model layer i's views of the verify buffers: (state before [1, K-1, C] and
        [1, Hv, Dk, Dv], conv inputs [R, C], packed inputs [R, P])."""
        if self.conv_rows is None:
            raise KvLayoutError("capturing verify checkpoints needs reserve_rows() first")
        j = self._slot[i]
        return (self.conv_before[j:j + 1], self.ssm_before[j:j + 1], self.conv_rows[:, j],
                self.in_rows[:, j])

    def rollback(self, keep: int) -> None:
        """Keep rows 0..keep-1 of the latest (checkpointed) forward: the state before it,
        then the delta rule over the kept rows' recorded inputs (module doc)."""
        consumed = self.n_tokens - self._forward_start
        if keep == consumed:
            return
        if not 1 <= keep < min(consumed, self.checkpoint_rows + 1):
            raise KvLayoutError(f"cannot keep {keep} rows of a forward of {consumed} rows "
                                f"with {self.checkpoint_rows} checkpoint rows")
        n, hk, hv, d = len(self.layers), self.hk, self.hv, self.d
        width = self.conv.shape[1]
        if width:
            window = torch.cat([self.conv_before, self.conv_rows[:keep].transpose(0, 1)], 1)
            self.conv.copy_(window[:, window.shape[1] - width:])
        # q, k tiled to the value heads (gated_deltanet.expand_key_heads), then every
        # layer's heads side by side, the kept rows in order: one call
        q, k, v, g, beta = self.in_rows[:keep].split([hk * d, hk * d, hv * d, hv, hv], dim=-1)
        heads = (keep, n * hv, d)
        q, k = (expand_key_heads(x.reshape(keep * n, hk, d), hv).reshape(heads) for x in (q, k))
        _, ssm = gdn_recurrent(q, k, v.reshape(heads),
                               g.reshape(keep, n * hv), beta.reshape(keep, n * hv),
                               self.ssm_before.view(n * hv, d, d), 1.0 / d ** 0.5)
        self.ssm.copy_(ssm.view(self.ssm.shape))
        self.n_tokens = self._forward_start + keep

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv state [K-1, conv_dim], ssm state [Hv, Dk, Dv]) views of model layer i."""
        return self.conv[self._slot[i]], self.ssm[self._slot[i]]

    def reset(self) -> None:
        self.conv.zero_()
        self.ssm.zero_()
        self.n_tokens = 0

    def snapshot(self, out: RecurrentSnapshot | None = None) -> RecurrentSnapshot:
        """Copy the state out (into `out`'s buffers when given, so nothing is allocated)."""
        if out is None:
            return RecurrentSnapshot(self.conv.clone(), self.ssm.clone(), self.n_tokens)
        out.conv.copy_(self.conv)
        out.ssm.copy_(self.ssm)
        out.n_tokens = self.n_tokens
        return out

    def restore(self, snap: RecurrentSnapshot) -> None:
        if snap.conv.shape != self.conv.shape or snap.ssm.shape != self.ssm.shape:
            raise KvLayoutError("this snapshot was taken from a model of another geometry")
        self.conv.copy_(snap.conv)
        self.ssm.copy_(snap.ssm)
        self.n_tokens = snap.n_tokens

    def begin(self, first_position: int, n_new: int) -> None:
        """Check that a forward continues exactly where the state stands (a forward from
        position 0 starts a new sequence), then account for its tokens."""
        if first_position == 0:
            self.reset()
        elif first_position != self.n_tokens:
            raise KvLayoutError(
                f"the recurrent state has consumed {self.n_tokens} tokens but this forward "
                f"starts at position {first_position}; a hybrid model cannot skip or repeat "
                f"positions: restore a snapshot taken at that position or restart from 0")
        self._forward_start = first_position
        self.n_tokens = first_position + n_new
