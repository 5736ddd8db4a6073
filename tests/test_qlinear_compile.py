"""The quantized-linear kernels compile for Hopper (sm_90) without a GPU: Triton's own
front end and ptxas, for every type and every kernel at its launch defaults, within the
SM's shared memory. The interpreter (test_kernels_qlinear) runs the kernels as Python and
accepts code the compiler rejects (a non-constexpr global, a pipelined gather that needs
more shared memory than an SM has); this catches those on the CPU."""
from __future__ import annotations

import pytest
import triton
import triton.language as tl

from kvcompile.ops.qlinear import triton_kernel as K
from kvcompile.ops.qlinear.dequant import geometry
from kvcompile.ops.qlinear.formats import FORMATS, weight_format

try:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
except ImportError:                                   # pragma: no cover
    GPUTarget = None

SM90_SHARED = 232448          # bytes of shared memory a block may use on an H100 / H200
_ARGS = {
    "row": ["x_ptr", "w_ptr", "b_ptr", "y_ptr", "N", "K", "nb", "stride_w"],
    "row_float": ["x_ptr", "w_ptr", "b_ptr", "y_ptr", "N", "K", "nb", "stride_w"],
    "rows": ["x_ptr", "w_ptr", "b_ptr", "y_ptr", "M", "N", "K", "nb", "stride_w", "stride_xm"],
    "gemm": ["x_ptr", "w_ptr", "b_ptr", "y_ptr", "M", "N", "K", "nb", "stride_w", "stride_xm"],
    "rows_deq": ["idx_ptr", "w_ptr", "y_ptr", "R", "K", "nb", "stride_w"],
}
_PTR = {"x_ptr": "*bf16", "w_ptr": "*u8", "b_ptr": "*bf16", "y_ptr": "*bf16", "idx_ptr": "*i64"}


def compile_for_sm90(kind: str, name: str, aligned: bool = False):
    """aligned: every pointer and integer argument divisible by 16, as the launcher
    specializes them at the 8B shapes (vector loads); otherwise nothing is assumed."""
    block, parts, s, gpb = geometry(name)
    fn, cfg = {"row": (K._qgemv_row, K.row_config(name, 4096, 4096)),
               "row_float": (K._qgemv_row, K.row_config(name, 4096, 4096, int_dot=False)),
               "rows": (K._qgemv_rows, K.rows_config(name, 4096, 4096)),
               "gemm": (K._qgemm, K.gemm_config(name, 512, 4096, 4096)),
               "rows_deq": (K._dequant_rows, dict(NB=max(1, 256 // block), BLOCK_R=16,
                                                  num_warps=4))}[kind]
    cfg = dict(cfg)
    if cfg.pop("INT_DOT", False):
        fn = K._qgemv_row_int
    nb_tile, warps, stages = cfg.pop("NB"), cfg.pop("num_warps"), cfg.pop("num_stages", 3)
    sig = {a: _PTR.get(a, "i32") for a in _ARGS[kind]}
    sig.update({o: "i32" for o in ("OA", "OB", "OC", "OD", "OE")})
    ce = dict(QT=weight_format(name).ggml_id, BLOCK=block, PARTS=parts, S=s, GPB=gpb,
              G=nb_tile * gpb, NB=nb_tile, DTYPE=tl.bfloat16, EXACT=True, **cfg)
    if kind != "rows_deq":
        ce["HAS_BIAS"] = False
    if kind in ("row", "row_float", "rows"):
        ce.update(SILU=False, PDL=True)
    if kind in ("row", "row_float"):
        ce["EVEN_K"] = aligned          # the 8B shapes' tiles cover K
    sig.update({k: "constexpr" for k in ce})
    names = list(fn.arg_names)
    attrs = {(names.index(a),): [["tt.divisibility", 16]]
             for a in sig if aligned and sig[a] != "constexpr"}
    return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=ce, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=warps, num_stages=stages))


@pytest.mark.skipif(GPUTarget is None, reason="this Triton has no offline compile API")
@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.parametrize("aligned", [False, True], ids=["unaligned", "aligned"])
def test_kernels_compile_for_sm90(name, aligned):
    for kind in _ARGS:
        kernel = compile_for_sm90(kind, name, aligned)
        assert kernel.asm.get("cubin"), f"{name} {kind}: no machine code"
        assert kernel.metadata.shared <= SM90_SHARED, \
            f"{name} {kind}: {kernel.metadata.shared} bytes of shared memory"


def _run_ptx(asm: str, regs: dict) -> dict:
    """A tiny interpreter of the 32-bit PTX the dequantization's inline assembly uses (mov,
    and, or, xor, shr, prmt in its default mode), over named registers / $n operands."""
    def val(tok):
        tok = tok.strip()
        return int(tok, 0) & 0xFFFFFFFF if tok[0].isdigit() else regs[tok]

    def prmt(a, b, c):
        pool = (b << 32) | a                       # bytes 0-3 of a, 4-7 of b
        out = 0
        for i in range(4):
            sel = (c >> (4 * i)) & 15
            byte = (pool >> (8 * (sel & 7))) & 255
            if sel & 8:                            # sign replication of the chosen byte
                byte = 255 if byte & 128 else 0
            out |= byte << (8 * i)
        return out

    def dp4a(op, a, b, c):
        sa, sb = (t == "s32" for t in op.split(".")[1:])
        total = c
        for i in range(4):
            x, y = (a >> (8 * i)) & 255, (b >> (8 * i)) & 255
            total += (x - 256 * (sa and x > 127)) * (y - 256 * (sb and y > 127))
        return total

    # nested scopes only declare registers: their statements run in order
    for stmt in asm.replace("{", ";").replace("}", ";").split(";"):
        stmt = stmt.strip()
        if not stmt or stmt.startswith(".reg"):
            continue
        op, args = stmt.split(None, 1)
        d, *src = [a.strip() for a in args.split(",")]
        v = [val(a) for a in src]
        regs[d] = ({"mov.b32": lambda: v[0], "and.b32": lambda: v[0] & v[1],
                    "or.b32": lambda: v[0] | v[1], "xor.b32": lambda: v[0] ^ v[1],
                    "shr.b32": lambda: v[0] >> v[1],
                    "prmt.b32": lambda: prmt(*v)}.get(op) or (lambda: dp4a(op, *v)))() \
            & 0xFFFFFFFF
    return regs


