"""Count the sm_90 instructions of the decode split kernels' main loop, without a GPU.

Triton compiles for a named target with the ptxas it ships; cuobjdump (shipped too) gives
the SASS. The loop body's count per warp, against the bytes a tile reads, is a cheap proxy
for issue-bound quantized decode (int->float converts, I2F, are quarter rate on Hopper).
Integer arguments get Triton's divisible-by-16 hint as on a real launch (without it every
load is scalar).

usage: python tools/profile/sass_decode.py [--pair q8_0/q4_0] [--head-dim 256] [--group 6]
       [--rows-m 16] [--block-n 64] [--warps 4] [--stages 2] [--maxnreg 96]
       [--impls legacy,blocks,transposed] [--tma]
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kvcompile.ops import kv_format as F
from kvcompile.ops.span_attention.decode_blocks import _decode_split_blocks
from kvcompile.ops.span_attention.decode_kernel import _decode_split
from kvcompile.ops.span_attention.decode_transposed import _decode_split_t
from kvcompile.ops.span_attention.tma_codes import code_bytes

ARGS = ("q_ptr k_vals k_scl v_vals v_scl page_table q_pos_ptr m_ptr l_ptr acc_ptr stride_qt "
        "stride_qh n_rows n_chunks chunk_len table_len k_page_elems k_page_halves "
        "k_code_halves v_page_elems v_page_halves v_code_halves").split()
ALIGNED = {i for i, a in enumerate(ARGS) if a not in ("n_rows", "n_chunks", "table_len")}
PTR = {0: "*fp32", 1: "*fp16", 30: "*bf16", 8: "*i8", 2: "*u8"}


TRANSPOSED_PAIRS = {f"{k}/{v}" for k in ("q8_0", "q4_0") for v in ("q8_0", "q4_0")}


def compile_split(impl, k_type, v_type, head_dim, group, block_m, block_n, warps, stages,
                  maxnreg=None, tma=False):
    """The split kernel `impl` compiled for sm_90; tma (transposed only): its codes through
    TMA descriptors (tma_codes) rather than pointers."""
    sig = {a: "i32" for a in ARGS}
    sig.update(q_ptr="*bf16" if k_type == v_type == 30 else "*fp16", k_scl="*fp16",
               v_scl="*fp16", page_table="*i32", q_pos_ptr="*i32", m_ptr="*fp32",
               l_ptr="*fp32", acc_ptr="*fp32")
    raw = impl != "legacy"
    sig["k_vals"] = "*u8" if raw and k_type in (2, 8) else PTR[k_type]
    sig["v_vals"] = "*u8" if raw and v_type in (2, 8) else PTR[v_type]
    ce = dict(QK_SCALE=0.1, G=group, D=head_dim, P=256, BLOCK_M=block_m, BLOCK_N=block_n,
              K_TYPE=k_type, V_TYPE=v_type, QK_F16=int(not k_type == v_type == 30),
              K_SPLIT=int(k_type == 0), INTERP=0, PDL=False)
    if impl == "transposed":      # its query rows: one row's group, padded to a power of 2
        for k in ("BLOCK_M", "QK_F16", "K_SPLIT"):
            del ce[k]
        ce["BLOCK_R"] = max(2, triton.next_power_of_2(group))
        ce["TMA"] = tma
    sig.update({k: "constexpr" for k in ce})
    fn = {"legacy": _decode_split, "blocks": _decode_split_blocks,
          "transposed": _decode_split_t}[impl]
    aligned = ALIGNED
    if impl == "transposed":                      # its pools are code tiles (tma_codes)
        sig = {{"k_vals": "k_codes", "v_vals": "v_codes"}.get(k, k): v for k, v in sig.items()}
        if tma:
            k_row, v_rows = code_bytes(k_type, head_dim), code_bytes(v_type, head_dim)
            sig["k_codes"] = f"tensordesc<u8[1, {block_n}, {k_row * 32 // head_dim}]>"
            sig["v_codes"] = f"tensordesc<u8[1, {v_rows}, {block_n}]>"
            aligned = ALIGNED - {ARGS.index("k_vals"), ARGS.index("v_vals")}
    elif tma:
        raise SystemExit("--tma: only the transposed kernel reads its codes by TMA")
    src = ASTSource(fn=fn, signature=sig, constexprs=ce,
                    attrs={(i,): [["tt.divisibility", 16]] for i in aligned})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=warps, num_stages=stages,
                                       **({"maxnreg": maxnreg} if maxnreg else {})))


def cuobjdump(kernel, flag):
    tool = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        return subprocess.run([tool, flag, f.name], capture_output=True, text=True).stdout


def longest_loop(sass: str) -> collections.Counter:
    """Opcode counts between a backward branch and its target (the longest such body)."""
    ins = [(int(m[1], 16), m[3].split(".")[0], m[4]) for m in
           re.finditer(r"/\*([0-9a-f]+)\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_.]+)([^;]*);", sass)]
    best = collections.Counter()
    for addr, op, rest in ins:
        t = re.search(r"0x([0-9a-f]+)", rest) if op == "BRA" else None
        if t and int(t[1], 16) < addr:
            body = collections.Counter(o for a, o, _ in ins if int(t[1], 16) <= a <= addr)
            best = max(best, body, key=lambda c: sum(c.values()))
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pair", default="q8_0/q4_0")
    ap.add_argument("--head-dim", type=int, default=256)
    ap.add_argument("--group", type=int, default=6, help="query heads a KV head")
    ap.add_argument("--rows-m", type=int, default=16, help="BLOCK_M (query rows x group)")
    ap.add_argument("--block-n", type=int, default=64)
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--maxnreg", type=int, help="register cap a thread")
    ap.add_argument("--tma", action="store_true",
                    help="transposed: codes through TMA descriptors, as untraced launches on "
                         "Hopper read them (default: pointers, as traced launches)")
    ap.add_argument("--impls", help="comma-separated, default legacy,blocks(,transposed for "
                                     "q8_0 / q4_0 pairs); transposed: its query rows are one "
                                     "row's group (--rows-m applies to the others)")
    a = ap.parse_args()
    kt, vt = (F.kv_type(n).ggml_id for n in a.pair.split("/"))
    impls = ("legacy", "blocks") + (("transposed",) if a.pair in TRANSPOSED_PAIRS else ())
    for impl in a.impls.split(",") if a.impls else impls:
        k = compile_split(impl, kt, vt, a.head_dim, a.group, a.rows_m, a.block_n, a.warps, a.stages,
                          maxnreg=a.maxnreg, tma=a.tma and impl == "transposed")
        loop = longest_loop(cuobjdump(k, "-sass"))
        res = re.findall(r"REG:(\d+) STACK:(\d+)", cuobjdump(k, "-res-usage"))[0]
        print(f"{impl:6s} loop {sum(loop.values())} instructions/warp, registers {res[0]}, "
              f"stack {res[1]} B, shared {k.metadata.shared} B")
        print("       " + ", ".join(f"{o} {n}" for o, n in loop.most_common(14)))


if __name__ == "__main__":
    main()
