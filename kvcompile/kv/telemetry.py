"""Per-step telemetry of the streaming runtime (one record per forward)."""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class StepStats:
    step: int
    tokens: int                  # rows evaluated by this forward
    context_pages: int           # logical pages per layer read
    resident_pages: int          # physical pages given to residents (all layers)
    ring_slots: int
    h2d_bytes: int               # host -> device bytes copied (streaming and refills)
    d2h_bytes: int               # bytes published to host history (whole written pages)
    readiness_misses: int        # layers whose pages were not ready when attention wanted them
    copy_busy_pct: float         # copy engine busy time / wall time from this forward's
    #                              begin to the next one's (to its own end until then)
    ring_occupancy: float        # peak fraction of ring slots held
    resident_reads: int          # page reads served by resident pages (all layers)
    streamed_reads: int          # page reads served by ring slots
    layers: int                  # layers this forward acquired
    repartitioned: bool
    policy: str                  # the policy's reason for this step's split
    wall_ms: float = 0.0         # host time from begin to end of the forward
    replayed: bool = False       # a captured step's replay: its misses and copy-busy time
    #                              were not observed (a capture cannot query or time events)
    split_layers: int = 0        # layers whose fill waited in part for the layer before

    def as_dict(self) -> dict:
        return asdict(self)


def summarize(steps: list[StepStats]) -> dict:
    """Totals over steps, e.g. for a GenerationResult's stats."""
    if not steps:
        return {}
    reads = sum(s.resident_reads + s.streamed_reads for s in steps)
    return {
        "steps": len(steps),
        "h2d_bytes": sum(s.h2d_bytes for s in steps),
        "d2h_bytes": sum(s.d2h_bytes for s in steps),
        "readiness_misses": sum(s.readiness_misses for s in steps),
        "streamed_fraction": sum(s.streamed_reads for s in steps) / reads if reads else 0.0,
        "resident_pages": steps[-1].resident_pages,
        "ring_slots": steps[-1].ring_slots,
        "copy_busy_pct": sum(s.copy_busy_pct for s in steps) / len(steps),
        "repartitions": sum(s.repartitioned for s in steps),
    }