def test_inline_byte_permutes_give_the_interpreters_values():
    """dequant.py's PTX (nibbles, int8, the IQ4 codebook) run by _run_ptx over every byte
    value in every lane: the fp32 bits it leaves equal 2^23 (+ 128 for signed values) plus
    the value the interpreter's arithmetic gives."""
    import struct

    from kvcompile.ops.qlinear import dequant as D
    from kvcompile.ops.qlinear.naive import IQ4_VALUES
    words = [b0 | (b1 << 8) | (b2 << 16) | (b3 << 24)
             for b0, b1, b2, b3 in zip(range(256), range(1, 257), range(7, 263), range(99, 355))]
    words = [w & 0xFFFFFFFF for w in words]
    k = [w & 0xFFFFFFFF for w in D.CODEBOOK.value]
    ops = {"low": (D._LOW_NIBBLE_ASM, lambda b: b & 15, 0),
           "high": (D._HIGH_NIBBLE_ASM, lambda b: b >> 4, 0),
           "int8": (D._INT8_ASM, lambda b: b - 256 if b > 127 else b, 128),
           "iq4 low": (D._IQ4_LOW_ASM, lambda b: IQ4_VALUES[b & 15], 128),
           "iq4 high": (D._IQ4_HIGH_ASM, lambda b: IQ4_VALUES[b >> 4], 128)}
    for name, (asm, want, offset) in ops.items():
        for w in words:
            regs = {"$4": w, "$5": k[0], "$9": k[1], "$13": k[2], "$17": k[3]}
            regs = _run_ptx(str(asm.value if hasattr(asm, "value") else asm), regs)
            for lane in range(4):
                f = struct.unpack("<f", struct.pack("<I", regs[f"${lane}"]))[0]
                got = f - (8388608.0 + offset)
                assert got == want((w >> (8 * lane)) & 255), (name, hex(w), lane, got)


def _signed(w: int, byte: int) -> int:
    b = (w >> (8 * byte)) & 255
    return b - 256 if b > 127 else b


def test_integer_dot_ptx_gives_the_interpreters_integers():
    """int_dot.py's PTX run by _run_ptx over random words: the packing of rounded
    activations into byte planes, the IQ4 codebook lookup of both nibbles, and each type's
    chained dp4a dot (codes masked, signed or not) equal the integers the interpreter's
    arithmetic computes."""
    import random

    from kvcompile.ops.qlinear import dequant as D
    from kvcompile.ops.qlinear import int_dot as I
    from kvcompile.ops.qlinear.naive import IQ4_VALUES

    def run(asm, *ops):
        regs = _run_ptx(str(getattr(asm, "value", asm)),
                        {f"${i + 2}": o & 0xFFFFFFFF for i, o in enumerate(ops)})
        return regs["$0"], regs["$1"]

    rng = random.Random()
    book = [w & 0xFFFFFFFF for w in D.CODEBOOK.value]
    for _ in range(200):
        v = [rng.randrange(-2 ** 15, 2 ** 15) + 0x4B400000 for _ in range(4)]
        lo, hi = run(I._PACK_ASM, *v)
        for i, x in enumerate(v):
            n = x - 0x4B400000
            assert (lo >> (8 * i)) & 255 == n & 255 and _signed(hi, i) == n >> 8

        w = rng.getrandbits(32)
        low, high = run(I._IQ4_CODES_ASM, w, *book)
        for i in range(4):
            b = (w >> (8 * i)) & 255
            assert (_signed(low, i), _signed(high, i)) == (IQ4_VALUES[b & 15], IQ4_VALUES[b >> 4])

        for asm, words, code in (
                (I._Q8_ASM, 8, lambda w, i: _signed(w, i)),
                (I._IQ4_ASM, 4, lambda w, i: _signed(w, i)),
                (I._Q4_LOW_ASM, 4, lambda w, i: (w >> (8 * i)) & 15),
                (I._Q4_HIGH_ASM, 4, lambda w, i: (w >> (8 * i)) & 240),
                (I._Q4K_LOW_ASM, 8, lambda w, i: (w >> (8 * i)) & 15),
                (I._Q4K_HIGH_ASM, 8, lambda w, i: (w >> (8 * i)) & 240)):
            c, h, l = ([rng.getrandbits(32) for _ in range(words)] for _ in range(3))
            dh, dl = run(asm, *c, *h, *l)
            want_h = sum(code(c[k], i) * _signed(h[k], i) for k in range(words) for i in range(4))
            want_l = sum(code(c[k], i) * ((l[k] >> (8 * i)) & 255)
                         for k in range(words) for i in range(4))
            assert (dh, dl) == (want_h & 0xFFFFFFFF, want_l & 0xFFFFFFFF), asm
