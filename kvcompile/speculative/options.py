"""The speculative-decoding options of an Engine, named like llama.cpp's flags, checked
before the model loads."""
from __future__ import annotations

from dataclasses import dataclass

from kvcompile.errors import KvcompileError, UnsupportedModelError
from kvcompile.speculative.ngram import NgramDrafter

SPEC_TYPES = ("none", "ngram-simple", "draft-mtp", "ngram-simple,draft-mtp")


@dataclass(frozen=True)
class SpecOptions:
    spec_type: str = "none"
    ngram_n: int = 3              # --spec-ngram-size-n: tokens of the lookup key
    ngram_m: int = 8              # --spec-ngram-size-m: most tokens a draft proposes

    @classmethod
    def checked(cls, spec_type: str | None, ngram_n: int, ngram_m: int) -> "SpecOptions":
        spec_type = spec_type or "none"
        if spec_type not in SPEC_TYPES:
            raise KvcompileError(f"unknown --spec-type {spec_type!r}; use one of "
                                 f"{', '.join(SPEC_TYPES)}")
        if "draft-mtp" in spec_type:
            raise UnsupportedModelError(
                f"--spec-type {spec_type}: drafting with the model's MTP layer is not built "
                f"yet; use --spec-type ngram-simple")
        NgramDrafter(ngram_n, ngram_m)          # checks n and m
        return cls(spec_type, ngram_n, ngram_m)

    @property
    def enabled(self) -> bool:
        return self.spec_type != "none"

    def drafter(self) -> NgramDrafter | None:
        return NgramDrafter(self.ngram_n, self.ngram_m) if self.enabled else None


def check_model_supports(model, spec: SpecOptions) -> None:
    """A rejected draft must leave the model's state as if never fed: paged KV rows past the
    accepted ones are simply rewritten, but recurrent state would need a rollback."""
    if spec.enabled and getattr(model, "recurrent_state", None) is not None:
        raise UnsupportedModelError(
            "speculative decoding of a hybrid model (recurrent layers) needs the recurrent "
            "state rolled back after a rejected draft, which is not built yet; use "
            "--spec-type none with this model")
