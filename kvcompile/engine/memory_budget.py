"""The device-memory budget: weights + workspace + KV arena <= --gpu-memory-gib.

Everything is known before the weights load: the weights' device bytes from the file's
header (weights.weight_plan), the workspace from the geometry (below), the KV from the
context and cache types. `plan_budget` splits the budget or says, part by part, why it
cannot; `enforce` then caps torch's allocator at the budget, so a step that would need
more fails with a clear error instead of growing past it.

Workspace (what the forward allocates besides weights and KV): rope tables, the recurrent
state of hybrid models, the decode kernels' scratch, one prefill ubatch's activations
(4 bytes an element of a layer's widths: the bf16 activations twice over, room for a
layer's temporaries and the caching allocator's rounding; docs/findings.md, "Streaming and
PCIe", has a measured peak), the fp16 span a prefill launch dequantizes quantized pages into,
and a fixed reserve for cuBLAS / Triton workspaces and
CUDA-graph pools.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcompile.errors import ArenaError
from kvcompile.ops import kv_format as F
from kvcompile.ops.span_attention.dequant_pages import DEQUANT_ROWS, dequant_bytes

GIB, MIB = 1 << 30, 1 << 20
FIXED_RESERVE = 384 * MIB


class BudgetError(ArenaError):
    """The device-memory budget cannot hold the model (weights + workspace + smallest KV)."""


@dataclass(frozen=True)
class BudgetPlan:
    budget: int                   # bytes
    weights: int
    workspace: int
    kv_all: int                   # the whole context's KV on the device
    arena: int                    # 0: the whole KV resident (no streaming)

    @property
    def arena_mib(self) -> float:
        return self.arena / MIB

    def describe(self) -> str:
        kv = (f"KV arena {self.arena / GIB:.2f} GiB (of {self.kv_all / GIB:.2f} GiB of KV)"
              if self.arena else f"KV {self.kv_all / GIB:.2f} GiB, all resident")
        return (f"budget {self.budget / GIB:.2f} GiB: weights {self.weights / GIB:.2f} GiB, "
                f"workspace {self.workspace / GIB:.2f} GiB, {kv}")


def kv_layer_count(config, *, mtp: bool) -> int:
    """Layers that hold KV: the attention layers, and the MTP (NextN) layers when an MTP
    drafter reads them."""
    return (sum(config.is_attention_layer(i) for i in range(config.n_layers))
            + (config.nextn_layers if mtp else 0))


def kv_bytes(config, kv_layers: int, ctx: int, k_type: str, v_type: str,
             page_size: int = 256) -> int:
    """Bytes of the whole context's KV for kv_layers attention layers (whole pages)."""
    pages = -(-ctx // page_size)
    per_token = (F.bytes_per_token(F.kv_type(k_type), config.n_kv_heads, config.head_dim)
                 + F.bytes_per_token(F.kv_type(v_type), config.n_kv_heads, config.head_dim))
    return kv_layers * pages * page_size * per_token


def workspace_bytes(config, ubatch: int, device: torch.device, verify_rows: int = 0,
                    mtp: bool = False) -> int:
    """Device bytes besides weights and KV; verify_rows: a speculative verify step's rows,
    whose recurrence inputs a hybrid model records; mtp: an MTP drafter's programs too."""
    c = config
    rope = 2 * c.context_length * (c.rotary_dim // 2) * 4
    state = 0
    n_gdn = sum(not c.is_attention_layer(i) for i in range(c.n_layers)) if c.ssm_v_heads else 0
    if n_gdn:
        value_dim = c.ssm_v_heads * c.ssm_head_dim
        conv_dim = 2 * c.ssm_k_heads * c.ssm_head_dim + value_dim
        per = (max(c.ssm_conv_kernel - 1, 0) * conv_dim
               + c.ssm_v_heads * c.ssm_head_dim * c.ssm_head_dim)
        # the state and one copy (a snapshot, or the state before a verify forward), and a
        # (padded) verify row's recorded inputs (kv/recurrent_state.py)
        from kvcompile.executor.programs import verify_width
        from kvcompile.kv.recurrent_state import RecurrentState
        row = conv_dim + RecurrentState.row_floats(c.ssm_k_heads, c.ssm_v_heads,
                                                      c.ssm_head_dim)
        rows = verify_width(verify_rows) if verify_rows > 1 else 0
        state = (2 * per + rows * row) * n_gdn * 4
    decode = 0
    if device.type == "cuda":
        from kvcompile.kv.layer_kv import decode_workspace_numel
        from kvcompile.ops.span_attention.launch import num_sms
        decode = 4 * decode_workspace_numel(c, num_sms(device))
    q_dim = 2 * c.n_heads * c.head_dim
    kv_dim = 2 * c.n_kv_heads * c.head_dim
    gdn_dim = (2 * c.ssm_k_heads + 2 * c.ssm_v_heads) * c.ssm_head_dim if n_gdn else 0
    row = 6 * c.hidden + 3 * c.ffn + 2 * (q_dim + kv_dim) + 3 * gdn_dim
    acts = ubatch * row * 4 + 2 * c.vocab_size * 4
    # a prefill launch's quantized pages dequantized to fp16 (ops/span_attention/dequant_pages.py)
    fp16_span = dequant_bytes(c.n_kv_heads, c.head_dim) if ubatch >= DEQUANT_ROWS else 0
    return (rope + state + decode + acts + fp16_span + verify_outputs(c, verify_rows, mtp)
            + FIXED_RESERVE)


def verify_outputs(config, verify_rows: int, mtp: bool = False) -> int:
    """Bytes of the outputs the captured verify programs keep (executor.py: widths 2, 4, 8
    up to the verify step's, MAX_LAYOUTS each; fp32 as an upper bound), with an MTP
    drafter their hidden rows and the MTP programs' (every width, one logits row each),
    and a wider step's logits while it runs (programs.WIDE: not captured, none kept)."""
    if verify_rows < 2:
        return 0
    from kvcompile.executor.executor import MAX_LAYOUTS
    from kvcompile.executor.programs import BUCKETS, VERIFY_WIDTHS, bucket_for
    top = bucket_for(min(verify_rows, BUCKETS[-1]))
    rows = sum(b for b in BUCKETS if 2 <= b <= top)
    out = rows * config.vocab_size * 4
    if mtp:
        out += (rows + sum(BUCKETS)) * config.hidden * 4 + len(BUCKETS) * config.vocab_size * 4
    wide = (bucket_for(min(verify_rows, VERIFY_WIDTHS[-1]), VERIFY_WIDTHS)
            if verify_rows > BUCKETS[-1] else 0)
    return MAX_LAYOUTS * out + wide * config.vocab_size * 4


def plan_budget(*, budget: int, weights: int, workspace: int, kv_all: int, min_arena: int,
                arena: int | str) -> BudgetPlan:
    """Split `budget`. arena "auto": the whole KV when it fits, else everything left for an
    arena; 0: the whole KV must fit; N bytes: that arena. BudgetError names each part."""
    fixed = weights + workspace
    left = budget - fixed

    def fail(need_kv: int, what: str):
        raise BudgetError(
            f"a device-memory budget of {budget / GIB:.2f} GiB cannot hold {what}: weights "
            f"{weights / GIB:.2f} GiB + workspace {workspace / GIB:.2f} GiB + "
            f"{need_kv / GIB:.2f} GiB of KV = {(fixed + need_kv) / GIB:.2f} GiB; raise "
            f"--gpu-memory-gib to {-(-(fixed + need_kv) * 100 // GIB) / 100:.2f} or more"
            + ("" if what.startswith("the smallest") else
               ", or stream the KV from host memory (--kv-stream-arena-mib auto)")
            + ", or use a smaller model / lower --ctx-size / -ub")

    if arena == "auto":
        if kv_all <= left:
            return BudgetPlan(budget, weights, workspace, kv_all, 0)
        if left < min_arena:
            fail(min_arena, "the smallest KV arena for this context")
        return BudgetPlan(budget, weights, workspace, kv_all, left)
    if not arena:
        if kv_all > left:
            fail(kv_all, "the whole KV on the device")
        return BudgetPlan(budget, weights, workspace, kv_all, 0)
    if arena > left:
        fail(arena, f"a KV arena of {arena / MIB:.0f} MiB")
    return BudgetPlan(budget, weights, workspace, kv_all, arena)


def device_budget(device: torch.device, gpu_memory_gib: float | None) -> int:
    """The budget in bytes: `gpu_memory_gib`, or the device's free memory now."""
    if gpu_memory_gib is not None:
        return int(gpu_memory_gib * GIB)
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device)


def enforce(device: torch.device, budget: int | None) -> None:
    """Cap this process's torch allocations on `device` at `budget` bytes (None: no cap)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    total = torch.cuda.get_device_properties(index).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, (budget or total) / total), index)


def planned_weight_bytes(source, device: torch.device, dtype: torch.dtype) -> int:
    """Device bytes of the model's weights as the loader will place them (loader.ModelSource:
    from a GGUF's tensor infos; a Hugging Face folder: its tensors' element counts in
    `dtype`)."""
    from kvcompile.io.weights import layout, weight_plan
    if source.gguf is None:
        from kvcompile.io.hf_checkpoint import checkpoint_numel
        return checkpoint_numel(source.path) * dtype.itemsize
    return layout(weight_plan(source.gguf.tensors.values(), device, dtype))[1]


def plan_engine_memory(source, device: torch.device, dtype: torch.dtype, ctx: int, ubatch: int,
                       k_type: str, v_type: str, arena_mib, gpu_memory_gib,
                       verify_rows: int = 0, mtp: bool = True) -> BudgetPlan | None:
    """The Engine's split of the device budget for the model of `source` (loader.ModelSource;
    None on the CPU: no budget there). With gpu_memory_gib given, torch's allocator is capped
    at it (enforce); without, an earlier Engine's cap in this process is lifted (the cap is
    per process: the newest Engine's budget holds)."""
    if device.type != "cuda":
        if gpu_memory_gib is not None:
            raise BudgetError("--gpu-memory-gib bounds a GPU's memory: use it with --device "
                              "cuda")
        return None
    from kvcompile.kv.kv_pages import min_arena_bytes
    config = source.config
    n_kv = kv_layer_count(config, mtp=mtp)
    plan = plan_budget(
        budget=device_budget(device, gpu_memory_gib),
        weights=planned_weight_bytes(source, device, dtype),
        workspace=workspace_bytes(config, min(ubatch, ctx), device, verify_rows, mtp),
        kv_all=kv_bytes(config, n_kv, ctx, k_type, v_type),
        min_arena=min_arena_bytes(config, ctx, k_type, v_type),
        arena="auto" if arena_mib == "auto" else int((arena_mib or 0) * MIB))
    enforce(device, plan.budget if gpu_memory_gib is not None else None)
    return plan
