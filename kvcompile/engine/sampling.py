"""Sampling parameters, their validation, and the token sampler (one request at a time)."""
from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field, fields, replace

import torch

from kvcompile.errors import SamplingError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.8      # 0 = greedy
    top_k: int = 40               # 0 = off
    top_p: float = 0.95           # 1 = off
    min_p: float = 0.05           # 0 = off
    repeat_penalty: float = 1.0   # 1 = off (llama.cpp semantics: divide positive logits)
    repeat_last_n: int = 64       # how many recent tokens the penalty looks at
    seed: int | None = None       # None = a fresh random seed per request
    max_tokens: int = 256
    stop: tuple[str, ...] = field(default_factory=tuple)

    @classmethod
    def from_options(cls, **options) -> "SamplingParams":
        """Validated parameters from keyword options; SamplingError names unknown ones."""
        names = [f.name for f in fields(cls)]
        unknown = sorted(set(options) - set(names))
        if unknown:
            raise SamplingError(f"unknown option(s) {', '.join(unknown)}: a request takes "
                                f"{', '.join(names)}; engine options go to Engine(...) "
                                f"or kvcompile.generate(...)")
        return cls(**options).validated()

    def validated(self) -> "SamplingParams":
        checks = [
            (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
             and self.temperature >= 0, f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}"),
            (isinstance(self.top_k, int) and self.top_k >= 0,
             f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}"),
            (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1,
             f"top_p must be in (0, 1] (1 disables it), got {self.top_p!r}"),
            (isinstance(self.min_p, (int, float)) and 0 <= self.min_p <= 1,
             f"min_p must be in [0, 1] (0 disables it), got {self.min_p!r}"),
            (isinstance(self.repeat_penalty, (int, float)) and math.isfinite(self.repeat_penalty)
             and self.repeat_penalty > 0,
             f"repeat_penalty must be a finite number > 0 (1 disables it), got {self.repeat_penalty!r}"),
            (isinstance(self.repeat_last_n, int) and self.repeat_last_n >= 0,
             f"repeat_last_n must be an integer >= 0, got {self.repeat_last_n!r}"),
            (isinstance(self.max_tokens, int) and self.max_tokens >= 0,
             f"max_tokens must be an integer >= 0, got {self.max_tokens!r}"),
            (self.seed is None or (isinstance(self.seed, int)
                                   and -2**63 <= self.seed < 2**64),
             f"seed must be an integer in [-2**63, 2**64) or None, got {self.seed!r}"),
        ]
        for ok, message in checks:
            if not ok:
                raise SamplingError(message)
        if self.stop is None:
            stop = ()
        elif isinstance(self.stop, str):
            stop = (self.stop,)
        elif isinstance(self.stop, Iterable):
            stop = tuple(self.stop)
        else:
            raise SamplingError(f"stop must be a string or a list of strings, got "
                                f"{type(self.stop).__name__}")
        if any(not isinstance(s, str) or not s for s in stop):
            raise SamplingError(f"stop strings must be non-empty strings, got {self.stop!r}")
        return replace(self, stop=stop)


class Sampler:
    """Turns a row of logits into the next token; owns the request's random generator."""

    def __init__(self, params: SamplingParams):
        self.params = params.validated()
        seed = self.params.seed
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,)).item())
        self.seed = seed
        self.generator = torch.Generator().manual_seed(seed)
        self._device_generator = None

    @property
    def on_device(self) -> bool:
        """The token can be drawn where the logits are (`pick`): no repeat penalty, which
        reads the history on the host."""
        p = self.params
        return p.repeat_penalty == 1.0 or not p.repeat_last_n

    def pick(self, logits: torch.Tensor) -> torch.Tensor:
        """The next token (for an `on_device` sampler) as a 1-element tensor where the
        logits are, by the rule `__call__` follows: the first of the largest logits, or a
        draw after temperature, top-k, min-p and top-p from this request's generator of
        that device (on the CPU the one `__call__` uses: the same tokens for a seed)."""
        if self.params.temperature == 0:
            return torch.argmax(logits).reshape(1)
        probs = self._probs(logits.detach().float())
        return torch.multinomial(probs, 1, generator=self._generator_on(probs.device))

    def _generator_on(self, device: torch.device) -> torch.Generator:
        if device.type == "cpu":
            return self.generator
        if self._device_generator is None:
            self._device_generator = torch.Generator(device).manual_seed(self.seed)
        return self._device_generator

    def __call__(self, logits: torch.Tensor, history: list[int]) -> int:
        logits = self._penalized(logits, history)
        if self.params.temperature == 0:
            return int(torch.argmax(logits))
        return int(torch.multinomial(self._probs(logits), 1, generator=self.generator)[0])

    def probs(self, logits: torch.Tensor, history: list[int]) -> torch.Tensor:
        """The distribution a token is drawn from after `history` (temperature > 0):
        penalty, top-k, temperature, min-p, top-p applied, normalized."""
        return self._probs(self._penalized(logits, history))

    def _penalized(self, logits: torch.Tensor, history: list[int]) -> torch.Tensor:
        p = self.params
        logits = logits.detach().float().cpu().clone()
        if p.repeat_penalty != 1.0 and p.repeat_last_n and history:
            recent = torch.tensor(sorted(set(history[-p.repeat_last_n:])), dtype=torch.long)
            vals = logits[recent]
            logits[recent] = torch.where(vals > 0, vals / p.repeat_penalty, vals * p.repeat_penalty)
        return logits

    def _probs(self, logits: torch.Tensor) -> torch.Tensor:
        p = self.params
        if p.top_k and p.top_k < logits.numel():
            kth = torch.topk(logits, p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits / p.temperature, dim=-1)
        if p.min_p > 0:
            probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
        if p.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
            # keep the smallest prefix whose mass reaches top_p (always at least one token)
            sorted_probs = sorted_probs.masked_fill(before >= p.top_p * sorted_probs.sum(), 0.0)
            probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
        return probs / probs.sum()
