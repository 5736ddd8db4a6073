"""Recurrent state of a hybrid model's Gated DeltaNet layers, owned by the runtime.

Per GDN layer: the conv state (the last K-1 inputs of the short convolution, oldest first)
and the delta-rule state matrices [Hv, Dk, Dv]. Both are fp32 whatever the weights' dtype:
the state is summed into at every token, so rounding would accumulate.

The tensors are allocated once and only ever updated in place (copy_), so their addresses
stay fixed for CUDA graphs; snapshot/restore copy into and out of them. This state never
enters the KV page pool: the KV policy only sees attention layers.

Speculative verify: `reserve_rows(R)` allocates checkpoint buffers of R rows; a forward
asked for checkpoints runs each GDN layer's rows one at a time (the decode rule) and records
the state after every row (`kvcompile::checkpoint_capture`), so `rollback(keep)` restores
the state after row keep-1 of the last forward by one copy: no recompute.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcompile.models.config import ModelConfig
from kvcompile.errors import KvLayoutError


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
        n = len(self.layers)
        self.conv = torch.zeros(n, max(config.ssm_conv_kernel - 1, 0), conv_dim,
                                dtype=torch.float32, device=device)
        self.ssm = torch.zeros(n, config.ssm_v_heads, kd, vd, dtype=torch.float32, device=device)
        self.n_tokens = 0   # positions consumed since the last reset (host-side bookkeeping)
        self.conv_rows = self.ssm_rows = None      # [R, n, ...] once reserve_rows(R) ran
        self._forward_start = 0    # first position of the latest forward

    @property
    def nbytes(self) -> int:
        return self.conv.nbytes + self.ssm.nbytes

    @property
    def checkpoint_rows(self) -> int:
        return 0 if self.conv_rows is None else self.conv_rows.shape[0]

    def reserve_rows(self, rows: int) -> None:
        """Checkpoint buffers for verify forwards of up to `rows` rows (allocated once; a
        larger request replaces them)."""
        if rows > self.checkpoint_rows:
            self.conv_rows = self.conv.new_zeros((rows, *self.conv.shape))
            self.ssm_rows = self.ssm.new_zeros((rows, *self.ssm.shape))

    def checkpoints(self, i: int):
        """(conv rows [R, K-1, C], ssm rows [R, Hv, Dk, Dv]): model layer i's views of the
        checkpoint buffers."""
        if self.conv_rows is None:
            raise KvLayoutError("capturing verify checkpoints needs reserve_rows() first")
        j = self._slot[i]
        return self.conv_rows[:, j], self.ssm_rows[:, j]

    def rollback(self, keep: int) -> None:
        """Keep rows 0..keep-1 of the latest (checkpointed) forward: the state after row
        keep-1, as recorded, becomes the live state."""
        consumed = self.n_tokens - self._forward_start
        if keep == consumed:
            return
        if not 1 <= keep < min(consumed, self.checkpoint_rows + 1):
            raise KvLayoutError(f"cannot keep {keep} rows of a forward of {consumed} rows "
                                f"with {self.checkpoint_rows} checkpoint rows")
        self.conv.copy_(self.conv_rows[keep - 1])
        self.ssm.copy_(self.ssm_rows[keep - 1])
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
