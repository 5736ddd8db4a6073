"""Stop strings over streamed text: emit only what can no longer become part of a stop string."""
from __future__ import annotations


class StopStringFilter:
    def __init__(self, stops: tuple[str, ...]):
        self.stops = tuple(stops)
        self.pending = ""
        self.stopped = False

    def feed(self, piece: str) -> str:
        """Add decoded text; return the text that is safe to show now."""
        if self.stopped:
            return ""
        self.pending += piece
        if not self.stops:
            out, self.pending = self.pending, ""
            return out
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            out, self.pending = self.pending[: min(hits)], ""
            return out
        keep = self._longest_stop_prefix_suffix()
        cut = len(self.pending) - keep
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out

    def flush(self) -> str:
        out, self.pending = ("" if self.stopped else self.pending), ""
        return out

    def _longest_stop_prefix_suffix(self) -> int:
        """Length of the longest tail of `pending` that is a proper prefix of some stop string."""
        best = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(self.pending)), best, -1):
                if self.pending.endswith(s[:n]):
                    best = n
                    break
        return best
