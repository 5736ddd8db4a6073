"""What speculation did in a request: drafted and accepted tokens, verify forwards, the
realized verify width (rows a forward scored) and tokens a forward."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SpecStats:
    forwards: int = 0
    drafted: int = 0
    accepted: int = 0

    def record(self, drafted: int, accepted: int) -> None:
        self.forwards += 1
        self.drafted += drafted
        self.accepted += accepted

    def as_dict(self) -> dict:
        f = max(self.forwards, 1)
        return dict(forwards=self.forwards, drafted=self.drafted, accepted=self.accepted,
                    acceptance=self.accepted / self.drafted if self.drafted else 0.0,
                    verify_width=(self.forwards + self.drafted) / f,
                    tokens_per_forward=(self.forwards + self.accepted) / f)
