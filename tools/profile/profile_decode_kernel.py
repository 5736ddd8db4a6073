"""Launch the transposed decode a few times over resident q8_0 / q4_0 pages (for a profiler
such as Nsight Compute to attach to: `ncu -k regex:_decode_split_t -c 1 python ...`).

usage: python tools/profile/profile_decode_kernel.py [--kv-heads 8] [--head-dim 128] [--group 4]
       [--context 262144] [--calls 3]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))
from bench_attention import make_pools  # noqa: E402

from kvcompile.ops import kv_format as F  # noqa: E402
from kvcompile.ops.span_attention.decode_transposed import (  # noqa: E402
    span_attention_decode_transposed)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--context", type=int, default=262144)
    ap.add_argument("--calls", type=int, default=3)
    a = ap.parse_args()
    n_kv, d = a.kv_heads, a.head_dim
    kp, vp, tables, _ = make_pools("q8_0", "q4_0", a.context, n_kv, d, 1)
    q = torch.randn(1, n_kv * a.group, d, device="cuda", dtype=torch.bfloat16)
    q_pos = torch.tensor([a.context - 1], device="cuda", dtype=torch.int32)
    kt, vt = F.kv_type("q8_0").ggml_id, F.kv_type("q4_0").ggml_id
    from torch._library.triton import set_wrap_triton_enabled
    with set_wrap_triton_enabled(False):
        for _ in range(a.calls):
            span_attention_decode_transposed(q, kp, vp, tables[0], q_pos, kt, vt, 256,
                                             d ** -0.5)
    torch.cuda.synchronize()
    print("done")


if __name__ == "__main__":
    main()
