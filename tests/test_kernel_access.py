"""What torch.compile believes each Triton kernel writes (CPU, no GPU needed).

Under the inductor lowering, a kernel launched through wrap_triton is analysed from its TTIR:
every tensor it seems to store through counts as mutated and is cloned before the launch. The
analysis follows a store's address back through every op, and through a `triton.jit` helper's
call to all of that helper's arguments, so a helper that returns an index and also takes a
loaded value (or a pointer) makes that tensor look written: a KV pool or the query cloned on
every call. This test compiles each kernel's TTIR for sm_90 on the CPU (Triton needs a
target, not a device) and checks the analysis names exactly the kernel's outputs.
"""
from __future__ import annotations

import inspect

import pytest
import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget

from torch._higher_order_ops import triton_kernel_wrap as wrap

from kvcompile.ops.gemv.triton_kernel import _gemv_row, _gemv_rows
from kvcompile.ops.kv_write.triton_kernel import _kv_write
from kvcompile.ops.rms_norm.triton_kernel import _rms_norm
from kvcompile.ops.rope_rotate.triton_kernel import _rope_rotate
from kvcompile.ops.silu_mul.triton_kernel import _silu_mul
from kvcompile.ops.span_attention.decode_blocks import _decode_split_blocks
from kvcompile.ops.span_attention.decode_kernel import _decode_split
from kvcompile.ops.span_attention.decode_split import _decode_reduce
from kvcompile.ops.span_attention.decode_transposed import _decode_split_t
from kvcompile.ops.span_attention.prefill_kernel import _prefill


class _Sm90:
    """Stands in for the CUDA driver: TTIR generation only asks for the target."""

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self):
        return torch.device("cpu")


@pytest.fixture
def sm90_target():
    config = triton.runtime.driver
    before = config._active        # reset_active() would look for a GPU driver
    config.set_active(_Sm90())
    yield
    config._active = before


def tensor(dtype):
    return torch.zeros(64, dtype=dtype)


BF16, F16, F32, I32, U8, I8 = (torch.bfloat16, torch.float16, torch.float32, torch.int32,
                               torch.uint8, torch.int8)
SPLIT_TENSORS = dict(q_ptr=BF16, k_vals=U8, k_scl=F16, v_vals=U8, v_scl=F16, page_table=I32,
                     q_pos_ptr=I32, m_ptr=F32, l_ptr=F32, acc_ptr=F32)
SPLIT_CONST = dict(QK_SCALE=0.1, G=4, D=128, P=256, BLOCK_M=16, BLOCK_N=64, K_TYPE=8,
                   V_TYPE=2, QK_F16=1, K_SPLIT=0, INTERP=False, PDL=False)

