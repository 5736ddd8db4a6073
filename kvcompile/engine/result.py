"""What a request returns: the text, token ids and the request's statistics (times to GPU
completion, step percentiles, streaming telemetry, program events, speculation)."""
from __future__ import annotations

from dataclasses import dataclass, field, fields
import weakref
from typing import Callable, Generator

from kvcompile.errors import StreamInterruptedError


def _ms_at(ordered: list, q: float) -> float:
    """The q quantile of ascending seconds, in milliseconds (the element at q * n)."""
    return 1e3 * ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str            # "stop" (EOS / end of turn / stop string), "length"
    # (max_tokens), "context" (the context filled first), "cancelled" (the request's cancel
    # event) or "interrupted" (StreamInterruptedError)
    prefill_s: float              # to the first token (its sampling included): the TTFT
    decode_s: float               # the decode steps, each to its token's read (GPU completion)
    kv: dict = field(default_factory=dict)   # the store's telemetry summed over the request
    programs: dict = field(default_factory=dict)   # the executor's program events
    step_s: list = field(default_factory=list)   # each decode step's seconds, in order
    host_s: list = field(default_factory=list)   # each forward's host time (prefill chunks
    # first, then decode steps): until its work was queued, before waiting for the device
    speculative: dict = field(default_factory=dict)   # drafted / accepted tokens, widths
    cached_tokens: int = 0        # prompt tokens whose KV the store held (not prefilled)

    @property
    def prefill_tok_s(self) -> float:
        """Prompt tokens prefilled (the cached ones left out) a second of prefill_s."""
        n = self.prompt_tokens - self.cached_tokens
        return n / self.prefill_s if self.prefill_s else 0.0

    @property
    def decode_tok_s(self) -> float:
        steps = max(self.completion_tokens - 1, 0)   # the first token comes out of prefill
        return steps / self.decode_s if self.decode_s else 0.0

    def step_ms(self) -> dict:
        """p50, p90 and max of the decode steps' times, in milliseconds (empty: no step)."""
        if not self.step_s:
            return {}
        t = sorted(self.step_s)
        return dict(p50=_ms_at(t, 0.5), p90=_ms_at(t, 0.9), max=1e3 * t[-1])

    def stats(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in fields(self)
               if f.name not in ("text", "token_ids", "step_s", "host_s")}
        out.update(ttft_s=self.prefill_s, prefill_tok_s=self.prefill_tok_s,
                   decode_tok_s=self.decode_tok_s, step_ms=self.step_ms(),
                   host_step_ms=self.host_step_ms())
        return out

    @property
    def decode_host_s(self) -> list:
        """The decode steps' host seconds (host_s without the prefill chunks')."""
        return self.host_s[len(self.host_s) - len(self.step_s):] if self.step_s else []

    def host_step_ms(self) -> float | None:
        """Median host time of the decode steps, in milliseconds (None: no step)."""
        steps = self.decode_host_s
        return _ms_at(sorted(steps), 0.5) if steps else None

    def stats_line(self) -> str:
        """One line for people: tokens, time to first token, prefill and decode rates, step
        time percentiles."""
        steps = self.step_ms()
        step = (f", step p50 {steps['p50']:.1f} / p90 {steps['p90']:.1f} / max "
                f"{steps['max']:.1f} ms" if steps else "")
        spec = self.speculative
        spec = (f"; speculative: {spec['accepted']} of {spec['drafted']} drafted tokens "
                f"accepted, verify width {spec['verify_width']:.2f}, "
                f"{spec['tokens_per_forward']:.2f} tokens a forward of "
                f"{spec['ms_per_forward']:.1f} ms" if spec else "")
        warm = self.programs.get("warmup_s") or 0.0
        warm = (f"; {warm:.2f} s of it warm-up (traces and CUDA graph captures, paid once "
                f"an Engine)" if warm >= 0.01 else "")
        cached = f" ({self.cached_tokens} cached)" if self.cached_tokens else ""
        first = (f"first token after {self.prefill_s:.2f} s" if self.completion_tokens
                 else f"prefill took {self.prefill_s:.2f} s")
        return (f"[{self.prompt_tokens} prompt tokens{cached}, {self.completion_tokens} generated "
                f"({self.finish_reason}); {first}; prefill "
                f"{self.prefill_tok_s:.1f} tok/s, decode {self.decode_tok_s:.1f} tok/s{step}"
                f"{warm}{spec}]")


class TokenStream:
    """Iterator of text pieces; `.result` holds the GenerationResult once exhausted (or, after
    StreamInterruptedError, what was generated, with finish_reason "interrupted"). The stream
    holds its Engine until it ends: read it to the end, or close() it (a `with` block does)."""

    def __init__(self, pieces: Generator[str, None, GenerationResult],
                 release: Callable[[], None]):
        self._pieces = pieces
        self.result: GenerationResult | None = None
        # a stream dropped unread gives the Engine back too (no cycle holds it)
        self._release = weakref.finalize(self, release)

    def __iter__(self):
        return self

    def __next__(self) -> str:
        try:
            return next(self._pieces)
        except StopIteration as end:
            if end.value is not None:
                self.result = end.value
            self._release()
            raise StopIteration from None
        except StreamInterruptedError as e:
            self.result = e.result
            raise

    def close(self) -> None:
        """Stop generating and give the Engine back (the tokens so far stay in its history)."""
        self._pieces.close()
        self._release()

    def __enter__(self) -> "TokenStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
