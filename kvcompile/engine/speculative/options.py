"""The speculative-decoding options of an Engine, named like llama.cpp's flags, checked
before the model loads (and against the model once it is loaded)."""
from __future__ import annotations

from dataclasses import dataclass

from kvcompile.errors import KvcompileError, UnsupportedModelError
from kvcompile.engine.speculative.mtp import MtpDrafter, NgramThenMtp
from kvcompile.engine.speculative.ngram import NgramDrafter

SPEC_TYPES = ("none", "ngram-simple", "draft-mtp", "ngram-simple,draft-mtp")
MAX_MTP_DEPTH = 5


@dataclass(frozen=True)
class SpecOptions:
    spec_type: str = "none"
    ngram_n: int = 3              # --spec-ngram-size-n: tokens of the lookup key
    ngram_m: int = 8              # --spec-ngram-size-m: most tokens an ngram draft proposes
    draft_n_max: int = 3          # --spec-draft-n-max: MTP depth (drafted tokens a round)
    draft_p_min: float = 0.7      # --spec-draft-p-min: stop drafting below this probability

    @classmethod
    def checked(cls, spec_type: str | None = "none", ngram_n: int = 3, ngram_m: int = 8,
                draft_n_max: int = 3, draft_p_min: float = 0.7) -> "SpecOptions":
        spec_type = spec_type or "none"
        if spec_type not in SPEC_TYPES:
            raise KvcompileError(f"unknown --spec-type {spec_type!r}; use one of "
                                 f"{', '.join(SPEC_TYPES)}")
        NgramDrafter(ngram_n, ngram_m)          # checks n and m
        if (not isinstance(draft_n_max, int) or isinstance(draft_n_max, bool)
                or not 1 <= draft_n_max <= MAX_MTP_DEPTH):
            raise KvcompileError(f"--spec-draft-n-max (the MTP depth) must be an integer in "
                                 f"1..{MAX_MTP_DEPTH}, got {draft_n_max!r}")
        if not isinstance(draft_p_min, (int, float)) or not 0.0 <= draft_p_min <= 1.0:
            raise KvcompileError(f"--spec-draft-p-min must be a probability in [0, 1], got "
                                 f"{draft_p_min!r}")
        return cls(spec_type, ngram_n, ngram_m, draft_n_max, float(draft_p_min))

    @property
    def enabled(self) -> bool:
        return self.spec_type != "none"

    @property
    def uses_ngram(self) -> bool:
        return "ngram-simple" in self.spec_type

    @property
    def uses_mtp(self) -> bool:
        return "draft-mtp" in self.spec_type

    @property
    def verify_rows(self) -> int:
        """The most rows a verify step scores: the pending token and the longest draft
        (0 without speculation)."""
        if not self.enabled:
            return 0
        return 1 + max(self.ngram_m if self.uses_ngram else 0,
                       self.draft_n_max if self.uses_mtp else 0)


    def drafter(self, executor):
        """The drafter of a request (None without speculation); MTP drafts through the
        executor's MTP step."""
        if not self.enabled:
            return None
        ngram = NgramDrafter(self.ngram_n, self.ngram_m) if self.uses_ngram else None
        mtp = (MtpDrafter(executor.mtp, self.draft_n_max, self.draft_p_min, executor.ubatch)
               if self.uses_mtp else None)
        if ngram is not None and mtp is not None:
            return NgramThenMtp(ngram, mtp)
        return ngram or mtp


def check_model_supports(model, spec: SpecOptions) -> None:
    """draft-mtp needs the model's NextN/MTP layer (a file with more than one is refused when
    it loads: qwen35_config)."""
    if spec.uses_mtp and not model.layer_plan.mtp:
        raise UnsupportedModelError(
            f"--spec-type {spec.spec_type}: this model has no NextN/MTP layer to draft with; "
            f"use --spec-type ngram-simple, or a model file that keeps its MTP layer")