# kernel, its tensor arguments' dtypes, its constexprs, what it writes
CASES = {
    "rms_norm": (_rms_norm, dict(x_ptr=BF16, r_ptr=BF16, w_ptr=F32, s_ptr=BF16, y_ptr=BF16),
                 dict(HAS_RESIDUAL=True, BLOCK=4096, DTYPE=tl.bfloat16, EXACT=True,
                      PDL=False), {"s_ptr", "y_ptr"}),
    "silu_mul": (_silu_mul, dict(x_ptr=BF16, out_ptr=BF16),
                 dict(BLOCK=1024, DTYPE=tl.bfloat16, EXACT=True, PDL=False), {"out_ptr"}),
    "kv_write": (_kv_write, dict(k_pool=U8, v_pool=U8, k_new=BF16, v_new=BF16, slots=I32,
                                 page_table=I32),
                 dict(P=256, D=128, K_TYPE=8, V_TYPE=2, HAS_TABLE=True, EXACT_MUL=True,
                      PDL=False), {"k_pool", "v_pool"}),
    "gemv_row": (_gemv_row, dict(x_ptr=BF16, w_ptr=BF16, b_ptr=BF16, y_ptr=BF16),
                 dict(HAS_BIAS=True, BLOCK_N=8, BLOCK_K=512, EVEN=True, DTYPE=tl.bfloat16,
                      EXACT=True, SILU=True, PDL=False), {"y_ptr"}),
    "gemv_rows": (_gemv_rows, dict(x_ptr=BF16, w_ptr=BF16, b_ptr=BF16, y_ptr=BF16),
                  dict(HAS_BIAS=True, BLOCK_N=64, BLOCK_K=128, EVEN=True, DTYPE=tl.bfloat16,
                       EXACT=True, SILU=False, PDL=False), {"y_ptr"}),
    "decode_split_blocks": (_decode_split_blocks, SPLIT_TENSORS, SPLIT_CONST,
                            {"m_ptr", "l_ptr", "acc_ptr"}),
    "decode_split_legacy": (_decode_split, dict(SPLIT_TENSORS, k_vals=I8), SPLIT_CONST,
                            {"m_ptr", "l_ptr", "acc_ptr"}),
    # traced launches read the codes by pointers (TMA=False: tma_codes)
    "decode_split_transposed": (_decode_split_t,
                                {{"k_vals": "k_codes", "v_vals": "v_codes"}.get(k, k): v
                                 for k, v in SPLIT_TENSORS.items()},
                                {k: v for k, v in SPLIT_CONST.items()
                                 if k not in ("BLOCK_M", "QK_F16", "K_SPLIT")}
                                | dict(BLOCK_R=4, TMA=False),
                                {"m_ptr", "l_ptr", "acc_ptr"}),
    "decode_split_blocks_bf16": (_decode_split_blocks,
                                 dict(SPLIT_TENSORS, k_vals=BF16, v_vals=BF16, k_scl=BF16,
                                      v_scl=BF16),
                                 dict(SPLIT_CONST, K_TYPE=30, V_TYPE=30, QK_F16=0),
                                 {"m_ptr", "l_ptr", "acc_ptr"}),
    "decode_split_legacy_bf16": (_decode_split,
                                 dict(SPLIT_TENSORS, k_vals=BF16, v_vals=BF16, k_scl=BF16,
                                      v_scl=BF16),
                                 dict(SPLIT_CONST, K_TYPE=30, V_TYPE=30, QK_F16=0),
                                 {"m_ptr", "l_ptr", "acc_ptr"}),
    "decode_reduce": (_decode_reduce, dict(m_ptr=F32, l_ptr=F32, acc_ptr=F32, q_pos_ptr=I32,
                                           rot_ptr=F32, out_ptr=BF16),
                      dict(G=4, D=128, P=256, ROWS_P2=2, BLOCK_C=128, BLOCK_D=64,
                           ONE_STEP=True, ROT=True, PDL=False), {"out_ptr"}),
    "prefill": (_prefill, dict(q_ptr=F16, k_vals=I8, k_scl=F16, v_vals=U8, v_scl=F16,
                               page_table=I32, q_pos_ptr=I32, out_ptr=BF16, ws_ptr=F32),
                dict(QK_SCALE=0.1, G=4, D=128, P=256, BLOCK_M=64, BLOCK_N=64, K_TYPE=8,
                     V_TYPE=2, QK_F16=1, K_SPLIT=0, LOAD_STATE=True, FINISH=False,
                     INTERP=False), {"ws_ptr"}),    # a piece of a chunked prefill
    "prefill_last": (_prefill, dict(q_ptr=F16, k_vals=I8, k_scl=F16, v_vals=U8, v_scl=F16,
                                    page_table=I32, q_pos_ptr=I32, out_ptr=BF16, ws_ptr=F32),
                     dict(QK_SCALE=0.1, G=4, D=128, P=256, BLOCK_M=64, BLOCK_N=64, K_TYPE=8,
                          V_TYPE=2, QK_F16=1, K_SPLIT=0, LOAD_STATE=True, FINISH=True,
                          INTERP=False), {"out_ptr"}),
    "rope_rotate": (_rope_rotate, dict(x_ptr=BF16, out_ptr=BF16, cos_ptr=F32, sin_ptr=F32,
                                       rot_a=F32, rot_b=F32),
                    dict(NEOX=True, HAS_A=True, HAS_B=True, BLOCK_D=128, BH=16, BN=32,
                         DTYPE=tl.bfloat16, EXACT=True, PDL=False), {"out_ptr"}),
}


def written(kernel, tensors: dict, const: dict) -> set[str]:
    kwargs = {}
    for name in inspect.signature(kernel.fn).parameters:
        if name in const:
            kwargs[name] = const[name]
        elif name in tensors:
            kwargs[name] = tensor(tensors[name])
        else:
            kwargs[name] = 64            # sizes and strides
    if hasattr(wrap, "identify_accessed_tensors"):       # newer torch (2.13 here)
        access = wrap.identify_accessed_tensors(kernel, kwargs, {})
        return {dep.name for dep in access.read_writes.writes}
    return set(wrap.identify_mutated_tensors(kernel, kwargs, {}))     # older: writes only


@pytest.mark.parametrize("case", CASES)
def test_torch_compile_sees_only_the_kernels_outputs_written(case, sm90_target):
    kernel, tensors, const, outputs = CASES[case]
    got = written(kernel, tensors, const)
    assert got == outputs, (f"{case}: torch.compile takes {sorted(got - outputs)} for written "
                            f"(cloned before every launch under inductor)")
