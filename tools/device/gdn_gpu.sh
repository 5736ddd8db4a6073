#!/usr/bin/env bash
# Gated DeltaNet on CUDA (issue 6): fla-core's Triton kernels against the torch reference
# (tests/test_gdn_gpu.py), then a timing of one qwen35-27B-shaped GDN layer (Hk=16, Hv=48,
# D=128): fla vs the torch reference on the same GPU. Needs .whl/fla_core-*.whl and
# .whl/einops-*.whl installed (the lead's preamble does it). Run from the repo root with R
# and OUT set; writes $OUT/gdn_gpu/. Expected run time on one H200: ~2 minutes (mostly
# Triton compiling and autotuning fla's kernels on a fresh machine).
set -uo pipefail
R=${R:-$(pwd)}
O="$OUT/gdn_gpu"
mkdir -p "$O"
cd /tmp
python3 -c "import fla, einops, triton, torch; print('fla', fla.__version__, 'triton', triton.__version__, 'torch', torch.__version__)" 2>&1 | tee "$O/versions.log"
python3 -m pytest -q -m gpu -s -rs "$R/tests/test_gdn_gpu.py" 2>&1 | tee "$O/pytest.log"
rc=${PIPESTATUS[0]}
timeout 120 python3 - "$O/timing.json" <<'PY' 2>&1 | tee "$O/timing.log"
import json, math, os, sys, torch
import torch.nn.functional as F
from kvcompile.models import gated_deltanet as G
def inputs(t, hk=16, hv=48, d=128):
    q = F.normalize(torch.randn(t, hk, d, device="cuda"), dim=-1)
    k = F.normalize(torch.randn(t, hk, d, device="cuda"), dim=-1)
    v = torch.randn(t, hv, d, device="cuda")
    g = -torch.rand(t, hv, device="cuda")
    return q, k, v, g, torch.rand(t, hv, device="cuda"), torch.zeros(hv, d, d, device="cuda")
def ms(fn, *a, n=10):
    fn(*a); torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(n):
        fn(*a)
    e.record(); torch.cuda.synchronize()
    return s.elapsed_time(e) / n
res = {}
for backend in ("fla", "torch"):
    os.environ["KVCOMPILE_GDN"] = backend
    pre, dec = inputs(4096), inputs(1)
    res[backend] = {"prefill_4096_ms": ms(G.gdn_chunked, *pre, 1 / math.sqrt(128)),
                    "decode_1_ms": ms(G.gdn_recurrent, *dec, 1 / math.sqrt(128))}
print(json.dumps(res, indent=1))
json.dump(res, open(sys.argv[1], "w"), indent=1)
PY
exit $rc
