"""resolve_dtype: the compute dtype by name, or picked for the device."""
from __future__ import annotations

import pytest
import torch

from kvcompile.engine.dtypes import DtypeError, resolve_dtype
from kvcompile.errors import KvcompileError


def test_auto_is_f32_on_the_cpu_and_bf16_on_cuda():
    assert resolve_dtype(None, "cpu") == resolve_dtype("auto", "cpu") == torch.float32
    want = torch.bfloat16
    if torch.cuda.is_available() and not torch.cuda.is_bf16_supported():
        want = torch.float16
    assert resolve_dtype("AUTO", "cuda") == want


@pytest.mark.parametrize("spec,want", [("f32", torch.float32), ("bfloat16", torch.bfloat16),
                                       ("F16", torch.float16), (torch.bfloat16, torch.bfloat16)])
def test_named_dtypes(spec, want):
    assert resolve_dtype(spec, "cpu") == want == resolve_dtype(spec, "cuda")


@pytest.mark.parametrize("spec", ["int8", "fp8", torch.int8, torch.float64])
def test_other_dtypes_are_refused_with_the_choices(spec):
    with pytest.raises(DtypeError) as e:
        resolve_dtype(spec, "cpu")
    assert isinstance(e.value, KvcompileError) and "auto, f32, f16, bf16" in str(e.value)


def test_a_cpu_engine_runs_in_bf16_when_asked():
    """The CPU reference path takes a bf16 model too (the ops' references compute in fp32)."""
    from kvcompile.engine.engine import Engine
    eng = Engine(None, ctx_size=256, dtype="bf16", progress=False)
    assert eng.dtype == torch.bfloat16 and eng.model.lm_head.weight.dtype == torch.bfloat16
    r = eng.generate("The capital of France is", max_tokens=6, temperature=0)
    print(repr(r.text))
    assert r.completion_tokens == 6 and r.text.strip()
