#!/usr/bin/env bash
# Prefill attention over KV consumed in staged pieces (ops/span_attention/prefill_chunks.py)
# on the GPU:
#  1. the marked tests of tests/test_prefill_chunks.py (bitwise: any split == one launch,
#     q8_0/q4_0, bf16/bf16, f16/q8_0 x D 64/128/256, and fp64 oracle);
#  2. 16K query rows x 16K keys (8 KV heads x 128, 32 q heads, causal), one launch vs
#     4 pieces (even and uneven splits): bitwise check and time; the one-launch time beside
#     the last recorded benchmarks/results/attention.json prefill number for that shape.
# Expected run time: about 3 minutes (mostly Triton compiles). Writes $OUT/prefill_chunks/:
# pytest.log, timing.log, timing.json. Exit status 1 if a test or a bitwise check fails.
set -uo pipefail
R=${R:-$(pwd)}
D="$OUT/prefill_chunks"
mkdir -p "$D"
cd /tmp
status=0
XDIST=$(python3 -c "import xdist" 2>/dev/null && echo "-n 4")
python3 -m pytest -q -m gpu $XDIST -rfEP "$R/tests/test_prefill_chunks.py" 2>&1 \
    | tee "$D/pytest.log" || status=1

cat > "$D/timing.py" <<'EOF'
import json
import sys
from pathlib import Path

import torch

import kvcompile.ops  # noqa: F401
from kvcompile.ops import kv_format as F
from kvcompile.ops.span_attention.prefill_chunks import PrefillAccumulator, workspace_numel
from kvcompile.ops.span_attention.prefill_kernel import span_attention_prefill


sys.path.insert(0, str(Path(sys.argv[2]).resolve().parents[1]))    # benchmarks/
from bench_util import events_ms  # noqa: E402


def ms_of(fn):
    return events_ms(fn, 5)


n, n_kv, d, n_q, P = 16384, 8, 128, 32, 256
n_pages = n // P
scale = d ** -0.5
gen = torch.Generator(device="cuda").manual_seed(1)
q = torch.randn(n, n_q, d, device="cuda", generator=gen).bfloat16()
k = torch.randn(n, n_kv, d, device="cuda", generator=gen)
v = torch.randn(n, n_kv, d, device="cuda", generator=gen)
q_pos = torch.arange(n, dtype=torch.int32, device="cuda")
table = torch.randperm(n_pages, device="cuda", generator=gen).int()     # scattered pages
pos = torch.arange(n, device="cuda")
slots = table[pos // P].long() * P + pos % P
flops = 4 * n * n / 2 * d * n_q
before = {}
try:
    for r in json.loads(Path(sys.argv[2]).read_text()):
        if (r.get("kernel") == "prefill" and r.get("head_dim") == d
                and r.get("n_kv_heads") == n_kv and r.get("context") == n):
            before[r["kv_type"]] = r["ms"]
except (OSError, ValueError) as e:
    print(f"no earlier benchmark numbers: {e}")
results, ok = [], True
for kn, vn in (("bf16", "bf16"), ("q8_0", "q4_0")):
    kt, vt = F.kv_type(kn), F.kv_type(vn)
    kp = torch.zeros(n_pages, F.page_bytes(kt, P, n_kv, d), dtype=torch.uint8, device="cuda")
    vp = torch.zeros(n_pages, F.page_bytes(vt, P, n_kv, d), dtype=torch.uint8, device="cuda")
    torch.ops.kvcompile.kv_write(kp, vp, k, v, slots, kt.ggml_id, vt.ggml_id, P)
    one = torch.empty(q.shape, dtype=torch.float32, device="cuda")
    ws = torch.empty(workspace_numel(n, n_q, d), dtype=torch.float32, device="cuda")

    def run_one():
        span_attention_prefill(q, kp, vp, table, q_pos, kt.ggml_id, vt.ggml_id, P, scale,
                               out=one)

    def chunked(bounds, out):
        acc = PrefillAccumulator(q, q_pos, kt.ggml_id, vt.ggml_id, P, scale, n_pages, out=out,
                                 workspace=ws)
        for lo, hi in zip(bounds, bounds[1:]):
            acc.consume(kp, vp, table[lo:hi])
        assert acc.done

    even = [0, 16, 32, 48, 64]
    uneven = [0, 5, 25, 55, 64]
    four = torch.empty_like(one)
    ms_one = ms_of(run_one)
    ms_four = ms_of(lambda: chunked(even, four))
    same_even = torch.equal(one, four)
    chunked(uneven, four)
    same_uneven = torch.equal(one, four)
    ok &= same_even and same_uneven
    row = dict(kv_type=f"{kn}/{vn}", q_rows=n, context=n, n_kv_heads=n_kv, head_dim=d,
               n_q_heads=n_q, ms_one_launch=ms_one, ms_4_pieces=ms_four,
               pieces_over_one=ms_four / ms_one, tflops_one_launch=flops / ms_one / 1e9,
               bitwise_even_split=same_even, bitwise_uneven_split=same_uneven,
               ms_one_launch_recorded_before=before.get(f"{kn}/{vn}"),
               device=torch.cuda.get_device_name())
    results.append(row)
    print(json.dumps(row), flush=True)
Path(sys.argv[1]).write_text(json.dumps(results, indent=1))
sys.exit(0 if ok else 1)
EOF
python3 "$D/timing.py" "$D/timing.json" "$R/benchmarks/results/attention.json" 2>&1 \
    | tee "$D/timing.log" || status=1
exit $status
