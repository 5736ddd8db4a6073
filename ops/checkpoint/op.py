"""torch.ops.kvcompile.checkpoint_capture: record what a recurrent layer's rollback needs
during a verify forward, so that a rejected draft rolls the state back.

checkpoint_capture(conv_rows, ssm_rows, conv, ssm, row)
    conv and ssm are written into row `row` (< R) of conv_rows [R, ...] and ssm_rows
    [R, ...], one layer's views of the request slot's verify buffers
    (`RecurrentState.checkpoints`). A GDN layer records its state before the forward's rows
    (conv [K-1, C], ssm [Hv, Dk, Dv], into a one-row buffer) and the rows' recurrence inputs
    (conv inputs [T, C] and packed q, k, v, gate, beta [T, P], into buffers of a one-row
    view of rows row..row+T). A rollback to "rows 0..j kept" puts the state back and reruns
    rows 0..j (`RecurrentState.rollback`).

The op mutates its first two arguments and returns nothing, so the graph keeps it (a
mutation is a side effect) and a captured CUDA graph replays its two device copies; the
buffers' addresses never change. The copy is the whole semantics: the CPU and CUDA paths
are the same `copy_`, which is bitwise, so a rollback reruns the kept rows from exactly the
state and inputs the verify forward had.
"""
from __future__ import annotations

import torch

from kvcompile.errors import OpInputError


def check_checkpoint_args(conv_rows, ssm_rows, conv, ssm, row: int) -> None:
    if conv_rows.shape[1:] != conv.shape or ssm_rows.shape[1:] != ssm.shape:
        raise OpInputError(f"checkpoint_capture: buffers {tuple(conv_rows.shape)} / "
                           f"{tuple(ssm_rows.shape)} do not hold states {tuple(conv.shape)} / "
                           f"{tuple(ssm.shape)}")
    if not 0 <= row < min(conv_rows.shape[0], ssm_rows.shape[0]):
        raise OpInputError(f"checkpoint_capture: row {row} outside the {conv_rows.shape[0]} "
                           f"rows of the checkpoint buffers; verify at most that many rows")


@torch.library.custom_op("kvcompile::checkpoint_capture", mutates_args=("conv_rows", "ssm_rows"))
def checkpoint_capture(conv_rows: torch.Tensor, ssm_rows: torch.Tensor, conv: torch.Tensor,
                       ssm: torch.Tensor, row: int) -> None:
    check_checkpoint_args(conv_rows, ssm_rows, conv, ssm, row)
    conv_rows[row].copy_(conv)
    ssm_rows[row].copy_(ssm)


@checkpoint_capture.register_fake
def _(conv_rows, ssm_rows, conv, ssm, row):
    check_checkpoint_args(conv_rows, ssm_rows, conv, ssm, row)
