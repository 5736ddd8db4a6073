"""The decode kernels' scratch: per (KV head, chunk, query row) partial max, sum and
accumulator in fp32, carved from one caller-provided buffer.

A cache allocates the buffer once (sized by `decode_workspace_floats` for its widest verify)
so decode allocates nothing per call: the memory stays inside what the cache owns and a
captured CUDA graph replays against the same addresses. Without a buffer the launchers
allocate one per call (tests, benchmarks).
"""
from __future__ import annotations

import torch

from kvcompile.errors import KvLayoutError


# Most programs an SM any decode launch default asks for (decode_blocks.blocks_config,
# decode_transposed.transposed_config, decode_kernel.legacy_programs_per_sm): what a
# cache's workspace is sized for.
MAX_PROGRAMS_PER_SM = 8


def chunks_per_head(n_kv_heads: int, sms: int, programs_per_sm: int) -> int:
    """How many chunks a KV head's context is cut into at most: about programs_per_sm
    programs an SM over all heads (decode_split.decode_chunking; the workspace bound)."""
    return max(1, (programs_per_sm * sms) // n_kv_heads)


def decode_workspace_floats(n_kv_heads: int, head_dim: int, max_rows: int, sms: int,
                            programs_per_sm: int = MAX_PROGRAMS_PER_SM) -> int:
    """fp32 elements the decode split needs for up to `max_rows` query rows a KV head
    (rows x group). decode_chunking never makes more than programs_per_sm * sms // n_kv
    chunks a head (ceil(n / ceil(n / w)) <= w)."""
    max_chunks = chunks_per_head(n_kv_heads, sms, programs_per_sm)
    return n_kv_heads * max_chunks * max_rows * (head_dim + 2)


def carve(workspace: torch.Tensor | None, n_kv: int, n_chunks: int, mrows: int, head_dim: int,
          device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(m, l, acc) views [n_kv, n_chunks, mrows(, head_dim)] of `workspace` (or new)."""
    part = n_kv * n_chunks * mrows
    need = part * (head_dim + 2)
    if workspace is None:
        workspace = torch.empty(need, device=device, dtype=torch.float32)
    elif (workspace.dtype != torch.float32 or workspace.dim() != 1
          or not workspace.is_contiguous() or workspace.device != torch.device(device)):
        raise KvLayoutError(f"the decode workspace must be a contiguous 1-D fp32 tensor on "
                            f"{device}, got {workspace.dtype} {tuple(workspace.shape)} on "
                            f"{workspace.device}")
    elif workspace.numel() < need:
        raise KvLayoutError(f"the decode workspace holds {workspace.numel()} floats, this call "
                            f"needs {need} ({n_kv} KV heads x {n_chunks} chunks x {mrows} rows "
                            f"x (head dim {head_dim} + 2)); size it with "
                            f"decode_workspace_floats()")
    m = workspace[:part].view(n_kv, n_chunks, mrows)
    l = workspace[part:2 * part].view(n_kv, n_chunks, mrows)
    acc = workspace[2 * part:need].view(n_kv, n_chunks, mrows, head_dim)
    return m, l, acc
