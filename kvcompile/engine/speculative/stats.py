"""What speculation did in a request: drafted and accepted tokens, verify forwards, the
realized verify width (rows a forward scored), tokens a forward and the cost of a round
(drafting, the verify forward to GPU completion, acceptance) in milliseconds."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SpecStats:
    forwards: int = 0
    drafted: int = 0
    accepted: int = 0
    seconds: float = 0.0

    def record(self, drafted: int, accepted: int, seconds: float = 0.0) -> None:
        self.forwards += 1
        self.drafted += drafted
        self.accepted += accepted
        self.seconds += seconds

    def as_dict(self) -> dict:
        f = max(self.forwards, 1)
        return dict(forwards=self.forwards, drafted=self.drafted, accepted=self.accepted,
                    acceptance=self.accepted / self.drafted if self.drafted else 0.0,
                    verify_width=(self.forwards + self.drafted) / f,
                    tokens_per_forward=(self.forwards + self.accepted) / f,
                    ms_per_forward=1e3 * self.seconds / f)
