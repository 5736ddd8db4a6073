"""The prefill and decode layouts of one arena, as sizes only (pure; the manager commits them).

Three regions, whatever the phase:
- `kv`: the pages the cache holds for the whole request (same size in both layouts, so an
  arena transaction keeps it in place and the KV written by prefill is there for decode);
- `workspace`: the phase's attention scratch (the decode kernels' split partials, bound to
  every layer's `workspace`) plus the reservation for the captured programs' activations;
- `kv_extra`: everything else. The KV pool of a phase is `kv + kv_extra`: prefill (a wide
  ubatch, large workspace) leaves a small pool, decode (at most 8 rows) a large one. The
  all-resident cache does not use `kv_extra`; a streaming cache would take resident pages
  and ring slots from it (the manager binds only the all-resident cache today).

The decode workspace depends on the model and the widest verify, never on the context, so
for a fixed arena the decode pool is the same at 8K and 256K (tests print the table).
"""
from __future__ import annotations

from dataclasses import dataclass

from kvcompile.errors import ArenaError, PhaseError
from kvcompile.ops.span_attention.op import DECODE_MAX_ROWS
from kvcompile.runtime.arena import ALIGN, MIB, align, mib_for

KV, WORKSPACE, EXTRA = "kv", "workspace", "kv_extra"
PHASES = ("prefill", "decode")
# decode verify widths captured as programs: powers of two, up to the decode kernel's widest
BUCKETS = tuple(sorted({min(1 << i, DECODE_MAX_ROWS)
                        for i in range(DECODE_MAX_ROWS.bit_length() + 1)}))
SLACK = 4 * MIB             # launch / reduction temporaries the per-row estimate misses


def bucket_for(width: int, buckets=BUCKETS) -> int:
    """The smallest captured verify width that holds `width` rows (padding fills the rest)."""
    for b in buckets:
        if width <= b:
            return b
    raise PhaseError(f"a decode step of {width} rows is wider than the widest decode program "
                     f"({max(buckets)} rows); verify at most {max(buckets)} tokens a step")


def attention_scratch_bytes(config, sms: int | None) -> int:
    """Bytes of the decode kernels' split partials for the widest verify (the caches' own
    decode workspace size; 0 without SMs: the CPU reference needs none). Depends on heads
    and SMs, not on the context length."""
    if not sms:
        return 0
    from kvcompile.kv_cache import decode_workspace_numel
    return 4 * decode_workspace_numel(config, sms)


def activation_bytes(config, rows: int, out_rows: int) -> int:
    """A generous bound on what one forward of `rows` tokens allocates (fp32 sizes): every
    intermediate of one layer twice over (a layer's temporaries die before the next layer
    runs), the residual stream, and the logits of `out_rows` rows twice (the head and its
    float copy)."""
    h, f = config.hidden, config.ffn
    q, kv = config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim
    per_row = 6 * h + 4 * q + 4 * kv + 3 * f + 2 * config.rotary_dim
    return 4 * (2 * rows * per_row + 2 * out_rows * config.vocab_size) + SLACK


def workspace_bytes(config, phase: str, ubatch: int, sms: int | None,
                    scratches: int = 1) -> int:
    """What a phase's workspace region must hold: attention scratch + program activations.
    Prefill programs run `ubatch` rows and return the last row's logits; decode programs run
    up to 8 rows and return every row's (a verify needs them all). `scratches`: how many
    attention scratches can be live at once (one bound to every layer; an inductor program
    allocates one per attention layer and its memory planner may keep them all: on the H200
    the 8B decode/1 program measured 30.6 MiB against 25.6 MiB reserved for one)."""
    scratch = scratches * align(attention_scratch_bytes(config, sms))
    if phase == "prefill":
        return scratch + activation_bytes(config, ubatch, 1)
    if phase == "decode":
        return scratch + activation_bytes(config, max(BUCKETS), max(BUCKETS))
    raise PhaseError(f"unknown phase {phase!r}; phases are {PHASES}")


@dataclass(frozen=True)
class Layout:
    phase: str
    regions: dict      # name -> bytes, in the order they are reserved

    @property
    def kv_pool_bytes(self) -> int:
        return self.regions[KV] + self.regions[EXTRA]


def plan_layouts(arena_bytes: int, kv_bytes: int, workspaces: dict[str, int]) -> dict[str, Layout]:
    """One Layout per phase filling the whole arena; ArenaError naming the smallest arena if
    the KV plus the larger workspace does not fit."""
    need = align(kv_bytes) + max(align(w) for w in workspaces.values())
    if need > arena_bytes:
        widest = max(workspaces, key=workspaces.get)
        raise ArenaError(
            f"the arena of {arena_bytes / MIB:g} MiB cannot hold the KV pages "
            f"({kv_bytes / MIB:.2f} MiB) and the {widest} workspace "
            f"({workspaces[widest] / MIB:.2f} MiB); use an arena of at least {mib_for(need)} "
            f"MiB, a smaller --ctx-size, or a smaller --ubatch-size")
    out = {}
    for phase, w in workspaces.items():
        extra = (arena_bytes - align(kv_bytes) - align(w)) // ALIGN * ALIGN
        out[phase] = Layout(phase, {KV: kv_bytes, WORKSPACE: w, EXTRA: extra})
    return out
