"""One request as the Engine's loop runs it (engine.py)."""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

from kvcompile.engine.sampling import SamplingParams


@dataclass
class Request:
    """One request as the loop runs it: what was asked, and what it has given so far (an
    interrupted stream's result is made of that)."""
    prompt_ids: list[int]
    sampling: SamplingParams
    ticket: int                   # its turn at the Engine (RequestGate)
    reuse: bool                   # cache_prompt
    cancel: threading.Event | None
    out_ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)

    def cancelled(self) -> bool:
        return self.cancel is not None and self.cancel.is_set()
